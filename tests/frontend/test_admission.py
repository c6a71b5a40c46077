"""Admission a caller can await, queue positions, deadlines and tenants through the engine.

The schedules are scripted: the core's steps run only when the test releases them
(:class:`Gate`), so positions and start orders are exact.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import anyio
import pytest

from asyncllm import EngineNotRunningError, InvalidRequestError, QueueFull, SamplingParams
from asyncllm.engine.async_engine import AsyncEngine
from tests.conftest import wait_until

SMALL = dict(block_size=4, kv_cache_bytes=2**20)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Gate:
    """Lets the engine's steps run only as the test releases them."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.core = engine.core
        self._real = self.core.step
        self._permits = threading.Semaphore(0)
        self.open = False
        self.core.step = self._step  # type: ignore[method-assign]

    def _step(self) -> Any:
        if not self.open:
            self._permits.acquire()
        return self._real()

    async def steps(self, n: int) -> None:
        """Run ``n`` steps and wait until they are done."""
        target = self.core.num_steps + n
        for _ in range(n):
            self._permits.release()
        await wait_until(lambda: self.core.num_steps >= target)

    def release_all(self) -> None:
        self.open = True
        self._permits.release()

    async def __aenter__(self) -> Gate:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release_all()  # never leave the engine's loop blocked in a step


async def _collect(stream: Any, into: list[Any]) -> None:
    async for out in stream:
        into.append(out)


def _positions(outs: list[Any]) -> list[int]:
    return [o.queue_position for o in outs if o.queue_position is not None]


async def test_queue_positions_are_exact_on_a_scripted_schedule(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting=3, **SMALL)
    outs: dict[str, list[Any]] = {k: [] for k in "abcde"}
    async with engine, anyio.create_task_group() as tg, Gate(engine) as gate:
        tg.start_soon(_collect, engine.stream([5] * 8, _greedy(3)), outs["a"])
        await gate.steps(1)  # a runs
        for i, key in enumerate("bcd"):
            stream = engine.stream([6 + i] * 8, _greedy(2), report_queue=True)
            tg.start_soon(_collect, stream, outs[key])
            await wait_until(lambda n=i + 1: engine.stats()["num_waiting"] == n)
        # The queue is full (3): e waits for a place, behind b, c and d.
        stream = engine.stream([9] * 8, _greedy(2), report_queue=True, admission="wait")
        tg.start_soon(_collect, stream, outs["e"])
        await wait_until(lambda: engine.stats()["num_waiting"] == 4)
        with pytest.raises(QueueFull):
            await engine.generate([10] * 4, _greedy(1))
        gate.release_all()
    assert _positions(outs["b"]) == [0]
    assert _positions(outs["c"]) == [1, 0]
    assert _positions(outs["d"]) == [2, 1, 0]
    assert _positions(outs["e"])[0] == 3 and _positions(outs["e"])[-1] == 0
    for key in "bcde":
        reports = [o for o in outs[key] if o.queue_position is not None]
        assert all(o.token_ids == [] and o.text == "" for o in reports)
        assert outs[key][-1].finish_reason == "length" and outs[key][-1].num_generated_tokens == 2
        etas = [o.estimated_start_s for o in reports if o.estimated_start_s is not None]
        assert all(eta > 0 for eta in etas)
    assert engine.stats()["num_waiting"] == 0


async def test_a_caller_waiting_for_a_place_keeps_its_timeout(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting=1, **SMALL)
    outs: dict[str, list[Any]] = {k: [] for k in "abcd"}
    async with engine, anyio.create_task_group() as tg, Gate(engine) as gate:
        tg.start_soon(_collect, engine.stream([5] * 8, _greedy(4)), outs["a"])
        await gate.steps(1)
        tg.start_soon(_collect, engine.stream([6] * 8, _greedy(2)), outs["b"])
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)
        # c waits with a short timeout and ends "timeout" while held; d waits and runs.
        tg.start_soon(
            _collect, engine.stream([7] * 8, _greedy(2), admission="wait", timeout=0.2), outs["c"]
        )
        tg.start_soon(_collect, engine.stream([8] * 8, _greedy(2), admission="wait"), outs["d"])
        await wait_until(lambda: bool(outs["c"]))
        assert outs["c"][-1].finish_reason == "timeout" and outs["c"][-1].token_ids == []
        # A caller that gives up leaves the line.
        with anyio.move_on_after(0.2):
            await engine.generate([11] * 8, _greedy(2), admission="wait")
        gate.release_all()
    assert [o.finish_reason for o in (outs["a"][-1], outs["b"][-1], outs["d"][-1])] == [
        "length"
    ] * 3
    assert outs["d"][-1].num_generated_tokens == 2


