"""Shared fixtures of every tier: tiny random-weight models, the default model, and the
block-pool check.

This module imports no torch (nor transformers) at its top: tests/core runs without torch
(tests/core/test_torch_free.py checks it), so the fixtures and helpers that need it import it
inside.

Every engine a test builds through ``make_engine`` is checked after the test: no request left
in it, every KV block free, and the pool's reference counts consistent.

``EngineConfig.compile="auto"`` is forced off in the test suite (``ASYNCLLM_COMPILE=0``, set
here and inherited by the processes tests start), whatever the shell exported or "auto"'s
default becomes: a compile on a background thread would slow every test that builds an
engine. tests/e2e/test_compile.py asks for ``compile=True`` explicitly.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from asyncllm import AsyncEngine
from asyncllm.bench.tiny_model import TINY_CONFIG, save_tiny_llama
from asyncllm.core.request import SAMPLE_ID_SEP, Request

if TYPE_CHECKING:
    import torch

    from asyncllm.worker.sampling.sampler import SamplerOutput

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

TINY = TINY_CONFIG

# asyncllm.worker.device.COMPILE_ENV, named here without importing the worker (torch)
os.environ["ASYNCLLM_COMPILE"] = "0"


#: The cores this process could run on before :func:`_pin_xdist_worker` narrowed them.
ALL_CORES = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _pin_xdist_worker() -> list[int] | None:
    """Under pytest-xdist (``make test`` runs two workers), each worker keeps to its own
    share of the cores, and torch's threads and every child process it starts with it
    (affinity is inherited; ``default_num_threads`` reads it): two workers never put two
    busy OpenMP threads on one core, where their spin-waits run each other several times
    slower. Returns the share (None when not narrowed). Done at this module's import,
    before any test module imports torch, whose OpenMP runtime reads the mask when loaded."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = cores[int(worker[2:]) % count :: count] or cores
    for tid in os.listdir("/proc/self/task"):  # threads started already (execnet's) too
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), share)
    return share


PINNED_CORES = _pin_xdist_worker()


