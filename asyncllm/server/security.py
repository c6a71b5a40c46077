"""HTTP-level protection of the server: the request body limit and content type, API keys
(``Authorization: Bearer``) and the tenant digest that isolates each key's prefix cache.
See :mod:`asyncllm.server` (Security) for the options that set them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from typing import Any

import anyio
import msgspec
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncllm.server import protocol as p
from asyncllm.server.drivers import json_response

#: Default of ``max_request_bytes``: the largest request body read (4 MiB: a prompt of
#: several hundred thousand tokens as text or token ids).
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20

#: Bodies larger than this are decoded on a worker thread (a 4 MiB one takes up to ~0.2 s
#: to check and decode; the event loop keeps serving other streams meanwhile).
THREAD_DECODE_BYTES = 256 * 2**10

#: The scope key under which the API-key check leaves the caller's tenant (a digest of the
#: key it presented), for prefix-cache isolation.
TENANT_KEY = "asyncllm.tenant"


def _too_large(limit: int) -> p.APIError:
    return p.APIError(
        f"the request body is larger than this server's limit of {limit} bytes",
        413,
        code="request_too_large",
    )


async def read_json(request: Request, kind: type[msgspec.Struct], limit: int) -> Any:
    """Read and decode a POST body: ``Content-Type: application/json`` (parameters such as
    ``charset`` allowed) and at most ``limit`` bytes.

    The body is read in chunks and reading stops at the first chunk past the limit,
    whatever ``Content-Length`` says (a larger declared length is refused unread).

    Raises:
        APIError: 415 for another (or no) content type (so a web page cannot post a
            "simple" cross-origin request without a CORS preflight), 413 past the limit,
            400 for a malformed body (:func:`~.protocol.decode_body`).
        ClientDisconnect: the client went away while sending it.
    """
    ctype = request.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise p.APIError(
            "Content-Type must be application/json",
            415,
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > THREAD_DECODE_BYTES:  # its nesting scan and decode: off the event loop
        return await anyio.to_thread.run_sync(p.decode_body, body, kind)
    return p.decode_body(body, kind)


def split_commas(values: str | Iterable[str] | None) -> list[str]:
    """Items (API keys, origins) from a string or strings, each holding one item or several
    separated by commas (as ``--api-key``, ``$ASYNCLLM_API_KEY`` and ``--allowed-origins``
    take them); blanks are dropped."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [k.strip() for v in values for k in v.split(",") if k.strip()]


def _tenant(key: bytes) -> str:
    # a digest, so the key itself is never kept in request state or cache hashes
    return "apikey:" + hashlib.sha256(key).hexdigest()


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` with one of ``keys`` on every HTTP request
    but those to ``open_paths``; otherwise answer 401 with OpenAI's error JSON
    (``code`` "invalid_api_key"). Keys are compared with :func:`hmac.compare_digest`,
    against every key whatever matches (the time does not tell which key, or how much of
    one, matched). An accepted request's scope gets ``TENANT_KEY``: a digest of its key.

    Raises:
        ValueError: no keys.
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str]) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]
        if not self._keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self._tenants = [_tenant(k) for k in self._keys]
        self._open = frozenset(open_paths)

    def _match(self, authorization: str | None) -> int | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        match = None
        for i, key in enumerate(self._keys):
            if hmac.compare_digest(given, key) and match is None:
                match = i
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        index = self._match(Headers(scope=scope).get("authorization"))
        if index is None:
            err = p.APIError(
                "missing or invalid API key: send Authorization: Bearer <key>",
                401,
                code="invalid_api_key",
            )
            response = json_response(err.body(), err.status, {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[TENANT_KEY] = self._tenants[index]
        await self.app(scope, receive, send)


def default_served_name(model: str) -> str:
    """The served model name for a ``--model`` value: the base name of a local directory or
    file (so no response shows a filesystem path), else the value itself ("default")."""
    if model and os.path.exists(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model))) or model
    return model