async def test_a_call_larger_than_the_queue_is_refused_even_when_it_would_wait(
    tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, max_waiting=2, max_waiting_per_tenant=1, **SMALL)
    async with engine:
        params = SamplingParams(max_tokens=2, n=3)
        with pytest.raises(InvalidRequestError, match="max_waiting=2"):
            await engine.generate([5] * 4, params, admission="wait")
        with pytest.raises(InvalidRequestError, match="max_waiting_per_tenant=1"):
            await engine.generate([5] * 4, SamplingParams(max_tokens=2, n=2), admission="wait")


async def test_per_tenant_limit(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting_per_tenant=1, **SMALL)
    outs: list[Any] = []
    async with engine, anyio.create_task_group() as tg, Gate(engine) as gate:
        tg.start_soon(_collect, engine.stream([5] * 8, _greedy(3), tenant="a"), outs)
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)
        await gate.steps(1)  # a's first runs
        tg.start_soon(_collect, engine.stream([6] * 8, _greedy(3), tenant="a"), outs)
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)
        with pytest.raises(QueueFull, match="max_waiting_per_tenant=1"):
            await engine.generate([7] * 4, _greedy(1), tenant="a")
        tg.start_soon(_collect, engine.stream([8] * 8, _greedy(3), tenant="b"), outs)
        await wait_until(lambda: engine.stats()["num_waiting"] == 2)
        gate.release_all()
    assert sorted(o.finish_reason for o in outs if o.finished) == ["length"] * 3


async def test_earliest_deadline_first_and_expiry_before_start(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, **SMALL)
    outs: dict[str, list[Any]] = {k: [] for k in "abcde"}
    deadlines: dict[str, Any] = {"b": 60.0, "c": 30.0, "d": None, "e": 0.2}
    async with engine, anyio.create_task_group() as tg, Gate(engine) as gate:
        tg.start_soon(_collect, engine.stream([5] * 8, _greedy(3)), outs["a"])
        await gate.steps(1)
        for i, (key, deadline) in enumerate(deadlines.items()):
            stream = engine.stream([6 + i] * 8, _greedy(2), deadline=deadline)
            tg.start_soon(_collect, stream, outs[key])
            await wait_until(lambda n=i + 1: engine.stats()["num_waiting"] == n)
        await wait_until(lambda: bool(outs["e"]))  # e never started: "timeout", no tokens
        assert outs["e"][-1].finish_reason == "timeout" and outs["e"][-1].num_generated_tokens == 0
        gate.release_all()
    start = {k: outs[k][-1].metrics.queue_time + outs[k][-1].metrics.arrival_time for k in "bcd"}
    assert sorted(start, key=start.__getitem__) == ["c", "b", "d"]


async def test_a_past_deadline_and_bad_arguments(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=5)
    async with engine:
        out = await engine.generate([5] * 4, _greedy(2), deadline=past)
        assert out.finish_reason == "timeout" and out.token_ids == []
        bad: list[dict[str, Any]] = [
            {"deadline": datetime.datetime.now()},  # naive: its zone is unknown
            {"deadline": 0},
            {"deadline": float("nan")},
            {"deadline": True},
            {"tenant": 5},
            {"tenant": "x" * 300},
            {"admission": "later"},
        ]
        for kwargs in bad:
            with pytest.raises(InvalidRequestError):
                await engine.generate([5] * 4, _greedy(2), **kwargs)
        with pytest.raises(ValueError, match="tenant weight"):
            engine.set_tenant_weight("a", 0)
        assert (await engine.generate([5] * 4, _greedy(2), tenant="t")).num_generated_tokens == 2


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_a_tenants_lone_request_starts_beside_a_burst(tiny_llama_dir, make_engine):
    """Tenant a sends 32 prompts into 4 slots; b's one request starts in the step after it
    reaches the core (b is within its share of 2 slots: one of a's is preempted for it), long
    before a's burst is done. (Without tenants b would wait behind all 32.)"""
    engine = make_engine(tiny_llama_dir, max_num_seqs=4, **SMALL)
    burst: list[Any] = []
    lone: list[Any] = []
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    async with engine, anyio.create_task_group() as tg, Gate(engine) as gate:
        for i in range(32):
            tg.start_soon(_collect, engine.stream([5 + i] * 6, params, tenant="a"), burst)
        await wait_until(lambda: len(engine.core.scheduler.requests) == 32)
        await gate.steps(4)
        assert len(engine.core.scheduler.running) == 4
        tg.start_soon(_collect, engine.stream([99] * 6, _greedy(3), tenant="b"), lone)
        await wait_until(lambda: engine._loop.requests.num_queued("b") == 1)
        await gate.steps(2)  # the first was planned before b reached the core
        assert any(r.tenant == "b" for r in engine.core.scheduler.running)
        gate.release_all()
        await wait_until(lambda: bool(lone) and lone[-1].finished)
        assert sum(o.finished for o in burst) < 32
    assert lone[-1].metrics.num_generated_tokens == 3
    assert sum(o.finished for o in burst) == 32


