"""The int8 KV cache's rounding error on the default model's own K/V: float16 scales (the
layout, :mod:`asyncllm.attention.kv_int8`) against the float32 scales it had before.

Runs transformers' float32 model over the first ``--tokens`` tokens of
``tests/data/public_domain.txt``, rounds every layer's K and V to bfloat16 (the engine's
bfloat16 cache input), quantizes them both ways and prints the RMS and mean absolute error of
each and how many rows have a scale below float16's normal range. Run from the repository
root::

    PYTHONPATH=. python benchmarks/kv_int8_scale_error.py [--tokens 256]

docs/tuning.md ("int8 KV cache") has the figures.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from asyncllm.attention import kv_int8


def float32_scale_values(x: torch.Tensor) -> torch.Tensor:
    """The earlier layout's values: ``round(x * 127 / absmax) * (absmax * (1/127))``."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return torch.round(x * inv).clamp(-127, 127) * (amax * (1.0 / 127))


def main(a: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncllm.models.loader import resolve_model_dir

    model_dir = resolve_model_dir("default")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    text = pathlib.Path("tests/data/public_domain.txt").read_text()
    ids = tok(text[: 20 * a.tokens], return_tensors="pt").input_ids[:, : a.tokens]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    sq = {"float32 scale": 0.0, "float16 scale": 0.0}
    ab = dict.fromkeys(sq, 0.0)
    n = subnormal = rows = 0
    for layer in cache.layers:
        for x in (layer.keys, layer.values):
            x = x.bfloat16().float()
            new = kv_int8.dequantize(kv_int8.quantize(x))
            for name, y in (("float32 scale", float32_scale_values(x)), ("float16 scale", new)):
                sq[name] += float((y - x).pow(2).sum())
                ab[name] += float((y - x).abs().sum())
            amax = x.abs().amax(-1)
            subnormal += int((amax / 127 < 2**-14).sum())
            rows += amax.numel()
            n += x.numel()
    for name in sq:
        print(f"{name}: RMS error {(sq[name] / n) ** 0.5:.4e}, mean abs. error {ab[name] / n:.4e}")
    ratio = (sq["float16 scale"] / sq["float32 scale"]) ** 0.5
    print(f"RMS float16 / float32 scale: {ratio:.6f}; rows with a subnormal float16 scale: "
          f"{subnormal} of {rows}")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    main(p.parse_args())
