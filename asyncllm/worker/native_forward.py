"""The native forward: a step of a Llama-family model or Gemma 3 as one C++ call.

At decode a step's work is small per op: a batch-1 step of the default model makes ~270 op
calls whose fixed costs (Python, dispatch, an OpenMP region, code and data evicted by the
step's 100 MB weight sweep) add up to as much as its weight reads (docs/tuning.md,
"Compiled forward"). ``csrc/decoder_layer.cpp`` runs every decoder layer, the final norm
and the LM head in one call, as llama.cpp does: the linears and the paged attention are the
same ops the modeling code calls (``asyncllm::int4_linear``, ``asyncllm::q8_0_linear``,
``asyncllm::paged_attention``, ``aten::linear``, with the layers' own arguments), reached
from C++; the norms, rotary embedding, SiLU-and-multiply and residual adds are its own
loops. Every step of such a model runs here: decodes (the attention's C++ kernel writes and
attends straight from C++), prefill chunks and speculative verifications (the attention
op's Python implementation plans those), so a model it runs needs no compiled forward
(docs/tuning.md, "Native forward"). transformers' modeling code stays the reference and
the path of every other model.

:func:`build` accepts a model only where its structure is exactly what the C++ computes:
``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
with their own decoder layers, RMSNorms and SiLU MLPs, and ``Gemma3ForCausalLM`` (norms of
``1 + w``, a norm on each block's output, tanh-GELU, a rotary embedding per layer type),
float32 on CPU. Any other model, dtype or device keeps the modeling code;
``ASYNCLLM_NATIVE_FORWARD=0`` switches it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncllm.kernels import int4_dequant, native
from asyncllm.layers import q8_linear
from asyncllm.layers.q8_linear import Q8Linear
from asyncllm.layers.quant_linear import INT4_GEMV_MAX_ROWS, Int4Linear, int4_max_rows
from asyncllm.layers.sibling_linears import SiblingLinear

__all__ = ["FAMILIES", "NativeForward", "build", "unsupported_reason"]

logger = logging.getLogger("asyncllm")


@dataclass(frozen=True)
class Family:
    """A causal LM's transformers classes that the C++ decoder computes exactly."""

    layer: str
    norm: str
    #: Gemma 3: norms scale by ``1 + w`` (``eps``, not ``variance_epsilon``), each block's
    #: output is normed before its residual add, the MLP is tanh-GELU, and each layer type
    #: has its own rotary embedding.
    gemma: bool = False


#: Causal LM class -> its :class:`Family`. Mistral passes the config's window to every
#: layer; Qwen2/3 and Gemma 3 a window per layer (``sliding_window`` on the attention
#: module); Qwen3 and Gemma 3 norm q and k per head.
FAMILIES = {
    "LlamaForCausalLM": Family("LlamaDecoderLayer", "LlamaRMSNorm"),
    "MistralForCausalLM": Family("MistralDecoderLayer", "MistralRMSNorm"),
    "Qwen2ForCausalLM": Family("Qwen2DecoderLayer", "Qwen2RMSNorm"),
    "Qwen3ForCausalLM": Family("Qwen3DecoderLayer", "Qwen3RMSNorm"),
    "Gemma3ForCausalLM": Family("Gemma3DecoderLayer", "Gemma3RMSNorm", gemma=True),
}


