"""The engine's own decode step at a short and a long context, one process: how much of a
step the decode attention's reads of a long context take (docs/tuning.md, "Decode attention
in parts").

For each context in ``--contexts`` (alternating, ``--rounds`` times): one request of that
many random prompt ids (prefix caching off), prefilled, then ``--tokens`` greedy decode
steps timed one by one; the median step (the first two skipped) per round, in ms.

    PYTHONPATH=. python benchmarks/decode_context.py [--model default] [--contexts 100 1750]
        [--rounds 2] [--tokens 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncllm import SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.engine.llm_engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 1750])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    config = EngineConfig(
        model=args.model,
        num_threads=args.threads,
        enable_prefix_caching=False,
        max_model_len=max(args.contexts) + args.tokens + 1,
    )
    engine = LLMEngine.from_config(config)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    steps: dict[int, list[float]] = {c: [] for c in args.contexts}
    for r in range(args.rounds):
        for ctx in args.contexts:
            ids = torch.randint(100, 40000, (ctx,), generator=g).tolist()
            engine.add_request(engine.inputs.make_request(f"r{r}-{ctx}", ids, params))
            requests = engine.scheduler.requests.values()
            while any(q.num_computed_tokens < len(q.prompt_token_ids) for q in requests):
                engine.step()
            times = []
            while engine.scheduler.requests:
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            steps[ctx].append(statistics.median(times[2:]) * 1e3)
    for ctx, ms in steps.items():
        print(f"context {ctx}: decode step {', '.join(f'{x:.2f}' for x in ms)} ms")


if __name__ == "__main__":
    main()
