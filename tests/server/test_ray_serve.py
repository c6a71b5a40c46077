"""Replicas on Ray Serve (asyncllm.integrations.ray_serve): streaming through a handle and
through HTTP with the openai client, cancellation, prefix-aware routing, replica death.

One local Ray instance (2 CPUs, a small object store) serves the module; each test deploys
its own application of tiny random-weight replicas (1 torch thread, 1 Ray CPU each).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import openai  # noqa: E402

from asyncllm import SamplingParams  # noqa: E402
from asyncllm.bench.tiny_model import save_tiny_llama  # noqa: E402
from asyncllm.core.block_manager import BlockManager, prompt_block_hashes  # noqa: E402
from asyncllm.integrations import ray_serve as rs  # noqa: E402
from asyncllm.worker.device import COMPILE_ENV  # noqa: E402
from tests.conftest import unpinned  # noqa: E402

#: The module starts a local Ray instance (~60 s) and deploys replicas.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = {"num_threads": 1, "device": "cpu", "max_model_len": 256, "kv_cache_bytes": 2**21}
SYSTEMS = [
    "You are a terse assistant for a shipping company. Answer in one line. " * 3,
    "You are a cheerful tutor who explains chemistry to children with examples. " * 3,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[int]:
    """A local Ray instance and Serve on a free loopback port; yields the port. Its
    processes run on every core, not only this test worker's (``unpinned``)."""
    port = _free_port()
    with unpinned():
        _start_ray()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


def _start_ray() -> None:
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 2**20,
        include_dashboard=False,
        logging_level="warning",
        runtime_env={
            "env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", COMPILE_ENV: "0"}
        },
    )


def _deploy(
    tiny: pathlib.Path, name: str, *, router: str = "prefix", replicas: int = 2, **engine: Any
) -> Any:
    """Deploy an app; replicas reserve half a CPU each, so two apps fit on 2 CPUs."""
    app = rs.build_app(
        str(tiny), num_replicas=replicas, engine_config={**ENGINE, **engine}, router=router,
        app_options={"served_model_name": "tiny"},
        llm_options={"ray_actor_options": {"num_cpus": 0.5}},
    )  # fmt: skip
    return serve.run(app, name=name, route_prefix=f"/{name}")


@contextlib.contextmanager
def _deployed(tiny: pathlib.Path, name: str, **kwargs: Any) -> Iterator[Any]:
    """:func:`_deploy`, the app deleted however the block ends: left deployed (a failed
    test), its replicas hold the CPUs the next app needs, and that deploy waits forever."""
    _deploy(tiny, name, **kwargs)
    try:
        yield _llm(name)
    finally:
        serve.delete(name)


@pytest.fixture(scope="module")
def prefix_app(ray_cluster: int, tiny_llama_dir: pathlib.Path) -> Iterator[str]:
    """Two replicas behind the prefix-cache router, shared by the tests; yields its name."""
    _deploy(tiny_llama_dir, "main")
    yield "main"
    serve.delete("main")


def _llm(name: str) -> Any:
    return serve.get_deployment_handle("LLMServer", app_name=name)


async def _replica_stats(llm: Any) -> list[dict[str, Any]]:
    return [await llm.stats.remote(replica=k) for k in range(2)]


async def _all_blocks_free(llm: Any) -> bool:
    stats = await _replica_stats(llm)
    return all(
        s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0 for s in stats
    )


async def _wait_blocks_free(llm: Any) -> None:
    for _ in range(400):  # a step or two on the replica; bounded
        if await _all_blocks_free(llm):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(await _replica_stats(llm))


# ----------------------------------------------------------------- the policy, without Ray


def test_prompt_block_hashes_are_the_schedulers() -> None:
    """The router hashes a prompt's blocks exactly as the engine's block manager does (the
    salt included), and only the blocks the prefix cache can serve."""

    class Tokens:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

        def token_ids(self, start: int, stop: int) -> list[int]:
            return self.ids[start:stop]

    ids = list(range(100, 149))  # 49 tokens: 3 full blocks of 16 before the last token
    for salt in (None, "tenant-a"):
        bm = BlockManager(num_blocks=8, block_size=16)
        assert prompt_block_hashes(ids, 16, salt) == bm.block_hashes("r", Tokens(ids), salt, 48)
    assert len(prompt_block_hashes(ids[:48], 16)) == 2  # the last token is never cached
    assert prompt_block_hashes(ids, 16, "a") != prompt_block_hashes(ids, 16, "b")
    assert len(prompt_block_hashes(ids, 16, max_blocks=1)) == 1


