"""The engine's step-timing hook (``LLMEngine.step_observer``, asyncllm/worker/step_timing.py):
what the benchmark's trace reads instead of patching the engine's methods (issue 15)."""

from __future__ import annotations

from asyncllm.config import EngineConfig
from asyncllm.engine.llm_engine import LLMEngine
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.step_timing import PHASES, StepTimings


def test_step_observer_gets_each_phase_and_the_plan(tiny_llama_dir):
    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), max_num_seqs=4, max_num_batched_tokens=4)
    )
    seen: list[tuple[StepTimings, int, int]] = []

    def observer(t, plan):
        seen.append((t, len(plan.chunks), plan.num_batched_tokens))

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    # A 6-token prompt in chunks of 4: a step that samples nothing, then ones that do.
    engine.add_request(engine.inputs.make_request("a", [5, 6, 7, 8, 9, 10], params))
    engine.step_observer = observer
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    engine.step_observer = None
    engine.add_request(engine.inputs.make_request("b", [5, 6], params))
    while engine.has_unfinished():
        engine.step()
    engine.stop_compute_thread()
    assert len(seen) == steps == 4  # unset: the later steps are not observed
    assert [(n, tokens) for _, n, tokens in seen] == [(1, 4), (1, 2), (1, 1), (1, 1)]
    for t, _, _ in seen:
        assert set(t.phases) <= set(PHASES)
        assert {"schedule", "prep", "forward", "update"} <= set(t.phases)
        assert "grammar_fill" not in t.phases  # no constrained request
        assert t.end >= t.start and sum(t.phases.values()) <= t.end - t.start + 1e-6
    assert "sample" not in seen[0][0].phases  # the first chunk samples nothing
    assert all("sample" in t.phases for t, _, _ in seen[1:])
    assert engine.runner.timings is None  # nothing is measured once the hook is unset
