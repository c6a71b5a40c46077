"""The step's result crosses from the compute thread to the front end as plain, frozen data.

The front end must not read the core's live ``Request`` objects (the next step mutates them
on the compute thread while the event loop reads): a request's first scheduling, prefix-cache
hits and preemptions reach its :class:`RequestState` only through :class:`StepOutput`.
"""

from __future__ import annotations

import dataclasses

import pytest

from asyncllm import SamplingParams
from asyncllm.core.plan import RequestUpdate
from asyncllm.core.request import Request
from asyncllm.output_processing.output_processor import RequestState, TokenTextCache, process_step
from asyncllm.output_processing.step_output import RequestStart, StepOutput

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class _Tokenizer:
    """Just enough tokenizer for a RequestState: every token is the letter "a"."""

    all_special_ids: tuple[int, ...] = ()

    def decode(self, ids, **kw):
        return "a" * len(ids)

    def convert_ids_to_tokens(self, ids):
        return ["a"] * len(ids) if isinstance(ids, list) else "a"


def _state(request: Request) -> RequestState:
    tok = _Tokenizer()
    return RequestState(request, GREEDY, tok, TokenTextCache(tok))


def test_a_state_reads_no_live_core_request():
    request = Request("r", [5, 6, 7], max_tokens=6, max_model_len=64, arrival_time=10.0)
    state = _state(request)
    # The core mutates its request on the compute thread: the state must not see it.
    request.num_cached_tokens, request.num_preemptions = 99, 7
    request.started = True
    request.prompt_token_ids.append(8)
    m = state.metrics()
    assert (m.num_cached_tokens, m.num_preemptions, m.queue_time) == (0, 0, None)
    # What the step reports is what the state shows.
    step = StepOutput(
        [RequestUpdate("r", 42, None)],
        started={"r": RequestStart(11.0, 2)},
        preempted=["r", "other"],
    )
    assert [(s.request_id, stop) for s, stop in process_step({"r": state}, step)] == [("r", False)]
    m = state.metrics()
    assert (m.num_cached_tokens, m.num_preemptions, m.queue_time) == (2, 1, 1.0)
    assert m.num_prompt_tokens == 3


def test_step_output_is_frozen_and_iterates_its_updates():
    step = StepOutput([RequestUpdate("a", 1, None), RequestUpdate("b", 2, "length")])
    assert [u.token_id for u in step] == [1, 2] and len(step) == 2
    assert not step.idle and dict(step.logprobs) == {} and dict(step.started) == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.idle = True  # type: ignore[misc]


def test_engine_step_reports_first_scheduling_and_preemptions(tiny_llama_dir, make_engine):
    """Recompute preemption in a pool of 12 blocks: each preemption the engine counts is in
    exactly one step's ``preempted``, and each request starts exactly once."""
    engine = make_engine(
        tiny_llama_dir,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=48,
        kv_cache_bytes=12 * 4 * 2 * 2 * 2 * 16 * 4,  # 12 blocks of 4 tokens, float32
    )
    core = engine.core
    for i in range(6):
        core.add_request(core.inputs.make_request(f"r{i}", list(range(10 + i, 30 + i)), GREEDY))
    starts: list[str] = []
    preempted: list[str] = []
    tokens = 0
    while core.has_unfinished():
        step = core.step()
        starts += step.started
        preempted += step.preempted
        tokens += len(step)
        assert all(s.num_cached_tokens == 0 for s in step.started.values())
    assert sorted(starts) == [f"r{i}" for i in range(6)] and tokens == 6 * 6
    assert len(preempted) == core.stats()["num_preemptions"] > 0
