"""asyncllm: an async streaming LLM inference SDK with a paged KV cache and continuous batching."""

from asyncllm.config import EngineConfig
from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.engine.streams import RequestStream
from asyncllm.errors import (
    AsyncLLMError,
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    QueueFull,
    UnsupportedModelError,
)
from asyncllm.llm import LLM
from asyncllm.outputs import Logprob, RequestMetrics, RequestOutput, ToolCall, ToolCallDelta
from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "AsyncLLMError",
    "EngineConfig",
    "EngineDeadError",
    "EngineNotRunningError",
    "InvalidRequestError",
    "Logprob",
    "ModelLoadError",
    "ModelNotFoundError",
    "QueueFull",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputsParams",
    "ToolCall",
    "ToolCallDelta",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
