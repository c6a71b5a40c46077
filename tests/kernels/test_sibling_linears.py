"""Sibling linears (q/k/v, gate/up) fused into one call: same outputs, nothing held, and
groups that cannot be fused left alone."""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from asyncllm.layers.q8_linear import MAX_ROWS as Q8_MAX_ROWS
from asyncllm.layers.q8_linear import Q8Linear
from asyncllm.layers.quant_linear import Int4Linear
from asyncllm.layers.sibling_linears import SiblingLinear, fuse_siblings
from asyncllm.models.quantization import QuantSetting, quantize_model

# Head size 64 and one KV head: every projection's rows a multiple of 64 (int4 can fuse them).
SHAPE = dict(
    vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
)  # fmt: skip


def _llama(**kw: object) -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SHAPE, **kw})).eval()


def _qwen2() -> nn.Module:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=False)).eval()
    with torch.no_grad():  # random init leaves the q/k/v biases at zero
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _int4(model: nn.Module, tmp: pathlib.Path) -> nn.Module:
    cache = tmp / "int4.pt"
    setting = QuantSetting("int4", 32, torch.float32, torch.device("cpu"), cache, None, "test")
    quantize_model(model, setting)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "llama-int4"])
def test_fused_siblings_give_the_same_logits(kind, tmp_path):
    make = {"llama": _llama, "qwen2-bias": _qwen2, "llama-int4": lambda: _int4(_llama(), tmp_path)}
    model = make[kind]()
    ids = torch.tensor([[5, 9, 200, 7, 3, 3, 41]])
    with torch.inference_mode():
        ref = model(ids).logits
        fused = copy.deepcopy(model)
        assert fuse_siblings(fused) == 2 * SHAPE["num_hidden_layers"]  # q/k/v and gate/up
        assert fuse_siblings(fused) == 0  # idempotent
        out = fused(ids).logits
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        assert isinstance(m, SiblingLinear)
        assert m.group.x is None and m.group.y is None  # no activation held after the layer
    expected = Int4Linear if kind.endswith("int4") else nn.Linear
    assert type(attn.q_proj.fused) is expected and attn.q_proj.fused.out_features == 128 + 64 + 64
    if kind.endswith("int4"):  # each output column is the same dot product
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # one copy of the weights: the fused layer replaces its parts
    n_params = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    assert sum(t.numel() for t in (*fused.parameters(), *fused.buffers())) == n_params


def test_siblings_called_on_other_inputs_or_out_of_order():
    """The fused output is reused only for the very tensor it was computed from."""
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = (nn.Linear(8, n) for n in (8, 4, 4))
    ref = copy.deepcopy(parent)
    assert fuse_siblings(parent) == 1
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        # v before q, and k on another input than q
        for name, inp in (("v_proj", x), ("q_proj", x), ("k_proj", y), ("k_proj", x)):
            got, want = getattr(parent, name)(inp), getattr(ref, name)(inp)
            torch.testing.assert_close(got, want)
        z = torch.randn(2, 8)
        for name in ("q_proj", "k_proj", "v_proj"):  # the modeling code's order
            torch.testing.assert_close(getattr(parent, name)(z), getattr(ref, name)(z))
    assert parent.q_proj.group.x is None  # z's output was dropped once all three had it


