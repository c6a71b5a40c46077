"""The model's forward compiled ahead of time with ``torch.compile`` (Inductor), built off the
engine's path and loaded from disk.

What is compiled: the transformers ``*ForCausalLM`` call of one step (embedding, every
decoder layer, the final norm and the LM head on the kept rows). Paged attention with its
K/V write (``asyncllm::paged_attention``, :mod:`asyncllm.attention.backend_registry`), the
oneDNN-packed linears (``asyncllm::packed_linear``, :mod:`asyncllm.layers.cpu_linear`) and
the int4 linears (``asyncllm::int4_linear``, :mod:`asyncllm.kernels.int4_dequant`) are
opaque ops, so the step's plan objects stay out of the graph and Inductor fuses what lies
between them (RMSNorm, rotary embedding, SiLU-and-multiply, residual adds); the rotary
cos/sin are computed once per step, not inlined into every layer
(:func:`rotary_computed_once`).

Shapes: the flattened token count ``T`` and the kept-row count ``K`` are dynamic (one graph
for every batch composition). Dynamo specializes sizes 0 and 1, so the runner pads both to
at least :data:`MIN_ROWS` (a padded token repeats the last real one, its id and position;
its attention output is a copy of that token's and it writes no K/V; a padded kept row
repeats the last one; both are dropped): a batch-1 decode runs two equal rows, which the
linear kernels compute once, and every step runs the one graph.

How it is built (PyTorch's precompilation, ``torch.compile(...).aot_compile``, saved with
``save_compiled_function`` and read back with ``torch.compiler.load_compiled_function``):
the compiled forward (Dynamo's bytecode, its few guards and Inductor's code) is an
*artifact* file under asyncllm's cache directory (``compiled/``), keyed by the model's
structure (not its weights, which are the graph's inputs), torch, transformers, asyncllm,
the thread count and the CPU (:func:`artifact_path`). An engine that finds its artifact loads
it in seconds and runs compiled from its first steps. Otherwise it serves eagerly while a
child process (:mod:`asyncllm.worker.compile_worker`, at the lowest CPU priority, with one
compiler thread) loads the same model and compiles it (about a minute on 2 cores); the
engine then loads the artifact and switches between two steps. Compiling in another
process keeps Dynamo's tracing (tens of seconds of Python) off the engine's GIL: an
in-process compile stalled the eager steps for its whole length. A model that no child can
load (built in memory, e.g. in tests) is compiled on a background thread instead, into the
same kind of artifact. Any failure leaves the engine eager with one warning.

Inductor keeps its own caches (compiled kernels) under ``TORCHINDUCTOR_CACHE_DIR``; unless
that is set, :func:`inductor_cache_dir` (``~/.cache/asyncllm/inductor``). The artifact names
kernels there: with them present a load is quick, without them (cache deleted) Inductor
compiles the kernels again from the artifact's source. The variable is set only while a
compile or a load (with its dry runs) runs, then restored (:func:`inductor_cache_env`): the
host application's environment is left as asyncllm found it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import logging
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from filelock import FileLock, Timeout

import asyncllm.kernels.ops  # noqa: F401  (asyncllm::materialize)
from asyncllm.attention.backend_registry import step_metadata
from asyncllm.cache_dirs import cache_dir
from asyncllm.kernels import native
from asyncllm.kernels.native import cpu_flags
from asyncllm.layers.quant_linear import load_kernels
from asyncllm.worker.device import trim_host_memory

logger = logging.getLogger("asyncllm")

#: The fewest tokens and kept rows a compiled step runs (Dynamo specializes sizes 0 and 1).
MIN_ROWS = 2

#: The bound given to Dynamo for both (any step is far smaller).
MAX_ROWS = 1 << 20

#: ``torch.compile``'s backend; tests swap it for one that fails.
BACKEND: str | Callable[..., Any] = "inductor"

#: Seconds :meth:`CompiledForward.close` waits for its background thread (loading a cached
#: artifact and its dry runs take a few).
CLOSE_TIMEOUT = 60.0

#: Compiled forwards whose background thread was started: closed at interpreter exit.
_RUNNING: weakref.WeakSet[CompiledForward] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    # atexit runs before finalization starts: a thread joined here ends cleanly.
    for compiled in list(_RUNNING):
        compiled.close(CLOSE_TIMEOUT)


def keep_guard(entries: list[Any]) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: keep only the symbolic-shape guard (the input
    sizes the graph was compiled for: ``T, K >= MIN_ROWS``). Dropped: the guards on the
    model (about 7,000 for a 30-layer Llama: every module's hooks, attributes and
    parameters, a measurable share of a batch-1 step to check: docs/tuning.md, "Compiled
    forward", Guards), on global state, which a saved
    artifact cannot carry, and on the inputs' dtype and device, which the runner fixes. The
    artifact's key (:func:`artifact_key`) stands for them: it names the model's structure,
    and an engine never changes its model."""
    return [not e.is_global and e.guard_type == "SHAPE_ENV" for e in entries]


