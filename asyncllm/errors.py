"""Typed errors raised by asyncllm.

Errors caused by what a caller sends subclass ``ValueError`` so that callers can catch bad
input uniformly; they are raised before a request reaches the engine loop.
"""


class AsyncLLMError(Exception):
    """Base class of every error asyncllm raises on purpose."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """A request is malformed (empty prompt, prompt longer than max_model_len, bad params)."""


class ModelNotFoundError(AsyncLLMError, ValueError):
    """The model source does not exist or lacks required files; the message names the path."""


class UnsupportedModelError(AsyncLLMError, ValueError):
    """The model cannot be served exactly: its config needs an attention feature the paged
    attention lacks, its transformers class computes attention in its own code (not through
    transformers' attention interface), or its modeling code does not run on the paged KV
    cache as the load-time check found (:mod:`asyncllm.worker.paged_check`: its attention
    bypasses the cache, its first step raises, or its logits differ from its own eager
    forward's)."""


class ModelLoadError(AsyncLLMError, ValueError):
    """The model files exist but cannot be read (corrupt or truncated file), or hold weights
    that are not finite numbers (inf/NaN: a GGUF block scale, or a weight that makes the
    logits non-finite); the message names the file, tensor or module."""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """The engine loop failed; ``__cause__`` holds the original exception."""


class EngineNotRunningError(AsyncLLMError, RuntimeError):
    """A request was sent to an engine that is not started (use ``async with engine``)."""


class QueueFull(AsyncLLMError, RuntimeError):
    """The waiting queue holds ``EngineConfig.max_waiting`` requests (parallel samples count
    one each); try again later (the server answers 429). Raised when the request is
    submitted. A call with more samples than ``max_waiting`` alone raises
    ``InvalidRequestError`` instead (400): it is never taken."""
