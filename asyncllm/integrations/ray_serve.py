"""Replicas of an :class:`~asyncllm.AsyncEngine` on Ray Serve, with prefix-cache-aware routing.

Install the ``ray`` extra (``pip install 'asyncllm[ray]'``; tested with Ray
:data:`TESTED_RAY_VERSION`). docs/scaling.md tells how to run it on a multi-node cluster and
how to size replicas.

Pieces:

- :class:`LLMServer`: a Serve deployment class owning one engine per replica (the model is
  loaded once per replica, in its constructor; the engine is stopped when the replica shuts
  down; Serve's health check calls :meth:`AsyncEngine.health`). Python callers stream
  through a ``DeploymentHandle``::

      handle = serve.run(build_llm_deployment("default", num_replicas=2).bind())
      async for out in handle.options(stream=True).stream.remote("Hello", params):
          print(out.text, end="")

  ``stream`` and ``chat`` take the arguments of :meth:`AsyncEngine.stream` and
  :meth:`AsyncEngine.chat`. Cancelling the response (``response.cancel()``, or the caller's
  task) cancels the replica's generator, which aborts the request and frees its KV blocks.
- :class:`OpenAIIngress`: the OpenAI-compatible routes of ``python -m asyncllm serve`` on
  Serve's HTTP proxy: :func:`asyncllm.server.create_app` over an :class:`EngineClient`, which
  forwards each generation to the :class:`LLMServer` replicas through a handle. A client that
  disconnects cancels its handle responses (the replica aborts the request); ``QueueFull``
  from a replica, and Serve's own ``BackPressureError`` (``max_queued_requests``), answer
  429; a replica that dies mid-stream ends the stream with the server's 503 error event.
- :class:`~asyncllm.integrations.ray_router.PrefixCacheRouter` (in
  :mod:`asyncllm.integrations.ray_router`, re-exported here): a Serve ``RequestRouter``
  that sends a request to the replica most likely to hold its prompt's prefix in its KV
  cache (see its docstring for the policy and the load guard).
- :func:`build_app` (both deployments), :func:`cli_app` and :func:`main` (``python -m
  asyncllm serve --replicas N``).

Errors a replica raises reach callers as Ray wraps them (``ray.exceptions.RayTaskError``,
an instance of the original class too); :class:`EngineClient` re-raises the original
(``QueueFull``, ``InvalidRequestError``...), and a replica's death as
:class:`~asyncllm.errors.EngineDeadError`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from ray import serve

from asyncllm.config import EngineConfig
from asyncllm.core.speculation import Speculation
from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.errors import EngineDeadError, QueueFull
from asyncllm.integrations.ray_router import (
    DEFAULT_IMBALANCE_THRESHOLD,
    DEFAULT_MAX_PREFIX_BLOCKS,
    DEFAULT_RECORD_BLOCKS,
    PrefixAffinity,
    PrefixCacheRouter,
    load_tokenizer,
    router_config,
    routing_token_ids,
)
from asyncllm.outputs import RequestOutput

__all__ = [
    "CLI_APP_NAME", "DEFAULT_IMBALANCE_THRESHOLD", "DEFAULT_MAX_PREFIX_BLOCKS",
    "DEFAULT_RECORD_BLOCKS", "TESTED_RAY_VERSION", "EngineClient", "LLMServer", "OpenAIIngress",
    "PrefixAffinity", "PrefixCacheRouter", "build_app", "build_llm_deployment", "cli_app",
    "load_tokenizer", "main", "router_config", "routing_token_ids",
]  # fmt: skip

logger = logging.getLogger("asyncllm.ray_serve")

#: The Ray version the ``ray`` extra pins and the tests run against.
TESTED_RAY_VERSION = "2.60.0"

# --------------------------------------------------------------------------- the replicas


class LLMServer:
    """A Serve deployment class: one :class:`AsyncEngine` per replica.

    Make it a deployment with :func:`build_llm_deployment` (its options, the router), or
    ``serve.deployment(LLMServer)`` with your own.

    Args:
        model: "default", a Hugging Face directory or a .gguf file, loaded once per replica.
        engine_config: other :class:`~asyncllm.EngineConfig` fields (``num_threads``: torch
            threads per replica; ``max_waiting``: past it a call raises ``QueueFull``).

    Raises:
        ValueError: a bad model or engine setting (the replica fails to start).
    """

    async def __init__(self, model: str = "default", engine_config: dict[str, Any] | None = None):
        from asyncllm.server.cli import freeze_loaded_objects

        self.engine = AsyncEngine.from_pretrained(model, **(engine_config or {}))
        freeze_loaded_objects()  # the replica's process serves this engine until it ends
        # The engine is entered and left by one task (its task group's rule): this one,
        # which holds it until __del__ sets _stop.
        self._stop = asyncio.Event()
        entered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._serving = asyncio.create_task(self._serve(entered))
        await entered
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._served: collections.deque[str] = collections.deque(maxlen=4096)

    async def _serve(self, entered: asyncio.Future[None]) -> None:
        try:
            async with self.engine:
                entered.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not entered.done():
                entered.set_exception(exc)  # the replica fails to start
            raise

    async def stream(
        self, prompt: Any, params: Any = None, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`AsyncEngine.stream` on this replica's engine (same arguments)."""
        self._served.append(str(kwargs.get("request_id")))
        async for out in self.engine.stream(prompt, params, **kwargs):
            yield out

    async def chat(
        self, messages: Any, params: Any = None, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`AsyncEngine.chat` on this replica's engine (same arguments)."""
        self._served.append(str(kwargs.get("request_id")))
        async for out in self.engine.chat(messages, params, **kwargs):
            yield out

    async def decode(self, token_ids: Sequence[int]) -> str:
        """:meth:`AsyncEngine.decode`."""
        return await self.engine.decode(token_ids)

    def info(self) -> dict[str, Any]:
        """What the ingress needs of the engine: ``max_model_len``, ``block_size``."""
        engine = self.engine
        return {"max_model_len": engine.max_model_len, "block_size": engine.config.block_size}

    def stats(self, replica: int | None = None, served: bool = True) -> dict[str, Any]:
        """This replica's :meth:`AsyncEngine.stats`, its ``replica_id`` and (unless
        ``served`` is False) ``served``: the request ids of its recent ``stream``/``chat``
        calls (the last 4096). Pass ``replica=k`` to read the k-th replica with
        :class:`PrefixCacheRouter`."""
        stats: dict[str, Any] = {**self.engine.stats(), "replica_id": self.replica_id}
        if served:
            stats["served"] = list(self._served)
        return stats

    async def reset_prefix_cache(self, replica: int | None = None) -> int:
        """:meth:`AsyncEngine.reset_prefix_cache` (``replica`` as in :meth:`stats`)."""
        return await self.engine.reset_prefix_cache()

    def check_health(self) -> None:
        """Serve's health check: raises unless the engine is running.

        Raises:
            EngineDeadError: the engine's step loop failed.
            RuntimeError: the engine is stopped.
        """
        if self.engine.health() != "running":
            raise RuntimeError("the engine is not running")

    async def __del__(self) -> None:
        # Serve calls (and awaits) this when the replica shuts down.
        self._stop.set()
        await self._serving


def build_llm_deployment(
    model: str = "default",
    *,
    num_replicas: int = 1,
    engine_config: dict[str, Any] | None = None,
    router: str = "prefix",
    router_kwargs: dict[str, Any] | None = None,
    max_ongoing_requests: int = 64,
    max_queued_requests: int = -1,
    ray_actor_options: dict[str, Any] | None = None,
    name: str = "LLMServer",
) -> Any:
    """The :class:`LLMServer` deployment (call ``.bind()`` on it, or use :func:`build_app`).

    Args:
        model: the model each replica loads.
        num_replicas: replicas (each its own process, model and KV cache).
        engine_config: :class:`~asyncllm.EngineConfig` fields for each replica.
        router: "prefix" (:class:`PrefixCacheRouter`) or "default" (Serve's own).
        router_kwargs: :class:`PrefixCacheRouter` keywords (``imbalance_threshold``...).
        max_ongoing_requests: Serve's cap of requests sent to one replica at once (then
            the router tries the next ranked replica, then waits).
        max_queued_requests: requests a caller's handle queues while every replica is at
            ``max_ongoing_requests``; past it Serve raises ``BackPressureError`` (HTTP:
            429). -1: no limit.
        ray_actor_options: per replica, e.g. ``{"num_cpus": 1, "num_gpus": 1}``.
        name: the deployment's name.

    Raises:
        ValueError: a bad ``router``, or an engine setting :class:`EngineConfig` refuses.
    """
    cfg = EngineConfig(model=model, **(engine_config or {}))
    routing = router_config(model, cfg.block_size, router, **(router_kwargs or {}))
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": num_replicas,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "ray_actor_options": ray_actor_options or {"num_cpus": 1},
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
    }
    if routing is not None:
        options["request_router_config"] = routing
    return serve.deployment(LLMServer).options(**options)