def forward(
    model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """The function compiled: ``input_ids``, ``position_ids`` [1, T] int64, ``keep`` [K] int64
    -> logits [K, vocab] (attention reads the step's metadata from ``step_metadata``)."""
    out = model(
        input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep
    )
    logits: torch.Tensor = out.logits[0]
    return logits


def _materialize_outputs(
    module: torch.nn.Module, args: Any, out: Any
) -> tuple[torch.Tensor, ...] | Any:
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(torch.ops.asyncllm.materialize(list(out)))
    return out


@contextlib.contextmanager
def rotary_computed_once(model: torch.nn.Module) -> Iterator[None]:
    """While tracing: the outputs of ``model``'s rotary embedding modules (transformers'
    ``rotary_emb``: ``(cos, sin)`` of the step's positions, shared by all layers) go through
    ``asyncllm::materialize`` (:mod:`asyncllm.kernels.ops`), so the compiled forward
    computes them once per step, as eager does, not once per layer. Their values are
    eager's (already in the model's dtype)."""
    handles = [
        m.register_forward_hook(_materialize_outputs)
        for name, m in model.named_modules()
        if name.rpartition(".")[2] == "rotary_emb"
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> pathlib.Path:
    """Where Inductor's on-disk caches go: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``inductor/`` in asyncllm's cache directory (:func:`asyncllm.cache_dirs.cache_dir`)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = _env_saved if _env_users else os.environ.get(_INDUCTOR_ENV)
    if env == default_cache_dir():  # torch writes its default there once it used it
        env = None
    return pathlib.Path(env) if env else cache_dir() / "inductor"


_env_lock = threading.Lock()
_env_users = 0
_env_saved: str | None = None


@contextlib.contextmanager
def inductor_cache_env() -> Iterator[None]:
    """``TORCHINDUCTOR_CACHE_DIR`` is :func:`inductor_cache_dir` inside the block (Inductor
    reads it from the environment only), and what it was before (unset included) once the
    last of any concurrent blocks exits."""
    global _env_users, _env_saved
    with _env_lock:
        if _env_users == 0:
            _env_saved = os.environ.get(_INDUCTOR_ENV)
            os.environ[_INDUCTOR_ENV] = str(inductor_cache_dir())
        _env_users += 1
    try:
        yield
    finally:
        with _env_lock:
            _env_users -= 1
            if _env_users == 0:
                if _env_saved is None:
                    os.environ.pop(_INDUCTOR_ENV, None)
                else:
                    os.environ[_INDUCTOR_ENV] = _env_saved


def _source_digest() -> str:
    """A hash of asyncllm's own Python source (the ops and modeling code a graph calls)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def artifact_key(model: torch.nn.Module, num_threads: int) -> str:
    """What a compiled forward depends on, hashed: the model's structure (module tree, config,
    and every parameter's and buffer's name, shape and dtype; not the weights' values, which
    are the graph's inputs), the thread count (Inductor's kernels fix it), torch,
    transformers, Python, asyncllm's source, the CPU's flags (its kernels are built for
    this CPU) and which C++ kernel variant or torch path each kernel family runs."""
    import transformers

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    parts = [
        repr(model),
        config.to_json_string() if config is not None else "",
        *(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in model.state_dict(keep_vars=True).items()),
        str(num_threads),
        torch.__version__,
        transformers.__version__,
        sys.version,
        _source_digest(),
        " ".join(sorted(cpu_flags())) or platform.processor(),
        # The graph is traced through the paths the kernel switches select: a forward
        # compiled with a kernel on ran it again with that kernel switched off. The C++
        # decoder runs beside the graph, not in it.
        repr(sorted((f, v) for f, v in native.status().items() if f != "decoder")),
    ]
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def artifact_path(model: torch.nn.Module, num_threads: int) -> pathlib.Path:
    """The compiled forward's artifact file for ``model`` run with ``num_threads`` threads."""
    return cache_dir() / "compiled" / f"{artifact_key(model, num_threads)}.bin"


def _example(t: int, k: int, device: torch.device, dynamic: bool) -> tuple[torch.Tensor, ...]:
    ids = torch.zeros((1, t), dtype=torch.long, device=device)
    pos = torch.arange(t, device=device)[None]
    keep = torch.arange(k, device=device)
    if dynamic:
        for x, d in ((ids, 1), (pos, 1), (keep, 0)):
            torch._dynamo.mark_dynamic(x, d, min=MIN_ROWS, max=MAX_ROWS)
    return ids, pos, keep


#: The first line of an artifact file: this, the key (:func:`artifact_key`), a newline.
_HEADER = b"asyncllm-compiled-forward "


def build_artifact(model: torch.nn.Module, path: pathlib.Path, num_threads: int) -> None:
    """Compile :func:`forward` for ``model`` (one graph, dynamic ``T`` and ``K``) and save
    it to ``path`` (written whole or not at all), headed by the model's
    :func:`artifact_key`. Run with ``num_threads`` torch threads (the engine's).

    Raises:
        Exception: whatever Dynamo or Inductor raise (a graph break, a compiler error...).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    if device.type == "cpu":  # the graph takes the kernels there are: all of them
        load_kernels(model)
    # Under inference mode, as the runner's steps (the input guards check it); T != K, so
    # that Dynamo gives them separate symbols. No metadata: a dry run.
    with (
        inductor_cache_env(),
        torch.inference_mode(),
        step_metadata(None),
        rotary_computed_once(model),
    ):
        compiler = torch.compile(
            forward,
            backend=BACKEND,
            fullgraph=True,
            dynamic=False,
            # torch.compile pops guard_filter_fn: a fresh dict. No size/stride asserts in
            # the wrapper: one per input and custom op output, hundreds a step, a share of
            # a decode step (docs/tuning.md, "Compiled forward", No size asserts); the ops
            # and inputs are ours and fixed.
            options={
                "guard_filter_fn": keep_guard,
                "size_asserts": False,
                "alignment_asserts": False,
            },
        )
        example = (model, *_example(3, MIN_ROWS, device, True))
        compiled = compiler.aot_compile((example, {}))  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw, whole = pathlib.Path(tmp, "raw"), pathlib.Path(tmp, "whole")
        compiled.save_compiled_function(str(raw))
        key = artifact_key(model, num_threads).encode()
        whole.write_bytes(_HEADER + key + b"\n" + raw.read_bytes())
        os.replace(whole, path)


def load_artifact(path: pathlib.Path, key: str) -> Callable[..., torch.Tensor]:
    """The compiled forward saved at ``path``: ``(model, input_ids, position_ids, keep) ->
    logits``, checked only on its inputs' shapes (a mismatch raises RuntimeError).

    Raises:
        ValueError: the file is not an artifact of ``key`` (another model's, copied or
            renamed; truncated).
        OSError, RuntimeError, pickle errors: an unreadable or incompatible file.
    """

    data = path.read_bytes()
    head, _, body = data.partition(b"\n")
    if head != _HEADER + key.encode():
        raise ValueError(f"{path} is not the compiled forward of this model (key {key})")
    # The kernels the graph calls, their ops registered.
    load_kernels()
    with inductor_cache_env():
        fn: Callable[..., torch.Tensor] = torch.compiler.load_compiled_function(io.BytesIO(body))
    return fn


@dataclass(frozen=True)
class ModelSource:
    """How a child process loads the engine's model again (:func:`asyncllm.models.loader.
    load_model`'s arguments), to compile it there."""

    model: str
    dtype: str
    quantization: str | None
    quantization_group_size: int


def pad_to(n: int) -> int:
    """The row count a compiled step runs for ``n`` rows (at least :data:`MIN_ROWS`)."""
    return max(n, MIN_ROWS)


class CompiledForward:
    """One model's compiled forward, prepared in the background (loaded, or built then
    loaded).

    Args:
        model: the transformers causal LM (its attention already the paged one).
        device: where the dry runs' inputs live.
        source: how a child process can load the same model (None: compile on a thread).
        build: build the artifact where it is missing or does not load (False: only load
            it; a failed load leaves the engine eager).

    Create it on the engine's compute thread (its torch thread count names the artifact).

    Attributes:
        ready: loaded and warmed up (False before, and after a failure); then calling this
            object runs ``(input_ids [1, T], position_ids [1, T], keep [K]) -> logits
            [K, vocab]``.
        error: why compiling or loading failed, or None.
        compile_seconds: how long it took until ready, once done.
        path: the artifact file.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        source: ModelSource | None = None,
        build: bool = True,
    ) -> None:
        self.model = model
        self.device = device
        self.source = source
        self.build = build
        self.num_threads = torch.get_num_threads()
        self.key = artifact_key(model, self.num_threads)
        self.path = artifact_path(model, self.num_threads)
        self.ready = False
        #: Steps run through the compiled forward.
        self.calls = 0
        self.error: str | None = None
        self.compile_seconds: float | None = None
        self._started = time.monotonic()
        self._fn: Callable[..., torch.Tensor] | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._closed = False
        # Orders close() against the child's start: a child started after close() would
        # compile for a minute for an engine that is gone.
        self._child_lock = threading.Lock()

    def start(self) -> None:
        """Load or build the artifact on a background thread (returns at once); an engine
        never closed has it closed at interpreter exit (see :meth:`close`)."""
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._prepare, name="asyncllm-compile", daemon=True)
        _RUNNING.add(self)
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

    def close(self, timeout: float = 0.0) -> None:
        """Stop a compile still running in a child process, or keep one from starting (the
        engine is closing), and wait up to ``timeout`` seconds for the background thread to
        end (0: return at once; an event loop closing an engine must not wait for an
        artifact's load). A compile not ready by then ends "failed" without a warning, and a
        load that fails after this call leaves the artifact file alone.

        At interpreter exit :func:`_close_at_exit` waits (:data:`CLOSE_TIMEOUT`): a daemon
        thread still loading the artifact (or dropping the model's last reference) while the
        interpreter finalizes is killed inside torch's C++ and aborts the process
        ("terminate called without an active exception").
        """
        with self._child_lock:
            self._closed = True
            child = self._child
        if child is not None and child.poll() is None:
            child.kill()
        thread = self._thread
        if timeout > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("asyncllm: the compile thread is still running after close()")

    def _prepare(self) -> None:
        try:
            if self.path.is_file():
                try:
                    fn = self._load()
                except Exception as e:  # truncated, another torch's, not this model's...
                    # Closing (imports fail at exit: nothing wrong with the file), or
                    # load-only (fail() gives the one warning).
                    if self._closed or not self.build:
                        raise
                    logger.warning(
                        "asyncllm: compiled forward %s does not load (%s: %s); compiling it again",
                        self.path,
                        type(e).__name__,
                        " ".join(str(e).split())[:200],
                    )
                    self.path.unlink(missing_ok=True)
            if not self.path.is_file():
                if not self.build:
                    raise RuntimeError(f"no compiled forward at {self.path}")
                self._build_once()
                fn = self._load()
        except Exception as e:
            if self._closed:  # killed by close(): no warning, but done (wait() returns)
                self.error = "closed before the compiled forward was ready"
                self.compile_seconds = time.monotonic() - self._started
                self._done.set()
            else:
                self.fail(e)
            return
        self._fn = fn
        trim_host_memory()  # what loading (or compiling) the artifact freed
        self.compile_seconds = time.monotonic() - self._started
        self.ready = True
        logger.info("asyncllm: compiled forward ready after %.1f s", self.compile_seconds)
        self._done.set()

    def _build_once(self) -> None:
        """:meth:`_build` under a machine-wide lock: one compile at a time on this machine
        (engines starting together would each start a compile process for the same
        artifact); the others wait for it, serving eagerly, and then load its artifact."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path.parent / "compile.lock"))
        while True:
            try:
                lock.acquire(timeout=0.5)
                break
            except Timeout:
                if self._closed:
                    raise RuntimeError("closed while another compile ran") from None
        try:
            if not self.path.is_file():
                self._build()
        finally:
            lock.release()

    def _build(self) -> None:
        logger.info(
            "asyncllm: compiling the model forward in the background (%s; artifact %s); "
            "serving eagerly until it is ready",
            "child process" if self.source is not None else "thread",
            self.path,
        )
        if self.source is not None:
            self._build_in_child(self.source)
        else:
            build_artifact(self.model, self.path, self.num_threads)

    def _load(self) -> Callable[..., torch.Tensor]:
        """The artifact loaded and run once (dry runs of two shapes)."""
        with inductor_cache_env():  # kernels Inductor loads at their first call
            fn = load_artifact(self.path, self.key)
            with torch.inference_mode(), step_metadata(None):
                for t, k in ((MIN_ROWS, MIN_ROWS), (5, 4)):
                    fn(self.model, *_example(t, k, self.device, False))
        return fn

    def _build_in_child(self, source: ModelSource) -> None:
        env = {**os.environ, _INDUCTOR_ENV: str(inductor_cache_dir())}
        args = [sys.executable, "-m", "asyncllm.worker.compile_worker"]
        spec = json.dumps({**asdict(source), "num_threads": self.num_threads})
        with self._child_lock:
            if self._closed:
                raise RuntimeError("the engine closed before its compile process started")
            child = self._child = subprocess.Popen(
                [*args, spec, str(self.path)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        _, err = child.communicate()
        if child.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"the compile process exited with status {child.returncode}: "
                f"{lines[-1] if lines else 'no message'}"
            )

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Run the compiled forward (padded inputs, ``step_metadata`` set by the caller)."""
        if self._fn is None:
            raise RuntimeError("the compiled forward is not ready")
        self.calls += 1
        return self._fn(self.model, input_ids, position_ids, keep)
