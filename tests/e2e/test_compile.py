"""The compiled forward (``EngineConfig.compile``): same tokens as eager, one graph for every
batch composition, and a failed compile that leaves the engine serving eagerly.

Compiling is slow on a small CPU, so each tiny model is compiled once (module fixture) and
the engines of a test share that model and its compiled forward (the compiled graph holds no
KV cache: each engine's caches reach it through the step's metadata).
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from torch._dynamo.utils import counters

from asyncllm import SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.worker import compiled as compiled_mod
from asyncllm.worker.device import COMPILE_ENV, resolve_compile
from tests.conftest import check_pool_whole

#: Each tiny model is compiled (torch.compile on CPU: tens of seconds each).
pytestmark = pytest.mark.slow

# float32: Inductor keeps fused bfloat16 intermediates in float32 where eager rounds each
# op's output, so bfloat16 runs part at near-ties; float32 runs must be token-identical.
SMALL = dict(max_model_len=256, kv_cache_bytes=2**22, max_num_batched_tokens=64, dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def _modeling_code_decodes() -> Iterator[None]:
    """The modeling code for these families: the C++ forward, on by default for them, runs
    every step, and no forward is compiled then (tests/worker/test_native_forward.py)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("ASYNCLLM_NATIVE_FORWARD", "0")
        yield


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def compiled_engine(request: pytest.FixtureRequest) -> Iterator[LLMEngine]:
    """An engine on the tiny model with its forward compiled (in a child process, into an
    artifact file; waited for)."""
    path: pathlib.Path = request.getfixturevalue(f"tiny_{request.param}_dir")
    engine = LLMEngine.from_config(EngineConfig(model=str(path), compile=True, **SMALL))
    cf = engine.runner.compiled
    assert cf is not None and cf.wait(600), "compile did not finish"
    assert cf.ready, cf.error
    assert engine.stats()["compile"] == "ready" and engine.stats()["compile_seconds"] > 0
    yield engine
    engine.stop_compute_thread()


def compile_here(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """Compile on the engine's background thread (where a patched ``BACKEND`` applies)
    instead of a child process, into a fresh artifact under ``tmp_path``."""

    def in_thread(self: compiled_mod.CompiledForward, source: Any) -> None:
        compiled_mod.build_artifact(self.model, self.path, self.num_threads)

    monkeypatch.setattr(compiled_mod.CompiledForward, "_build_in_child", in_thread)
    monkeypatch.setattr(
        compiled_mod, "artifact_path", lambda model, threads: tmp_path / f"{id(model)}.bin"
    )


def twin(base: LLMEngine, *, compiled: bool, **config: Any) -> LLMEngine:
    """An engine on ``base``'s model (its own KV cache and scheduler), eager or with the
    compiled forward of ``base``."""
    cfg = EngineConfig(model=base.config.model, compile=False, **{**SMALL, **config})
    engine = LLMEngine(cfg, base.loaded)
    if compiled:
        engine.runner.compiled = base.runner.compiled
    return engine


def prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 49152, (40,), generator=g).tolist()  # prefix-cache hits
    lens = [1, 5, 17, 33, 2, 70, 9, 24]
    out = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]
    return [*out, [*shared, 7], [*shared, 8, 9], shared]


