"""GGUF Q8_0 layers: the matrix-vector kernel (its AVX-512 and AVX2 variants) and the many-row
paths (bfloat16 brgemm on the codes; a packed dense copy) against a dequantize-then-matmul
reference, and the default model's Q8_0 head
kept as codes, shared with its tied embedding table, through the quantization cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from asyncllm.kernels import native
from asyncllm.layers import q8_linear
from asyncllm.models.gguf_quant import read_tensors, unpack
from asyncllm.models.loader import load_model
from asyncllm.preflight import default_gguf

needs_kernel = pytest.mark.skipif(
    q8_linear.kernel() is None, reason=f"Q8_0 kernel unavailable: {native.failure('q8')}"
)


def _codes(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return q, torch.rand(n, k // 32, generator=g) * 0.02


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None):
    y = x.double() @ q8_linear.dequantize(q, s).double().T
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_q8_linear_matches_reference(rows, dtype, packed, monkeypatch):
    """Few rows (the kernel, float32 from the exact weights) and many (``q8_mm`` or
    ``q8_mm_f32``), or with the kernel switched off the packed dense copy at every row count,
    with a bias and a width not a multiple of 64; float32 logits whatever the model's
    dtype."""
    n, k = 100, 96
    q, s = _codes(n, k)
    bias = torch.randn(n).to(dtype)
    layer = q8_linear.Q8Linear(q, s, bias, dtype)
    if packed:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            pytest.skip("oneDNN's bfloat16 reorder (the packed copy) needs AVX-512 BW/VL/DQ")
        monkeypatch.setenv(q8_linear.ENV_SWITCH, "0")
        layer.pack()
        assert layer.packed is not None
    x = torch.randn(2, rows, k).to(dtype)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, rows, n) and y.dtype == torch.float32
    ref = _reference(x.reshape(-1, k), q, s, bias).view(2, rows, n)
    many = 2 * rows > q8_linear.MAX_ROWS
    # float32 sums of exact weights (x is exact in either dtype); bfloat16's packed dense copy:
    # the weight's rounding (d * q rounded once) and oneDNN's output's; q8_mm: the weight's.
    mm = many and dtype == torch.bfloat16 and q8_linear.mm_available() and not packed
    tol = 2e-2 if dtype == torch.bfloat16 and layer.packed is not None else 1e-5
    tol = 1e-2 if mm else tol
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


needs_mm = pytest.mark.skipif(
    q8_linear.kernel() is None or not q8_linear.mm_available(), reason="no bfloat16 brgemm here"
)


@needs_mm
@pytest.mark.parametrize("n, k, rows", [(100, 96, 9), (128, 64, 64), (70, 576, 130), (64, 32, 1)])
def test_q8_mm_uses_the_exact_weights(n, k, rows):
    """The many-row kernel (per 64 outputs: dequantize, brgemm, transposed store) multiplies
    by the weight the dense copy held (``d * q`` rounded once to bfloat16) bit for bit (times
    the identity, every output is one product with 1), and any rows within bfloat16's
    rounding of the float64 reference: output blocks of fewer than 64, row tiles past 64;
    float32 output (the float32 sums, not rounded)."""
    q, s = _codes(n, k, seed=n + rows)
    mod = q8_linear.kernel()
    dense = q8_linear.dequantize(q, s).bfloat16()
    assert torch.equal(mod.q8_mm(torch.eye(k, dtype=torch.bfloat16), q, s), dense.T.float())
    x = torch.randn(rows, k).bfloat16()
    y = mod.q8_mm(x, q, s)
    ref = x.double() @ dense.double().T
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(RuntimeError, match="q8_mm"):
        mod.q8_mm(x.float(), q, s)


@needs_kernel
def test_q8_linear_makes_no_dense_copy_where_the_kernel_runs(monkeypatch):
    """With the kernel, every row count reads the codes (no dense copy of Gemma 3's 262k x
    640 head: 671 MB in float32); without it, one packed copy for the torch reference."""
    q, s = _codes(64, 64)
    for dtype in (torch.bfloat16, torch.float32):
        layer = q8_linear.Q8Linear(q, s, None, dtype)
        layer.pack()
        assert layer.packed is None
    monkeypatch.setenv(q8_linear.ENV_SWITCH, "0")
    layer = q8_linear.Q8Linear(q, s, None, torch.float32)
    layer.pack()
    assert layer.packed is not None


def test_q8_linear_refuses_bad_shapes():
    q, s = _codes(8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_linear.Q8Linear(q[:, :40], s[:, :1], None)
    with pytest.raises(ValueError, match="scales"):
        q8_linear.Q8Linear(q, s[:, :1], None)


@needs_kernel
def test_q8_gemv_checks_its_inputs():
    q, s = _codes(8, 64)
    y = torch.empty(1, 8)
    with pytest.raises(RuntimeError, match="q8_gemv"):
        q8_linear.kernel().q8_gemv(torch.randn(1, 64).bfloat16(), q, s, y)
    with pytest.raises(RuntimeError, match="q8_gemv"):
        q8_linear.kernel().q8_gemv(torch.randn(1, 32), q, s, y)


def _avx2_variant():  # type: ignore[no-untyped-def]
    try:
        return native.import_variant("q8", "avx2")
    except ImportError as e:
        pytest.skip(f"the avx2 variant is not installed: {e}")


def test_q8_gemv_avx2_variant_matches_the_reference():
    """The avx2 variant (the path of CPUs without AVX-512: no fast path) gives the
    reference's values up to float32 summation order."""
    mod = _avx2_variant()
    assert not mod.q8_fast()
    q, s = _codes(70, 128, seed=3)
    x = torch.randn(6, 128)
    y = torch.empty(6, 70)
    mod.q8_gemv(x, q, s, y)
    ref = _reference(x, q, s, None)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_q8_gemv_avx2_variant_matches_the_loaded_one():
    """The avx2 variant gives the values of the variant loaded here (AVX-512's fast path),
    up to float32 summation order."""
    mod, loaded = _avx2_variant(), q8_linear.kernel()
    if loaded is None or loaded is mod:
        pytest.skip("only the avx2 variant runs here (against the reference: the test above)")
    q, s = _codes(70, 128, seed=3)
    x = torch.randn(6, 128)
    y, fast = torch.empty(6, 70), torch.empty(6, 70)
    mod.q8_gemv(x, q, s, y)
    loaded.q8_gemv(x, q, s, fast)
    scale = _reference(x, q, s, None).abs().max().item()
    torch.testing.assert_close(fast, y, rtol=1e-5, atol=2e-5 * scale)


