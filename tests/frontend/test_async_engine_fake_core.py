"""AsyncEngine over a fake core (tests/frontend/fake_core.py): the front end alone, no model.

The fake plans with the real pure-Python scheduler and "samples" a script (by default each
request echoes its prompt), so every stream's exact tokens are known: streaming order,
cancellation, ``n > 1`` fan-out, timeouts, deadlines and admission are checked against exact
values, on asyncio and trio, in milliseconds.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest

from asyncllm import QueueFull, SamplingParams
from asyncllm.core.request import SAMPLE_ID_SEP, Request
from asyncllm.engine.async_engine import AsyncEngine
from tests.conftest import BOTH_BACKENDS, wait_until
from tests.frontend.fake_core import FakeCore


@pytest.fixture(params=BOTH_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _whole(core: FakeCore) -> None:
    """Nothing left in the fake's core and every block back in the pool."""
    core.block_manager.check_invariants()
    assert not core.has_unfinished(), core.scheduler.requests
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


async def _drain(stream: Any, into: list[Any]) -> None:
    async for out in stream:
        into.append(out)


async def test_concurrent_streams_get_their_own_tokens_in_order():
    """Three streams batched together: each gets exactly its prompt echoed, one token per
    step in order, and the steps batched them (fewer steps than tokens in all)."""
    core = FakeCore(block_size=4, max_num_batched_tokens=64)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    prompts = {"a": "abcdef", "b": "uvwxyz", "c": "0123456789"}
    outs: dict[str, list[Any]] = {k: [] for k in prompts}
    async with engine, anyio.create_task_group() as tg:
        for key, text in prompts.items():
            tg.start_soon(_drain, engine.stream(text, _greedy(8), request_id=key), outs[key])
    for key, text in prompts.items():
        items = outs[key]
        echoed = (text * 2)[:8]
        assert "".join(o.text for o in items) == echoed
        assert [t for o in items for t in o.token_ids] == list(echoed.encode())
        assert [o.num_generated_tokens for o in items] == sorted(
            {o.num_generated_tokens for o in items}
        )
        assert [o.finish_reason for o in items][-1] == "length"
        assert all(o.finish_reason is None for o in items[:-1])
        assert all(o.request_id == key for o in items)
    assert core.num_steps < 3 * 8  # batched: a step decodes all three
    _whole(core)


async def test_eos_and_stop_string_end_a_stream_with_their_reason():
    """The script writes "hello world" then EOS: a plain call stops at EOS (its text left
    out); one with the stop string "o w" ends before it, and the front end finishes the
    core's request at once."""
    script = [*b"hello world", 256]
    core = FakeCore(lambda r, k: script[min(k, len(script) - 1)], block_size=4)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    async with engine:
        plain = await engine.generate("hi", SamplingParams(max_tokens=50, temperature=0.0))
        cut = await engine.generate(
            "hi", SamplingParams(max_tokens=50, temperature=0.0, stop=["o w"])
        )
    assert plain.text == "hello world" and plain.finish_reason == "stop"
    assert plain.stop_reason is None and plain.token_ids == script
    assert cut.text == "hell" and cut.finish_reason == "stop" and cut.stop_reason == "o w"
    _whole(core)


async def test_leaving_a_stream_aborts_it_and_frees_its_blocks():
    """A caller that breaks out after two items: its request leaves the core before the
    next step, its blocks are free, and a concurrent stream runs on to its full length."""
    core = FakeCore(block_size=4, step_s=0.01)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    other: list[Any] = []
    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(_drain, engine.stream("stay", _greedy(30)), other)
        seen = 0
        async with engine.stream("leave", _greedy(1000), request_id="gone") as stream:
            async for out in stream:
                seen += len(out.token_ids)
                if seen >= 2:
                    break
        await wait_until(lambda: not any(i.startswith("gone") for i in core.scheduler.requests))
    assert "".join(o.text for o in other) == ("stay" * 8)[:30]
    assert other[-1].finish_reason == "length"
    _whole(core)