@pytest.fixture(scope="session", autouse=True)
def _torch_threads_follow_the_pinning() -> None:
    """torch's thread count set to the worker's share of the cores, when the collected test
    modules imported torch (tests/core alone does not)."""
    torch = sys.modules.get("torch")
    if PINNED_CORES is not None and torch is not None:
        torch.set_num_threads(len(PINNED_CORES))


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Within this block the calling thread, and every process it starts, may run on all
    of :data:`ALL_CORES` (a local Ray instance's daemons and replicas, a dozen processes,
    would otherwise share the worker's one core)."""
    if ALL_CORES is None:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


#: Log-probability gap under which two correct greedy runs of one model in one dtype may
#: part (another summation order or batch shape). float32 rounds at 2**-24 relative;
#: bfloat16 keeps 8 significant bits, so logits between 16 and 32 (the default model's top
#: ones) are multiples of 0.125 and two runs' top two can swap across one or two steps of it:
#: 0.25. (The default model's bfloat16 parity tests part at gaps of 0, 0.125 and 0.25; vLLM's
#: bfloat16 tests compare top-k logprobs for the same reason.)
NEAR_TIE = {"float32": 1e-4, "bfloat16": 0.25}


def first_divergence_is_near_tie(
    ref_model: torch.nn.Module, prompt: list[int], expected: list[int], got: list[int]
) -> bool:
    """True when the first token where ``got`` parts from ``expected`` (the reference's own
    greedy continuation of ``prompt``) is one the reference ranks within ``NEAR_TIE`` of its
    best in its dtype (two steps of bfloat16's 0.125 is exactly 0.25): the only difference
    the parity tests accept. Within that window, not among the top two: bfloat16 logits of
    ~16 are rounded to steps of 0.125, so three or more tokens can tie, and which two of
    them come first is the sort's choice, not the model's."""
    import torch

    j = next(i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b)
    ids = torch.tensor([prompt + expected[:j]])
    with torch.inference_mode():
        logprobs = ref_model(ids).logits[0, -1].float().log_softmax(-1)
    dtype = next(ref_model.parameters()).dtype
    gap = float(logprobs.max() - logprobs[got[j]])
    print(f"first divergence at token {j} ({dtype}): the engine's token {gap:.3g} below the best")
    return gap <= NEAR_TIE[str(dtype).removeprefix("torch.")]


@pytest.fixture
def anyio_backend() -> str:
    """The event loop async tests run on (anyio's pytest plugin): asyncio by default; the
    front-end test files override this fixture to run on trio too."""
    return "asyncio"


#: Parametrize a module's ``anyio_backend`` fixture with these to run it on both loops.
BOTH_BACKENDS = ["asyncio", "trio"]


@pytest.fixture(scope="session")
def default_model_dir() -> pathlib.Path:
    """The default model as a cached safetensors directory (converted once per machine)."""
    from asyncllm.models.loader import resolve_model_dir

    return resolve_model_dir("default")


def _save_tiny(path: pathlib.Path, model: torch.nn.Module, tokenizer_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: pathlib.Path
) -> pathlib.Path:
    """A 2-layer random Llama (GQA 4:2) with SmolLM2's tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_llama_512_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: pathlib.Path
) -> pathlib.Path:
    """The tiny Llama with 512 positions (room for tools in the prompt and a call)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-512"), default_model_dir, max_positions=512
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: pathlib.Path
) -> pathlib.Path:
    """A 2-layer random Qwen2 (q/k/v biases, GQA 4:2) with SmolLM2's tokenizer; its second
    layer attends over a sliding window of 8 tokens (Qwen2's ``max_window_layers``), so the
    tests that run it (eager and compiled, preempted, quantized) run a window too."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    _save_tiny(path, model, default_model_dir)
    return path


@pytest.fixture(scope="session")
def bos_llama_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: pathlib.Path
) -> pathlib.Path:
    """The tiny Llama with a Llama-2 style tokenizer: its post-processor adds the BOS token
    (``<|endoftext|>``, id 0) and its chat template starts with ``{{ bos_token }}``."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("bos-llama")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    bos = "<|endoftext|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    tok.bos_token = bos
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    tok.save_pretrained(path)
    return path


@pytest.fixture
def make_engine() -> Iterator[Callable[..., AsyncEngine]]:
    """Build engines; after the test, assert that each one's block pool is whole."""
    engines: list[AsyncEngine] = []

    def make(model: str | pathlib.Path, **config: Any) -> AsyncEngine:
        engine = AsyncEngine.from_pretrained(str(model), **config)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        check_pool_whole(engine)


def chunked_engine(
    make_engine: Callable[..., AsyncEngine], model_dir: pathlib.Path, attention_backend: str
) -> AsyncEngine:
    """A tiny-model engine whose steps mix chunked prefill with decodes (16-token blocks and
    budget, a 1 MiB KV cache) on ``attention_backend``: for comparing backends end to end."""
    return make_engine(
        model_dir,
        block_size=16,
        max_num_batched_tokens=16,
        kv_cache_bytes=2**20,
        attention_backend=attention_backend,
    )


def check_pool_whole(engine: AsyncEngine) -> None:
    """No request left, every device block free, every CPU block free or held by the host
    tier of the prefix cache, reference counts consistent."""
    core = engine.core
    core.block_manager.check_invariants()
    assert not core.has_unfinished(), core.scheduler.requests
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks
    store = core.block_manager.host_store
    cpu_pool = store.pool if store is not None else core.scheduler.cpu_pool
    if store is not None:
        store.check_invariants()
        assert core.scheduler.cpu_pool in (None, store.pool)
    if cpu_pool is not None:
        cpu_pool.check_invariants()
        assert cpu_pool.num_free == cpu_pool.num_blocks - (len(store) if store else 0)


