"""Which configs asyncllm's paged attention can run, read before any weight is loaded:
decoder-only causal LMs whose attention goes through transformers' attention interface, with
full or sliding-window layers (:func:`check_architecture`, :func:`check_attention_interface`,
:func:`check_local_attention`). The engine's load-time probe
(:mod:`asyncllm.worker.paged_check`) then checks what the modeling code really computes."""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from asyncllm.errors import UnsupportedModelError

__all__ = ["check_architecture", "check_attention_interface", "check_local_attention"]

# Encoder families whose "ForCausalLM" class is a decoder adaptation of a bidirectional encoder.
_ENCODER_TYPES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & frozenset(
    MODEL_FOR_MASKED_LM_MAPPING_NAMES
)


def check_architecture(config: PretrainedConfig) -> None:
    """Check that the model is a plain decoder-only causal LM that paged attention can run.

    Returns None when it is.

    Raises:
        UnsupportedModelError: naming ``config.model_type`` and every feature it needs that a
            plain causal paged attention lacks: encoder-decoder or cross-attention, an encoder
            model, no causal LM class in transformers, attention layers other than full or
            sliding-window ones (chunked, linear...), or ALiBi position biases.
    """
    model_type = getattr(config, "model_type", None) or type(config).__name__
    text = config.get_text_config(decoder=True)
    configs = [config] if text is config else [config, text]
    reasons: list[str] = []

    def add(reason: str) -> None:
        if reason not in reasons:
            reasons.append(reason)

    for cfg in configs:
        if getattr(cfg, "is_encoder_decoder", False):
            add("an encoder-decoder architecture")
        if getattr(cfg, "add_cross_attention", False):
            add("cross-attention")
    if model_type in _ENCODER_TYPES:
        add("bidirectional encoder attention (it is not a decoder-only model)")
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        add("a non-causal-LM architecture (transformers has no ForCausalLM class for it)")

    for cfg in configs:
        # Sliding-window and soft-capped layers run (the attention takes both per layer);
        # other kinds (chunked, linear, state-space...) do not.
        for kind in dict.fromkeys(getattr(cfg, "layer_types", None) or ()):
            if kind not in ("full_attention", "sliding_attention"):
                add(f"{kind!r} attention layers")
        attn_config = getattr(cfg, "attn_config", None)
        if (
            getattr(cfg, "alibi", False)
            or getattr(attn_config, "alibi", False)
            or getattr(cfg, "position_embedding_type", None) == "alibi"
            or getattr(cfg, "model_type", None) in ("bloom", "mpt")
        ):
            add("ALiBi position biases")

    if reasons:
        raise UnsupportedModelError(
            f"model_type {model_type!r} needs {', '.join(reasons)}, which asyncllm's causal "
            "paged attention does not support; use a decoder-only model with full causal "
            "attention and rotary or learned positions (e.g. Llama, Qwen2, SmolLM2)."
        )


def check_local_attention(config: PretrainedConfig) -> None:
    """Refuse GPT-Neo-style local attention: ``attention_layers`` (expanded from
    ``attention_types``) naming layers other than "global", which attend only to the last
    ``window_size`` tokens. :func:`check_architecture` reads ``layer_types`` and
    ``sliding_window``; this config spells its window otherwise, and the load-time probe's
    8 tokens cannot see a window of 256.

    Raises:
        UnsupportedModelError: naming ``config.model_type`` and the layer kinds.
    """
    model_type = getattr(config, "model_type", None) or type(config).__name__
    text = config.get_text_config(decoder=True)
    for cfg in [config] if text is config else [config, text]:
        kinds = getattr(cfg, "attention_layers", None) or ()
        local = [k for k in dict.fromkeys(kinds) if isinstance(k, str) and k != "global"]
        if local:
            window = getattr(cfg, "window_size", None)
            raise UnsupportedModelError(
                f"model_type {model_type!r} needs {', '.join(map(repr, local))} attention "
                f"layers (a window of {window} tokens), which asyncllm's causal paged "
                "attention does not support; use a decoder-only model with full causal "
                "attention (e.g. Llama, Qwen2, SmolLM2)."
            )


def check_attention_interface(config: PretrainedConfig) -> None:
    """Refuse a model whose transformers class computes attention in its own code instead
    of through transformers' attention interface: it cannot be switched to the paged
    attention (transformers' own test, the one ``set_attn_implementation`` applies before it
    warns and leaves the attention as it is). Such classes (GPT-Neo, XGLM, Falcon, ...)
    often lack an SDPA implementation too, and building one with
    ``attn_implementation="sdpa"`` raised transformers' "does not support an attention
    implementation through torch.nn.functional.scaled_dot_product_attention".

    Raises:
        UnsupportedModelError: naming ``config.model_type`` and the class.
    """
    try:
        found = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ImportError):
        return  # no causal LM class (check_architecture refused it), or none importable
    # Several classes for one config: the one its architectures name, as transformers picks.
    choices = list(found) if isinstance(found, (list, tuple)) else [found]
    architectures = getattr(config, "architectures", None) or ()
    cls = next((c for c in choices if c.__name__ in architectures), choices[0])
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is None or can_set():  # a transformers without the test: the probe checks
        return
    model_type = getattr(config, "model_type", None) or type(config).__name__
    raise UnsupportedModelError(
        f"model_type {model_type!r}: transformers' {cls.__name__} calls attention code of "
        "its own, not transformers' attention interface, so its attention cannot run on "
        "asyncllm's paged KV cache; use a model whose attention goes through that interface "
        "(e.g. Llama, Qwen2, SmolLM2)."
    )
