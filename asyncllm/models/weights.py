"""The transformers model of an engine, built with its weights (and quantized layers).

Two ways: ``from_pretrained`` then :func:`~asyncllm.models.quantization.quantize_model`
(the first start, or no quantization), or, when the quantized layers are cached, the model
built around them so that their dense weights are never made
(:func:`build_around_cached`).
"""

from __future__ import annotations

import pathlib

import accelerate
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from asyncllm.errors import AsyncLLMError, ModelLoadError
from asyncllm.models.quantization import (
    QuantInfo,
    QuantSetting,
    apply_cached,
    load_cached,
    quantize_model,
)

__all__ = ["build_around_cached", "load_weights"]


def load_weights(
    model_dir: pathlib.Path,
    config: PretrainedConfig,
    attn_implementation: str,
    setting: QuantSetting,
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module, QuantInfo]:
    """The tokenizer and the model on ``setting.device``, quantized as ``setting`` says
    (around its cached layers when they are cached: :func:`build_around_cached`).

    Raises:
        ModelLoadError: the weight or tokenizer files cannot be read, or lack a parameter
            of the model (naming it; transformers would initialize it at random).
        ValueError: a quantization the model's layers cannot take (naming the layer).
    """
    cached = load_cached(setting)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        # With the quantized layers cached, their dense weights are never built or read.
        built = build_around_cached(model_dir, config, attn_implementation, setting, cached)
        if built is None:
            lm, loading = AutoModelForCausalLM.from_pretrained(
                model_dir,
                config=config,
                dtype=setting.dtype,
                attn_implementation=attn_implementation,
                local_files_only=True,
                output_loading_info=True,
            )
            # transformers initializes a parameter the files lack at random and only
            # reports it; vLLM refuses such a checkpoint ("weights not initialized").
            if loading.get("missing_keys"):
                missing = sorted(loading["missing_keys"])
                raise ModelLoadError(
                    f"the weight files in {model_dir} lack {len(missing)} parameter(s) of "
                    f"the model: {', '.join(missing[:5])}"
                )
    except (AsyncLLMError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model in {model_dir}: {exc}") from exc
    if built is not None:
        return (tokenizer, *built)
    lm.to(setting.device)
    return tokenizer, lm, quantize_model(lm, setting, cached)


def build_around_cached(
    model_dir: pathlib.Path,
    config: PretrainedConfig,
    attn_implementation: str,
    setting: QuantSetting,
    cached: dict | None,
) -> tuple[torch.nn.Module, QuantInfo] | None:
    """Build the model with its cached quantized layers, reading only the other weights.

    The model is made with its parameters on the meta device (accelerate's
    ``init_empty_weights``; buffers such as the rotary frequencies are computed as usual),
    the cached modules replace theirs, and the remaining parameters (embeddings, norms, what
    was not quantized) are read from the safetensors files in ``setting.dtype``. So a start
    from the cache never holds the dense weights of the quantized layers, nor maps the
    file's copy of them: the peak resident memory is about the quantized model's.

    Returns:
        (the model on ``setting.device``, what was quantized), or None where this path does
        not apply (nothing cached, a cache that does not fit the model (see
        :func:`~asyncllm.models.quantization.apply_cached`), no safetensors files, or a
        parameter the files lack under its own name): then the caller loads the whole
        model with ``from_pretrained``.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    if not cached or not files:  # nothing cached, or a file found not to fit (emptied)
        return None
    with accelerate.init_empty_weights(include_buffers=False):
        lm = AutoModelForCausalLM.from_config(
            config, dtype=setting.dtype, attn_implementation=attn_implementation
        )
    info = apply_cached(lm, setting, cached)
    if info is None:
        return None
    tied = dict(getattr(lm, "all_tied_weights_keys", None) or {})
    wanted = {n for n, p in lm.named_parameters(remove_duplicate=False) if p.is_meta}
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in wanted & set(f.keys()):
                state[key] = f.get_tensor(key).to(setting.dtype)
    if wanted - state.keys() - tied.keys():
        return None
    lm.load_state_dict(state, strict=False, assign=True)
    if tied and getattr(lm.config, "tie_word_embeddings", False):
        lm.tie_weights()
    if any(p.is_meta for p in lm.parameters()):
        return None
    lm.generation_config = GenerationConfig.from_model_config(lm.config)
    if (model_dir / "generation_config.json").is_file():
        lm.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return lm.to(setting.device), info
