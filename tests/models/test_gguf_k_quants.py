"""GGUF K-quant tensors kept quantized: ``Q4_K`` unpacks exactly to int4 group 32 (its
6-bit sub-block scales and minimums folded into each block's float32 scale and offset).
gguf-py cannot quantize to Q4_K, so the blocks are random bytes with sane float16 scales:
every code, scale and minimum pattern is a valid block."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from transformers import LlamaConfig, LlamaForCausalLM

from asyncllm.bench.tiny_model import TINY_CONFIG
from asyncllm.errors import ModelLoadError
from asyncllm.layers import quant_linear as ql
from asyncllm.models import quantization as qz
from asyncllm.models.gguf_quant import GGUFTensor, unpack

Q4_K = GGMLQuantizationType.Q4_K


def random_q4_k(rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Raw ``Q4_K`` bytes [rows, cols / 256 * 144]: random codes and packed 6-bit scales and
    minimums; ``d`` and ``dmin`` uniform in (-scale, scale) (float16, finite)."""
    rng = np.random.default_rng(seed)
    n = cols // 256
    raw = rng.integers(0, 256, (rows, n, 144), dtype=np.uint8)
    for lo in (0, 2):  # d, then dmin
        halves = rng.uniform(-scale, scale, (rows, n)).astype(np.float16)
        raw[..., lo : lo + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, n * 144)


