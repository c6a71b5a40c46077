"""Regression tests of the hardening issue's core items: a request id reused at once, prefix
cache counters on readmission, ``max_model_len`` above the model's, ``n`` caps and fairness
between calls, and tokenization off the event loop."""

from __future__ import annotations

import asyncio
import collections.abc
import threading
from typing import Any

import pytest

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.core.block_manager import BlockManager
from asyncllm.core.preemption import release_waiting_blocks
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from tests.conftest import wait_until

SMALL = dict(block_size=4, kv_cache_bytes=2**20)


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# --------------------------------------------------------------- request ids are per call


@pytest.mark.parametrize("n", [1, 2])
async def test_an_id_reused_after_an_early_finish_gets_only_its_own_tokens(
    n, tiny_llama_dir, make_engine
):
    """A step in flight when "x" ends early must not post its token to the next "x"."""
    engine = make_engine(tiny_llama_dir, **SMALL)
    params = _greedy(8, n=n, logprobs=1)
    async with engine:
        alone = await engine.generate(list(range(2000, 2010)), params)
        for _ in range(4):
            g = engine.stream(list(range(1000, 1040)), _greedy(200, n=n), request_id="x")
            async for _out in g:
                break
            await g.aclose()
            out = await engine.generate(list(range(2000, 2010)), params, request_id="x")
            assert out.request_id == "x"
            samples = out.samples or [out]
            assert [s.token_ids for s in samples] == [s.token_ids for s in alone.samples or [alone]]
            assert all(len(s.logprobs or ()) == 8 for s in samples)
            assert all(
                s.metrics is not None and s.metrics.num_generated_tokens == 8 for s in samples
            )
        await wait_until(lambda: not engine.core.has_unfinished())
        assert not engine._loop.requests.states and not engine._loop.requests.calls


async def test_an_id_reused_after_a_timeout_or_abort_by_id(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    async with engine:
        alone = await engine.generate(list(range(2000, 2010)), _greedy(8))
        slow = asyncio.create_task(
            engine.generate(list(range(1000, 1040)), _greedy(200), request_id="y", timeout=0.05)
        )
        assert (await slow).finish_reason == "timeout"
        first = await engine.generate(list(range(2000, 2010)), _greedy(8), request_id="y")
        g = engine.stream(list(range(1000, 1040)), _greedy(200), request_id="z")
        await g.__anext__()
        engine.abort("z")
        second = await engine.generate(list(range(2000, 2010)), _greedy(8), request_id="z")
        assert [o.finish_reason async for o in g][-1] == "abort"
    assert first.token_ids == second.token_ids == alone.token_ids


# --------------------------------------------------------------- max_model_len


def test_max_model_len_above_the_models_is_refused(tiny_llama_dir, make_engine):
    with pytest.raises(ValueError, match=r"max_model_len=1000.*256"):
        make_engine(tiny_llama_dir, max_model_len=1000, **SMALL)
    with pytest.raises(ValueError, match=r"max_model_len=257.*256"):
        make_engine(tiny_llama_dir, max_model_len=257, **SMALL)
    assert make_engine(tiny_llama_dir, max_model_len=256, **SMALL).core.max_model_len == 256
    assert make_engine(tiny_llama_dir, **SMALL).core.max_model_len == 256


# --------------------------------------------------------------- counters on readmission


@pytest.mark.parametrize("mode", ["recompute", "offload"])
async def test_prefix_cache_counts_first_admissions_only(mode, tiny_llama_dir, make_engine):
    """Readmitted after a recompute preemption, a request finds its own blocks cached:
    neither the engine's counters nor its num_cached_tokens may count them."""
    engine = make_engine(
        tiny_llama_dir, block_size=4, kv_cache_bytes=49152, max_model_len=64,
        preemption_mode=mode, cpu_offload_bytes=4 * 4 * 512,  # 4 blocks: offload falls back
    )  # fmt: skip
    prompts = [list(range(100 + 17 * i, 117 + 17 * i)) for i in range(6)]  # disjoint
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, _greedy(40)) for p in prompts))
        stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_recomputed_tokens"] > 0
    assert stats["prefix_cache_queries"] == 6 * 17
    assert stats["prefix_cache_hits"] == 0
    for out in outs:
        assert len(out.token_ids) == 40
        assert out.num_cached_tokens == 0 and out.metrics is not None
        assert out.metrics.num_cached_tokens == 0


