"""Structured-output costs on the default model's tokenizer (no timed assertions anywhere):
grammar compile time of a typical tool-like schema, first and cached, and the per-step cost
of filling the token bitmask for a batch of constrained rows and applying it (xgrammar's CPU
kernel) to float32 logits; and the greedy sampler's cost with every row constrained, when
each row's best token is allowed by its grammar (no mask needed), in 90% of rows, and in none,
against no constraint (one torch thread; ``asyncllm.worker.sampling.grammar_mask._apply_grammar``).

    python benchmarks/structured_cost.py [--batch 64] [--steps 50]

``--engine`` instead runs W1J (W1's first ``--batch`` prompts, each under its JSON schema,
greedy) on the default model through ``LLMEngine``, ``--rounds`` times, and prints the
grammar's share of the decode steps at full batch and the sampler's row counters:

    python benchmarks/structured_cost.py --engine [--rounds 2] [--max-tokens 64] \
        [--dtype float32] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch
from transformers import AutoTokenizer

from asyncllm.models.loader import resolve_model_dir
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams
from asyncllm.structured_output import GrammarCompiler, GrammarMatchers, apply_token_bitmask
from asyncllm.worker.sampling import grammar_mask
from asyncllm.worker.sampling.batch import SamplingBatch
from asyncllm.worker.sampling.sampler import Sampler

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "include": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            },
            "required": ["location", "unit"],
        },
    },
    "required": ["name", "arguments"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--engine", action="store_true", help="W1J through LLMEngine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.engine:
        engine_w1j(args.batch, args.rounds, args.max_tokens, args.dtype, args.threads)
        return
    tok = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    vocab = 49152
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    t = time.perf_counter()
    compiler._backend()
    print(f"tokenizer info + compiler: {1e3 * (time.perf_counter() - t):.1f} ms (once)")
    spec = StructuredOutputsParams(json=TOOL_SCHEMA)
    t = time.perf_counter()
    grammar = compiler.compile(spec)
    print(f"compile tool schema, first: {1e3 * (time.perf_counter() - t):.2f} ms")
    t = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=TOOL_SCHEMA))
    print(f"compile tool schema, cached: {1e6 * (time.perf_counter() - t):.1f} us")
    matchers = GrammarMatchers(vocab, args.batch)
    ids = [f"r{i}" for i in range(args.batch)]
    for rid in ids:
        matchers.add(rid, grammar)
    logits = torch.randn(args.batch, vocab)
    g = torch.Generator().manual_seed(0)
    fill = apply = clone = 0.0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        bitmask, rows = matchers.fill(ids)
        t1 = time.perf_counter()
        work = logits.clone()
        t2 = time.perf_counter()
        apply_token_bitmask(work, bitmask, rows)
        t3 = time.perf_counter()
        fill, clone, apply = fill + t1 - t0, clone + t2 - t1, apply + t3 - t2
        # advance each row by a random allowed token, as sampling would
        probs = torch.where(torch.isinf(work), 0.0, 1.0)
        tokens = torch.multinomial(probs, 1, generator=g)[:, 0].tolist()
        finished = matchers.accept(dict(zip(ids, tokens, strict=True)))
        for rid in finished:  # restart a finished row's document
            matchers.free([rid])
            matchers.add(rid, grammar)
    n = args.steps
    print(
        f"batch {args.batch}, per step: fill {1e3 * fill / n:.2f} ms, "
        f"apply (CPU kernel) {1e3 * apply / n:.2f} ms, logits clone {1e3 * clone / n:.2f} ms"
    )

    greedy_sampler_cost(args.batch, vocab, args.steps)


def greedy_sampler_cost(batch: int, vocab: int, steps: int) -> None:
    """Median sampler call over ``steps`` for greedy rows under random bitmasks (30% of the
    tokens allowed) whose rows' best tokens are allowed in a given fraction of rows."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    greedy = SamplingParams(temperature=0.0)
    chunks = [
        SimpleNamespace(
            request_id=f"r{i}", params=greedy, prompt_token_ids=[1], output_token_ids=[],
            num_output_tokens=0, stop_token_ids=frozenset({2}),
        )
        for i in range(batch)
    ]  # fmt: skip
    logits = torch.randn(batch, vocab)
    best = logits.argmax(-1)

    def bitmask(allowed_rows: int) -> torch.Tensor:
        allowed = torch.rand(batch, vocab) < 0.3
        allowed[torch.arange(batch), best] = torch.arange(batch) < allowed_rows
        words = allowed.view(batch, -1, 32).long() << torch.arange(32)
        return words.sum(-1).to(torch.int32)  # two's complement wrap, as xgrammar's

    cases: dict[str, torch.Tensor | None] = {"unconstrained": None}
    for frac in (1.0, 0.9, 0.0):
        cases[f"best token allowed in {frac:.0%} of rows"] = bitmask(int(batch * frac))
    samplers = {name: Sampler(0, cpu) for name in cases}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(steps):
        for name, bm in cases.items():
            mask = None if bm is None else (bm, list(range(batch)))
            b = SamplingBatch.from_chunks(chunks, cpu, mask)
            work = logits.clone()
            t = time.perf_counter()
            samplers[name](work, b)
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"greedy sampler, batch {batch}, 1 thread, {name}: {ms:.2f} ms")


