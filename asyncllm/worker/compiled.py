"""The model's forward compiled with ``torch.compile`` (Inductor), built in the background.

What is compiled: the transformers ``*ForCausalLM`` call of one step (embedding, every
decoder layer, the final norm and the LM head on the kept rows). Paged attention with its
K/V write (``asyncllm::paged_attention``, :mod:`asyncllm.attention.backend_registry`) and the
oneDNN-packed linears (``asyncllm::packed_linear``, :mod:`asyncllm.worker.cpu_linear`) are
custom ops, opaque to Dynamo, so the step's plan objects stay out of the graph and Inductor
fuses what lies between them (RMSNorm, rotary embedding, SiLU-and-multiply, residual adds).
Other modules (plain ``nn.Linear``, quantized linears calling aten ops) are traced as they
are.

Shapes: the flattened token count ``T`` and the kept-row count ``K`` are dynamic (one graph
for every batch composition). Dynamo specializes sizes 0 and 1, so the runner pads both to
at least :data:`MIN_ROWS` (a padded token writes no K/V and attends to nothing; a padded kept
row is dropped): a batch-1 decode computes two rows, which costs next to nothing in its
weight-bandwidth-bound matmuls, and every step runs the one graph.

Cold start: :meth:`CompiledForward.start` compiles on a background thread, driving the
compiled function with dry runs (no cache is touched) while the engine keeps serving
eagerly; the runner switches between two steps, once :attr:`CompiledForward.fn` is set.
The background thread's Python competes with the compute thread for the GIL and the cores
while it runs, so eager steps are slower until it ends (one log line when it starts, one
when it ends). Any failure leaves the engine eager with one warning.

Inductor keeps its caches (generated code, compiled kernels, FX graphs) on disk under
``TORCHINDUCTOR_CACHE_DIR``; unless that is set, :func:`inductor_cache_dir` (asyncllm's
cache directory, ``~/.cache/asyncllm/inductor``). A later process with the same model,
torch and asyncllm loads the compiled code from there instead of compiling it again (Dynamo
still traces the model: seconds).
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
import types
from collections.abc import Callable
from typing import Any, Literal

import torch

from asyncllm.attention.backend_registry import step_metadata

logger = logging.getLogger("asyncllm")

#: The fewest tokens and kept rows a compiled step runs (Dynamo specializes sizes 0 and 1).
MIN_ROWS = 2

#: The bound given to Dynamo for both (any step is far smaller).
MAX_ROWS = 1 << 20

#: ``torch.compile``'s backend; tests swap it for one that fails.
BACKEND: str | Callable[..., Any] = "inductor"


def inductor_cache_dir() -> pathlib.Path:
    """Where Inductor's on-disk caches go: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``inductor/`` in asyncllm's cache directory (:func:`asyncllm.models.loader.cache_dir`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from asyncllm.models.loader import cache_dir

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env == default_cache_dir():  # torch writes its default there once it used it
        env = None
    return pathlib.Path(env) if env else cache_dir() / "inductor"


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of the plain function ``fn`` with a code object of its own.

    Dynamo keeps the variants it compiled for a function on that function's code object, at
    most ``torch._dynamo.config.recompile_limit`` (8) of them; past that it runs the function
    eagerly, silently. Every engine compiles its own model (its guards name that model), so
    with one shared code object a process's ninth compiled engine would run eagerly: each
    :class:`CompiledForward` compiles its own copy instead.
    """
    code = fn.__code__.replace()  # equal, but another object: another Dynamo cache
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def pad_to(n: int) -> int:
    """The row count a compiled step runs for ``n`` rows (at least :data:`MIN_ROWS`)."""
    return max(n, MIN_ROWS)


class CompiledForward:
    """One model's compiled forward, compiled on a background thread.

    Args:
        model: the transformers causal LM (its attention already the paged one).
        device: where the dry runs' inputs live.

    Attributes:
        ready: compiled and warmed up (False before, and after a failure); then calling
            this object runs ``(input_ids [1, T], position_ids [1, T], keep [K]) -> logits
            [K, vocab]``.
        error: why compiling failed, or None.
        compile_seconds: how long compiling took, once done.
        state: "compiling", "ready" or "failed" (:attr:`state`).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.ready = False
        #: Steps run through the compiled forward.
        self.calls = 0
        self.error: str | None = None
        self.compile_seconds: float | None = None
        self._started = time.monotonic()
        self._fn: Callable[..., torch.Tensor] = self._forward
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def start(self) -> None:
        """Compile on a background thread (returns at once)."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
        self._started = time.monotonic()
        logger.info(
            "asyncllm: compiling the model forward in the background (torch.compile, cache "
            "%s); serving eagerly until it is ready",
            inductor_cache_dir(),
        )
        self._thread = threading.Thread(target=self._compile, name="asyncllm-compile", daemon=True)
        self._thread.start()

    @property
    def state(self) -> Literal["compiling", "ready", "failed"]:
        """Where compiling stands: "compiling" (eager steps meanwhile), "ready" (steps run
        the compiled forward) or "failed" (eager for good; :attr:`error` says why)."""
        if self.ready:
            return "ready"
        return "failed" if self.error is not None else "compiling"

    @property
    def seconds(self) -> float:
        """Seconds compiling took (ready or failed), or has taken so far."""
        if self.compile_seconds is not None:
            return self.compile_seconds
        return time.monotonic() - self._started

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compiling ended (ready or failed); False on timeout."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        """Compiling ended, ready or failed."""
        return self._done.is_set()

    def fail(self, error: BaseException) -> None:
        """Drop the compiled forward for good (eager from now on), with one warning."""
        self.ready = False
        if self.compile_seconds is None:
            self.compile_seconds = time.monotonic() - self._started
        self.error = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        logger.warning("asyncllm: compiled forward failed, serving eagerly (%s)", self.error)
        self._done.set()

    def _compile(self) -> None:
        try:
            forward = types.MethodType(own_code(CompiledForward._forward), self)
            fn = torch.compile(forward, backend=BACKEND, dynamic=False)
            dev = self.device
            # Dry runs (no metadata: attention writes nothing): T != K at the first call, so
            # that Dynamo gives them separate symbols; then the shapes the engine meets.
            # Inputs made under inference mode, as the runner's are (Dynamo guards on it).
            self._fn = fn
            for t, k in ((3, MIN_ROWS), (MIN_ROWS, MIN_ROWS), (5, 4), (7, 5)):
                with torch.inference_mode(), step_metadata(None):
                    ids = torch.zeros((1, t), dtype=torch.long, device=dev)
                    self(ids, torch.arange(t, device=dev)[None], torch.arange(k, device=dev))
        except Exception as e:
            self.fail(e)
            return
        self.compile_seconds = time.monotonic() - self._started
        self.ready = True
        logger.info("asyncllm: compiled forward ready after %.1f s", self.compile_seconds)
        self._done.set()

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Run the compiled forward (padded inputs, ``step_metadata`` set by the caller)."""
        for x, d in ((input_ids, 1), (position_ids, 1), (keep, 0)):
            torch._dynamo.mark_dynamic(x, d, min=MIN_ROWS, max=MAX_ROWS)
        self.calls += 1
        return self._fn(input_ids, position_ids, keep)