def test_readmitted_forked_sample_counts_nothing_again():
    """A waiting forked sample whose blocks were dropped (``preemption.release_waiting_blocks``) is
    readmitted through the prefix-cache lookup: no new query, its cached count kept."""
    bm = BlockManager(64, 4, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    samples = [Request(f"s{i}", list(range(1, 11)), max_tokens=3, max_model_len=100)
               for i in range(2)]  # fmt: skip
    for r in samples:
        r.group_id = "g"
    sched.add_parallel_requests(samples)
    while sched.requests:
        plan = sched.schedule()
        sched.update_from_output(plan, {c.request_id: 7 for c in plan.chunks if c.sample})
        if bm.block_table("s1") and samples[1].status is RequestStatus.WAITING:
            assert release_waiting_blocks(sched, samples[0])
    assert sched.prefix_cache_queries == 9  # the shared prefix: the prompt but its last token
    assert [r.num_cached_tokens for r in samples] == [0, 0]


# --------------------------------------------------------------- n and fairness


async def test_n_above_max_num_seqs_is_refused(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=8, **SMALL)
    async with engine:
        with pytest.raises(InvalidRequestError, match=r"n=9.*max_num_seqs=8"):
            await engine.generate("hello", SamplingParams(n=9, max_tokens=4))
        assert engine.core.scheduler.num_unfinished == 0
        out = await engine.generate("hello", SamplingParams(n=8, max_tokens=4))
        assert len(out.samples or ()) == 8


def _group_scheduler(
    n: int, max_num_seqs: int, now: float = 0.0
) -> tuple[Scheduler, list[Request]]:
    bm = BlockManager(256, 4, enable_caching=False)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, clock=lambda: now)
    samples = [Request(f"g{i}", list(range(1, 9)), max_tokens=100, max_model_len=1000)
               for i in range(n)]  # fmt: skip
    for r in samples:
        r.group_id = "g"
    sched.add_parallel_requests(samples)
    return sched, samples


def _step(sched: Scheduler) -> list[str]:
    plan = sched.schedule()
    sched.update_from_output(plan, {c.request_id: 5 for c in plan.chunks if c.sample})
    return [c.request_id for c in plan.chunks]


@pytest.mark.parametrize("now", [0.0, 1000.0])  # 1000: every request is protected by age
def test_a_call_above_its_fair_share_yields_its_newest_sample(now):
    sched, samples = _group_scheduler(8, 8, now)
    for _ in range(3):
        _step(sched)
    assert len(sched.running) == 8
    newest = sched.running[-1]
    sched.add_request(Request("new", [1, 2, 3], max_tokens=5, max_model_len=1000, arrival_time=1))
    assert "new" in _step(sched)  # admitted in the very next step
    assert newest.status is RequestStatus.WAITING and sched.num_preemptions == 1
    for _ in range(3):  # no churn: the preempted sample waits, nothing else is preempted
        _step(sched)
    assert sched.num_preemptions == 1 and newest.status is RequestStatus.WAITING
    while sched.requests:
        _step(sched)
    assert all(len(r.output_token_ids) == 100 for r in samples)


def test_waiting_samples_within_their_share_go_first_and_better_priority_is_never_preempted():
    sched, samples = _group_scheduler(4, 4)
    for r in samples:
        r.priority = -1  # better than the newcomer
    for _ in range(3):
        _step(sched)
    sched.add_request(Request("new", [1, 2, 3], max_tokens=5, max_model_len=1000, arrival_time=1))
    _step(sched)
    assert sched.num_preemptions == 0 and sched.requests["new"].status is RequestStatus.WAITING


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("mode", ["offload", "recompute"])
async def test_a_new_stream_starts_within_steps_beside_a_call_of_n_max_num_seqs(
    mode, tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, max_num_seqs=8, preemption_mode=mode, **SMALL)
    core = engine.core
    async with engine:
        big = asyncio.create_task(engine.generate(list(range(300, 320)), _greedy(100, n=8)))
        await wait_until(
            lambda: core.scheduler.num_unfinished == 8 and len(core.scheduler.running) == 8
        )
        submitted = core.num_steps
        g = engine.stream(list(range(500, 510)), _greedy(20))
        first = await g.__anext__()
        assert core.num_steps - submitted <= 4  # beside 100 steps to wait for a free slot
        rest = [out async for out in g]
        outs = await big
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 20
    assert [len(s.token_ids) for s in outs.samples or ()] == [100] * 8
    assert engine.stats()["num_preemptions"] >= 1


