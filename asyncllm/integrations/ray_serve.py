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
- :class:`PrefixCacheRouter`: a Serve ``RequestRouter`` that sends a request to the replica
  most likely to hold its prompt's prefix in its KV cache (see its docstring for the policy
  and the load guard).
- :func:`build_app` (both deployments) and :func:`main` (``python -m asyncllm serve
  --replicas N``).

Errors a replica raises reach callers as Ray wraps them (``ray.exceptions.RayTaskError``,
an instance of the original class too); :class:`EngineClient` re-raises the original
(``QueueFull``, ``InvalidRequestError``...), and a replica's death as
:class:`~asyncllm.errors.EngineDeadError`.
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from asyncllm.config import EngineConfig
from asyncllm.core.block_manager import prompt_block_hashes
from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.errors import EngineDeadError, QueueFull
from asyncllm.outputs import RequestOutput

logger = logging.getLogger("asyncllm.ray_serve")

#: The Ray version the ``ray`` extra pins and the tests run against.
TESTED_RAY_VERSION = "2.60.0"

#: Default of the router's ``imbalance_threshold``: when the replica holding a request's
#: prefix has more than this many requests in flight beyond the least-loaded replica, the
#: request goes to the least-loaded one instead (ray.llm's ``PrefixCacheAffinityRouter``
#: uses the same kind of guard, as the difference of queue lengths).
DEFAULT_IMBALANCE_THRESHOLD = 4

#: Default of the router's ``record_blocks``: block hashes remembered per replica (least
#: recently routed dropped first). Sized like a replica's KV cache: a hash the replica has
#: long evicted only costs a miss.
DEFAULT_RECORD_BLOCKS = 16384

#: Default of the router's ``max_prefix_blocks``: leading blocks of a prompt hashed and
#: matched (a longer shared prefix routes the same way; the cost stays bounded).
DEFAULT_MAX_PREFIX_BLOCKS = 256


# --------------------------------------------------------------------------- routing policy


class PrefixAffinity:
    """The router's policy, without Ray: per-replica records of routed block hashes and the
    choice of replica for a request's hashes.

    Each replica has a bounded, least-recently-routed-first record of the block hashes of
    the prompts sent to it (those blocks are in its prefix cache unless it evicted them).
    :meth:`rank` puts first the replica whose record holds the longest leading run of the
    request's hashes (the chain makes a run a shared prefix), unless its load exceeds the
    least-loaded replica's by more than ``imbalance_threshold``: then, or when no replica
    matches, the least-loaded replica (ties: the one with the fewest recorded hashes, so new
    prefixes spread over replicas; then at random).

    Args:
        record_blocks: hashes remembered per replica (>= 1).
        imbalance_threshold: requests in flight (>= 0) by which the matching replica may
            exceed the least-loaded one and still be chosen.

    Raises:
        ValueError: a bad argument.
    """

    def __init__(
        self,
        record_blocks: int = DEFAULT_RECORD_BLOCKS,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    ) -> None:
        if record_blocks < 1:
            raise ValueError(f"record_blocks must be >= 1, got {record_blocks}")
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        self.record_blocks = record_blocks
        self.imbalance_threshold = imbalance_threshold
        self._records: dict[str, collections.OrderedDict[bytes, None]] = {}

    def match(self, replica: str, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the replica's record holds."""
        record = self._records.get(replica)
        if not record:
            return 0
        n = 0
        for h in hashes:
            if h not in record:
                break
            n += 1
        return n

    def record(self, replica: str, hashes: Sequence[bytes]) -> None:
        """Remember that ``hashes`` were routed to ``replica`` (most recent last)."""
        record = self._records.setdefault(replica, collections.OrderedDict())
        for h in hashes:
            record[h] = None
            record.move_to_end(h)
        while len(record) > self.record_blocks:
            record.popitem(last=False)

    def forget_except(self, replicas: set[str]) -> None:
        """Drop the records of replicas not in ``replicas`` (gone, replaced)."""
        for r in list(self._records):
            if r not in replicas:
                del self._records[r]

    def rank(self, hashes: Sequence[bytes], loads: Mapping[str, int]) -> list[str]:
        """The replicas of ``loads`` (replica -> requests in flight), best first."""
        order = sorted(
            loads, key=lambda r: (loads[r], len(self._records.get(r, ())), random.random())
        )
        if not order or not hashes:
            return order
        matches = {r: self.match(r, hashes) for r in order}
        best = max(order, key=lambda r: matches[r])  # the least loaded of the longest
        if matches[best] and loads[best] - loads[order[0]] <= self.imbalance_threshold:
            return [best, *(r for r in order if r != best)]
        return order


def routing_token_ids(
    tokenizer: Any, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[int] | None:
    """The prompt token ids of an :class:`LLMServer` call, as its engine will tokenize them
    (None for a call without a prompt, or one that cannot be tokenized: the replica reports
    that error).

    ``stream``: the prompt (text, ids, or a prompt dict) tokenized as
    :meth:`AsyncEngine.stream` does. ``chat``: the messages rendered by the chat template
    with ``add_generation_prompt`` and ``chat_template_kwargs`` (``tools`` are not
    rendered here, so a tool request's key is its messages' prefix).
    """
    from asyncllm.engine.llm_engine import _without_added_bos
    from asyncllm.engine.tool_calls import template_messages

    try:
        if method == "stream":
            prompt = args[0] if args else kwargs.get("prompt")
            if isinstance(prompt, Mapping):
                prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
            if isinstance(prompt, str):
                return _without_added_bos(tokenizer, prompt)
            if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            return None
        if method == "chat":
            messages = args[0] if args else kwargs.get("messages")
            ids = tokenizer.apply_chat_template(
                template_messages(messages),
                add_generation_prompt=kwargs.get("add_generation_prompt", True),
                tokenize=True,
                return_dict=False,
                **dict(kwargs.get("chat_template_kwargs") or {}),
            )
            return list(ids)
    except Exception:  # a malformed request: the replica raises the typed error
        return None
    return None


def load_tokenizer(model: str) -> Any:
    """The tokenizer of ``model`` ("default", an HF directory or a .gguf), without weights.

    Raises:
        ModelNotFoundError: the model is missing.
    """
    from transformers import AutoTokenizer

    from asyncllm.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model), local_files_only=True)