def engine_w1j(batch: int, rounds: int, max_tokens: int, dtype: str, threads: int) -> None:
    """W1J on the default model through ``LLMEngine``, ``rounds`` times: the grammar's share
    of the decode steps at full batch ((fill + mask) / step, as
    ``asyncllm.bench.reporting.markdown.grammar_share``; "mask" is the sampler's ``_apply_grammar``:
    check, mask and re-argmax) and the sampler's row counters (``Sampler.grammar_rows``,
    load-independent). The A/B of three policies that chose the sampler's (module
    docstring of ``asyncllm.worker.sampling.grammar_mask``) is this function at commit 6e715d6."""
    from asyncllm.bench.workloads import W1J_SCHEMA, load_prompts
    from asyncllm.config import EngineConfig
    from asyncllm.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="default", max_num_seqs=batch, dtype=dtype, quantization=None, num_threads=threads
    )
    engine = LLMEngine.from_config(config)
    prompts = load_prompts()["W1"]["ids"][:batch]
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs={"json": W1J_SCHEMA}
    )
    sampler = engine.runner.sampler
    timed: dict[str, float] = {}

    def wrap(obj: Any, name: str, key: str) -> None:
        orig = getattr(obj, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                timed[key] = timed.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapped)

    wrap(grammar_mask, "_apply_grammar", "mask")
    wrap(engine.grammar_matchers, "fill", "fill")
    schedule = engine.scheduler.schedule

    def traced_schedule() -> Any:
        plan = schedule()
        timed["tokens"] = plan.num_batched_tokens
        return plan

    engine.scheduler.schedule = traced_schedule  # type: ignore[method-assign]
    n = 0
    for rnd in range(rounds):
        sampler.grammar_rows = grammar_mask.GrammarRowCounts()
        for ids in prompts:
            engine.add_request(engine.inputs.make_request(f"q{n}", list(ids), params))
            n += 1
        fill = mask = step = 0.0
        counted = 0
        while engine.has_unfinished():
            timed.clear()
            t = time.perf_counter()
            out = engine.step()
            dt = time.perf_counter() - t
            if len(out) == batch and timed.get("tokens") == batch:  # decodes only
                fill, step = fill + timed["fill"], step + dt
                mask += timed.get("mask", 0.0)
                counted += 1
        c = sampler.grammar_rows
        per = 1e3 / max(counted, 1)
        print(
            f"round {rnd}: {counted} steps at batch {batch}, step {per * step:.1f} ms, "
            f"fill {per * fill:.2f} ms, mask {per * mask:.2f} ms, "
            f"share {(fill + mask) / step:.2%}; rows checked {c.checked}, "
            f"forbidden {c.forbidden}, sampled {c.sampled}",
            flush=True,
        )
    print(f"compiler: {engine.grammar_compiler.stats()}")
    engine.stop_compute_thread()


if __name__ == "__main__":
    main()
