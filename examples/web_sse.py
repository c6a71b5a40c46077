"""Stream tokens to web clients as server-sent events (Starlette + uvicorn).

    pip install 'asyncllm[server]'          # starlette and uvicorn
    python examples/web_sse.py --model default --port 8000
    curl -N 'http://127.0.0.1:8000/generate?prompt=Tell+me+a+story&max_tokens=200'
    # or open http://127.0.0.1:8000/ in a browser

Every engine output becomes one event ``data: {"text": "..."}``; the last one is
``event: done`` with the finish reason and the request's metrics. Parameter errors answer
400 before the stream starts; errors after it started arrive as ``event: error``.

When the client goes away (curl interrupted, tab closed), generation stops at once: Starlette
stops iterating the response body, ``ClosingStreamingResponse`` closes the body generator,
and its ``finally`` closes the engine stream, which aborts the request and frees its KV
blocks before the next step. ``GET /stats`` shows the engine's counters (``num_running``,
``num_free_blocks``...) and how many streams were cut short by their client.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from asyncllm import AsyncEngine, QueueFull, SamplingParams

PAGE = """<!doctype html>
<meta charset="utf-8"><title>asyncllm SSE demo</title>
<form id="f"><input id="p" size="60" value="Tell me a short story."> <button>Send</button></form>
<pre id="out" style="white-space: pre-wrap"></pre>
<script>
let source = null;
document.getElementById("f").onsubmit = (e) => {
  e.preventDefault();
  if (source) source.close();  // closing the connection aborts the request on the server
  const out = document.getElementById("out");
  out.textContent = "";
  const q = encodeURIComponent(document.getElementById("p").value);
  source = new EventSource(`/generate?prompt=${q}&max_tokens=256`);
  source.onmessage = (m) => { out.textContent += JSON.parse(m.data).text; };
  source.addEventListener("done", (m) => { out.textContent += "\\n\\n" + m.data; source.close(); });
  source.addEventListener("error", () => source.close());
};
</script>
"""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body generator when the response ends.

    On a client disconnect Starlette stops iterating the body but leaves the generator
    suspended (it would only be closed at garbage collection); closing it here runs its
    ``finally`` block, which closes the engine stream and so aborts the request now.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def create_app(engine: AsyncEngine) -> Starlette:
    """The demo app; its lifespan runs the engine (``async with engine``)."""
    counters = {"streams": 0, "completed": 0, "client_gone": 0}

    async def generate(request: Request) -> Response:
        args: dict[str, Any] = dict(request.query_params)
        if request.method == "POST":
            args.update(await request.json())
        prompt = args.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return JSONResponse({"error": "prompt is required"}, status_code=400)
        try:
            params = SamplingParams(
                max_tokens=int(args.get("max_tokens", 128)),
                temperature=float(args.get("temperature", 0.0)),
                ignore_eos=str(args.get("ignore_eos", "")).lower() in ("1", "true"),
            )
        except ValueError as e:  # InvalidRequestError names the field
            return JSONResponse({"error": str(e)}, status_code=400)
        use_chat = bool(getattr(engine.tokenizer, "chat_template", None))
        if str(args.get("raw", "")).lower() in ("1", "true"):
            use_chat = False

        async def events() -> AsyncIterator[str]:
            counters["streams"] += 1
            if use_chat:
                stream = engine.chat([{"role": "user", "content": prompt}], params)
            else:
                stream = engine.stream(prompt, params)
            finished = False
            try:
                async for out in stream:
                    if out.text:
                        yield sse({"text": out.text})
                    if out.finished:
                        finished = True
                        metrics = out.metrics
                        yield sse(
                            {
                                "finish_reason": out.finish_reason,
                                "prompt_tokens": out.num_prompt_tokens,
                                "generated_tokens": out.num_generated_tokens,
                                "ttft_s": metrics.ttft if metrics else None,
                                "mean_tpot_s": metrics.mean_tpot if metrics else None,
                            },
                            event="done",
                        )
                counters["completed"] += 1
            except (ValueError, QueueFull) as e:  # bad prompt, or the queue is full
                finished = True
                yield sse({"error": str(e)}, event="error")
            finally:
                # Reached on a client disconnect too: closing the stream aborts the request
                # and frees its KV blocks.
                await stream.aclose()
                if not finished:
                    counters["client_gone"] += 1

        return ClosingStreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stats(request: Request) -> Response:
        return JSONResponse({**engine.stats(), **counters})

    async def index(request: Request) -> Response:
        return HTMLResponse(PAGE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine:
            yield

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/generate", generate, methods=["GET", "POST"]),
            Route("/stats", stats),
        ],
        lifespan=lifespan,
    )
    app.state.counters = counters
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help='"default", an HF directory or a .gguf')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args(argv)

    import uvicorn

    engine = AsyncEngine.from_pretrained(args.model, max_num_seqs=args.max_num_seqs)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
