"""Sibling linears (a layer's q/k/v projections, its MLP's gate/up) run as one fused call.

transformers' modeling code calls ``q_proj``, ``k_proj`` and ``v_proj`` one after another on
the same hidden states, and ``gate_proj`` and ``up_proj`` likewise: 7 linear calls per
decoder layer where 4 would do. At a decode batch of 1 on CPU each call costs its weight
reads plus a fixed part (an OpenMP region, the op's own steps) that dominates the small
``k_proj``/``v_proj`` (192 x 576 in the default model). :func:`fuse_siblings` replaces each
such group by one linear over the concatenated weights (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do the same in its own model code) while transformers' code
stays as it is: each sibling becomes a :class:`SiblingLinear` that returns its columns of
the fused output, computed once per input.

``python benchmarks/sibling_linears.py`` measures it: the fused calls are the faster, at
batch 1 most (docs/tuning.md, "CPU fast paths", q/k/v and gate/up as one call each).

Fused: ``nn.Linear`` (before :func:`~asyncllm.layers.cpu_linear.pack_linears` packs the
fused layer for oneDNN), :class:`~asyncllm.layers.quant_linear.Int4Linear` and
:class:`~asyncllm.layers.q8_linear.Q8Linear` (GGUF's Q8_0, Q5_0, Q6_K, Q5_K codes) layers,
all of one type, whose input width, dtype, device (and group size) agree, with a bias on all
of them or none, no weight shared with another module, and (int4) every part a multiple of
64 rows (the packed layout's row block).
"""

from __future__ import annotations

import typing

import torch
from torch import nn

from asyncllm import envs
from asyncllm.layers.q8_linear import Q8Linear
from asyncllm.layers.quant_linear import Int4Linear

__all__ = ["ENV_SWITCH", "SIBLING_NAMES", "SiblingLinear", "fuse_siblings"]

#: ``ASYNCLLM_FUSED_SIBLINGS=0`` leaves the siblings as they are (for A/B measurements).
ENV_SWITCH = "ASYNCLLM_FUSED_SIBLINGS"

#: Child names that a decoder's modules call in this order on one input (transformers'
#: Llama, Mistral, Qwen2/3, Gemma, Phi-3 (already fused there), OLMo, ... naming).
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The fused output of one input, kept until each sibling has taken its columns."""

    def __init__(self, leader: SiblingLinear, bounds: list[tuple[int, int]]) -> None:
        self.leader, self.bounds = leader, bounds
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.left = 0

    def columns(self, i: int, x: torch.Tensor) -> torch.Tensor:
        # Identity, not values: the siblings are called on the same tensor object. Another
        # input (a model that calls them on different tensors) gets its own fused call.
        if x is not self.x:
            self.x, self.y, self.left = x, self.leader.fused(x), len(self.bounds)
        y = self.y
        assert y is not None
        self.left -= 1
        if self.left == 0:  # every sibling served: hold no activation past the layer
            self.x = self.y = None
        start, end = self.bounds[i]
        return y[..., start:end]


class SiblingLinear(nn.Module):
    """One of a group of linears that run as one fused call (see the module docstring).

    ``forward(x [..., in_features]) -> [..., out_features]``, the same values as the linear
    it replaced (its rows of the fused weight; a fused GEMM may sum in another order).
    The group's first member holds the fused layer as its child ``fused``.
    """

    fused: nn.Module

    def __init__(self, group: _Group | None, index: int, in_features: int, out_features: int):
        super().__init__()
        self.index, self.in_features, self.out_features = index, in_features, out_features
        # Not a child: the fused layer is registered once, on the leader.
        object.__setattr__(self, "group", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group: _Group = self.group  # type: ignore[assignment]
        return group.columns(self.index, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"columns of a fused call ({self.index})"
        )


_Part = nn.Linear | Int4Linear | Q8Linear
#: The layer types a group may be made of (all its members of one type).
_FUSABLE = (nn.Linear, Int4Linear, Q8Linear)


def _fused(parts: list[_Part]) -> nn.Module | None:
    """One layer computing ``parts``' outputs side by side, or None where they cannot be."""
    if all(type(p) is nn.Linear for p in parts):
        lins: list[nn.Linear] = parts  # type: ignore[assignment]
        w = [p.weight for p in lins]
        if len({(t.shape[1], t.dtype, t.device) for t in w}) != 1:
            return None
        biases = [p.bias for p in lins]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None
        fused = nn.Linear(w[0].shape[1], sum(t.shape[0] for t in w), biases[0] is not None)
        with torch.no_grad():
            fused.weight = nn.Parameter(torch.cat([t.detach() for t in w]), requires_grad=False)
            if biases[0] is not None:
                b = torch.cat([t.detach() for t in biases if t is not None])
                fused.bias = nn.Parameter(b, requires_grad=False)
        return fused
    if all(type(p) is Int4Linear for p in parts):
        int4: list[Int4Linear] = parts  # type: ignore[assignment]
        return Int4Linear.concat(int4)
    if all(type(p) is Q8Linear for p in parts):
        q8: list[Q8Linear] = parts  # type: ignore[assignment]
        return Q8Linear.concat(q8)
    return None


def _shared(parts: list[_Part], model: nn.Module) -> bool:
    """Some part's tensor is also held by a module outside the group (tied weights)."""
    mine = {id(t) for p in parts for t in (*p.parameters(), *p.buffers())}
    for m in model.modules():
        if any(m is p for p in parts):
            continue
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            if id(t) in mine:
                return True
    return False


def fuse_siblings(model: nn.Module) -> int:
    """Replace each group of :data:`SIBLING_NAMES` children of one module by
    :class:`SiblingLinear` members over one fused layer, in place; returns the number of
    groups fused. Where a whole group cannot be fused (see the module docstring), its
    longest runs of consecutive members that can are (Gemma 3's q/k as 5-bit codes, its v
    as int8 codes: q/k one call, v another). Idempotent (fused groups are no longer plain
    linears); none with ``ASYNCLLM_FUSED_SIBLINGS=0``."""
    if not envs.switch(ENV_SWITCH):
        return 0
    n = 0
    for parent in list(model.modules()):
        for names in SIBLING_NAMES:
            i = 0
            while i < len(names) - 1:
                end = next(
                    (j for j in range(len(names), i + 1, -1) if _fuse(parent, names[i:j], model)),
                    i + 1,
                )
                n += end - i > 1
                i = end
    return n


def _fuse(parent: nn.Module, names: tuple[str, ...], model: nn.Module) -> bool:
    """Fuse ``parent``'s children ``names`` into one group if they can be; whether they were."""
    mods = [getattr(parent, name, None) for name in names]
    if any(type(m) not in _FUSABLE for m in mods):
        return False
    parts = typing.cast(list[_Part], mods)
    fused = _fused(parts)
    if fused is None or _shared(parts, model):
        return False
    outs = [p.out_features for p in parts]
    starts = [sum(outs[:i]) for i in range(len(outs))]
    bounds = [(s, s + o) for s, o in zip(starts, outs, strict=True)]
    ins = parts[0].in_features
    leader = SiblingLinear(None, 0, ins, outs[0])
    leader.fused = fused
    group = _Group(leader, bounds)
    for i, name in enumerate(names):
        member = leader if i == 0 else SiblingLinear(group, i, ins, outs[i])
        object.__setattr__(member, "group", group)
        setattr(parent, name, member)
    return True