def test_affinity_policy_and_load_guard() -> None:
    policy = rs.PrefixAffinity(record_blocks=4, imbalance_threshold=2)
    a, b = [b"a1", b"a2", b"a3"], [b"b1", b"b2"]
    policy.record("r0", a)
    assert policy.rank(a, {"r0": 0, "r1": 0})[0] == "r0"
    assert policy.rank(a, {"r0": 2, "r1": 0})[0] == "r0"  # within the threshold
    assert policy.rank(a, {"r0": 3, "r1": 0})[0] == "r1"  # imbalanced: least loaded
    # a new prefix goes to the least loaded, ties to the replica with the fewest records
    assert policy.rank(b, {"r0": 0, "r1": 0})[0] == "r1"
    assert policy.match("r0", [b"a1", b"x", b"a3"]) == 1  # a leading run only
    policy.record("r0", b)  # bounded: the oldest hashes go
    assert policy.match("r0", a) == 0 and policy.match("r0", b) == 2
    policy.forget_except({"r1"})
    assert policy.match("r0", b) == 0
    with pytest.raises(ValueError):
        rs.PrefixAffinity(imbalance_threshold=-1)


class _FakeReplica:
    """What Serve's routing loop reads of a replica: its id, capacity and queue length."""

    def __init__(self, unique_id: str, deployment: Any, queue_len: int) -> None:
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(unique_id, deployment)
        self.max_ongoing_requests = 2
        self.queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


async def _router(tiny: pathlib.Path, queue_len: int) -> tuple[Any, list[_FakeReplica]]:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    dep = DeploymentID(name="LLMServer", app_name="unit")
    router = rs.PrefixCacheRouter(dep, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(model=str(tiny))
    replicas = [_FakeReplica(f"r{i}", dep, queue_len) for i in range(2)]
    router.update_replicas(replicas)
    return router, replicas


def _counted(router: Any, replicas: list[_FakeReplica]) -> list[int]:
    """The requests the router counts in flight on each replica (its part of the load)."""
    return [router._inflight[r.replica_id.unique_id] for r in replicas]


def _pending(key: str) -> Any:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    meta = RequestMetadata(request_id=key, internal_request_id=key, call_method="stream")
    return PendingRequest(args=["Hello there, " * 8], kwargs={}, metadata=meta)


@pytest.mark.parametrize("decisions", [1, 3])
async def test_request_cancelled_before_dispatch_leaves_no_load(
    tiny_llama_dir: pathlib.Path, decisions: int
) -> None:
    """Every replica is full, so the routed request waits (Serve ranks it again after each
    backoff); its caller gives up: it must not stay counted in the chosen replica's load
    (Serve calls neither on_request_routed nor on_request_completed for it)."""
    router, replicas = await _router(tiny_llama_dir, queue_len=2)
    task = asyncio.ensure_future(router._choose_replica_for_request(_pending("a")))
    for _ in range(10_000):  # until ranked `decisions` times (bounded)
        if router.num_decisions >= decisions:
            break
        await asyncio.sleep(0.001)
    assert sum(_counted(router, replicas)) == 1  # counted while it waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the future's done callbacks
    assert _counted(router, replicas) == [0, 0]
    assert not router._pending and not router._watched


async def test_dispatched_request_counts_until_completed(tiny_llama_dir: pathlib.Path) -> None:
    router, replicas = await _router(tiny_llama_dir, queue_len=0)
    chosen = await router._choose_replica_for_request(_pending("b"))
    await asyncio.sleep(0)
    # sent: counted until Serve reports its completion
    assert router._inflight[chosen.replica_id.unique_id] == 1
    router.on_request_completed(chosen.replica_id, "b")
    assert _counted(router, replicas) == [0, 0]


# ----------------------------------------------------------------- two replicas on Ray Serve


async def test_handle_and_http_streaming_and_cancel(ray_cluster: int, prefix_app: str) -> None:
    llm = _llm(prefix_app)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    text = ""
    outs = []
    async for out in llm.options(stream=True).stream.remote("Hello there", params):
        outs.append(out)
        text += out.text
    assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 8

    # HTTP, with the official client, on Serve's proxy: the same routes as `serve`
    base = f"http://127.0.0.1:{ray_cluster}/{prefix_app}/v1"
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]
    whole = await client.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == text  # greedy: same replica weights, same answer
    pieces = []
    async for chunk in await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        pieces += [c.finish_reason for c in chunk.choices]
    assert pieces[-1] == "length"

    # a handle stream cancelled mid-way: aborted on its replica, its blocks freed
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    resp = llm.options(stream=True).stream.remote("Tell me a long story", long)
    got = 0
    async for _ in resp:
        got += 1
        if got == 3:
            break
    resp.cancel()
    await _wait_blocks_free(llm)

    # an HTTP stream whose client goes away: the same
    stream = await client.completions.create(
        model="tiny", prompt="Another long story", max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for _ in stream:
        break
    await stream.close()
    await _wait_blocks_free(llm)
    await client.close()


#: The queue-full test's context: its slot's request decodes this many tokens (seconds even
#: at the C++ forward's ~1 ms a step for the tiny model), so the queue stays full while
#: both refused callers ask. 250 tokens (within 256 positions) took a second or two in the
#: modeling code, and under the C++ forward a 429 was once answered after the slot had
#: finished.
LONG_CONTEXT = 4096


async def test_queue_full_is_429(
    ray_cluster: int, tmp_path: pathlib.Path, default_model_dir: pathlib.Path
) -> None:
    """A replica whose waiting queue is full refuses: the handle caller gets QueueFull, an
    HTTP client 429 (nothing waits without bound). Both ask at once, right after the queue
    is seen full, while the slot's request still has thousands of tokens to go."""
    from asyncllm.errors import QueueFull

    tiny = save_tiny_llama(tmp_path / "tiny-long", default_model_dir, max_positions=LONG_CONTEXT)
    engine = dict(max_model_len=LONG_CONTEXT, kv_cache_bytes=2**23)
    with _deployed(tiny, "full", replicas=1, max_waiting=1, max_num_seqs=1, **engine) as llm:
        await _queue_full_refuses(llm, ray_cluster, tiny, QueueFull)


async def _queue_full_refuses(
    llm: Any, port: int, tiny_llama_dir: pathlib.Path, queue_full: type[Exception]
) -> None:
    client = rs.EngineClient(llm, str(tiny_llama_dir), LONG_CONTEXT)
    long = SamplingParams(max_tokens=LONG_CONTEXT - 64, ignore_eos=True)
    running = client.stream("One long story", long)
    await running.__anext__()  # running: the one sequence slot is taken
    waiting = client.stream("Another long story", long)
    queued = asyncio.ensure_future(waiting.__anext__())
    for _ in range(400):  # until the second request waits on the replica (bounded)
        if (await llm.stats.remote())["num_waiting"] == 1:
            break
        await asyncio.sleep(0.01)
    http = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/full/v1", api_key="x", max_retries=0
    )

    async def by_handle() -> None:
        async for _ in client.stream("Hi", SamplingParams(max_tokens=2)):
            pass

    handle, over_http = await asyncio.gather(
        by_handle(),
        http.completions.create(model="tiny", prompt="Hi", max_tokens=2),
        return_exceptions=True,
    )
    await http.close()
    assert isinstance(handle, queue_full), handle
    assert isinstance(over_http, openai.RateLimitError), over_http
    queued.cancel()
    await running.aclose()
    s = await llm.stats.remote()
    for _ in range(400):
        s = await llm.stats.remote()
        if s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0:
            break
        await asyncio.sleep(0.025)
    assert s["num_free_blocks"] == s["num_total_blocks"], s