def unsupported_reason(model: Any) -> str | None:
    """Why the C++ forward cannot run ``model`` exactly, or None where it can."""
    name = type(model).__name__
    if name not in FAMILIES:
        return f"{name} is not one of {sorted(FAMILIES)}"
    fam = FAMILIES[name]
    layer_cls, norm_cls = fam.layer, fam.norm
    config = model.config
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "the model is not on the CPU"
    if getattr(model, "dtype", torch.float32) != torch.float32:
        return f"the model computes in {model.dtype}, not float32"
    act = "hidden_activation" if fam.gemma else "hidden_act"
    want = "gelu_pytorch_tanh" if fam.gemma else "silu"
    if getattr(config, act, None) != want:
        return f"{act} {getattr(config, act, None)!r} is not {want!r}"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "the logits are soft-capped"
    inner = model.model
    layers = list(inner.layers)
    norms = [inner.norm] + [n for lay in layers for n in _norms(lay, fam)]
    if any(type(n).__name__ != norm_cls for n in norms):
        return f"a norm is not a {norm_cls}"
    if len({_eps(n, fam) for n in norms}) != 1:
        return "the norms' epsilons differ"
    if any(n.weight.dtype != torch.float32 for n in norms):
        return "a norm's weight is not float32"
    for lay in layers:
        if type(lay).__name__ != layer_cls:
            return f"a decoder layer is a {type(lay).__name__}, not a {layer_cls}"
        if type(lay.mlp.act_fn).__name__ not in _ACTS[fam.gemma]:
            return f"an MLP's activation is {type(lay.mlp.act_fn).__name__}"
    head_dim = layers[0].self_attn.head_dim if layers else 0
    if head_dim % 2 or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "the rotary embedding does not cover whole, even heads"
    return None


#: The activation modules of the MLP (SiLU; Gemma: tanh-GELU), by ``Family.gemma``.
_ACTS = {False: ("SiLUActivation", "SiLU"), True: ("GELUTanh", "PytorchGELUTanh")}


def _norms(layer: Any, fam: Family) -> list[Any]:
    attn = layer.self_attn
    extra = [m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m]
    if fam.gemma:
        extra += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return [layer.input_layernorm, layer.post_attention_layernorm, *extra]


def _eps(norm: Any, fam: Family) -> float:
    return float(norm.eps if fam.gemma else norm.variance_epsilon)


def _weight(norm: Any, fam: Family) -> torch.Tensor | None:
    """The norm's multiplier: its weight, or Gemma's ``1 + w`` as its forward computes it
    (float32); None for no norm."""
    if norm is None:
        return None
    w: torch.Tensor = norm.weight.detach()
    return (1.0 + w.float()).contiguous() if fam.gemma else w


def _linear(mod: Any, k: Any) -> Any:
    """The C++ ``Linear`` that calls ``mod`` as its own forward does."""
    if type(mod) is Int4Linear and int4_dequant.op_available():
        rows = [int4_max_rows(mod.scales_and_zeros.dtype), INT4_GEMV_MAX_ROWS]
        sizes = [mod.group_size, mod.in_features, mod.out_features]
        return k.Linear(k.INT4, [mod.packed, mod.scales_and_zeros, mod.bias], sizes + rows)
    if type(mod) is Q8Linear and (mod.packed is not None or q8_linear.kernel() is not None):
        tensors = [mod.q, mod.scale, mod.packed, mod.bias, mod.offset]
        return k.Linear(k.Q8, tensors, [q8_linear.MAX_ROWS, int(mod.logits)])
    if type(mod) is nn.Linear:
        return k.Linear(k.DENSE, [mod.weight, mod.bias], [])
    return k.Linear(k.MODULE, [], [], mod)


def _siblings(parent: Any, names: tuple[str, ...], k: Any) -> list[Any]:
    """The calls that compute ``names`` in this order: one per fused group of consecutive
    members (:mod:`asyncllm.layers.sibling_linears`), one per other member."""
    mods = [getattr(parent, n) for n in names]
    calls, i = [], 0
    while i < len(mods):
        m = mods[i]
        if not isinstance(m, SiblingLinear):
            calls.append(_linear(m, k))
            i += 1
            continue
        group: Any = getattr(m, "group", None)
        size = len(group.bounds)
        run = mods[i : i + size]
        members = [isinstance(r, SiblingLinear) and r.group is group for r in run]
        if len(run) < size or not all(members) or [r.index for r in run] != list(range(size)):
            raise ValueError(f"{names} are fused in another grouping")
        calls.append(_linear(m.fused, k))
        i += size
    return calls


def _window(model: Any, attn: Any) -> int:
    if type(model).__name__ == "MistralForCausalLM":
        return int(getattr(model.config, "sliding_window", None) or 0)
    return int(getattr(attn, "sliding_window", None) or 0)