def core_request_ids(engine: AsyncEngine, request_id: str) -> list[str]:
    """The internal ids in the core of the caller's ``request_id`` (the caller's id,
    ``SAMPLE_ID_SEP`` and a counter; then the sample index for ``n > 1``), samples in index
    order, a parallel call's hidden prefix request left out."""
    prefix = request_id + SAMPLE_ID_SEP
    ids = [
        i for i in engine.core.scheduler.requests
        if i.startswith(prefix) and not i.endswith(SAMPLE_ID_SEP + "prefix")
    ]  # fmt: skip
    return sorted(ids, key=lambda i: [int(p) for p in i[len(prefix) :].split(SAMPLE_ID_SEP)])


def core_request(engine: AsyncEngine, request_id: str) -> Request | None:
    """The core request of the caller's ``request_id`` (its first sample), or None."""
    ids = core_request_ids(engine, request_id)
    return engine.core.scheduler.requests[ids[0]] if ids else None


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` on the event loop (asyncio or trio) until it holds (fails the
    test after ``timeout`` seconds)."""
    deadline = anyio.current_time() + timeout
    while not predicate():
        if anyio.current_time() > deadline:
            raise AssertionError("condition not reached in time")
        await anyio.sleep(0.005)


class Scripted:
    """Stands in for the sampler: the k-th generated token of every request is script[k]
    (the last one repeated past the end).

    The real sampler still runs (so logprobs and shapes are real); only the choice is
    replaced, which makes the text of a generation exactly controllable.
    """

    def __init__(self, real: Any, script: list[int]) -> None:
        self.real = real
        self.script = script

    def __call__(self, logits: torch.Tensor, batch: Any) -> SamplerOutput:
        import torch

        from asyncllm.worker.sampling.sampler import SamplerOutput

        out = self.real(logits, batch)
        ids = [self.script[min(k, len(self.script) - 1)] for k in batch.token_indices]
        return SamplerOutput(torch.tensor(ids), out.logprobs)


def script_output(engine: AsyncEngine, text: str, *, end_with_eos: bool = True) -> list[int]:
    """Make every request of ``engine`` generate ``text`` (its tokens; then the EOS token,
    so requests finish with "stop", unless ``end_with_eos`` is False); returns the ids."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if end_with_eos:
        ids.append(min(engine.core.eos_token_ids))
    engine.core.runner.sampler = Scripted(engine.core.runner.sampler, ids)
    return ids


class Spawned:
    """An awaitable started with :func:`spawn`: an ``asyncio.Task`` for tests that run on
    asyncio and trio. Its error is kept (not raised into the task group), as a task's is."""

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.started = False
        self.value: Any = None
        self.error: BaseException | None = None

    def cancel(self) -> None:
        self.scope.cancel()

    def cancelled(self) -> bool:
        return self.scope.cancelled_caught

    def exception(self) -> BaseException | None:
        return self.error

    async def result(self) -> Any:
        """Wait for the end; return the value or raise the error."""
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


def spawn(tg: anyio.abc.TaskGroup, aw: Awaitable[Any]) -> Spawned:
    """Run ``aw`` in a task of ``tg`` and return its :class:`Spawned` handle."""
    handle = Spawned()

    async def run() -> None:
        handle.started = True
        with handle.scope:
            try:
                handle.value = await aw
            except Exception as exc:
                handle.error = exc
        handle.done.set()

    tg.start_soon(run)
    return handle


async def gather(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` on anyio: run the awaitables concurrently, results in order (the
    first error cancels the others and is raised, unwrapped from the task group's group)."""
    results: list[Any] = [None] * len(aws)

    async def run(i: int, aw: Awaitable[Any]) -> None:
        results[i] = await aw

    try:
        async with anyio.create_task_group() as tg:
            for i, aw in enumerate(aws):
                tg.start_soon(run, i, aw)
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from group
    return results


@pytest.fixture
def quant_cache(tmp_path, monkeypatch):
    """Quantized weights cached in a temporary directory (``ASYNCLLM_CACHE``)."""
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"