# --------------------------------------------------------------------------- the HTTP ingress


def _unwrap(exc: BaseException) -> BaseException:
    """The exception a caller should see for a handle call's failure."""
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        return QueueFull(f"every replica is busy and the queue is full: {exc}")
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException):
            return cause
    if isinstance(
        exc,
        (
            ray.exceptions.RayActorError,
            ray.exceptions.ActorUnavailableError,
            ray.exceptions.WorkerCrashedError,
        ),
    ):
        err = EngineDeadError("the replica serving this request died")
        err.__cause__ = exc
        return err
    return exc


#: What ``EngineClient.stats()`` answers before the first :meth:`EngineClient.refresh_stats`:
#: every counter the server's metrics read, at zero.
NO_STATS: dict[str, Any] = {
    "num_running": 0, "num_waiting": 0, "num_free_blocks": 0, "num_total_blocks": 0,
    "kv_cache_usage": 0.0, "num_preemptions": 0, "num_swapped_out_blocks": 0,
    "num_swapped_in_blocks": 0, "swap_bytes": 0, "num_recomputed_tokens": 0,
    "num_free_cpu_blocks": 0, "num_total_cpu_blocks": 0, "prefix_cache_queries": 0,
    "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "num_steps": 0,
    "prefix_cache_device_hits": 0, "prefix_cache_host_hits": 0,
    "num_host_cache_blocks": 0, "num_total_host_cache_blocks": 0,
    "num_generated_tokens": 0, "compile": {}, **Speculation.off_stats(),
}  # fmt: skip


