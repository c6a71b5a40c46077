"""asyncllm: an async streaming LLM inference SDK with a paged KV cache and continuous batching."""

from asyncllm.config import EngineConfig
from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.errors import (
    AsyncLLMError,
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "AsyncLLMError",
    "EngineConfig",
    "EngineDeadError",
    "EngineNotRunningError",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