def run(engine: LLMEngine, n: int = 1, max_tokens: int = 12) -> dict[str, list[int]]:
    """Requests added over the first steps (mixed prefill and decode batches); greedy;
    returns each request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
    todo = list(enumerate(prompts()))
    out: dict[str, list[int]] = {}
    while todo or engine.has_unfinished():
        for _ in range(2):
            if todo:
                i, p = todo.pop(0)
                for r in engine.inputs.make_requests(f"r{i}", p, params):
                    engine.add_request(r)
        for u in engine.step():
            out.setdefault(u.request_id, []).append(u.token_id)
    engine.compute_thread.call(lambda: None)
    check_pool_whole_engine(engine)
    return out


def check_pool_whole_engine(engine: LLMEngine) -> None:
    class _Wrap:
        core = engine

    check_pool_whole(_Wrap())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"kv_cache_bytes": 2**16, "max_model_len": 128, "preemption_mode": "offload"},
        {"kv_cache_bytes": 2**16, "max_model_len": 128, "preemption_mode": "recompute"},
    ],
    ids=["plain", "preempt-offload", "preempt-recompute"],
)
def test_compiled_tokens_equal_eager(compiled_engine: LLMEngine, config: dict[str, Any]) -> None:
    """Greedy outputs token-identical, with prefix-cache hits, n=2 and preemption."""
    eager = twin(compiled_engine, compiled=False, **config)
    comp = twin(compiled_engine, compiled=True, **config)
    cf = comp.runner.compiled
    assert cf is not None
    calls = cf.calls
    want, got = run(eager, n=2), run(comp, n=2)
    assert got == want
    assert cf.calls - calls == comp.num_steps  # every step went through the compiled graph
    assert comp.scheduler.prefix_cache_hits > 0
    if config:
        assert comp.scheduler.num_preemptions > 0
    for e in (eager, comp):
        e.stop_compute_thread()


def test_a_one_token_step_is_padded_with_a_copy_of_its_token(
    compiled_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo specializes size 1, so a one-sequence decode runs two rows: the second repeats
    the first (its id, position and kept row), so every layer computes it as the first and
    the linear kernels compute it once; the tokens stay eager's."""
    engine = twin(compiled_engine, compiled=True)
    seen: list[tuple[list[int], list[int], list[int]]] = []
    real = compiled_mod.CompiledForward.__call__

    def recording(self: Any, ids: Any, pos: Any, keep: Any) -> Any:
        seen.append((ids[0].tolist(), pos[0].tolist(), keep.tolist()))
        return real(self, ids, pos, keep)

    def alone(e: LLMEngine) -> list[int]:  # one request: every decode step is one token
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        e.add_request(e.inputs.make_request("alone", prompts()[0], params))
        tokens = []
        while e.has_unfinished():
            tokens += [u.token_id for u in e.step()]
        return tokens

    monkeypatch.setattr(compiled_mod.CompiledForward, "__call__", recording)
    got = alone(engine)
    monkeypatch.setattr(compiled_mod.CompiledForward, "__call__", real)
    eager = twin(compiled_engine, compiled=False)
    assert got == alone(eager)
    decodes = seen[1:]  # after the prompt's step
    assert len(decodes) == 5 and all(len(ids) == 2 for ids, _, _ in decodes)
    assert all(ids[0] == ids[1] and pos[0] == pos[1] and keep[0] == keep[1]
               for ids, pos, keep in decodes)  # fmt: skip
    for e in (engine, eager):
        e.stop_compute_thread()