def test_q8_0_blocks_are_exact():
    """A Q8_0 tensor made by gguf-py: the layer's dequantized weight is gguf-py's own."""
    w = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(40, 64))
    blocks = unpack("Q8_0", raw, (40, 64))
    layer = q8_linear.Q8Linear(blocks.q, blocks.scale, None, torch.float32)
    assert torch.equal(q8_linear.dequantize(layer.q, layer.scale), ref)


@needs_kernel
def test_default_model_head_is_its_q8_0_codes_shared_with_the_embedding(
    default_model_dir, quant_cache
):
    """The default model's tied head and embedding: one set of Q8_0 codes (the GGUF file's,
    exact), the same after a start from the quantization cache."""
    if not q8_linear.fast():
        pytest.skip("the Q8_0 head is kept as codes only where the AVX-512 kernel builds")
    (t,) = [t for t in read_tensors(default_gguf()) if t.name == "token_embd.weight"]
    assert t.kind == "Q8_0"
    ref = t.dequantize()
    for _ in range(2):  # converted, then from the cache
        lm = load_model(default_model_dir, dtype=torch.bfloat16, device=torch.device("cpu"),
                        quantization="gguf").model  # fmt: skip
        head, emb = lm.get_output_embeddings(), lm.get_input_embeddings()
        assert isinstance(head, q8_linear.Q8Linear)
        assert head.q.data_ptr() == emb.q.data_ptr()
        assert head.scale.data_ptr() == emb.scale.data_ptr()
        # llama.cpp stores token_embd unpermuted: rows in the model's order
        assert torch.equal(q8_linear.dequantize(head.q, head.scale), ref)
        ids = torch.tensor([[0, 17, 49151]])
        assert torch.equal(emb(ids), ref[ids].to(torch.bfloat16))


