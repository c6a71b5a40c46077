"""``python -m asyncllm bench``: the standard workloads against asyncllm and its peers, in one
run, alternating engines; JSON lines, a markdown report and plots.

    python -m asyncllm bench [--quick] [--repeats 3] [--workloads W1,W3]
                             [--peers vllm,hf,hf_cb,llamacpp] [--threads N] [--compare-threads 2]
                             [--dtype D] [--quantization Q] [--asyncllm-variants "bfloat16;gguf"]
                             [--vllm-dtype float32,bfloat16]
                             [--out bench-results]
    python -m asyncllm bench --fidelity [--quick] [--fidelity-paths default,float32,...]

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

``--fidelity`` runs the fidelity harness instead (:mod:`asyncllm.bench.fidelity`): every
precision path against the float32 reference, into ``fidelity.jsonl``, ``fidelity.json``
and ``fidelity.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from asyncllm.bench import ceilings
from asyncllm.bench.options import (
    LABELS,
    UNSUPPORTED,
    base_engine,
    parser,
    resolve,
    same_precision,
    variant_name,
)
from asyncllm.bench.processes import (
    REPO,
    Command,
    WorkerProc,
    in_process,
    log,
    peer_commands,
    wait_until_quiet,
)
from asyncllm.bench.workloads import (
    PROMPTS_FILE,
    Workload,
    build,
    load_prompts,
    shared_copy_differs,
)

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
        """Start every engine's process (asyncllm at each thread count and precision
        variant, then the peers) and wait until each is loaded; a peer that cannot start is
        recorded in :attr:`skipped` with the reason."""
        a = self.args
        # Engines refuse a max_model_len above the model's (asyncllm and vLLM alike).
        limit = self.model_info.get("max_position_embeddings") or a.max_model_len
        max_model_len = min(a.max_model_len, limit)
        if max_model_len < a.max_model_len:
            log(f"--max-model-len {a.max_model_len} lowered to the model's {limit}")
        base = {"max_model_len": max_model_len, "kv_cache_bytes": a.kv_gib * 2**30}
        common = ["--max-batch", "64", "--max-model-len", str(max_model_len)]
        specs: dict[str, Command] = {}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))

        def asyncllm(threads: int, precision: dict[str, str]) -> Command:
            # A quantized engine loads the model as the user named it (a GGUF file keeps
            # its own quantization); others share the resolved directory.
            model = a.model if precision.get("quantization") else model_dir
            cfg = json.dumps({**base, **precision})
            return in_process("asyncllm", threads, "--config", cfg, *common, "--model", model), env

        for t in [a.threads, *a.compare_threads]:
            name = "asyncllm" if t == a.threads else f"asyncllm-t{t}"
            self.labels[name] = "asyncllm" if t == a.threads else f"asyncllm ({t} threads)"
            self.thread_engines.append(name)
            specs[name] = asyncllm(t, a.precision)
        for variant in a.variants:
            name, self.labels[name] = variant_name(variant)
            specs[name] = asyncllm(a.threads, variant)
        for peer in a.peers:
            columns = peer_commands(peer, a, common, model_dir, env)
            if isinstance(columns, str):
                self.skipped[peer] = columns
                continue
            for name, (label, command) in columns.items():
                self.labels[name] = label
                specs[name] = command
        self._start(specs)

    def _start(self, specs: dict[str, Command]) -> None:
        for name, (cmd, e) in specs.items():
            w = WorkerProc(name, cmd, e, self.out / "logs" / f"{name}.log")
            w.start()
            self.workers[name] = w
            log(f"starting {name}")
            if not self.args.parallel_start:
                self._wait(w)
        if self.args.parallel_start:
            for w in self.workers.values():
                self._wait(w)

    def _wait(self, w: WorkerProc) -> None:
        # vLLM compiles its model; asyncllm may convert a GGUF file first, and waits for its
        # compiled forward (COMPILE_WAIT_S at most) before it says it is ready.
        base = base_engine(w.name)
        timeout = 1200 if base in ("vllm", "asyncllm") else 300
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
            "outputs": wl.name in ("W1", "W1J", "W3", "W5", "W6", "W7", "C4", "C16"),
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
                    quiet = wait_until_quiet()
                    if quiet > 1.0:
                        log(f"{tag} run {r} on {e}: waited {quiet:.1f} s for idle CPUs")
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
    safetensors files' headers (read by ``safetensors``; no weights loaded) and config."""
    from safetensors import safe_open

    d = pathlib.Path(model_dir)
    n = 0
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                count = 1
                for s in st.get_slice(k).get_shape():
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code (0 when asyncllm ran)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
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
    if args.fidelity:
        from asyncllm.bench.fidelity.run import run as run_fidelity

        return run_fidelity(args)
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
    names = resolve(args, default_num_threads())
    model_dir, wls = _prepare(args, names)
    bench = Bench(args)
    bench.model_info = model_figures(model_dir)
    bench.machine_line = {
        "cores": bench.machine["cores"],
        "processor": bench.machine["processor"],
        # asyncllm's dtype "auto" for this model on this CPU (each engine's settings name
        # its own).
        "dtype": same_precision({}, args.model)["dtype"],
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
    _write_outputs(bench, wls, cold, time.perf_counter() - started, model_dir)
    return 0 if "asyncllm" in bench.workers and not bench.workers["asyncllm"].failed else 1


def _prepare(args: argparse.Namespace, names: list[str]) -> tuple[str, list[Workload]]:
    """The model's directory and the workloads to run (``--out`` made).

    Raises:
        SystemExit: ``--out`` cannot be made, or ``--model`` is not found.
    """
    from asyncllm.errors import ModelNotFoundError
    from asyncllm.models.loader import resolve_model_dir

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
    return model_dir, wls


def _write_outputs(
    bench: Bench, wls: list[Workload], cold: dict[str, Any], elapsed: float, model_dir: str
) -> None:
    """summary.json, the plots and report.md (also printed)."""
    from asyncllm.bench.reporting import markdown as report
    from asyncllm.bench.reporting import plots as plotting
    from asyncllm.bench.reporting.summary import build_summary

    summary = build_summary(bench, wls, cold, elapsed, model_dir)
    (bench.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    img = pathlib.Path(bench.args.img_dir) if bench.args.img_dir else bench.out / "img"
    plots: list[str] = []
    if not bench.args.no_plots:
        plots = plotting.make_plots(summary, bench, img)
    md = report.markdown(summary, plots, bench.out)
    (bench.out / "report.md").write_text(md)
    print(md)
    log(f"done in {elapsed / 60:.1f} min; results in {bench.out}")


if __name__ == "__main__":
    sys.exit(main())
