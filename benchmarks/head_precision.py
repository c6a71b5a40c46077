"""What quantizing the LM head would cost in quality: the default model's perplexity.

The default model (SmolLM2-135M, its Q4_1 GGUF file) is loaded as the engine runs it by
default (bfloat16, ``quantization="gguf"``: decoder linears int4, head and tied embedding
bfloat16) and as the float32 reference; the logits of ``tests/data/public_domain.txt`` are
computed with the head as it is, with an int4 copy of it (group 32, scale and zero point,
``Int4Linear``, 8 rows per call: the int4 kernel's path) and with an int8 copy (one scale
per output channel, ``Int8Linear``). docs/tuning.md and :mod:`asyncllm.models.quantization`
quote the result (the head stays in the model's dtype).

Run: ``python benchmarks/head_precision.py``
"""

from __future__ import annotations

import math
import pathlib

import torch

from asyncllm.layers import quant_linear as ql
from asyncllm.models.loader import load_model, resolve_model_dir

TEXT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "public_domain.txt"


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean cross entropy of ``logits`` [T - 1, V] against ``ids[1:]``."""
    return math.exp(float(torch.nn.functional.cross_entropy(logits.float(), ids[1:])))


def main() -> None:
    model_dir = resolve_model_dir("default")
    for dtype, mode in ((torch.float32, None), (torch.bfloat16, "gguf")):
        loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"), quantization=mode)
        lm = loaded.model
        ids = torch.tensor(loaded.tokenizer.encode(TEXT.read_text()))
        with torch.inference_mode():
            h = lm.model(ids[None]).last_hidden_state[0, :-1]
            w = lm.get_output_embeddings().weight
            out = {"head as loaded": perplexity(torch.nn.functional.linear(h, w), ids)}
            if mode is not None:
                q, s, o = ql.int4_codes(w, 32)
                heads = {
                    "int4 g32 head": ql.Int4Linear(q, s, o, 32, None, ql.COMPUTE_DTYPE),
                    "int8 head": ql.Int8Linear(*ql.int8_codes(w), None, ql.COMPUTE_DTYPE),
                }
                for name, head in heads.items():
                    logits = torch.cat([head(h[i : i + 8]) for i in range(0, len(h), 8)])
                    out[name] = perplexity(logits, ids)
        print(f"{loaded.precision} ({len(ids)} tokens):", {k: round(v, 2) for k, v in out.items()})


if __name__ == "__main__":
    main()