def _rope_kinds(model: Any, fam: Family) -> list[str | None]:
    """The rotary embeddings a step computes: one (None), or Gemma's one per layer type."""
    return sorted(set(model.config.layer_types)) if fam.gemma else [None]


class NativeForward:
    """A model's steps through ``csrc/decoder_layer.cpp``.

    Args:
        model: a model :func:`unsupported_reason` accepts, after the runner's layer swaps
            (fused siblings, quantized and packed linears).
        kernels: the ``decoder`` kernel module.
    """

    def __init__(self, model: Any, kernels: Any) -> None:
        k = kernels
        inner = model.model
        config = model.config
        fam = FAMILIES[type(model).__name__]
        self._ropes = _rope_kinds(model, fam)
        layers = []
        for i, lay in enumerate(inner.layers):
            attn, mlp = lay.self_attn, lay.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            gemma = fam.gemma
            layers.append(
                k.Layer(
                    in_norm=_weight(lay.input_layernorm, fam),
                    ffn_norm=_weight(
                        lay.pre_feedforward_layernorm if gemma else lay.post_attention_layernorm,
                        fam,
                    ),
                    attn_out_norm=_weight(lay.post_attention_layernorm, fam) if gemma else None,
                    ffn_out_norm=_weight(lay.post_feedforward_layernorm, fam) if gemma else None,
                    q_norm=_weight(q_norm, fam),
                    k_norm=_weight(k_norm, fam),
                    qkv=_siblings(attn, ("q_proj", "k_proj", "v_proj"), k),
                    o=_linear(attn.o_proj, k),
                    gate_up=_siblings(mlp, ("gate_proj", "up_proj"), k),
                    down=_linear(mlp.down_proj, k),
                    index=int(attn.layer_idx),
                    scale=float(attn.scaling),
                    # No attention soft-cap: these families' modeling code passes none (Gemma
                    # 3 keeps attn_logit_softcapping in its config but never applies it).
                    window=_window(model, attn),
                    rope=self._ropes.index(config.layer_types[i] if gemma else None),
                    act=k.GELU_TANH if gemma else k.SILU,
                )
            )
        head_dim = int(inner.layers[0].self_attn.head_dim)
        self._decoder = k.Decoder(
            layers=layers,
            final_norm=_weight(inner.norm, fam),
            head=_linear(model.lm_head, k),
            eps=_eps(inner.norm, fam),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=head_dim,
        )
        self._embed = model.get_input_embeddings()
        self._rotary = inner.rotary_emb
        #: Steps run (for stats and tests).
        self.steps = 0

    def forward(
        self, input_ids: list[int], positions: list[int], keep: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[len(keep), vocab]`` float32 of the step's rows ``keep`` (int64 indices)
        for its tokens ``input_ids`` at ``positions`` (one each: the plan's chunks side by
        side); inside the runner's ``step_metadata`` (the attention reads its caches and
        plan there)."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        pos = torch.tensor([positions], dtype=torch.long)
        hidden = self._embed(ids)
        ropes = [self._rotary(hidden, pos, *([] if t is None else [t])) for t in self._ropes]
        cos, sin = [c[0] for c, _ in ropes], [s[0] for _, s in ropes]
        logits: torch.Tensor = self._decoder.step(hidden[0], cos, sin, keep)
        self.steps += 1
        return logits


def build(model: nn.Module) -> NativeForward | None:
    """The native forward of ``model``, or None where it does not run (switched off, the
    kernels not installed, or a model :func:`unsupported_reason` refuses; logged at debug)."""
    kernels = native.module("decoder")
    reason = "not installed or switched off" if kernels is None else unsupported_reason(model)
    if reason is not None:
        logger.debug("asyncllm: the modeling code runs the steps: %s", reason)
        return None
    try:
        return NativeForward(model, kernels)
    except ValueError as e:
        logger.debug("asyncllm: the modeling code runs the steps: %s", e)
        return None