async def _hit_rate(llm: Any, users: int) -> tuple[float, list[dict[str, Any]]]:
    """Send every system prompt's users' chats concurrently (one wave per user index);
    returns the prompt tokens served from the replicas' prefix caches over all prompt
    tokens, and the replicas' stats."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    cached = total = 0

    async def one(s: int, u: int) -> None:
        nonlocal cached, total
        msgs = [{"role": "system", "content": SYSTEMS[s]}, {"role": "user", "content": f"q{u}"}]
        gen = llm.options(stream=True).chat.remote(msgs, params, request_id=f"s{s}-u{u}")
        async for out in gen:
            if out.finished:
                cached += out.num_cached_tokens
                total += out.num_prompt_tokens

    for u in range(users):  # both prefixes at once, so load stays balanced across them
        await asyncio.gather(*(one(s, u) for s in range(len(SYSTEMS))))
    return cached / total, await _replica_stats(llm)


async def test_routing_by_prefix_vs_default(prefix_app: str, tiny_llama_dir: pathlib.Path) -> None:
    users = 6
    llm = _llm(prefix_app)
    for k in range(2):  # a clean slate: no cached prefixes, no served ids from other tests
        await llm.reset_prefix_cache.remote(replica=k)
    before = [set(s["served"]) for s in await _replica_stats(llm)]
    rate, stats = await _hit_rate(llm, users)
    for st, old in zip(stats, before, strict=True):
        st["served"] = [r for r in st["served"] if r not in old]
    with _deployed(tiny_llama_dir, "pow2", router="default") as pow2:
        default_rate, _ = await _hit_rate(pow2, users)
    print(f"\nprefix-cache hit rate: prefix router {rate:.3f}, Ray's default router "
          f"{default_rate:.3f}")  # fmt: skip
    # every system prompt's requests on one replica, and the two prompts on different ones
    for st in stats:
        prefixes = {r.split("-")[0] for r in st["served"]}
        assert len(prefixes) == 1, st["served"]
    assert {r.split("-")[0] for st in stats for r in st["served"]} == {"s0", "s1"}
    assert rate >= default_rate


async def test_replica_death_ends_streams(ray_cluster: int, tiny_llama_dir: pathlib.Path) -> None:
    """Killing a replica's process mid-stream ends its streams with a clear error (the
    handle's RayActorError, the client's EngineDeadError), not a hang; Serve replaces it."""
    from asyncllm.errors import EngineDeadError

    with _deployed(tiny_llama_dir, "die", replicas=1) as llm:
        await _replica_death_ends_streams(llm, tiny_llama_dir, EngineDeadError)


async def _replica_death_ends_streams(
    llm: Any, tiny_llama_dir: pathlib.Path, engine_dead: type[Exception]
) -> None:
    client = rs.EngineClient(llm, str(tiny_llama_dir), 256)
    first = (await llm.stats.remote())["replica_id"]
    gen = client.stream("A very long story", SamplingParams(max_tokens=250, ignore_eos=True))
    await gen.__anext__()
    replica = next(
        a for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::die#LLMServer#")
    )  # fmt: skip
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    with pytest.raises(engine_dead, match="replica"):
        async for _ in gen:
            pass
    for _ in range(600):  # Serve starts a new replica (bounded wait)
        try:
            stats = await llm.stats.remote()
            if stats["replica_id"] != first:
                break
        except Exception:
            pass
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the replica was not replaced")
    out = [o async for o in client.stream("Hi", SamplingParams(max_tokens=2, ignore_eos=True))]
    assert out[-1].finished


# ------------------------------------------------------ python -m asyncllm serve --replicas


def _metric(text: str, name: str) -> float:
    """The value of ``asyncllm:<name>{model_name="tiny"}`` in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(f'asyncllm:{name}{{model_name="tiny"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def _use_cli_server(base: str) -> dict[str, Any]:
    """Requests to a starting `serve --replicas 1`; returns what they saw."""
    import httpx

    seen: dict[str, Any] = {}
    with httpx.Client(base_url=base, timeout=60) as http:
        for _ in range(3000):  # until deployed (bounded)
            if http.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        seen["models"] = [m["id"] for m in http.get("/v1/models").json()["data"]]
        body = {"model": "tiny", "prompt": "A long story", "max_tokens": 200, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()  # kept: dropping it would close the stream
            next(lines)  # the first token: the request runs on its replica
            seen["running"] = _metric(http.get("/metrics").text, "num_requests_running")
            lines.close()
        for _ in range(400):  # the client went away: aborted on the replica (bounded)
            page = http.get("/metrics").text
            if _metric(page, "num_requests_running") == 0:
                break
            time.sleep(0.025)
        seen["queries"] = _metric(page, "prefix_cache_queries_total")
        prefix = "asyncllm:compiled_forward_state{"  # replicas per state: the one is off
        seen["compile_off"] = [ln for ln in page.splitlines() if ln.startswith(prefix)]
        llm = serve.get_deployment_handle("LLMServer", app_name=rs.CLI_APP_NAME)
        seen["stats"] = llm.stats.remote(replica=0).result()
    return seen


def test_cli_replicas_serves_and_stops_on_sigterm(
    ray_cluster: int, prefix_app: str, tiny_llama_dir: pathlib.Path
) -> None:
    """`python -m asyncllm serve --replicas 1` through the CLI's own code, on the module's
    Ray: the routes answer, /metrics' engine gauges are the replicas' (read on each scrape),
    a client that goes away is aborted, and SIGTERM stops it, removing its application and
    nothing else (the Ray instance and the other apps stay)."""
    import argparse
    import os
    import signal
    import threading

    from asyncllm.__main__ import serve as serve_command
    from asyncllm.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_llama_dir), "--replicas", "1", "--port", str(ray_cluster),
         "--served-model-name", "tiny", "--device", "cpu", "--max-model-len", "256",
         "--kv-cache-bytes", str(2**21)]
    )  # fmt: skip
    seen: dict[str, Any] = {}

    def client() -> None:
        try:
            seen.update(_use_cli_server(f"http://127.0.0.1:{ray_cluster}"))
        except BaseException as e:
            seen["error"] = e
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # as a service manager stops it

    # a SIGTERM that came after the command returned must not end the test run
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        thread = threading.Thread(target=client)
        thread.start()
        assert serve_command(args) == 0
        thread.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "error" not in seen, seen.get("error")
    assert seen["models"] == ["tiny"]
    assert seen["running"] == 1
    assert seen["stats"]["num_running"] == 0
    assert seen["queries"] == seen["stats"]["prefix_cache_queries"] > 0
    states = {ln.split('state="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
              for ln in seen["compile_off"]}  # fmt: skip
    assert states == {"off": 1.0, "compiling": 0.0, "ready": 0.0, "failed": 0.0}
    apps = serve.status().applications
    assert rs.CLI_APP_NAME not in apps and prefix_app in apps and ray.is_initialized()