async def test_n_samples_fan_out_with_their_own_tokens():
    """``n=3``: one prompt prefilled once for the three samples (a hidden prefix request),
    each sample's tokens its own (the script shifts by the sample's index), in index
    order in ``generate``'s result and tagged with ``index`` in the stream."""

    def shifted(request: Request, k: int) -> int:
        index = int(request.request_id.rsplit(SAMPLE_ID_SEP, 1)[-1])
        return ord("a") + index * 10 + k

    # Prefix caching off: the second call computes its prompt again, so the count is exact.
    core = FakeCore(shifted, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    prompt = "shared prompt of some length"
    async with engine:
        result = await engine.generate(prompt, _greedy(4, n=3, seed=1))
        items: list[Any] = []
        await _drain(engine.stream(prompt, _greedy(4, n=3, seed=1)), items)
    assert [s.text for s in result.samples] == ["abcd", "klmn", "uvwx"]
    assert [s.index for s in result.samples] == [0, 1, 2]
    by_index = {i: "".join(o.text for o in items if o.index == i) for i in range(3)}
    assert by_index == {0: "abcd", 1: "klmn", 2: "uvwx"}
    # Prompt positions computed, over both calls: the hidden prefix request computes all but
    # the last prompt token once, each sample that last token for its own first sample
    # (P - 1 + n per call; 3P without sharing).
    computed = sum(
        min(c.start_pos + len(c.token_ids), len(prompt)) - min(c.start_pos, len(prompt))
        for plan in core.plans
        for c in plan.chunks
    )
    assert computed == 2 * (len(prompt) - 1 + 3)
    _whole(core)


async def test_timeout_keeps_what_was_generated():
    """A slow "model" (20 ms a step) and a 0.2 s timeout: the stream ends "timeout" with
    the tokens made by then, an exact prefix of its echo."""
    core = FakeCore(block_size=4, step_s=0.02)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    async with engine:
        out = await engine.generate("timeout!", _greedy(10_000), timeout=0.2)
    assert out.finish_reason == "timeout"
    assert 0 < len(out.token_ids) < 10_000
    assert out.text == ("timeout!" * 2000)[: len(out.token_ids)]
    _whole(core)


async def test_full_queue_refuses_then_waits_then_a_deadline_expires_unstarted():
    """One slot busy and ``max_waiting=1``: a second call waits in the core, a third is
    refused with QueueFull, a fourth with ``admission="wait"`` is held and served after
    the others, and one whose deadline passes before it starts ends "timeout" with no
    tokens."""
    core = FakeCore(block_size=4, step_s=0.005, max_num_seqs=1, max_waiting=1)
    engine = AsyncEngine(core)  # type: ignore[arg-type]
    done: dict[str, Any] = {}

    async def run(key: str, **kw: Any) -> None:
        done[key] = await engine.generate(key * 4, _greedy(kw.pop("n_tokens", 4)), **kw)

    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(run, "a", n_tokens=40))
        await wait_until(lambda: len(core.scheduler.running) == 1)
        tg.start_soon(run, "b")
        await wait_until(lambda: core.num_waiting() == 1)
        with pytest.raises(QueueFull):
            await engine.generate("c", _greedy(4))
        tg.start_soon(functools.partial(run, "d", admission="wait"))
        await wait_until(lambda: engine.stats()["num_waiting"] == 2)
    assert {k: (v.text, v.finish_reason) for k, v in done.items()} == {
        "a": (("a" * 4 * 10)[:40], "length"),
        "b": ("bbbb", "length"),
        "d": ("dddd", "length"),
    }
    # A deadline that passes while a long request holds the only slot.
    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(run, "e", n_tokens=60))
        await wait_until(lambda: len(core.scheduler.running) == 1)
        late = await engine.generate("f", _greedy(4), deadline=0.05)
    assert late.finish_reason == "timeout" and late.token_ids == [] and late.text == ""
    assert done["e"].finish_reason == "length"
    _whole(core)