def test_groups_that_cannot_be_fused_are_left_alone(tmp_path):
    parent = nn.Module()  # a bias on some but not all
    parent.q_proj, parent.k_proj = nn.Linear(8, 8), nn.Linear(8, 4, bias=False)
    parent.v_proj = nn.Linear(8, 4)
    parent.gate_proj, parent.up_proj = nn.Linear(8, 16), nn.Linear(6, 16)  # other widths
    assert fuse_siblings(parent) == 0
    # int4 parts whose rows are not a multiple of 64 (the packed layout's row block)
    narrow = _llama(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    tiny = _int4(narrow, tmp_path)
    attn, mlp = tiny.model.layers[0].self_attn, tiny.model.layers[0].mlp
    assert attn.k_proj.out_features == 32
    assert fuse_siblings(tiny) == SHAPE["num_hidden_layers"]  # gate/up only
    assert type(attn.q_proj) is Int4Linear and isinstance(mlp.up_proj, SiblingLinear)
    # a weight another module holds (tied) stays where it is
    tied = nn.Module()
    tied.gate_proj, tied.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
    tied.other = nn.Linear(8, 16)
    tied.other.weight = tied.up_proj.weight
    assert fuse_siblings(tied) == 0


def _codes(out: int, cols: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-16, 16, (out, cols), generator=g, dtype=torch.int8)
    return q, torch.rand(out, cols // group, generator=g) * 0.02


@pytest.mark.parametrize("rows", [1, 2, 9])
def test_gguf_code_layers_fuse_bit_for_bit(rows):
    """Q8_0/Q5_0 siblings (a scale per 32 columns; Gemma 3's q/k/v mix them) run as one
    Q8Linear, up to 8 rows (the matrix-vector kernel: each output its own sum) with the same
    bits per output column; a Q6_K part (per 16) stays apart, and so do parts with an offset
    on some but not all."""
    parent = nn.Module()
    for i, (name, out) in enumerate((("q_proj", 64), ("k_proj", 32), ("v_proj", 32))):
        setattr(parent, name, Q8Linear(*_codes(out, 96, 32, i), None, torch.float32, False))
    parent.gate_proj = Q8Linear(*_codes(64, 96, 32, 5), None, torch.float32, False)
    parent.up_proj = Q8Linear(*_codes(64, 96, 16, 6), None, torch.float32, False)
    ref = copy.deepcopy(parent)
    assert fuse_siblings(parent) == 1
    assert type(parent.q_proj.fused) is Q8Linear and parent.q_proj.fused.out_features == 128
    assert type(parent.up_proj) is Q8Linear  # groups of 16 and 32 do not fuse
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            got, want = getattr(parent, name)(x), getattr(ref, name)(x)
            if rows <= Q8_MAX_ROWS:
                assert torch.equal(got, want)
            else:  # a GEMM's blocking may sum in another order
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    offsets = nn.Module()
    offsets.gate_proj = Q8Linear(*_codes(64, 96, 32, 7), None, torch.float32, False)
    q, s = _codes(64, 96, 32, 8)
    offsets.up_proj = Q8Linear(q, s, None, torch.float32, False, offset=s.clone())
    assert fuse_siblings(offsets) == 0


def test_a_run_of_members_fuses_where_the_whole_group_cannot():
    """Gemma 3's q/k (Q5_0, 5-bit codes) and v (Q8_0, int8 codes) cannot be one layer: q/k
    become one fused call and v stays as it is, with the same bits."""
    parent = nn.Module()
    bits = {"q_proj": 5, "k_proj": 5, "v_proj": 8}
    for i, (name, out) in enumerate((("q_proj", 64), ("k_proj", 32), ("v_proj", 32))):
        q, s = _codes(out, 96, 32, i)
        if bits[name] == 5:
            s = s.half()
        setattr(parent, name, Q8Linear(q, s, None, torch.float32, False, None, bits[name]))
    ref = copy.deepcopy(parent)
    assert fuse_siblings(parent) == 1
    assert isinstance(parent.k_proj, SiblingLinear) and parent.k_proj.group.bounds == [
        (0, 64),
        (64, 96),
    ]
    assert parent.q_proj.fused.bits == 5 and type(parent.v_proj) is Q8Linear
    x = torch.randn(3, 96)
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(parent, name)(x), getattr(ref, name)(x))


def test_switched_off(monkeypatch):
    monkeypatch.setenv("ASYNCLLM_FUSED_SIBLINGS", "0")
    model = _llama()
    assert fuse_siblings(model) == 0
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
