"""The Starlette app of the OpenAI-compatible server.

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/responses``
(:mod:`asyncllm.server.responses_api`), ``GET /health``, ``GET /metrics``.

A generation route reads and checks the body (:mod:`asyncllm.server.security`), turns it
into the engine's arguments (:mod:`asyncllm.server.endpoints`, pure functions) and returns
a :class:`~asyncllm.server.drivers.GenerationResponse`, which runs the call's engine
requests and the client-disconnect watcher on one anyio task group. Each choice of a call
(one per prompt and sample, ``n`` samples per prompt) comes from one engine request per
prompt; sample ``i`` of a call with ``seed=s`` uses ``seed=(s + i) mod 2**63``, as the
engine's parallel sampling documents. A client that goes away aborts its requests and frees
their KV blocks before the next step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.chat_templates import load_chat_template
from asyncllm.engine.async_engine import AsyncEngine
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.outputs import RequestOutput
from asyncllm.server import endpoints as ep
from asyncllm.server import protocol as p
from asyncllm.server.drivers import (
    CLIENT_CLOSED,
    Fanout,
    GenerationResponse,
    Prompt,
    Shape,
    json_response,
    make_prompts,
)
from asyncllm.server.metrics import ServerMetrics
from asyncllm.server.protocol import INTERNAL_ERROR, APIError, api_error
from asyncllm.server.responses import Health, ModelCard, ModelList
from asyncllm.server.responses_api import (
    ResponsesRequest,
    ResponsesShape,
    ResponseStore,
    responses_call,
)
from asyncllm.server.security import (
    DEFAULT_MAX_REQUEST_BYTES,
    TENANT_KEY,
    APIKeyMiddleware,
    default_served_name,
    read_json,
    split_commas,
)

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "TENANT_KEY", "OpenAIServer", "create_app",
           "default_served_name", "split_commas"]  # fmt: skip

logger = logging.getLogger("asyncllm.server")


class OpenAIServer:
    """The state behind the routes (``app.state.server`` of :func:`create_app`'s app).

    Args:
        engine: an :class:`AsyncEngine`; the app's lifespan enters and leaves it.
        served_model_name: the name clients pass as ``model`` (and ``/v1/models`` lists).
        max_request_bytes: the largest request body read (bytes; past it: 413).
        trust_request_chat_template: let requests send their own ``chat_template``.
        client_priority_range: ``(lo, hi)`` with ``lo <= 0 <= hi``: the ``priority`` values
            a request may ask for (outside: 400); (0, 0) keeps clients from jumping ahead
            of others.
        share_prefix_cache: let requests made with different API keys share prefix-cache
            blocks (by default each key's requests hit only their own).
        chat_template: the Jinja text of the chat template that renders chat requests
            instead of the model's (a request's own, when trusted, still wins); None: the
            model's.
        tenant_header: a request header whose value names the request's tenant (the
            engine's fair-share unit; from a gateway the operator trusts); without it (or
            the header) the tenant is the API key's, else the shared one.
        admission: "refuse": a full waiting queue answers 429; "wait": requests wait for a
            place (their ``timeout``... still apply).
        queue_events: streamed requests get server-sent-event comments with their queue
            position and estimated start before their first token.

    Attributes:
        engine: the engine.
        model_name: the served model name.
        metrics: the :class:`~asyncllm.server.metrics.ServerMetrics` behind ``/metrics``
            (its ``registry`` is a prometheus_client ``CollectorRegistry``).

    Raises:
        ValueError: a ``max_request_bytes`` below 1 or a priority range without 0.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        trust_request_chat_template: bool = False,
        client_priority_range: tuple[int, int] = (0, 0),
        share_prefix_cache: bool = False,
        chat_template: str | None = None,
        tenant_header: str | None = None,
        admission: str = "refuse",
        queue_events: bool = False,
    ) -> None:
        if admission not in ("refuse", "wait"):
            raise ValueError(f"admission must be 'refuse' or 'wait', got {admission!r}")
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes!r}")
        lo, hi = client_priority_range
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= 0 <= hi):
            raise ValueError(
                f"client_priority_range must be (lo, hi) with lo <= 0 <= hi, got "
                f"{client_priority_range!r}"
            )
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = ServerMetrics(engine, served_model_name)
        self.created = int(time.time())
        self.max_request_bytes = max_request_bytes
        self.trust_request_chat_template = trust_request_chat_template
        self.client_priority_range = (lo, hi)
        self.share_prefix_cache = share_prefix_cache
        self.chat_template = chat_template
        self.tenant_header = tenant_header
        self.admission = admission
        self.queue_events = queue_events
        self._reserved_template_options = p.reserved_template_options(engine.tokenizer)
        self.response_store = ResponseStore()  # for /v1/responses' previous_response_id

    # ------------------------------------------------------------------ helpers

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                404,
                param="model",
                code="model_not_found",
            )

    def _check_admissible(self, call: ep.EngineCall) -> None:
        """A call's requests (n samples of each prompt) all fit the engine's waiting queue:
        the server submits them at once, so one with more than ``max_waiting`` would get
        429 on an idle server, every time a client retried."""
        limit = getattr(getattr(self.engine, "config", None), "max_waiting", None)
        total = call.n * len(call.prompts)
        if isinstance(limit, int) and total > limit:
            raise APIError(
                f"n x the number of prompts is {total}, more than this server's waiting "
                f"queue ever holds ({limit})",
                param="n",
            )

    async def _echo_text(self, prompt: str | list[int]) -> str:
        """A prompt's text for ``echo``. Token ids are checked first, by count (a prompt
        longer than ``max_model_len`` is refused before any work proportional to it) and
        range (the tokenizer would raise on ids outside the vocabulary), then decoded off
        the event loop."""
        if isinstance(prompt, str):
            return prompt
        try:
            return await self.engine.decode(prompt)
        except InvalidRequestError as e:
            raise APIError(str(e), param="prompt") from None

    def _engine_kwargs(
        self, request: Request, call_kwargs: dict[str, Any], salt: str | None, stream: bool
    ) -> dict[str, Any]:
        """The engine call's keywords: the endpoint's, the cache salt, the tenant (from the
        operator's tenant header, else the API key), admission and queue reports."""
        tenant = request.scope.get(TENANT_KEY) or ""
        if self.tenant_header is not None:
            named = request.headers.get(self.tenant_header)
            if named:  # an empty header names no tenant
                if len(named) > 256:
                    raise APIError(f"the {self.tenant_header} header is over 256 characters")
                tenant = named
        return {
            **call_kwargs,
            "cache_salt": self._cache_salt(request, salt),
            "tenant": tenant,
            "admission": self.admission,
            "report_queue": self.queue_events and stream,
        }

    def _cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The client's ``cache_salt`` within its API key's own prefix-cache space."""
        tenant = None if self.share_prefix_cache else request.scope.get(TENANT_KEY)
        if tenant is None:
            return salt
        return tenant if salt is None else f"{tenant}\x00{salt}"

    def _generate(
        self,
        prompts: list[Prompt],
        method: Callable[..., AsyncIterator[RequestOutput]],
        kwargs: dict[str, Any],
        shape: Shape,
        stream: bool,
    ) -> GenerationResponse:
        """The response that runs ``method`` (``engine.stream`` or ``engine.chat``) once per
        prompt with ``kwargs`` and answers with ``shape``."""

        def open_stream(prompt: Prompt) -> AsyncIterator[RequestOutput]:
            return method(prompt.prompt, request_id=prompt.request_id, **kwargs)

        return GenerationResponse(Fanout(prompts, open_stream, self.metrics), shape, stream)

    # ------------------------------------------------------------------ routes

    def routes(self) -> list[Route]:
        """The app's routes (see the module docstring)."""
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        """``GET /v1/models`` and ``/v1/models/{id}``."""
        model = request.path_params.get("model")
        card = ModelCard(
            id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len
        )
        if model is None:
            return json_response(ModelList(data=[card]))
        if model != self.model_name:
            err = APIError(f"The model `{model}` does not exist.", 404, code="model_not_found")
            return json_response(err.body(), err.status)
        return json_response(card)

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while the engine runs, else 503."""
        try:
            state = self.engine.health()
        except EngineDeadError as e:  # api_error gives a fixed message; the log has e
            err = api_error(e)
            return json_response(err.body(), err.status)
        return json_response(Health(status=state), 200 if state == "running" else 503)

    async def metrics_route(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus' text format."""
        from prometheus_client import CONTENT_TYPE_LATEST

        # An engine whose stats live elsewhere (ray_serve.EngineClient: the replicas') reads
        # them now, so the scrape's engine gauges are current; AsyncEngine has them at hand.
        refresh = getattr(self.engine, "refresh_stats", None)
        if refresh is not None:
            await refresh()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response | GenerationResponse:
        """``POST /v1/completions``."""
        try:
            req = await read_json(request, p.CompletionRequest, self.max_request_bytes)
            self._check_model(req.model)
            call = ep.completion_call(req, self.client_priority_range)
            self._check_admissible(call)
            kwargs = self._engine_kwargs(request, call.kwargs, req.cache_salt, call.stream)
            echoed = [await self._echo_text(x) for x in call.prompts] if req.echo else None
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:
            err = api_error(e)
            return json_response(err.body(), err.status)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = make_prompts(call.prompts, call.n, rid)
        for prompt, text in zip(prompts, echoed or [], strict=False):
            for c in prompt.choices:
                c.prompt_text = text
        shape = ep.CompletionShape(
            rid, int(time.time()), self.model_name, req.logprobs, call.include_usage
        )
        method = functools.partial(self.engine.stream, params=call.params)
        return self._generate(prompts, method, kwargs, shape, call.stream)

    async def chat_completions(self, request: Request) -> Response | GenerationResponse:
        """``POST /v1/chat/completions``."""
        try:
            req = await read_json(request, p.ChatCompletionRequest, self.max_request_bytes)
            self._check_model(req.model)
            call = ep.chat_call(
                req,
                self.client_priority_range,
                self._reserved_template_options,
                trust_template=self.trust_request_chat_template,
                server_template=self.chat_template,
            )
            self._check_admissible(call)
            kwargs = self._engine_kwargs(request, call.kwargs, req.cache_salt, call.stream)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:
            err = api_error(e)
            return json_response(err.body(), err.status)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        shape = ep.ChatShape(
            rid, int(time.time()), self.model_name, bool(req.logprobs), req.top_logprobs or 0,
            call.include_usage,
        )  # fmt: skip
        method = functools.partial(self.engine.chat, params=call.params)
        return self._generate(make_prompts(call.prompts, call.n, rid), method, kwargs, shape,
                              call.stream)  # fmt: skip

    async def responses(self, request: Request) -> Response | GenerationResponse:
        """``POST /v1/responses``."""
        try:
            req = await read_json(request, ResponsesRequest, self.max_request_bytes)
            self._check_model(req.model)
            call, conversation = responses_call(
                req,
                self.response_store,
                self.client_priority_range,
                self._reserved_template_options,
                self.chat_template,
            )
            kwargs = self._engine_kwargs(request, call.kwargs, req.cache_salt, call.stream)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:
            err = api_error(e)
            return json_response(err.body(), err.status)
        shape = ResponsesShape(req, self.model_name, conversation, self.response_store,
                               keep=req.store is not False)  # fmt: skip
        method = functools.partial(self.engine.chat, params=call.params)
        return self._generate(make_prompts(call.prompts, 1, shape.id), method, kwargs, shape,
                              call.stream)  # fmt: skip


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status >= 500:
        logger.error("HTTP %d: %s", status, exc.detail)
    detail = exc.detail if status < 500 and isinstance(exc.detail, str) else None
    err = APIError(
        detail or ("error" if status < 500 else INTERNAL_ERROR),
        status,
        type="invalid_request_error" if status < 500 else "server_error",
        code="not_found" if status == 404 else None,
    )
    return json_response(err.body(), status, exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    err = api_error(exc)
    return json_response(err.body(), err.status)


def _middleware(
    keys: list[str], metrics_without_auth: bool, allowed_origins: Iterable[str]
) -> list[Middleware]:
    """CORS for ``allowed_origins`` (outermost: preflights are answered before the key
    check), then the API-key check when there are ``keys``."""
    middleware: list[Middleware] = []
    origins = list(allowed_origins)
    if origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        )
    if keys:
        open_paths = {"/health"} | ({"/metrics"} if metrics_without_auth else set())
        middleware.append(Middleware(APIKeyMiddleware, keys=keys, open_paths=open_paths))
    return middleware