class EngineClient:
    """The part of :class:`AsyncEngine` that :mod:`asyncllm.server` uses, over a handle to
    :class:`LLMServer` replicas: the OpenAI server runs unchanged in front of many replicas.

    ``stream``/``chat``/``decode`` are forwarded (closing a stream early cancels the handle
    response, which aborts the request on its replica); errors are re-raised as the
    replica raised them (:func:`_unwrap`: ``QueueFull``, ``InvalidRequestError``; a dead
    replica as ``EngineDeadError``). ``stats`` are those last read by :meth:`refresh_stats`
    (zeros before), which the server's ``/metrics`` route calls on each scrape.

    Args:
        handle: a ``DeploymentHandle`` to the :class:`LLMServer` deployment.
        model: its model (for the tokenizer and the served name).
        max_model_len: the replicas' ``max_model_len``.
        num_replicas: the deployment's replicas (the ones :meth:`refresh_stats` reads).
    """

    #: Seconds :meth:`refresh_stats` waits for the replicas before it keeps the last stats.
    STATS_TIMEOUT_S = 5.0

    def __init__(self, handle: Any, model: str, max_model_len: int, num_replicas: int = 1) -> None:
        self._handle = handle
        self.num_replicas = num_replicas
        self.tokenizer = load_tokenizer(model)
        self.config = EngineConfig(model=model)
        self.max_model_len = max_model_len
        self._stats: dict[str, int | float] = {}
        self._dead = False

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def health(self) -> str:
        """ "running": the replicas' health is Serve's to check (it replaces failed ones)."""
        return "running"

    async def _forward(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        gen = getattr(self._handle.options(stream=True), method).remote(*args, **kwargs)
        try:
            async for out in gen:
                yield out
        except Exception as e:
            raise _unwrap(e) from e
        finally:
            gen.cancel()  # a no-op once finished; else aborts the request on its replica

    def stream(
        self, prompt: Any, params: Any = None, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`AsyncEngine.stream` on a replica."""
        return self._forward("stream", prompt, params, **kwargs)

    def chat(
        self, messages: Any, params: Any = None, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`AsyncEngine.chat` on a replica."""
        return self._forward("chat", messages, params, **kwargs)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """:meth:`AsyncEngine.decode` on a replica."""
        try:
            return str(await self._handle.decode.remote(list(token_ids)))
        except Exception as e:
            raise _unwrap(e) from e

    def stats(self) -> dict[str, int | float]:
        """The last stats :meth:`refresh_stats` read (summed over replicas)."""
        return dict(self._stats) or dict(NO_STATS)

    async def refresh_stats(self) -> None:
        """Read every replica's stats and sum them (ratios recomputed from the sums).

        With :class:`PrefixCacheRouter`, call k goes to the k-th replica; with Serve's own
        router the calls land at random, so up to ``4 * num_replicas`` are made and each
        replica counts once (by its ``replica_id``): the sums may then miss a replica. A
        replica that does not answer within :attr:`STATS_TIMEOUT_S`, or fails, leaves the
        last stats in place (a scrape must not fail while Serve replaces a replica).
        """
        try:
            per_replica = await asyncio.wait_for(self._read_replicas(), self.STATS_TIMEOUT_S)
        except Exception as e:  # TimeoutError, a replica restarting...
            logger.warning("engine stats not refreshed: %r", e)
            return
        total: collections.Counter[str] = collections.Counter()
        for s in per_replica:
            total.update({n: v for n, v in s.items() if isinstance(v, (int, float))})
        blocks = total["num_total_blocks"]
        total["kv_cache_usage"] = 1 - total["num_free_blocks"] / blocks if blocks else 0.0
        q = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / q if q else 0.0
        drafts, steps = total["spec_num_draft_tokens"], total["spec_num_steps"]
        total["spec_acceptance_rate"] = (
            total["spec_num_accepted_tokens"] / drafts if drafts else 0.0
        )
        emitted = sum(s["spec_mean_tokens_per_step"] * s["spec_num_steps"] for s in per_replica)
        total["spec_mean_tokens_per_step"] = emitted / steps if steps else 0.0
        states = collections.Counter(str(s.get("compile", "off")) for s in per_replica)
        self._stats = {**total, "compile": dict(states)}

    async def _read_replicas(self) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for k in range(4 * self.num_replicas):
            if len(seen) >= self.num_replicas:
                break
            s = await self._handle.stats.remote(replica=k % self.num_replicas, served=False)
            seen[str(s["replica_id"])] = s
        return list(seen.values())


@serve.ingress()
class OpenAIIngress:
    """The OpenAI-compatible app of :mod:`asyncllm.server` as a Serve HTTP ingress
    deployment, in front of the :class:`LLMServer` replicas (``llm``: its bound deployment).

    Args:
        llm: the handle Serve passes for the bound :class:`LLMServer` deployment.
        model: the replicas' model (its tokenizer is loaded here; no weights).
        app_options: :func:`asyncllm.server.create_app` keywords (API keys...), and
            ``served_model_name``.
        num_replicas: the :class:`LLMServer` replicas (``/metrics`` sums their stats).
    """

    async def __init__(
        self,
        llm: Any,
        model: str,
        app_options: dict[str, Any] | None = None,
        num_replicas: int = 1,
    ):
        info = await llm.info.remote()
        self.client = EngineClient(llm, model, info["max_model_len"], num_replicas)
        self._app_options = dict(app_options or {})

    def __serve_build_asgi_app__(self) -> Any:
        from asyncllm.server import create_app

        options = dict(self._app_options)
        name = options.pop("served_model_name", None)
        return create_app(self.client, name, **options)  # type: ignore[arg-type]


def build_app(
    model: str = "default",
    *,
    num_replicas: int = 1,
    engine_config: dict[str, Any] | None = None,
    router: str = "prefix",
    router_kwargs: dict[str, Any] | None = None,
    app_options: dict[str, Any] | None = None,
    llm_options: dict[str, Any] | None = None,
    ingress_actor_options: dict[str, Any] | None = None,
) -> Any:
    """The Serve application: :class:`OpenAIIngress` over ``num_replicas`` :class:`LLMServer`
    replicas (run it with ``serve.run(build_app(...), route_prefix="/")``).

    Args:
        model, num_replicas, engine_config, router, router_kwargs: as
            :func:`build_llm_deployment`.
        app_options: :func:`asyncllm.server.create_app` keywords, and ``served_model_name``.
        llm_options: other :func:`build_llm_deployment` keywords.
        ingress_actor_options: the ingress replica's ``ray_actor_options`` (default: no
            reserved CPU; it only parses, tokenizes for routing and forwards).

    Raises:
        ValueError: as :func:`build_llm_deployment`.
    """
    llm = build_llm_deployment(
        model,
        num_replicas=num_replicas,
        engine_config=engine_config,
        router=router,
        router_kwargs=router_kwargs,
        **(llm_options or {}),
    )
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", ray_actor_options=ingress_actor_options or {"num_cpus": 0}
    )
    return ingress.bind(
        llm.bind(model, engine_config or {}), model, app_options or {}, num_replicas
    )


# --------------------------------------------------------------------------- the command line


#: The Serve application name of ``python -m asyncllm serve --replicas N``.
CLI_APP_NAME = "asyncllm"


def cli_app(
    args: argparse.Namespace, engine_config: dict[str, Any], app_options: dict[str, Any]
) -> Any:
    """The application ``serve --replicas N`` runs: :func:`build_app` with the parsed
    options (``--replicas``, ``--replica-threads`` as each replica's torch threads and Ray
    CPUs, ``--router``, ``--served-model-name``), ``engine_config`` and ``app_options`` (from
    :func:`asyncllm.server.engine_config_from_args` and ``app_options_from_args``).

    Raises:
        ValueError: an engine setting :class:`EngineConfig` refuses.
    """
    options = {**app_options, "served_model_name": args.served_model_name}
    return build_app(
        args.model,
        num_replicas=args.replicas,
        engine_config={"num_threads": args.replica_threads, **engine_config},
        router=args.router,
        app_options=options,
        llm_options={"ray_actor_options": {"num_cpus": args.replica_threads}},
    )


def main(
    args: argparse.Namespace, engine_config: dict[str, Any], app_options: dict[str, Any]
) -> int:
    """``python -m asyncllm serve --replicas N``: serve :func:`cli_app` on
    ``--host``/``--port`` until Ctrl-C or SIGTERM; returns the exit code (0).

    Ray: the cluster of ``$RAY_ADDRESS`` ("auto": the one ``ray start`` runs here) if set,
    else a new local instance (never one another program started), or the instance this
    process already holds. Stopping removes what it started and nothing else: a local
    instance it started is shut down with Serve; on a cluster it joined, only its own
    application (:data:`CLI_APP_NAME`) is deleted, so other Serve apps keep running.
    """
    import os
    import signal
    import threading

    address = os.environ.get("RAY_ADDRESS")
    preexisting = ray.is_initialized()
    # SIGTERM (a service manager's stop) ends the wait below as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if not preexisting:
            # A local instance without the dashboard: its processes cost memory and
            # nothing here reads them (a joined cluster keeps its own).
            ray.init(address=address or "local", include_dashboard=False if not address else None)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(cli_app(args, engine_config, app_options), name=CLI_APP_NAME, route_prefix="/")
        print(
            f"serving {args.replicas} replicas on http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
            flush=True,
        )
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ray.is_initialized():
            if preexisting or address:
                serve.delete(CLI_APP_NAME)
            else:
                serve.shutdown()
            if not preexisting:
                ray.shutdown()
    return 0