@pytest.mark.parametrize("length", [150, 129])
def test_a_long_prompt_alone_stays_compiled(compiled_engine: LLMEngine, length: int) -> None:
    """A prompt longer than the token budget (64), alone: its first chunks sample nothing (no
    kept row). The compiled graph runs them too (it once raised there and turned the engine
    eager for good: the agent-turn workload W7, 1,489 tokens against a budget of 512, decoded
    2x slower); tokens equal eager's; a second request after it still runs compiled."""
    g = torch.Generator().manual_seed(length)
    long_prompt = torch.randint(3, 49152, (length,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def alone(e: LLMEngine) -> list[int]:
        tokens = []
        for i, prompt in enumerate((long_prompt, prompts()[1])):
            e.add_request(e.inputs.make_request(f"r{i}", prompt, params))
            while e.has_unfinished():
                tokens += [u.token_id for u in e.step()]
        return tokens

    engine, eager = twin(compiled_engine, compiled=True), twin(compiled_engine, compiled=False)
    cf = engine.runner.compiled
    assert cf is not None
    calls = cf.calls
    assert alone(engine) == alone(eager)
    assert cf.ready and cf.error is None
    assert cf.calls - calls == engine.num_steps  # the chunk-only steps included
    for e in (engine, eager):
        e.stop_compute_thread()


def test_second_engine_loads_the_artifact(
    compiled_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fixture's engine compiled in a child process into an artifact file; a new engine
    of the same model finds it, loads it without compiling (no child) and computes the
    eager tokens. The load leaves ``TORCHINDUCTOR_CACHE_DIR`` as it was (unset here)."""
    first = compiled_engine.runner.compiled
    assert first is not None and first.path.is_file()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    again = LLMEngine.from_config(compiled_engine.config)
    cf = again.runner.compiled
    assert cf is not None and cf.wait(600) and cf.ready, cf.error
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert cf.path == first.path and cf._child is None
    eager = twin(compiled_engine, compiled=False)
    assert run(again) == run(eager)
    for e in (again, eager):
        e.stop_compute_thread()


def test_no_recompilation_across_batch_compositions(compiled_engine: LLMEngine) -> None:
    """20+ steps of changing token and kept-row counts (1 to 64 tokens, decodes alone,
    prefill chunks that sample nothing) run the one graph compiled at start."""
    engine = twin(compiled_engine, compiled=True)
    before = dict(counters["stats"])
    run(engine, max_tokens=20)
    assert engine.num_steps >= 20
    assert dict(counters["stats"]) == before
    engine.stop_compute_thread()


def test_failed_compile_serves_eagerly(
    tiny_llama_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A compiler error leaves the engine eager, with one warning, and it keeps serving; so
    does an error of the compiled forward in a step (that step reruns eagerly)."""

    def broken(gm: Any, inputs: Any, **options: Any) -> Any:  # options: Inductor's config
        raise RuntimeError("injected compile failure")

    monkeypatch.setattr(compiled_mod, "BACKEND", broken)
    compile_here(monkeypatch, tmp_path)
    caplog.set_level(logging.WARNING, "asyncllm")
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), compile=True, **SMALL))
    cf = engine.runner.compiled
    assert cf is not None and cf.wait(600)
    assert not cf.ready and cf.error is not None and "injected" in cf.error
    warnings = [r for r in caplog.records if "serving eagerly" in r.getMessage()]
    assert len(warnings) == 1
    assert engine.stats()["compile"] == "failed"
    eager = twin(engine, compiled=False)
    assert eager.stats()["compile"] == "off" and eager.stats()["compile_seconds"] == 0.0
    want = run(eager)
    assert run(engine) == want

    def fails_in_step(*args: Any) -> Any:
        raise RuntimeError("injected step failure")

    again = twin(engine, compiled=True)
    cf._fn, cf.ready = fails_in_step, True
    assert run(again) == want
    assert again.runner.compiled is cf and cf.state == "failed" and not cf.ready
    assert len([r for r in caplog.records if "serving eagerly" in r.getMessage()]) == 2
    for e in (engine, eager, again):
        e.stop_compute_thread()


@pytest.mark.parametrize("dtype,packed", [("float32", "1"), ("bfloat16", "1"), ("float32", "0")])
def test_eager_steps_while_compiling(
    tiny_llama_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    packed: str,
) -> None:
    """Steps served eagerly while the background thread is inside the compiler compute the
    eager tokens. (torch.compiler.is_compiling() is one flag for the whole process: eager
    code that read it sent attention to the compiled path's op, which found no metadata
    and returned zeros, and the packed linears recursed until RecursionError.)"""
    entered, release = threading.Event(), threading.Event()

    def slow(gm: Any, inputs: Any, **options: Any) -> Any:
        entered.set()
        release.wait(600)
        raise RuntimeError("released")  # the engine stays eager

    monkeypatch.setattr(compiled_mod, "BACKEND", slow)
    compile_here(monkeypatch, tmp_path)
    monkeypatch.setenv("ASYNCLLM_CPU_PACKED_LINEAR", packed)  # "0": attention alone
    config = {**SMALL, "dtype": dtype}
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), compile=True, **config))
    eager = twin(engine, compiled=False, dtype=dtype)
    try:
        assert entered.wait(600)
        assert engine.stats()["compile"] == "compiling"
        got = run(engine)
    finally:
        release.set()
    assert got == run(eager)
    assert engine.runner.compiled is not None and engine.runner.compiled.wait(600)
    for e in (engine, eager):
        e.stop_compute_thread()