def create_app(
    engine: AsyncEngine,
    served_model_name: str | None = None,
    *,
    api_keys: str | Iterable[str] | None = None,
    metrics_without_auth: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trust_request_chat_template: bool = False,
    client_priority_range: tuple[int, int] = (0, 0),
    share_prefix_cache_across_keys: bool = False,
    allowed_origins: Iterable[str] = (),
    chat_template: str | None = None,
    tenant_header: str | None = None,
    admission: str = "refuse",
    queue_events: bool = False,
) -> Starlette:
    """Build the OpenAI-compatible Starlette app for ``engine``.

    The app's lifespan runs the engine (``async with engine``): serve it with uvicorn or
    any ASGI server that runs lifespans. uvicorn ends the lifespan only after the open
    responses, so call ``engine.begin_shutdown()`` when its shutdown starts (as ``python -m
    asyncllm serve`` does) for streams in flight to end at once. ``app.state.server`` is the
    :class:`OpenAIServer` (its ``metrics``, ``engine``, ``model_name``). Each keyword is
    the ``serve`` option of the same name (see the module's Security section).

    Args:
        engine: a built, not yet started :class:`AsyncEngine`.
        served_model_name: the name clients pass as ``model``; default the base name of
            the engine's ``config.model`` ("default", or the directory or file it was
            loaded from).
        api_keys: keys a client must present (``Authorization: Bearer <key>``) on every
            route but ``/health``; a string may hold several, comma-separated. None or
            empty: no authentication.
        metrics_without_auth: serve ``/metrics`` without a key.
        max_request_bytes: the largest request body read (past it: 413).
        trust_request_chat_template: let requests send their own ``chat_template``.
        client_priority_range: ``(lo, hi)``, ``lo <= 0 <= hi``: the ``priority`` values
            requests may ask for (outside: 400).
        share_prefix_cache_across_keys: let requests made with different API keys share
            prefix-cache blocks (by default each key gets its own ``cache_salt`` space).
        allowed_origins: origins allowed to call the server from a browser (CORS; "*" for
            any); none by default.
        chat_template: the chat template that renders ``/v1/chat/completions`` requests
            instead of the model's: a built-in name ("hermes": ChatML with Hermes-style tool
            calling, for a model whose own template has no tool support), a Jinja file, or
            a template's text (:func:`asyncllm.chat_templates.load_chat_template`). None:
            the model's.
        tenant_header, admission, queue_events: as :class:`OpenAIServer` takes them.

    Raises:
        ValueError: a bad ``max_request_bytes``, ``client_priority_range`` or ``admission``; a
            ``chat_template`` that names no built-in template or file.
    """
    server = OpenAIServer(
        engine,
        served_model_name or default_served_name(engine.config.model),
        max_request_bytes=max_request_bytes,
        trust_request_chat_template=trust_request_chat_template,
        client_priority_range=client_priority_range,
        share_prefix_cache=share_prefix_cache_across_keys,
        chat_template=None if chat_template is None else load_chat_template(chat_template),
        tenant_header=tenant_header,
        admission=admission,
        queue_events=queue_events,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    middleware = _middleware(split_commas(api_keys), metrics_without_auth, allowed_origins)
    app = Starlette(
        routes=server.routes(),
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.server = server
    return app