class PrefixCacheRouter(RequestRouter):
    """Ray Serve request router: a request goes to the replica most likely to hold its
    prompt's prefix in its prefix cache, within a load guard.

    Each routed ``stream`` or ``chat`` call is tokenized as the engine will
    (:func:`routing_token_ids`), its leading full blocks hashed exactly as the engine's
    scheduler hashes them (:func:`~asyncllm.core.block_manager.prompt_block_hashes`: same
    ``block_size``, chained SHA-256, the call's ``cache_salt`` in the first block), and
    matched against each replica's record of the hashes routed to it
    (:class:`PrefixAffinity`). Load is the larger of the requests this router has in flight
    on a replica and the queue length Serve last probed. Replicas ranked after the first
    are Serve's fallbacks when the first is full (``max_ongoing_requests``).

    Other calls (``stats``, ``decode``...) go to the least-loaded replica; a call with a
    ``replica=k`` keyword goes to the k-th replica in replica-id order (for per-replica
    reads such as :meth:`LLMServer.stats`; a k outside the replicas is routed as any call).

    Keywords (``RequestRouterConfig.request_router_kwargs``), for ``initialize_state``:
    ``model`` (its tokenizer is loaded on first use), ``block_size`` (the engine's),
    ``record_blocks``, ``imbalance_threshold``, ``max_prefix_blocks``.

    Decision cost (tokenizing, hashing, ranking) is kept in ``decision_seconds`` and
    ``num_decisions``.
    """

    def initialize_state(
        self,
        model: str = "default",
        block_size: int = 16,
        record_blocks: int = DEFAULT_RECORD_BLOCKS,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
        max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
        **kwargs: Any,
    ) -> None:
        """Set the router's options (see the class docstring)."""
        self._model = model
        self._tokenizer: Any = None
        self._block_size = block_size
        self._max_prefix_blocks = max_prefix_blocks
        self.policy = PrefixAffinity(record_blocks, imbalance_threshold)
        # internal request id -> its hashes, from its routing decision to its dispatch
        self._pending: collections.OrderedDict[str, list[bytes]] = collections.OrderedDict()
        self._inflight: collections.Counter[str] = collections.Counter()
        self._routed: dict[str, str] = {}  # internal request id -> replica, until completed
        self.decision_seconds = 0.0
        self.num_decisions = 0

    def request_hashes(self, pending: PendingRequest) -> list[bytes]:
        """The block hashes of a pending call's prompt ([] for a call without one)."""
        method = pending.metadata.call_method
        if method not in ("stream", "chat"):
            return []
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._model)
        ids = routing_token_ids(self._tokenizer, method, pending.args, pending.kwargs)
        if not ids:
            return []
        salt = pending.kwargs.get("cache_salt")
        return prompt_block_hashes(
            ids, self._block_size, salt if isinstance(salt, str) else None, self._max_prefix_blocks
        )

    def _load(self, replica: RunningReplica) -> int:
        probed = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(probed, self._inflight[replica.replica_id.unique_id])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Rank the candidates for ``pending_request`` (see the class docstring)."""
        start = time.perf_counter()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.policy.forget_except(set(by_id) | {r.unique_id for r in self.curr_replicas})
        hashes: list[bytes] = []
        if pending_request is not None:
            pin = pending_request.kwargs.get("replica")
            everyone = sorted(r.unique_id for r in self.curr_replicas)
            if isinstance(pin, int) and 0 <= pin < len(everyone):
                chosen = by_id.get(everyone[pin])
                return [[chosen]] if chosen is not None else []
            key = pending_request.metadata.internal_request_id
            if key in self._pending:
                hashes = self._pending[key]
            else:
                hashes = self.request_hashes(pending_request)
                self._pending[key] = hashes
                while len(self._pending) > 4096:  # requests cancelled before dispatch
                    self._pending.popitem(last=False)
        key = pending_request.metadata.internal_request_id if pending_request else None
        self._untrack(key)  # a retry (backoff): its earlier choice no longer counts
        order = self.policy.rank(hashes, {rid: self._load(r) for rid, r in by_id.items()})
        if key is not None:
            # Count the choice at once, so requests routed together see each other (Serve
            # may still send it to a later rank: on_request_routed corrects that).
            self._track(key, order[0], hashes)
        self.decision_seconds += time.perf_counter() - start
        self.num_decisions += 1
        return (
            [[by_id[order[0]]], [by_id[r] for r in order[1:]]]
            if len(order) > 1
            else [[by_id[order[0]]]]
        )

    def _track(self, key: str, replica: str, hashes: list[bytes]) -> None:
        if hashes:
            self.policy.record(replica, hashes)
        self._inflight[replica] += 1
        self._routed[key] = replica

    def _untrack(self, key: str | None) -> None:
        replica = self._routed.pop(key, None) if key is not None else None
        if replica is not None and self._inflight[replica] > 0:
            self._inflight[replica] -= 1

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Record the request's hashes on the replica it went to (if not the one ranked
        first); it counts in that replica's load until completed."""
        key = pending_request.metadata.internal_request_id
        hashes = self._pending.pop(key, None) or []
        if self._routed.get(key) != replica_id.unique_id:
            self._untrack(key)
            self._track(key, replica_id.unique_id, hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request no longer counts in its replica's load."""
        self._untrack(internal_request_id)


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
        self.engine = AsyncEngine.from_pretrained(model, **(engine_config or {}))
        await self.engine.__aenter__()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._served: collections.deque[str] = collections.deque(maxlen=4096)

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
        core = self.engine._engine
        return {"max_model_len": core.max_model_len, "block_size": self.engine.config.block_size}

    def stats(self, replica: int | None = None) -> dict[str, Any]:
        """This replica's :meth:`AsyncEngine.stats`, its ``replica_id`` and ``served``: the
        request ids of its recent ``stream``/``chat`` calls (the last 4096). Pass
        ``replica=k`` to read the k-th replica with :class:`PrefixCacheRouter`."""
        return {**self.engine.stats(), "replica_id": self.replica_id, "served": list(self._served)}

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
        await self.engine.__aexit__(None, None, None)


def router_config(
    model: str, block_size: int = 16, router: str = "prefix", **router_kwargs: Any
) -> RequestRouterConfig | None:
    """The ``request_router_config`` for :class:`LLMServer` deployments: ``router``
    "prefix" (:class:`PrefixCacheRouter`, ``router_kwargs`` as its keywords) or "default"
    (None: Serve's power-of-two-choices router).

    Raises:
        ValueError: another ``router``.
    """
    if router == "default":
        return None
    if router != "prefix":
        raise ValueError(f'router must be "prefix" or "default", got {router!r}')
    return RequestRouterConfig(
        request_router_class=PrefixCacheRouter,
        request_router_kwargs={"model": model, "block_size": block_size, **router_kwargs},
    )


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


class EngineClient:
    """The part of :class:`AsyncEngine` that :mod:`asyncllm.server` uses, over a handle to
    :class:`LLMServer` replicas: the OpenAI server runs unchanged in front of many replicas.

    ``stream``/``chat``/``decode`` are forwarded (closing a stream early cancels the handle
    response, which aborts the request on its replica); errors are re-raised as the
    replica raised them (:func:`_unwrap`: ``QueueFull``, ``InvalidRequestError``; a dead
    replica as ``EngineDeadError``). ``stats`` are those last read by :meth:`refresh_stats`
    (zeros before).

    Args:
        handle: a ``DeploymentHandle`` to the :class:`LLMServer` deployment.
        model: its model (for the tokenizer and the served name).
        max_model_len: the replicas' ``max_model_len``.
    """

    def __init__(self, handle: Any, model: str, max_model_len: int) -> None:
        self._handle = handle
        self.tokenizer = load_tokenizer(model)
        self.config = EngineConfig(model=model)
        self.max_model_len = max_model_len
        self._engine = self  # asyncllm.server reads engine._engine.max_model_len
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
        return dict(self._stats) or {
            "num_running": 0, "num_waiting": 0, "num_free_blocks": 0, "num_total_blocks": 0,
            "kv_cache_usage": 0.0, "num_preemptions": 0, "num_swapped_out_blocks": 0,
            "num_swapped_in_blocks": 0, "swap_bytes": 0, "num_recomputed_tokens": 0,
            "num_free_cpu_blocks": 0, "num_total_cpu_blocks": 0, "prefix_cache_queries": 0,
            "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "num_steps": 0,
            "num_generated_tokens": 0,
        }  # fmt: skip

    async def refresh_stats(self, num_replicas: int) -> None:
        """Read every replica's stats (with :class:`PrefixCacheRouter`) and sum them."""
        total: collections.Counter[str] = collections.Counter()
        for k in range(num_replicas):
            s = await self._handle.stats.remote(replica=k)
            total.update({n: v for n, v in s.items() if isinstance(v, (int, float))})
        blocks = total["num_total_blocks"]
        total["kv_cache_usage"] = 1 - total["num_free_blocks"] / blocks if blocks else 0.0
        q = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / q if q else 0.0
        self._stats = dict(total)


@serve.ingress()
class OpenAIIngress:
    """The OpenAI-compatible app of :mod:`asyncllm.server` as a Serve HTTP ingress
    deployment, in front of the :class:`LLMServer` replicas (``llm``: its bound deployment).

    Args:
        llm: the handle Serve passes for the bound :class:`LLMServer` deployment.
        model: the replicas' model (its tokenizer is loaded here; no weights).
        app_options: :func:`asyncllm.server.create_app` keywords (API keys...), and
            ``served_model_name``.
    """

    async def __init__(self, llm: Any, model: str, app_options: dict[str, Any] | None = None):
        info = await llm.info.remote()
        self.client = EngineClient(llm, model, info["max_model_len"])
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
    return ingress.bind(llm.bind(model, engine_config or {}), model, app_options or {})


# --------------------------------------------------------------------------- the command line


def main(
    args: argparse.Namespace, engine_config: dict[str, Any], app_options: dict[str, Any]
) -> int:
    """``python -m asyncllm serve --replicas N``: start a local Ray instance (or join the
    cluster of ``$RAY_ADDRESS``), serve :func:`build_app` on ``--host``/``--port`` until
    interrupted; returns the exit code."""
    import signal
    import threading

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    options = dict(app_options)
    options["served_model_name"] = args.served_model_name
    engine_config = {"num_threads": args.replica_threads, **engine_config}
    serve.run(
        build_app(
            args.model,
            num_replicas=args.replicas,
            engine_config=engine_config,
            router=args.router,
            app_options=options,
            llm_options={"ray_actor_options": {"num_cpus": args.replica_threads}},
        ),
        name="asyncllm",
        route_prefix="/",
    )
    print(f"serving {args.replicas} replicas on http://{args.host}:{args.port}/v1 (Ctrl-C stops)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
