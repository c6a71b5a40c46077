"""``dtype="auto"``: which dtype it resolves to, and why, on which device and CPU."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from asyncllm import EngineConfig
from asyncllm.worker import device

CPU = torch.device("cpu")


def _cpu(monkeypatch, flags, capability="AVX512"):
    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


BF16 = torch.bfloat16


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bfloat16_for_bfloat16_weights_on_cpus_with_native_bfloat16(
    monkeypatch, caplog, flag
):
    _cpu(monkeypatch, {"avx512f", flag})
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        assert device.resolve_dtype("auto", CPU, BF16) == torch.bfloat16
    assert f"dtype auto: bfloat16 (bfloat16 weights; the CPU has {flag}" in caplog.text


@pytest.mark.parametrize("stored", [torch.float32, torch.float16, None])
def test_auto_is_float32_for_weights_stored_in_anything_else(monkeypatch, caplog, stored):
    """A GGUF file (stored float32), a float32 or float16 checkpoint, or an unknown precision:
    computed in float32 even where bfloat16 is native (the default model answered the
    README's question wrongly in bfloat16 on AVX-512 BF16 CPUs)."""
    _cpu(monkeypatch, {"avx512f", "avx512_bf16"})
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        assert device.resolve_dtype("auto", CPU, stored) == torch.float32
        assert device.resolve_dtype("auto", torch.device("cuda"), stored) == torch.float32
    assert "dtype auto: float32 (the weights' own precision is" in caplog.text


@pytest.mark.parametrize(
    ("flags", "capability", "why"),
    [
        ({"avx2", "fma"}, "AVX2", "no native bfloat16"),
        ({"avx512f", "avx512_bf16"}, "AVX2", "at AVX2, not AVX512"),  # ATEN_CPU_CAPABILITY
        (set(), "DEFAULT", "no native bfloat16"),
    ],
)
def test_auto_is_float32_on_cpus_without_native_bfloat16(
    monkeypatch, caplog, flags, capability, why
):
    _cpu(monkeypatch, flags, capability)
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        assert device.resolve_dtype("auto", CPU, BF16) == torch.float32
        assert device.resolve_dtype(None, CPU, BF16) == torch.float32  # None: the alias
    assert "dtype auto: float32" in caplog.text and why in caplog.text


def test_auto_is_bfloat16_on_cuda_and_explicit_dtypes_are_kept(monkeypatch):
    _cpu(monkeypatch, set(), "AVX2")
    assert device.resolve_dtype("auto", torch.device("cuda"), BF16) == torch.bfloat16
    for name in ("float32", "float16", "bfloat16"):
        assert device.resolve_dtype(name, CPU) == getattr(torch, name)
    with pytest.raises(ValueError, match="unknown dtype"):
        device.resolve_dtype("int8", CPU)


def test_stored_dtype_is_read_from_the_weight_file(tmp_path, tiny_llama_dir):
    """GGUF: float32; a Hugging Face directory: its config's torch_dtype (or dtype)."""
    from asyncllm.models.loader import stored_dtype

    assert stored_dtype(tmp_path / "model.gguf") == torch.float32
    for key, value, want in (("torch_dtype", "bfloat16", BF16), ("dtype", "float16",
                             torch.float16), ("torch_dtype", "int8", None)):  # fmt: skip
        d = tmp_path / f"{key}-{value}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({key: value}))
        assert stored_dtype(d) == want
    assert stored_dtype(tmp_path / "missing") is None
    assert stored_dtype(tiny_llama_dir) is not None


def test_cpu_flags_reads_this_machine():
    flags = device.cpu_flags()
    assert isinstance(flags, frozenset)
    if torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        assert "avx2" in flags or "avx" in flags


def test_config_default_is_auto_and_refuses_unknown_dtypes():
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(dtype=None).dtype is None  # kept as "auto"'s alias
    with pytest.raises(ValueError, match=r"EngineConfig\.dtype"):
        EngineConfig(dtype="int4")  # type: ignore[arg-type]


async def test_engine_reports_the_resolved_dtype(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, block_size=4, kv_cache_bytes=2**20)
    want = device.resolve_dtype("auto", CPU)
    core = engine.core
    assert core.dtype == want == core.kv_cache.spec.dtype
    assert next(core.loaded.model.parameters()).dtype == want


@pytest.mark.parametrize(("block_size", "blocks"), [(7, 37), (16, 16)])
def test_default_kv_cache_holds_max_model_len_in_whole_blocks(block_size, blocks):
    """Unset kv_cache_bytes is capped at max_num_seqs sequences of max_model_len tokens in
    whole blocks: with one sequence and a block size that does not divide max_model_len,
    the cap used to round down below one sequence and the engine refused to start."""
    from transformers import LlamaConfig

    from asyncllm.worker.kv_cache import size_kv_cache

    config = LlamaConfig(
        num_attention_heads=4, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2
    )
    _, num_blocks = size_kv_cache(
        config, torch.float32, torch.device("cpu"),
        block_size=block_size, max_model_len=256, max_num_seqs=1, kv_cache_bytes=None,
    )  # fmt: skip
    assert num_blocks == blocks


def test_trim_host_memory_returns_freed_pages():
    """``malloc_trim(0)`` hands back the free holes of a fragmented heap (glibc keeps them
    mapped otherwise): where it reports a release, the resident set shrinks by most of it."""
    from asyncllm.worker.device import trim_host_memory

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    chunks = [bytearray(64 * 1024) for _ in range(2000)]  # 125 MiB in heap chunks
    del chunks[::2]  # 62 MiB free, in holes glibc keeps mapped
    before = resident()
    released = trim_host_memory()
    assert released in (0, 1)
    if released:
        assert resident() < before - (32 << 20) // os.sysconf("SC_PAGE_SIZE")
