"""Structured-output costs on the default model's tokenizer (no timed assertions anywhere):
grammar compile time of a typical tool-like schema, first and cached, and the per-step cost
of filling the token bitmask for a batch of constrained rows and applying it (xgrammar's CPU
kernel) to float32 logits.

    python benchmarks/structured_cost.py [--batch 64] [--steps 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from asyncllm.models.loader import resolve_model_dir
from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured_output import GrammarCompiler, GrammarMatchers, apply_token_bitmask

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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