def test_compile_config_values() -> None:
    assert EngineConfig().compile == "auto"
    assert EngineConfig(compile="cached").compile == "cached"
    for bad in ("yes", 1, 0, None):
        with pytest.raises(ValueError, match="compile"):
            EngineConfig(compile=bad)  # type: ignore[arg-type]


def test_compile_auto_resolves_on_cpu_unless_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" is on on CPU and off on CUDA; $ASYNCLLM_COMPILE=1 turns "auto" on, "0" off;
    True and False win over it; a bad value is a ValueError."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert resolve_compile("auto", cpu) is True
    assert resolve_compile("auto", cuda) is False
    for dev in (cpu, cuda):
        assert resolve_compile(True, dev) is True
        assert resolve_compile(False, dev) is False
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert resolve_compile("auto", cuda) is True
    assert resolve_compile(False, cpu) is False
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert resolve_compile("auto", cpu) is False
    assert resolve_compile(True, cpu) is True
    monkeypatch.setenv(COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        resolve_compile("auto", cpu)


def test_compile_without_precompilation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without ``aot_compile`` (2.11, seen on the GPU machine, where the compile child
    failed with "'function' object has no attribute 'aot_compile'"): "auto" and "cached" are
    off, even with $ASYNCLLM_COMPILE=1; True is a ValueError naming what is missing."""
    from asyncllm.worker import device as device_mod

    assert device_mod.precompilation_available()  # the torch this suite pins has it
    monkeypatch.setattr(device_mod, "precompilation_available", lambda: False)
    cpu = torch.device("cpu")
    for env in ("", "1"):
        monkeypatch.setenv(COMPILE_ENV, env)
        assert resolve_compile("auto", cpu) is False
        assert resolve_compile("cached", cpu) is False
    assert resolve_compile(False, cpu) is False
    with pytest.raises(ValueError, match=r"aot_compile.*compile=False"):
        resolve_compile(True, cpu)


def test_compile_cached_resolves_where_auto_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "cached" (load a saved forward, never build one) is "cached" where "auto" would
    compile and False where it would not (CUDA, experts, $ASYNCLLM_COMPILE=0)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert resolve_compile("cached", cpu) == "cached"
    assert resolve_compile("cached", cuda) is False
    assert resolve_compile("cached", cpu, experts=True) is False
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert resolve_compile("cached", cpu) is False
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert resolve_compile("cached", cuda) == "cached"


def test_cached_loads_a_saved_forward_and_never_builds_one(
    compiled_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """compile="cached" (``generate``'s default): the fixture's saved artifact is loaded
    (no child started) and computes the eager tokens; with none saved for the model the
    engine is eager from the start: no compiled forward (so no thread, no child), "off"."""
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    config = msgspec.structs.replace(compiled_engine.config, compile="cached")
    again = LLMEngine.from_config(config)
    cf = again.runner.compiled
    assert cf is not None and not cf.build and cf.wait(600) and cf.ready, cf and cf.error
    assert cf._child is None and cf.path == compiled_engine.runner.compiled.path
    eager = twin(compiled_engine, compiled=False)
    assert run(again) == run(eager)
    monkeypatch.setattr(compiled_mod, "artifact_path", lambda m, t: tmp_path / "none.bin")
    none = LLMEngine.from_config(config)
    # No CompiledForward: nothing that could start a compile thread or child.
    assert none.runner.compiled is None and none.stats()["compile"] == "off"
    assert not (tmp_path / "none.bin").exists()
    for e in (again, eager, none):
        e.stop_compute_thread()


def test_test_suite_builds_eager_engines(tiny_llama_dir: pathlib.Path) -> None:
    """conftest sets $ASYNCLLM_COMPILE=0: an engine built with the default "auto" does not
    compile (tests stay fast)."""
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), **SMALL))
    assert engine.runner.compiled is None and engine.stats()["compile"] == "off"
    engine.stop_compute_thread()


_Out = collections.namedtuple("_Out", "logits")


class _FakeLM(torch.nn.Module):
    """A causal LM's call signature: an embedding plus ``depth`` (a loop count: each depth
    is another graph, as each model architecture is)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.depth = depth

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kw: Any) -> Any:
        logits = self.embed(input_ids)[:, kw["logits_to_keep"]]
        for _ in range(self.depth):
            logits = logits + 1
        return _Out(logits)  # a namedtuple: no graph break, one frame as a real model

    def extra_repr(self) -> str:
        return f"depth={self.depth}"  # part of the structure: names the artifact