# --------------------------------------------------------------- tokenization off the loop


class TokenizerSpy:
    """Delegates to a tokenizer and records (method, thread, text length) of each encode."""

    ENCODERS = ("encode", "encode_plus", "tokenize", "apply_chat_template", "batch_encode_plus")

    def __init__(self, real: Any) -> None:
        self._real = real
        self.calls: list[tuple[str, int, int]] = []

    def _record(self, name: str, args: tuple[Any, ...]) -> None:
        arg = args[0] if args else None
        size = len(arg) if isinstance(arg, str) else sum(len(str(m)) for m in arg or ())
        self.calls.append((name, threading.get_ident(), size))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in self.ENCODERS:
            return attr

        def spied(*args: Any, **kw: Any) -> Any:
            self._record(name, args)
            return attr(*args, **kw)

        return spied

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self._record("__call__", args)
        return self._real(*args, **kw)

    def __len__(self) -> int:
        return len(self._real)


class Untouchable(collections.abc.Sequence):  # type: ignore[type-arg]
    """Ten million token ids that must be refused by their count, never read."""

    def __len__(self) -> int:
        return 10_000_000

    def __getitem__(self, i: Any) -> int:
        raise AssertionError("a too-long prompt's ids were read")


async def test_a_huge_prompt_is_refused_without_tokenizing_it(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    spy = TokenizerSpy(engine.core.tokenizer)
    engine.core.inputs.tokenizer = spy
    huge = "a" * 10_000_000
    async with engine:
        other = engine.stream(list(range(100, 110)), _greedy(30))
        await other.__anext__()
        with pytest.raises(InvalidRequestError, match="cannot fit max_model_len"):
            await engine.generate(huge, _greedy(4))
        with pytest.raises(InvalidRequestError, match="cannot fit max_model_len"):
            await engine.generate({"prompt": huge}, _greedy(4))
        with pytest.raises(InvalidRequestError, match="cannot fit max_model_len"):
            await collect_chat(engine, [{"role": "user", "content": huge}])
        with pytest.raises(InvalidRequestError, match="cannot fit max_model_len"):
            big = [{"role": "user", "content": [{"type": "text", "text": huge}]}]
            async for _ in engine.chat(big, _greedy(4)):
                pass
        with pytest.raises(InvalidRequestError, match="10000000 tokens; max_model_len is 256"):
            await engine.generate(Untouchable(), _greedy(4))
        with pytest.raises(InvalidRequestError, match="257 tokens; max_model_len is 256"):
            await engine.generate({"prompt_token_ids": [5] * 257}, _greedy(4))
        rest = [out async for out in other]
    assert all(size < 1000 for _, _, size in spy.calls)  # the huge text never reached it
    assert sum(len(o.token_ids) for o in rest) == 29 and rest[-1].finish_reason == "length"


async def test_text_prompts_and_chat_templates_are_tokenized_off_the_loop(
    tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, **SMALL)
    core = engine.core
    spy = TokenizerSpy(core.tokenizer)
    core.inputs.tokenizer = spy
    fits_chars = "word " * 2000  # 10,000 characters: under the bound, over 256 tokens
    assert len(fits_chars) < core.inputs.max_prompt_chars
    async with engine:
        loop_thread, compute_thread = threading.get_ident(), core.compute_thread.ident
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await engine.generate(fits_chars, _greedy(4))
        out = await engine.generate("Hello there", _greedy(4))
        chat = await collect_chat(engine, [{"role": "user", "content": "Hi"}])
    assert len(out.token_ids) == 4 and len(chat) == 4
    names = {name for name, _, _ in spy.calls}
    assert names & {"encode", "__call__"} and "apply_chat_template" in names
    threads = {thread for _, thread, _ in spy.calls}
    assert loop_thread not in threads and compute_thread not in threads


async def collect_chat(engine: Any, messages: list[dict[str, Any]]) -> list[int]:
    return [t async for out in engine.chat(messages, _greedy(4)) for t in out.token_ids]


def hold_tokenization(engine: Any) -> threading.Event:
    """Make the engine's tokenization of text prompts wait until the returned event is set."""
    core = engine.core
    release = threading.Event()
    real = core.inputs.make_requests

    def slow_make_requests(*args: Any, **kw: Any) -> Any:
        release.wait(10)
        return real(*args, **kw)

    core.inputs.make_requests = slow_make_requests
    return release


async def test_an_engine_closed_while_tokenizing_refuses_the_call(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    release = hold_tokenization(engine)
    async with engine:
        task = asyncio.create_task(engine.generate("Hello", _greedy(4)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    release.set()
    from asyncllm import EngineNotRunningError

    with pytest.raises(EngineNotRunningError):
        await task


async def test_a_chat_too_long_in_fields_check_chat_does_not_count_is_never_tokenized(
    tiny_llama_dir, make_engine
):
    """A template renders more than message contents (roles here; names, template
    variables): the rendered text is measured before it is tokenized, so a 3.5 MB role is
    refused without holding the tokenizer thread for seconds."""
    engine = make_engine(tiny_llama_dir, **SMALL)
    core = engine.core
    tokenized: list[int] = []  # lengths of every text the tokenizer encoded
    real_call = type(core.tokenizer).__call__

    def spy_call(self: Any, text: Any = None, *args: Any, **kw: Any) -> Any:
        tokenized.append(len(text) if isinstance(text, str) else -1)
        return real_call(self, text, *args, **kw)

    huge = "x" * 3_500_000
    template = "{{ big }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        type(core.tokenizer).__call__ = spy_call  # type: ignore[method-assign]
        async with engine:
            with pytest.raises(InvalidRequestError, match="cannot fit max_model_len"):
                await collect_chat(engine, [{"role": huge, "content": "Hi"}])
            with pytest.raises(InvalidRequestError, match="cannot fit max_model_len"):
                kw = {"chat_template": template, "big": huge}  # a template variable
                async for _ in engine.chat(
                    [{"role": "user", "content": "Hi"}], _greedy(4), chat_template_kwargs=kw
                ):
                    pass
            ok = await collect_chat(engine, [{"role": "user", "content": "Hi"}])
    finally:
        type(core.tokenizer).__call__ = real_call  # type: ignore[method-assign]
    assert len(ok) == 4
    assert tokenized and max(tokenized) < 1000  # only the small chat was tokenized


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_max_waiting_counts_calls_waiting_for_the_tokenizer(tiny_llama_dir, make_engine):
    """Calls queued for the one tokenizer thread count as waiting: past max_waiting a new
    text or chat call raises QueueFull at once instead of queueing behind them unbounded."""
    from asyncllm import QueueFull

    engine = make_engine(tiny_llama_dir, max_waiting=2, **SMALL)
    release = hold_tokenization(engine)
    async with engine:
        held = [asyncio.create_task(engine.generate(f"Hello {i}", _greedy(3))) for i in range(2)]
        await wait_until(lambda: engine.stats()["num_waiting"] == 2)
        with pytest.raises(QueueFull):
            await engine.generate("one more", _greedy(3))
        with pytest.raises(QueueFull):
            await collect_chat(engine, [{"role": "user", "content": "Hi"}])
        with pytest.raises(QueueFull):  # token ids need no tokenizer, but the queue is full
            await engine.generate([5, 6, 7], _greedy(3))
        release.set()
        outs = await asyncio.gather(*held)
        assert [len(o.token_ids) for o in outs] == [3, 3]
        assert engine.stats()["num_waiting"] == 0
        assert len(await collect_chat(engine, [{"role": "user", "content": "Hi"}])) == 4
