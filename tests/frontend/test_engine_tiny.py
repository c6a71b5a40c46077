"""End-to-end engine tests on tiny random-weight models (fast), on asyncio and trio."""

from __future__ import annotations

import time

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncllm import (
    EngineNotRunningError,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
)
from tests.conftest import (
    BOTH_BACKENDS,
    core_request,
    first_divergence_is_near_tie,
    gather,
    spawn,
    wait_until,
)


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request):
    return request.param


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [3, 7, 12, 20, 1, 9, 30, 16]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _reference(model_dir, prompts, max_new_tokens, dtype=torch.float32):
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return ref, _generate(ref, prompts, max_new_tokens)


def _generate(ref, prompts, max_new_tokens):
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
async def test_greedy_matches_transformers_generate(arch, dtype, request, make_engine):
    """8 prompts streamed concurrently, chunked (budget 16, block size 4) with decodes;
    against transformers' generate in the engine's dtype ("auto": bfloat16 where the CPU has
    it): float32 token for token, bfloat16 up to a near-tie (conftest's NEAR_TIE)."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompts = _prompts()
    engine = make_engine(
        model_dir, block_size=4, max_num_batched_tokens=16, kv_cache_bytes=2**20, dtype=dtype
    )
    ref, expected = _reference(model_dir, prompts, GREEDY.max_tokens, engine.core.dtype)

    async def consume(p):
        ids, n_items = [], 0
        async for out in engine.stream(p, GREEDY):
            ids.extend(out.token_ids)
            n_items += 1
        assert out.finish_reason == "length"
        return ids, n_items

    async with engine:
        results = await gather(*(consume(p) for p in prompts))
        stats = engine.stats()
    for p, (got, _), want in zip(prompts, results, expected, strict=True):
        if got != want:  # float32: never; bfloat16: only at a near-tie
            assert dtype != "float32" and first_divergence_is_near_tie(ref, p, want, got)
    assert all(n > 1 for _, n in results)  # streamed, not delivered at once
    # Prompts of 20 and 30 tokens cannot fit one 16-token step: they were chunked.
    assert stats["num_steps"] > GREEDY.max_tokens + 1


async def test_stops_at_eos_and_respects_max_model_len(tiny_llama_dir, make_engine):
    prompts = _prompts()
    expected = _reference(tiny_llama_dir, prompts[:1], 10)[1][0]
    eos = expected[3]
    engine = make_engine(
        tiny_llama_dir, block_size=4, kv_cache_bytes=2**20, max_model_len=40, dtype="float32"
    )
    engine.core.inputs.eos_token_ids = frozenset({eos})
    async with engine:
        out = await engine.generate(prompts[0], SamplingParams(max_tokens=10, temperature=0))
        assert out.finish_reason == "stop"
        assert out.token_ids == expected[: expected.index(eos) + 1]
        # ignore_eos runs on; a 30-token prompt with max_model_len 40 gets 10 tokens at most.
        long = await engine.generate(prompts[6], SamplingParams(max_tokens=50, ignore_eos=True))
        assert long.finish_reason == "length"
        assert len(long.token_ids) == 40 - 30


async def test_preemption_by_recompute_keeps_outputs(tiny_llama_dir, make_engine):
    """A pool far too small for the batch: requests are preempted and recomputed."""
    prompts = _prompts()
    expected = _reference(tiny_llama_dir, prompts, 10)[1]
    engine = make_engine(
        tiny_llama_dir,
        dtype="float32",  # exact tokens, and the pool below is sized in float32 blocks
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=48,
        kv_cache_bytes=12 * 4 * 2 * 2 * 2 * 16 * 4,  # 12 blocks of 4 tokens
    )
    async with engine:
        outs = await gather(*(engine.generate(p, GREEDY) for p in prompts))
        assert engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == expected


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_seeded_sampling_independent_of_batch(tiny_llama_dir, make_engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    prompts = _prompts()
    engine = make_engine(tiny_llama_dir, block_size=4, kv_cache_bytes=2**20)
    async with engine:
        alone = await engine.generate(prompts[0], params)
        crowd = await gather(
            engine.generate(prompts[0], params),
            *(
                engine.generate(p, SamplingParams(max_tokens=12, seed=i))
                for i, p in enumerate(prompts[1:])
            ),
        )
        other_seed = await engine.generate(prompts[0], SamplingParams(max_tokens=12, seed=8))
    assert crowd[0].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.parametrize(
    ("where", "how"),
    [("prefill", "cancel"), ("decode", "cancel"), ("decode", "break"), ("decode", "aclose")],
)
async def test_cancellation_frees_blocks(where, how, tiny_llama_dir, make_engine):
    """Mid-prefill a consumer can only be cancelled; mid-decode it can also break or aclose."""
    engine = make_engine(
        tiny_llama_dir, block_size=4, max_num_batched_tokens=8, kv_cache_bytes=2**20
    )
    long_prompt = list(range(5, 105))  # 100 tokens: many steps of prefill at budget 8
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    core = engine.core

    def victim():
        return core_request(engine, "victim")

    async with engine, anyio.create_task_group() as tg:
        other = spawn(tg, engine.generate(_prompts()[1], GREEDY))
        gen = engine.stream(long_prompt, params, request_id="victim")
        if how == "cancel":

            async def consume():
                async for _ in gen:
                    pass

            task = spawn(tg, consume())
            if where == "prefill":
                await wait_until(lambda: victim() is not None and victim().num_computed_tokens > 0)
                assert victim().num_computed_tokens < 100
            else:
                await wait_until(
                    lambda: victim() is not None and len(victim().output_token_ids) > 2
                )
            task.cancel()
        else:
            async for out in gen:
                if out.num_generated_tokens > 2:
                    break
            if how == "aclose":
                await gen.aclose()
            else:
                del gen  # the loop's async-generator finalizer closes it
        await wait_until(lambda: victim() is None)
        assert (await other.result()).finish_reason == "length"
        await wait_until(lambda: not core.has_unfinished())


LEAVE_WAYS = ["async with + break", "aclose", "cancel scope", "fail_after", "move_on_after"]


@pytest.mark.parametrize("anyio_backend", ["asyncio", ("asyncio", {"use_uvloop": True}), "trio"])
@pytest.mark.parametrize("how", LEAVE_WAYS)
async def test_leaving_a_stream_aborts_it_before_the_next_step(
    how, anyio_backend, tiny_llama_dir, make_engine
):
    """Every deterministic way out of a stream (structured cancellation included) removes
    its request from the core before the next step starts: no step after it runs it."""
    engine = make_engine(tiny_llama_dir, block_size=4, kv_cache_bytes=2**20)
    core = engine.core
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    left = False
    steps_after_leaving = 0
    real_run_step, real_step = engine._loop._step, core.step

    async def run_step():  # the loop starts a step (its inbox applied)
        nonlocal steps_after_leaving
        if left and core_request(engine, "victim") is not None:
            steps_after_leaving += 1
        return await real_run_step()

    def slow_step():  # 200 tokens outlast the deadlines below by far
        time.sleep(0.01)
        return real_step()

    engine._loop._step, core.step = run_step, slow_step

    async def read(stream, scope=None):
        # No await in the body: a cancellation reaches the stream inside __anext__.
        async for out in stream:
            if out.num_generated_tokens > 2:
                if scope is not None:
                    scope.cancel()
                elif how in ("async with + break", "aclose"):
                    break

    async with engine:
        stream = engine.stream(_prompts()[0], params, request_id="victim")
        if how == "async with + break":
            async with stream:
                await read(stream)
        elif how == "aclose":
            await read(stream)
            await stream.aclose()
        elif how == "cancel scope":
            with anyio.CancelScope() as scope:
                await read(stream, scope)
        elif how == "fail_after":
            with pytest.raises(TimeoutError), anyio.fail_after(0.2):
                await read(stream)
        else:
            with anyio.move_on_after(0.2) as scope:
                await read(stream)
            assert scope.cancelled_caught
        left = True
        await wait_until(lambda: core_request(engine, "victim") is None)
        await engine.generate(_prompts()[1], GREEDY)  # more steps: none may run the victim
    assert steps_after_leaving == 0
    if how in ("async with + break", "aclose"):
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


async def test_event_loop_stays_responsive(tiny_llama_dir, make_engine):
    """The loop keeps running other tasks while a step computes: every step waits (on the
    compute thread) until a ticker task on the loop has ticked 10 times since the step
    began. A loop blocked by the step would never tick and the step would give up."""
    engine = make_engine(tiny_llama_dir, block_size=16, kv_cache_bytes=2**22)
    ticks = 0
    stop = anyio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await anyio.sleep(0.001)

    real_step = engine.core.step
    waited: list[bool] = []

    def step_waiting_for_ticks():
        start = ticks
        deadline = time.monotonic() + 60  # a fail-safe against a hang, not a speed target
        while ticks - start < 10 and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL like a torch op would
        waited.append(ticks - start >= 10)
        return real_step()

    engine.core.step = step_waiting_for_ticks
    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await engine.generate(_prompts()[0], SamplingParams(max_tokens=5, ignore_eos=True))
        stop.set()
    assert len(waited) >= 5 and all(waited)


async def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, kv_cache_bytes=2**20, max_model_len=64)
    with pytest.raises(EngineNotRunningError):
        await engine.generate("hi")
    async with engine, anyio.create_task_group() as tg:
        good = spawn(tg, engine.generate(_prompts()[0], GREEDY))
        bad_calls = [
            ("", GREEDY),
            ([], GREEDY),
            (list(range(5, 69)), GREEDY),  # 64 tokens = max_model_len: no room to generate
            ([1, 2, 10**9], GREEDY),
            ("hello", "not params"),
        ]
        for prompt, params in bad_calls:
            with pytest.raises(InvalidRequestError):
                await engine.generate(prompt, params)
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=-1)
        stream = engine.stream(_prompts()[2], GREEDY, request_id="dup")
        first = await stream.__anext__()
        with pytest.raises(InvalidRequestError, match="duplicate"):
            await engine.generate("x", GREEDY, request_id="dup")
        await stream.aclose()
        assert first.token_ids
        assert (await good.result()).finish_reason == "length"


def test_unknown_model_path_is_a_typed_error(tmp_path):
    from asyncllm import AsyncEngine

    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "nope")):
        AsyncEngine.from_pretrained(str(tmp_path / "nope"))


async def test_all_torch_work_runs_on_the_compute_thread(tiny_llama_dir, make_engine):
    # libgomp slows every step once a second thread owns an OpenMP team (docs/tuning.md):
    # loading, the KV cache and every step, async or called directly, use one thread.
    import threading

    engine = make_engine(tiny_llama_dir, max_model_len=64, kv_cache_bytes=2**20)
    core = engine.core
    threads: set[str] = set()
    real = core.runner.execute

    def execute(plan, *args):
        threads.add(threading.current_thread().name)
        return real(plan, *args)

    core.runner.execute = execute
    async with engine:
        await engine.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))
        with pytest.raises(RuntimeError, match="AsyncEngine drives"):
            core.step()  # its outputs would never reach the streams
    # The sync engine, driven from this (the main) thread.
    core.add_request(core.inputs.make_request("direct", "hello", SamplingParams(max_tokens=2)))
    while core.has_unfinished():
        core.step()
    core.stop_compute_thread()
    assert len(threads) == 1 and threads.pop().startswith("asyncllm-step")


async def test_a_new_compute_thread_keeps_the_configured_thread_count(tiny_llama_dir, make_engine):
    """Each ``async with`` ends by joining the compute thread and the next one starts a new
    thread. That thread took torch's process-wide count at its first parallel op, which any
    ``torch.set_num_threads`` of the application (here 1) had changed; now it sets its own."""
    import torch

    engine = make_engine(tiny_llama_dir, max_model_len=64, kv_cache_bytes=2**20, num_threads=2)
    core = engine.core
    before = torch.get_num_threads()
    try:
        for _ in range(2):
            async with engine:
                await engine.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))
                assert core.compute_thread.submit(torch.get_num_threads).result() == 2
            torch.set_num_threads(1)  # the application's, on its own thread
    finally:
        torch.set_num_threads(before)


async def test_a_new_compute_thread_is_warmed_up_before_the_first_request(
    tiny_llama_dir, make_engine
):
    """Entering ``async with`` again starts a new compute thread and runs each quantized
    linear on it with more rows than the few-row kernels take (their many-row kernels are
    set up per thread), before any request; the answers do not change."""
    import threading

    import torch

    from asyncllm.worker import model_runner

    engine = make_engine(
        tiny_llama_dir, max_model_len=64, kv_cache_bytes=2**20, quantization="int4"
    )
    runner = engine.core.runner
    layers = [m for m in runner.model.modules() if type(m) is model_runner.Int4Linear]
    assert layers
    rows: list[tuple[str, int]] = []
    for m in layers:
        m.register_forward_pre_hook(
            lambda _, args: rows.append((threading.current_thread().name, args[0].shape[0]))
        )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    answers = []
    for _ in range(2):
        rows.clear()
        async with engine:
            warm = list(rows)
            answers.append((await engine.generate("hello there", params)).token_ids)
    # the second entry's new thread: every layer, before the request's steps
    assert len(warm) == len(layers)
    # and the steps themselves still run in inference mode (no autograd bookkeeping)
    real_forward = runner._forward
    modes: list[bool] = []

    def forward(*args):
        modes.append(torch.is_inference_mode_enabled())
        return real_forward(*args)

    runner._forward = forward
    async with engine:
        await engine.generate("hello there", params)
    assert modes and all(modes)
    assert all(n.startswith("asyncllm-step") and r == model_runner.WARM_UP_ROWS for n, r in warm)
    assert answers[0] == answers[1]


async def test_a_dropped_engine_leaves_no_thread(tiny_llama_dir):
    import gc
    import threading

    from asyncllm import AsyncEngine

    def engine_threads():
        return [t for t in threading.enumerate() if t.name.startswith("asyncllm")]

    engine = AsyncEngine.from_pretrained(str(tiny_llama_dir), max_model_len=64)
    assert engine_threads()  # loaded on its compute thread, never entered
    del engine
    gc.collect()
    await wait_until(lambda: not engine_threads())