def test_models_in_one_process_run_their_own_graphs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Models of different structure get different artifacts, and each compiled forward
    runs its own model's graph on its own weights; a second CompiledForward of a model
    loads the artifact instead of compiling again."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    forwards = []
    for depth in (1, 2):
        cf = compiled_mod.CompiledForward(_FakeLM(depth), torch.device("cpu"))
        cf.start()
        assert cf.wait(600) and cf.ready, cf.error
        forwards.append(cf)
    assert forwards[0].path != forwards[1].path and forwards[1].path.is_file()
    again = compiled_mod.CompiledForward(_FakeLM(2), torch.device("cpu"))
    assert again.path == forwards[1].path
    mtime = again.path.stat().st_mtime_ns
    again.start()
    assert again.wait(600) and again.ready, again.error
    assert again.path.stat().st_mtime_ns == mtime  # loaded, not written again
    with torch.inference_mode():
        for depth, cf in enumerate([*forwards, again], start=1):
            depth = min(depth, 2)
            out = cf(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.tensor([0, 2]))
            assert torch.allclose(out, cf.model.embed.weight[[1, 3]] + depth)


@pytest.mark.parametrize("content", [b"", b"not an artifact", "other model"])
def test_artifact_that_does_not_load_is_compiled_again(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    content: bytes | str,
) -> None:
    """An artifact file that is empty, garbage or another model's (copied under this name)
    gives one warning, is compiled again and replaced, and the forward is this model's."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    caplog.set_level(logging.WARNING, "asyncllm")
    if content == "other model":
        other = compiled_mod.CompiledForward(_FakeLM(3), torch.device("cpu"))
        other.start()
        assert other.wait(600) and other.ready, other.error
        content = other.path.read_bytes()
    cf = compiled_mod.CompiledForward(_FakeLM(1), torch.device("cpu"))
    assert isinstance(content, bytes)
    cf.path.parent.mkdir(parents=True, exist_ok=True)
    cf.path.write_bytes(content)
    cf.start()
    assert cf.wait(600) and cf.ready, cf.error
    assert cf.path.read_bytes() != content
    with torch.inference_mode():
        out = cf(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.tensor([0, 2]))
    assert torch.allclose(out, cf.model.embed.weight[[1, 3]] + 1)
    assert len([r for r in caplog.records if "does not load" in r.getMessage()]) == 1


def test_child_compile_failure_leaves_the_engine_eager(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The child process that cannot load the model exits non-zero: one warning naming its
    error, state "failed", no artifact."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    caplog.set_level(logging.WARNING, "asyncllm")
    source = compiled_mod.ModelSource(str(tmp_path / "no-such-model"), "float32", None, 32)
    cf = compiled_mod.CompiledForward(_FakeLM(1), torch.device("cpu"), source)
    cf.start()
    assert cf.wait(600) and cf.state == "failed"
    assert cf.error is not None and "compile process exited with status 1" in cf.error
    assert "no-such-model" in cf.error
    assert not cf.path.exists()
    assert len([r for r in caplog.records if "serving eagerly" in r.getMessage()]) == 1


def test_exit_while_compiling_is_quiet(
    tiny_llama_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A process that ends while its engine still compiles in the background (in a child
    process) exits at once with status 0 and no traceback, and the child ends with it
    (no artifact written)."""
    artifact = tmp_path / "forward.bin"
    code = (
        "import pathlib\n"
        "from asyncllm import LLM, SamplingParams\n"
        "from asyncllm.worker import compiled\n"
        f"compiled.artifact_path = lambda model, threads: pathlib.Path({str(artifact)!r})\n"
        f"llm = LLM({str(tiny_llama_dir)!r}, compile=True, dtype='float32',"
        " kv_cache_bytes=2**22, max_model_len=256)\n"
        "out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))\n"
        "assert llm.engine.stats()['compile'] == 'compiling', llm.engine.stats()['compile']\n"
        "print('generated', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated" in proc.stdout
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr[-3000:]
    deadline = time.monotonic() + 30
    while _workers_for(artifact) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _workers_for(artifact), "the compile child outlived its engine's process"
    assert not artifact.exists()


def _workers_for(artifact: pathlib.Path) -> list[str]:
    """Command lines of live compile children writing ``artifact`` (Linux /proc)."""
    out = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "compile_worker" in cmd and str(artifact) in cmd:
            out.append(cmd)
    return out


@pytest.mark.parametrize("when", ["before start", "as the child starts"])
def test_close_before_the_child_starts_starts_none(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
    when: str,
) -> None:
    """close() that comes before the compile child is started (the engine closed right
    after it was built) keeps it from starting: no process compiles for an engine that is
    gone; the compile ends (wait() returns) "failed", without a warning."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    caplog.set_level(logging.WARNING, "asyncllm")
    source = compiled_mod.ModelSource(str(tmp_path / "no-such-model"), "float32", None, 32)
    cf = compiled_mod.CompiledForward(_FakeLM(1), torch.device("cpu"), source)
    started: list[Any] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kw: Any) -> Any:
        started.append(args)
        return real_popen(*args, **kw)

    monkeypatch.setattr(compiled_mod.subprocess, "Popen", popen)
    if when == "before start":
        cf.close()
    else:  # the race: close() lands between the decision to compile and the child's start
        real_dir = compiled_mod.inductor_cache_dir

        def closing_dir() -> pathlib.Path:
            cf.close()
            return real_dir()

        monkeypatch.setattr(compiled_mod, "inductor_cache_dir", closing_dir)
    cf.start()
    assert cf.wait(60), "the compile never ended after close()"
    assert started == [] and cf._child is None
    assert cf.state == "failed" and not cf.path.exists()
    assert not [r for r in caplog.records if "serving eagerly" in r.getMessage()]


def test_close_waits_for_the_thread_that_loads_the_artifact(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """close() returns at once (an event loop closing its engine must not wait for a load);
    close(timeout), as at interpreter exit, returns once the background thread has ended: a
    thread still running torch code when the interpreter finalizes aborts the process
    ("terminate called without an active exception", 1 exit in ~8 of the CLI's). A load
    that fails after close() (at exit, imports fail) leaves the cached artifact alone."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    cf = compiled_mod.CompiledForward(_FakeLM(1), torch.device("cpu"))
    cf.path.parent.mkdir(parents=True, exist_ok=True)
    cf.path.write_bytes(b"cached")
    entered = threading.Event()

    def slow_load(path: pathlib.Path, key: str) -> Any:
        entered.set()
        time.sleep(0.5)
        raise ValueError("not an artifact")

    monkeypatch.setattr(compiled_mod, "load_artifact", slow_load)
    monkeypatch.setattr(compiled_mod, "build_artifact", lambda *a: None)
    cf.start()
    assert cf in compiled_mod._RUNNING
    assert entered.wait(30)
    t = time.monotonic()
    cf.close()
    assert time.monotonic() - t < 0.3 and cf._thread is not None and cf._thread.is_alive()
    cf.close(30)
    assert not cf._thread.is_alive()
    assert cf.done and cf.state == "failed"
    assert cf.path.read_bytes() == b"cached"


def test_unclosed_compiled_forward_is_joined_at_exit(tmp_path: pathlib.Path) -> None:
    """A process that exits without closing its engine still waits for the compile thread
    (an atexit hook closes every started CompiledForward): the thread finishes its work
    (here: a marker written after a slow load) instead of being killed mid-call, and the
    load's failure at exit (imports that register atexit handlers fail then) does not
    delete the cached artifact."""
    marker = tmp_path / "finished"
    (tmp_path / "a").write_bytes(b"cached")
    code = (
        "import pathlib, time, torch\n"
        "from asyncllm.worker import compiled\n"
        f"compiled.artifact_path = lambda model, threads: pathlib.Path({str(tmp_path)!r}) / 'a'\n"
        "compiled.build_artifact = lambda *a: compiled.artifact_path(None, 1).write_bytes(b'x')\n"
        "def load(path, key):\n"
        "    time.sleep(1.0)\n"
        f"    pathlib.Path({str(marker)!r}).write_text('done')\n"
        "    raise ValueError('no artifact')\n"
        "compiled.load_artifact = load\n"
        "cf = compiled.CompiledForward(torch.nn.Linear(2, 2), torch.device('cpu'))\n"
        "cf.start()\n"
        "time.sleep(0.2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.read_text() == "done"
    assert (tmp_path / "a").read_bytes() == b"cached" and "does not load" not in proc.stderr


def test_artifact_key_follows_the_kernel_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward is traced through the paths the switches select: with a kernel family
    switched off it is another artifact (the fidelity harness's no-int4-kernel path loaded
    the default path's artifact and ran the C++ kernel all the same). The C++ decoder runs
    beside the graph: its switch keeps the artifact."""
    from asyncllm.kernels.native import SWITCHES
    from asyncllm.worker.compiled import artifact_key

    model = torch.nn.Linear(4, 4)
    keys = {artifact_key(model, 2)}
    for family, var in SWITCHES.items():
        monkeypatch.setenv(var, "0")
        key = artifact_key(model, 2)
        assert (key in keys) == (family == "decoder")
        keys.add(key)
        monkeypatch.delenv(var)
    assert len(keys) == len(SWITCHES)
    assert artifact_key(model, 2) in keys


def test_inductor_cache_env_restores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the block Inductor's variable names asyncllm's directory; after the last of
    overlapping blocks (two engines loading on two threads) it is what it was, unset or a
    value of the caller's, which is also the directory used."""
    name = "TORCHINDUCTOR_CACHE_DIR"
    monkeypatch.delenv(name, raising=False)
    ours = str(compiled_mod.inductor_cache_dir())
    outer = compiled_mod.inductor_cache_env()
    outer.__enter__()
    with compiled_mod.inductor_cache_env():
        assert os.environ[name] == ours
        assert str(compiled_mod.inductor_cache_dir()) == ours
    assert os.environ[name] == ours  # the other block still runs
    outer.__exit__(None, None, None)
    assert name not in os.environ
    monkeypatch.setenv(name, "/tmp/callers-inductor")
    with compiled_mod.inductor_cache_env():
        assert os.environ[name] == "/tmp/callers-inductor"
    assert os.environ[name] == "/tmp/callers-inductor"
