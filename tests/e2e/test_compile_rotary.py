"""The compiled forward computes the rotary cos/sin once per step, not once per layer
(:func:`asyncllm.worker.compiled.rotary_computed_once`)."""

from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from asyncllm.kernels.ops import materialize
from asyncllm.worker.compiled import rotary_computed_once

LAYERS = 4


class Toy(torch.nn.Module):
    """transformers' shape of it: ``rotary_emb`` once, its (cos, sin) read by every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary_emb = LlamaRotaryEmbedding(
            LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=64)
        )

    def forward(self, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(q, pos)
        for _ in range(LAYERS):
            q, _k = apply_rotary_pos_emb(q, q, cos, sin)
            q = torch.ops.aten.mm(q.flatten(0, 2), torch.eye(32)).view(q.shape)  # opaque
        return q


def compiled_code(model: Toy, q: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, str]:
    torch._dynamo.reset()
    fn = torch.compile(model, backend="inductor", fullgraph=True)
    out, code = run_and_get_code(fn, q, pos)
    return out, "\n".join(code)


def cos_calls(code: str) -> int:
    return len(re.findall(r"^\s+cpp_fused_\w*_cos_\w*\(", code, re.M))


def test_cos_sin_computed_once() -> None:
    model = Toy()
    q, pos = torch.randn(1, 2, 5, 32), torch.arange(5)[None]
    with torch.no_grad():
        expected = model(q, pos)
        plain_out, plain = compiled_code(model, q, pos)
        with rotary_computed_once(model):
            out, code = compiled_code(model, q, pos)
    # kernel calls that compute cos (Inductor names a fused kernel by its ops): without it
    # Inductor inlines cos/sin into every layer's rotary kernel
    assert cos_calls(plain) == LAYERS
    assert cos_calls(code) == 1
    assert "asyncllm.materialize" in code
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(plain_out, expected)
    assert not model.rotary_emb._forward_hooks  # removed after


def test_materialize_copies() -> None:
    a, b = torch.randn(3), torch.randn(2, 2)
    x, y = materialize([a, b])
    assert torch.equal(x, a) and torch.equal(y, b)
    assert x.data_ptr() != a.data_ptr()
