"""Prefix-cache-aware request routing for :mod:`asyncllm.integrations.ray_serve`.

- :class:`PrefixAffinity`: the policy, without Ray (per-replica records of routed block
  hashes; the choice of replica for a request's hashes, within a load guard).
- :class:`PrefixCacheRouter`: the Ray Serve ``RequestRouter`` that applies it to
  :class:`~asyncllm.integrations.ray_serve.LLMServer` calls.
- :func:`router_config`: the deployment option that selects it (or Serve's own router).
- :func:`routing_token_ids`, :func:`load_tokenizer`: a call's prompt ids as the replica's
  engine will tokenize them.

docs/scaling.md ("What the router does") describes the policy and its options.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from asyncllm.core.block_manager import prompt_block_hashes

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
    from asyncllm.engine.input_processor import _without_added_bos
    from asyncllm.tool_calling.tool_calls import template_messages

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
        # internal request id -> the future Serve resolves with its replica (see _watch)
        self._watched: dict[str, asyncio.Future[Any]] = {}
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
        if pending_request is not None and key is not None:
            # Count the choice at once, so requests routed together see each other (Serve
            # may still send it to a later rank: on_request_routed corrects that).
            self._track(key, order[0], hashes)
            self._watch(key, pending_request.future)
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

    def _watch(self, key: str, future: asyncio.Future[Any]) -> None:
        """Untrack the request if Serve never sends it: Serve calls neither
        ``on_request_routed`` nor ``on_request_completed`` for a request whose caller
        cancelled it while it waited for a replica (its future is cancelled then), so
        without this its choice would count in the replica's load for good."""
        if self._watched.get(key) is not future:  # once per future (a retry gets a new one)
            self._watched[key] = future
            future.add_done_callback(functools.partial(self._routing_done, key))

    def _routing_done(self, key: str, future: asyncio.Future[Any]) -> None:
        if self._watched.get(key) is future:
            del self._watched[key]
        if future.cancelled() or future.exception() is not None:
            self._untrack(key)
            self._pending.pop(key, None)
        # else Serve sends it: on_request_completed follows, whatever happens next

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