async def test_a_tenant_at_its_limit_does_not_hold_up_another_tenants_call(
    tiny_llama_dir, make_engine
):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting_per_tenant=1, **SMALL)
    outs: dict[str, list[Any]] = {k: [] for k in ("a1", "a2", "a3", "b1")}
    async with engine, anyio.create_task_group() as tg, Gate(engine) as gate:
        tg.start_soon(_collect, engine.stream([5] * 8, _greedy(2), tenant="a"), outs["a1"])
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)
        await gate.steps(1)  # a1 runs
        tg.start_soon(_collect, engine.stream([6] * 8, _greedy(2), tenant="a"), outs["a2"])
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)
        for key, tenant in (("a3", "a"), ("b1", "b")):  # a3 waits for a's place, then b1
            stream = engine.stream([7] * 8, _greedy(2), tenant=tenant, admission="wait")
            tg.start_soon(_collect, stream, outs[key])
            await wait_until(lambda n=2 + (key == "b1"): engine.stats()["num_waiting"] == n)
        await gate.steps(1)  # between steps b1 reaches the core; a3 still waits
        assert engine.core.num_waiting("b") == 1 and engine.core.num_waiting("a") == 1
        gate.release_all()
    start = {k: v[-1].metrics.queue_time + v[-1].metrics.arrival_time for k, v in outs.items()}
    assert start["b1"] < start["a3"]


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
@pytest.mark.parametrize("leave", ["queue full", "too long"])
async def test_a_held_call_starts_when_a_tokenizing_call_leaves(leave, tiny_llama_dir, make_engine):
    """A call held behind one being tokenized starts once that one leaves without
    queueing (refused after tokenizing, or too long), on an otherwise idle engine."""
    from tests.frontend.test_hardening_core import hold_tokenization

    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_waiting=1, **SMALL)
    release = hold_tokenization(engine)
    result: dict[str, Any] = {}

    async def refused() -> None:
        text = "hello " * 300 if leave == "too long" else "some text"
        with pytest.raises((QueueFull, InvalidRequestError)):
            await engine.generate(text, _greedy(2))

    async def held() -> None:
        with anyio.fail_after(20):
            result["out"] = await engine.generate([5, 6, 7, 8], _greedy(2), admission="wait")

    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(refused)
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)  # tokenizing
        tg.start_soon(held)
        await wait_until(lambda: engine._loop.requests.num_held() == 1)
        release.set()
    assert result["out"].num_generated_tokens == 2


@pytest.mark.slow  # the inner loop's heaviest (make test-fast leaves it out)
async def test_a_drain_serves_held_calls(tiny_llama_dir, make_engine):
    from tests.frontend.test_hardening_core import hold_tokenization

    engine = make_engine(
        tiny_llama_dir, max_num_seqs=1, max_waiting=1, shutdown_mode="drain", **SMALL
    )
    release = hold_tokenization(engine)
    result: dict[str, Any] = {}

    async def tokenizing() -> None:
        with pytest.raises((EngineNotRunningError, QueueFull)):  # the drain began, or y holds
            await engine.generate("some text", _greedy(2))

    async def held() -> None:
        result["out"] = await engine.generate([5, 6, 7, 8], _greedy(2), admission="wait")

    async with anyio.create_task_group() as tg, engine:
        tg.start_soon(tokenizing)
        await wait_until(lambda: engine.stats()["num_waiting"] == 1)
        tg.start_soon(held)
        await wait_until(lambda: engine._loop.requests.num_held() == 1)
        release.set()
    assert result["out"].finish_reason == "length"


async def test_report_queue_must_be_a_bool(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **SMALL)
    async with engine:
        with pytest.raises(InvalidRequestError, match="report_queue"):
            async for _ in engine.stream([5] * 4, _greedy(1), report_queue="yes"):  # type: ignore[arg-type]
                pass
