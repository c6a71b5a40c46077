"""W2 with several system prompts and a device pool too small for them: prefix-cache hit
rate with the host tier (:mod:`asyncllm.core.host_store`), without it, and with a pool
that holds everything (docs/tuning.md, "The prefix cache's host tier").

The workload ("W2x8"): ``--agents`` agents, each with its own system prompt (W2's 528
shared tokens of ``prompts.json`` after a short agent-specific prefix, so no block is shared
between agents), ``--users`` users each. Users come in waves: wave ``u`` sends user ``u``
of every agent at once, so an agent's next user arrives after every other agent's request
went through the pool. The device pool holds ``--pool-seqs`` sequences (fewer than the
agents' system prompts), ``max_num_seqs`` is ``--max-num-seqs``.

Variants, on one loaded model and compute thread (greedy, ``--new`` tokens each):

* ``device only``: ``host_prefix_cache_bytes=0`` (before the host tier);
* ``host tier``: the host tier in a CPU pool of ``--host-seqs`` sequences;
* ``host tier, default size``: the host tier in the default CPU pool (as many bytes as
  the device pool);
* ``unbounded``: a device pool that holds every agent's prompts, no host tier;
* ``disk tier, restarted``: an engine with ``prefix_cache_dir`` (a temporary directory)
  serves wave 0, then a new engine on the same directory serves the other waves (reported
  for the new engine; its device pool and host tier start empty).

W2 itself after a restart, timed against a warm pool and against no caching (issue 39's
wall target), is ``benchmarks/kv_restart.py``.

Run from the repository root::

    PYTHONPATH=. python benchmarks/kv_tiers.py [--model default | --tiny] [--agents 8]
        [--users 4] [--pool-seqs 4] [--host-seqs 16] [--new 8]

``--tiny``: the tiny random Llama of :mod:`asyncllm.bench.tiny_model` (1024 positions,
the default model's tokenizer) instead of ``--model``: the same prompts and block counts
(hit rates depend on blocks, not weights), in a fraction of the time.

Prints one JSON object: per variant the hit rate (hits / prompt tokens looked up), hits
per tier, wall seconds, and whether its tokens equal the unbounded run's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

import msgspec

from asyncllm import EngineConfig, SamplingParams
from asyncllm.bench.workloads import load_prompts
from asyncllm.engine.llm_engine import LLMEngine


def prompts(engine: LLMEngine, agents: int, users: int) -> list[list[list[int]]]:
    """Per wave, per agent, the prompt's token ids."""
    w2 = load_prompts()["W2"]["ids"]
    tok = engine.tokenizer
    heads = [tok(f"Agent {a}:", add_special_tokens=False)["input_ids"] for a in range(agents)]
    return [[[*heads[a], *w2[(u * agents + a) % len(w2)]] for a in range(agents)]
            for u in range(users)]  # fmt: skip


def run(engine: LLMEngine, waves: list[list[list[int]]], new: int) -> tuple[list[Any], float]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    t = time.perf_counter()
    for u, wave in enumerate(waves):
        for a, prompt in enumerate(wave):
            for r in engine.inputs.make_requests(f"u{u}a{a}", prompt, params):
                engine.add_request(r)
                outs[r.request_id] = r.output_token_ids
        while engine.has_unfinished():
            engine.step()
    return [outs[k] for k in sorted(outs)], time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--pool-seqs", type=int, default=4)
    ap.add_argument("--host-seqs", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        from asyncllm.bench.tiny_model import save_tiny_llama
        from asyncllm.models.loader import resolve_model_dir

        tmp = pathlib.Path(tempfile.mkdtemp(prefix="kv-tiers-tiny-"))
        args.model = str(save_tiny_llama(tmp, resolve_model_dir("default"), max_positions=1024))
    seq = 600  # tokens a sequence holds: ~545 prompt tokens + new tokens, whole blocks
    base = EngineConfig(model=args.model, max_model_len=1024, compile=False,
                        max_num_seqs=args.max_num_seqs)  # fmt: skip
    first = LLMEngine.from_config(base)
    per_token = first.kv_cache.spec.bytes_per_token
    thread = first.compute_thread
    waves = prompts(first, args.agents, args.users)
    variants = {
        "unbounded": dict(kv_cache_bytes=per_token * seq * (args.agents + args.max_num_seqs),
                          host_prefix_cache_bytes=0),
        "device only": dict(kv_cache_bytes=per_token * seq * args.pool_seqs,
                            host_prefix_cache_bytes=0),
        "host tier": dict(kv_cache_bytes=per_token * seq * args.pool_seqs,
                          cpu_offload_bytes=per_token * seq * args.host_seqs),
        "host tier, default size": dict(kv_cache_bytes=per_token * seq * args.pool_seqs),
        "disk tier, restarted": dict(kv_cache_bytes=per_token * seq * args.pool_seqs,
                                     prefix_cache_dir=tempfile.mkdtemp(prefix="kv-tiers-")),
    }  # fmt: skip
    out: dict[str, Any] = {"settings": {**vars(args), "dtype": first.stats()["dtype"]}}
    reference = None
    for name, kw in variants.items():
        config = msgspec.structs.replace(base, **kw)
        engine = thread.submit(LLMEngine, config, first.loaded, thread).result()
        print(f"{name} ...", file=sys.stderr, flush=True)
        if "prefix_cache_dir" in kw and engine.disk is not None:
            run(engine, waves[:1], args.new)
            engine.disk.close()  # its files written
            engine = thread.submit(LLMEngine, config, first.loaded, thread).result()
            tokens, wall = run(engine, waves[1:], args.new)
        else:
            tokens, wall = run(engine, waves, args.new)
        s = engine.stats()
        reference = tokens if reference is None else reference
        out[name] = {
            "hit_rate": round(float(s["prefix_cache_hit_rate"]), 4),
            "prefix_cache_queries": s["prefix_cache_queries"],
            "device_hits": s["prefix_cache_device_hits"],
            "host_hits": s["prefix_cache_host_hits"],
            "disk_hits": s["prefix_cache_disk_hits"],
            "device_blocks": s["num_total_blocks"],
            "host_blocks": s["num_total_host_cache_blocks"],
            "preemptions": s["num_preemptions"],
            "wall_s": round(wall, 2),
            "tokens_equal_unbounded": tokens == reference[len(reference) - len(tokens) :],
        }
        del engine
    first.stop_compute_thread()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