# --- Q8_0 / Q5_0 decoder linears (logits=False) ----------------------------------------------

Q5_0 = GGMLQuantizationType.Q5_0


def random_q5_0(rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """Raw ``Q5_0`` bytes [rows, cols / 32 * 22]: random high bits and nibbles, ``d`` uniform
    in (-scale, scale) (float16, finite): every code pattern is a valid block."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 32, 22), dtype=np.uint8)
    raw[..., 0:2] = (
        rng.uniform(-scale, scale, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    )
    return raw.reshape(rows, -1)


def random_q8_0(rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """Raw ``Q8_0`` bytes: random codes, ``d`` uniform in (-scale, scale)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 32, 34), dtype=np.uint8)
    raw[..., 0:2] = (
        rng.uniform(-scale, scale, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    )
    return raw.reshape(rows, -1)


def _gguf_reference(raw: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    out = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
    return torch.from_numpy(out.astype(np.float32))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (signed zeros included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize(("rows", "cols"), [(32, 128), (7, 64)])
def test_q5_0_unpacks_to_gguf_values_bit_for_bit(rows, cols):
    """Random ``Q5_0`` blocks (and gguf-py's own quantization): codes ``q - 16`` in -16..15
    and scale ``d`` give gguf-py's ``d * (q - 16)`` bit for bit (its -0.0 included), in any
    row order, and as a Q8Linear's exact weight."""
    raw = random_q5_0(rows, cols, seed=rows)
    ref = _gguf_reference(raw, "Q5_0", rows, cols)
    blocks = unpack("Q5_0", raw, (rows, cols))
    assert blocks.q.shape == (rows, cols) and blocks.scale.shape == (rows, cols // 32)
    assert int(blocks.q.min()) == -16 and int(blocks.q.max()) == 15
    assert _same_bits(blocks.dequantize(), ref)
    perm = torch.randperm(rows)
    assert _same_bits(blocks.take_rows(perm).dequantize(), ref[perm])
    layer = q8_linear.Q8Linear(blocks.q, blocks.scale, None, torch.float32, logits=False)
    assert torch.equal(q8_linear.dequantize(layer.q, layer.scale), ref)
    w = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, Q5_0)
    assert _same_bits(unpack("Q5_0", raw, (rows, cols)).dequantize(),
                      _gguf_reference(raw, "Q5_0", rows, cols))  # fmt: skip


def test_q8_0_random_blocks_unpack_bit_for_bit():
    raw = random_q8_0(9, 96, seed=4)
    assert _same_bits(unpack("Q8_0", raw, (9, 96)).dequantize(),
                      _gguf_reference(raw, "Q8_0", 9, 96))  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("kind", ["Q5_0", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decoder_q8_linear_computes_the_dense_float32_product(kind, rows, with_bias):
    """A float32 model's Q5_0/Q8_0 decoder linear (``logits=False``; after ``pack()``, which
    makes no dense copy for it) returns float32 ``x @ W^T (+ b)`` of gguf-py's dequantized
    weight up to float32 summation order: few rows through the matrix-vector kernel, many
    through ``q8_mm_f32`` (a width of 100: a partial block of outputs)."""
    n, k = 100, 160
    raw = (random_q5_0 if kind == "Q5_0" else random_q8_0)(n, k, seed=rows)
    w = _gguf_reference(raw, kind, n, k)
    blocks = unpack(kind, raw, (n, k))
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(n, generator=g) if with_bias else None
    layer = q8_linear.Q8Linear(blocks.q, blocks.scale, bias, torch.float32, logits=False)
    layer.pack()
    assert layer.packed is None
    x = torch.randn(rows, k, generator=g)
    with torch.inference_mode():
        y = layer(x)
        want = nn_linear(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # float32 summation order: within a few ulps of sum |x| |w|
    bound = 1e-5 * (x.abs() @ w.abs().T) + 1e-30
    assert ((y - want).abs() <= bound).all()


def nn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, w, b)


@needs_kernel
@pytest.mark.parametrize("rows", [2, 12])
def test_decoder_q8_linear_returns_the_model_dtype(rows):
    """As a decoder layer of a bfloat16 model, the output is bfloat16 (the head's stays
    float32), within bfloat16's rounding of the float64 reference."""
    q, s = _codes(64, 96, seed=rows)
    bias = torch.randn(64).bfloat16()
    layer = q8_linear.Q8Linear(q, s, bias, torch.bfloat16, logits=False)
    layer.pack()
    x = torch.randn(3, rows, 96).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, rows, 64) and layer.packed is None
    ref = _reference(x.reshape(-1, 96), q, s, bias).view(3, rows, 64)
    assert torch.allclose(y.double(), ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())


@needs_kernel
@pytest.mark.parametrize(
    "n, k, rows", [(100, 96, 9), (128, 64, 64), (70, 576, 130), (64, 32, 1), (130, 2048, 200)]
)
def test_q8_mm_f32_is_exact_weights_times_x(n, k, rows):
    """The float32 many-row kernel: times the identity, gguf's exact weights bit for bit (every
    output one product with 1); any rows within float32 summation order of float64."""
    q, s = _codes(n, k, seed=n + rows)
    mod = q8_linear.kernel()
    w = q8_linear.dequantize(q, s)
    assert torch.equal(mod.q8_mm_f32(torch.eye(k), q, s), w.T)
    x = torch.randn(rows, k)
    ref = x.double() @ w.double().T
    # as chosen, brgemm forced, at::mm forced (the way above 128 rows)
    for y in (mod.q8_mm_f32(x, q, s), mod.q8_mm_f32_with(x, q, s, 1 << 40),
              mod.q8_mm_f32_with(x, q, s, 0)):  # fmt: skip
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert ((y.double() - ref).abs() <= 1e-5 * (x.abs() @ w.abs().T).double()).all()
    with pytest.raises(RuntimeError, match="q8_mm_f32"):
        mod.q8_mm_f32(x.bfloat16(), q, s)
    assert mod.q8_mm_f32(x[:0], q, s).shape == (0, n)


def test_q8_mm_f32_avx2_variant_matches_the_reference():
    mod = _avx2_variant()
    q, s = _codes(70, 128, seed=5)
    x = torch.randn(20, 128)
    ref = _reference(x, q, s, None)
    w = q8_linear.dequantize(q, s)
    bound = 1e-5 * (x.abs() @ w.abs().T).double()
    assert ((mod.q8_mm_f32(x, q, s).double() - ref).abs() <= bound).all()


@needs_kernel
def test_decoder_q8_linear_round_trips_the_cache_state():
    """``module_state``/``module_from_state`` keep a decoder layer a decoder layer."""
    from asyncllm.layers import quant_linear as ql

    q, s = _codes(64, 64)
    layer = q8_linear.Q8Linear(q, s, torch.randn(64), torch.float32, logits=False)
    again = ql.module_from_state(ql.module_state(layer))
    assert isinstance(again, q8_linear.Q8Linear) and again.logits is False
    x = torch.randn(10, 64)
    with torch.inference_mode():
        assert torch.equal(again(x), layer(x))
    head = ql.module_from_state(ql.module_state(q8_linear.Q8Linear(q, s, None, torch.float32)))
    assert head.logits is True


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_runs_in_cpp_and_equals_its_torch_reference(dtype):
    """The op's CPU kernel (``csrc/q8_linear.cpp``) and its torch reference (the
    ``CompositeExplicitAutograd`` implementation in ``layers/q8_linear.py``) compute the same
    function at few and many rows, for the head (float32 logits) and a decoder layer (``x``'s
    dtype), with offsets and scales per 16 columns."""
    n, k = 100, 96
    q, s = _codes(n, k)
    offset = torch.randn(n, k // 16) * 0.01
    s16 = torch.rand(n, k // 16) * 0.02
    bias = torch.randn(n).to(dtype)
    for scale, off in ((s, None), (s16, offset)):
        for rows in (1, 3, 8, 9, 40):
            x = torch.randn(rows, k).to(dtype)
            for logits in (True, False):
                args = (x, q, scale, None, bias, q8_linear.MAX_ROWS, logits, off)
                got = torch.ops.asyncllm.q8_0_linear(*args)
                want = q8_linear.q8_0_linear(*args)
                assert got.dtype == want.dtype == (torch.float32 if logits else dtype)
                # bfloat16: q8_mm rounds the weights (d * q) to bfloat16, the reference not
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                scale_of = want.float().abs().max().item()
                assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * scale_of)


@needs_kernel
def test_repeated_rows_are_computed_once_with_the_same_bits():
    """The compiled forward pads a one-sequence decode's kept rows with a copy of its row:
    a row equal to the one before it is copied, not computed again, and every row's output
    has the bits it would have alone."""
    q, s = _codes(300, 128)
    a, b = torch.randn(2, 128)
    x = torch.stack([a, a, b, b, b, a])
    y = torch.ops.asyncllm.q8_0_linear(x, q, s, None, None, q8_linear.MAX_ROWS, True, None)
    alone = [
        torch.ops.asyncllm.q8_0_linear(r[None], q, s, None, None, q8_linear.MAX_ROWS, True, None)
        for r in x
    ]
    assert torch.equal(y, torch.cat(alone))


# --- Q5_0 as 5-bit codes (quantization.Q5_0_BITS = 5) -----------------------------------------


def test_5_bit_codes_hold_the_file_s_codes_in_20_bytes_a_block():
    """``pack5`` of a Q5_0 tensor's codes: 20 bytes per 32 columns, byte ``j`` column ``j``'s
    ``u = q + 16`` in bits 0-4 and bits 2-4 of column ``j + 16``'s in bits 5-7, then a
    little-endian word with bits 0-1 of column ``j + 16``'s at bit ``2j`` (the layout the C++
    table lookup reads); ``unpack5`` gives the codes back, all 32 values in every column."""
    raw = random_q5_0(7, 128, seed=11)
    blocks = unpack("Q5_0", raw, (7, 128))
    packed = q8_linear.pack5(blocks.q)
    assert packed.shape == (7, 4 * 20) and packed.dtype == torch.uint8
    u = blocks.q.view(7, 4, 32).to(torch.int64) + 16
    b = packed.view(7, 4, 20).to(torch.int64)
    assert torch.equal(b[..., :16] & 31, u[..., :16])
    word = sum(b[..., 16 + i] << (8 * i) for i in range(4))
    for j in range(16):
        hi = ((b[..., j] >> 5) << 2) | ((word >> (2 * j)) & 3)
        assert torch.equal(hi, u[..., 16 + j])
    assert torch.equal(q8_linear.unpack5(packed), blocks.q)
    every = torch.arange(-16, 16, dtype=torch.int8)
    every = torch.stack([every.roll(i) for i in range(32)])  # each value in each column
    assert torch.equal(q8_linear.unpack5(q8_linear.pack5(every)), every)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False])
def test_5_bit_codes_compute_what_int8_codes_compute(rows, dtype, kernel, monkeypatch):
    """A Q5_0 decoder linear as 5-bit codes returns the int8 codes' output bit for bit: the
    matrix-vector kernel, ``q8_mm_f32`` (float32) and ``q8_mm`` (bfloat16) read the same
    weights from either layout, and so does the torch reference (kernel switched off); at
    5.5 bits a weight (codes and float16 scale) against 9."""
    if kernel and q8_linear.kernel() is None:
        pytest.skip("the q8 kernel is not installed")
    if not kernel:
        monkeypatch.setenv(q8_linear.ENV_SWITCH, "0")
    n, k = 100, 160
    blocks = unpack("Q5_0", random_q5_0(n, k, seed=rows), (n, k))
    bias = torch.randn(n).to(dtype)
    five = q8_linear.Q8Linear(blocks.q, blocks.scale, bias, dtype, False, None, 5)
    eight = q8_linear.Q8Linear(blocks.q, blocks.scale, bias, dtype, False)
    assert five.bits == 5 and eight.bits == 8 and five.q.dtype == torch.uint8
    nbytes = [m.q.nbytes + m.scale.nbytes for m in (five, eight)]
    assert nbytes == [n * k * 5.5 / 8, n * k * 9 / 8]
    assert torch.equal(five.weight, eight.weight)
    x = torch.randn(rows, k).to(dtype)
    with torch.inference_mode():
        assert torch.equal(five(x), eight(x))


def test_5_bit_codes_refuse_what_they_cannot_hold():
    q, s = _codes(8, 64)
    exact = s.half().float()
    with pytest.raises(ValueError, match="5-bit codes"):
        q8_linear.Q8Linear(q, exact, None, torch.float32, False, None, 5)  # codes past 15
    small = q.clamp(-16, 15)
    with pytest.raises(ValueError, match="5-bit codes"):
        q8_linear.Q8Linear(small, s + 1e-9, None, torch.float32, False, None, 5)  # not float16
    with pytest.raises(ValueError, match="5-bit codes"):
        q8_linear.Q8Linear(small, exact, None, torch.float32, False, exact, 5)  # an offset
    with pytest.raises(ValueError, match="8 or 5 bits"):
        q8_linear.Q8Linear(small, exact, None, torch.float32, False, None, 4)


@needs_kernel
def test_5_bit_kernels_check_their_inputs():
    q, s = _codes(8, 64)
    layer = q8_linear.Q8Linear(
        q.clamp(-16, 15), s.half().float(), None, torch.float32, False, None, 5
    )
    mod, x = q8_linear.kernel(), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="5-bit codes"):
        mod.q8_gemv(x, layer.q, layer.scale.float(), torch.empty(2, 8), None)  # float32 scales
    with pytest.raises(RuntimeError, match="5-bit codes"):
        mod.q8_mm_f32(x, layer.q[:, :30].contiguous(), layer.scale, None)


def test_5_bit_codes_in_the_avx2_variant():
    """The avx2 variant's portable loops read 5-bit codes as the int8 ones: the same bits."""
    mod = _avx2_variant()
    blocks = unpack("Q5_0", random_q5_0(70, 128, seed=5), (70, 128))
    five = q8_linear.Q8Linear(blocks.q, blocks.scale, None, torch.float32, False, None, 5)
    eight = q8_linear.Q8Linear(blocks.q, blocks.scale, None, torch.float32, False)
    x = torch.randn(3, 128)
    y5, y8 = torch.empty(3, 70), torch.empty(3, 70)
    mod.q8_gemv(x, five.q, five.scale, y5, None)
    mod.q8_gemv(x, eight.q, eight.scale, y8, None)
    assert torch.equal(y5, y8)
    assert torch.equal(mod.q8_mm_f32(x, five.q, five.scale), mod.q8_mm_f32(x, eight.q, eight.scale))