def _reference(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, Q4_K).reshape(rows, cols).astype(np.float32))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (signed zeros included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize(("rows", "cols"), [(32, 512), (16, 256)])
def test_q4_k_unpacks_to_gguf_values_bit_for_bit(rows, cols):
    raw = random_q4_k(rows, cols, seed=rows)
    ref = _reference(raw, rows, cols)
    blocks = unpack("Q4_K", raw, (rows, cols))
    assert blocks.q.shape == (rows, cols) and blocks.scale.shape == (rows, cols // 32)
    assert int(blocks.q.min()) >= 0 and int(blocks.q.max()) <= 15
    assert _same_bits(blocks.dequantize(), ref)
    perm = torch.randperm(rows)
    assert _same_bits(blocks.take_rows(perm).dequantize(), ref[perm])
    # The int4 kernels' own weight (the layer applied to rows of the identity, few and many
    # rows): they compute (q - 8) * scale + zero, torch's int4 layout, whose
    # zero = offset + 8 * scale is rounded once in float32 for Q4_K's 17-bit scales (exact
    # for Q4_1's float16 ones): within one float32 rounding of the block's largest term.
    layer = ql.Int4Linear(blocks.q, blocks.scale, blocks.offset, 32, None, torch.float32)
    eye = torch.eye(cols)
    with torch.inference_mode():
        few = torch.cat([layer(eye[i : i + 4]) for i in range(0, cols, 4)]).T
        many = layer(eye).T
    bound = 2**-23 * (8 * blocks.scale.abs() + blocks.offset.abs()).repeat_interleave(32, 1)
    for got in (few, many):
        assert ((got - ref).abs() <= bound).all()
    emb = ql.QuantEmbedding(blocks.q, blocks.scale, blocks.offset, torch.float32)
    ids = torch.tensor([[rows - 1, 0, 2]])
    assert torch.equal(emb(ids), ref[ids])


def test_q4_k_needs_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        unpack("Q4_K", random_q4_k(2, 256)[:, :72], (2, 128))


def _f16(value: float) -> np.ndarray:
    return np.array([value], np.float16).view(np.uint8)


@pytest.mark.parametrize(("at", "value"), [(0, np.inf), (0, -np.inf), (2, np.nan), (2, np.inf)])
def test_q4_k_with_a_non_finite_scale_is_a_corrupt_tensor(at, value):
    """An inf/NaN ``d`` (bytes 0-1) or ``dmin`` (2-3) was passed through: its block's
    weights came out inf/NaN (ggml's too) and the check blamed the paged cache."""
    raw = random_q4_k(16, 512)
    raw[3, 144 + at : 144 + at + 2] = _f16(value)  # row 3, second super-block
    field = "d" if at == 0 else "dmin"
    with pytest.raises(
        ModelLoadError,
        match=rf"blk\.3\.ffn_up\.weight: a non-finite {field} \(inf/NaN\) in 1 of its 32 Q4_K",
    ):
        unpack("Q4_K", raw, (16, 512), "blk.3.ffn_up.weight")


@pytest.mark.parametrize(
    ("kind", "size", "at"), [("Q4_0", 18, 0), ("Q4_1", 20, 0), ("Q4_1", 20, 2), ("Q8_0", 34, 0)]
)
def test_other_blocks_with_a_non_finite_scale_are_corrupt(kind, size, at):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (4, 2, size), dtype=np.uint8)
    raw[..., 0:2] = _f16(0.01)
    if kind == "Q4_1":
        raw[..., 2:4] = _f16(-0.05)
    unpack(kind, raw.reshape(4, -1), (4, 64), "ok")  # finite: unpacked
    raw[1, 1, at : at + 2] = _f16(np.nan)
    with pytest.raises(
        ModelLoadError, match=rf"corrupt GGUF tensor blk\.0\.attn_q\.weight.*{kind}"
    ):
        unpack(kind, raw.reshape(4, -1), (4, 64), "blk.0.attn_q.weight")


def test_a_q4_k_model_runs_as_int4_and_computes_the_file_s_function():
    """A 2-layer Llama (hidden 256: Q4_K needs rows of whole 256-weight super-blocks) with
    every linear of its decoder layers a Q4_K tensor (the model holds exactly what the file
    dequantizes to, as after the conversion): "gguf" replaces each by an ``Int4Linear`` of
    the file's codes, the model's float32 logits equal the dense model's within float32
    summation order, and "auto" keeps such a file quantized."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY_CONFIG, "hidden_size": 256, "intermediate_size": 512})
    lm = LlamaForCausalLM(config).eval()
    tensors = []
    with torch.no_grad():
        for i, (name, lin) in enumerate(qz._linears(lm)):
            if name == qz._head_name(lm):
                continue
            rows, cols = lin.weight.shape
            if cols % 256:
                continue
            raw = random_q4_k(rows, cols, seed=i, scale=0.02)
            lin.weight.copy_(_reference(raw, rows, cols))
            tensors.append(GGUFTensor(f"blk.{i}.w", "Q4_K", (rows, cols), raw, Q4_K))
    assert tensors
    for name in ("lm_head", "model.embed_tokens"):  # float in this file
        w = lm.get_submodule(name).weight.detach()
        raw = w.numpy().view(np.uint8).reshape(-1)
        tensors.append(GGUFTensor(name, "F32", tuple(w.shape), raw, GGMLQuantizationType.F32))
    ids = torch.tensor([[1, 5, 300, 7, 12000, 42]])
    with torch.inference_mode():
        want = lm(ids).logits
    modules, precision = qz._from_gguf(lm, tensors, torch.float32)
    assert precision == f"gguf (Q4_K int4 x{len(tensors) - 2})"
    assert all(isinstance(m, ql.Int4Linear) for m in modules.values())
    for name, module in modules.items():
        lm.set_submodule(name, module)
    with torch.inference_mode():
        got = lm(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    cpu = torch.device("cpu")
    assert qz._auto_mode(tensors, pathlib.Path("m.gguf"), cpu, torch.float32) == "gguf"

    # A corrupt block scale in one of the file's tensors: refused at load, naming it.
    bad = tensors[1]
    raw = bad.raw.copy()
    raw[0, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    tensors[1] = GGUFTensor(bad.name, "Q4_K", bad.shape, raw, Q4_K)
    with pytest.raises(ModelLoadError, match=rf"corrupt GGUF tensor {bad.name}: "):
        qz._from_gguf(lm, tensors, torch.float32)
