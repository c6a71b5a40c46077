"""Per-request sampling parameters.

Defaults follow vLLM's ``SamplingParams``. Every field is checked on construction; an
invalid value raises :class:`~asyncllm.errors.InvalidRequestError` (a ``ValueError``) whose
message names the field and the allowed range.
"""

from __future__ import annotations

import msgspec

from asyncllm.errors import InvalidRequestError


def _int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequestError(f"{name} must be {rng}, got {value}")


def _float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not (v > lo if lo_open else v >= lo) or v > hi:
        left = "(" if lo_open else "["
        raise InvalidRequestError(f"{name} must be in {left}{lo}, {hi}], got {value}")


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one request's tokens.

    Attributes:
        max_tokens: the most tokens to generate (>= 1).
        temperature: logits are divided by it before sampling; 0 means greedy (argmax).
            Range [0, 100].
        top_k: keep only the k most likely tokens (0 = all). Range >= 0.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (nucleus sampling, Holtzman et al., 2020). Range (0, 1].
        seed: makes the request's samples reproducible whatever else shares its batches
            (see :mod:`asyncllm.worker.sampler` for how per-token seeds are derived).
        ignore_eos: keep generating past the model's EOS tokens until max_tokens.

    Raises:
        InvalidRequestError: a field outside its range or of the wrong type.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        _float("temperature", self.temperature, 0.0, 100.0)
        _int("top_k", self.top_k, 0)
        _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.seed is not None:
            _int("seed", self.seed, 0, 2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1
