"""The prefix cache in tiers: the host tier's bookkeeping alone (pure Python), a scheduler
whose every read is checked against a simulated cache while blocks spill to and load from
the host tier beside preemption swap, and engines whose evicted prefixes come back from
host memory with the outputs of a recompute."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm import EngineConfig, SamplingParams
from asyncllm.core.block_manager import BlockManager, BlockPool, BlockPoolError, hash_block
from asyncllm.core.host_store import HostPrefixStore
from asyncllm.core.kv_groups import KVGroups
from asyncllm.core.plan import SchedulerOutput
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler
from tests.core.test_kv_groups import _drive, _SimulatedCache, _Tokens
from tests.worker.test_hybrid_kv import BLOCK_BYTES as HYBRID_BLOCK_BYTES
from tests.worker.test_hybrid_kv import SMALL, _greedy, _prompt
from tests.worker.test_hybrid_kv import gemma3_dir as gemma3_dir  # the module's fixtures
from tests.worker.test_hybrid_kv import reference as reference

BS = 4
#: One block of the tiny Llama in float32: 2 layers x K and V x 2 KV heads x 16 x 4 bytes x 4.
TINY_BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _h(i: int, salt: str | None = None) -> bytes:
    return hash_block(None, [i], salt)


# ---------------------------------------------------------------- the store alone


def test_store_spills_loads_and_replaces_least_recently_used():
    pool = BlockPool(4)
    store = HostPrefixStore(pool, max_blocks=2)
    store.spill(10, 0, _h(1))
    store.spill(11, 0, _h(2))
    assert store.spills == [(10, 0), (11, 1)] and len(store) == 2 and pool.num_free == 2
    store.spill(12, 0, _h(1))  # already stored: no copy, only most recently used
    assert len(store.spills) == 2
    store.spill(13, 0, _h(3))  # full, every slot written this step: dropped
    assert store.num_dropped == 1 and store.lookup(_h(3)) is None
    out: list[tuple[int, int]] = []
    into: list[tuple[int, int]] = []
    store.drain(out, into)
    assert out == [(10, 0), (11, 1)] and not into and not store.spills
    store.new_step()
    store.spill(14, 0, _h(3))  # replaces the least recently used key, _h(2), in slot 1
    assert store.lookup(_h(2)) is None and store.lookup(_h(3)) == 1
    assert store.lookup(_h(1)) == 0 and store.lookup(_h(1), group=1) is None
    assert store.load(0, 20) == ((0, _h(1)), False) and store.loads == [(0, 20)]
    store.spill(15, 0, _h(4))  # both slots pinned (written, read) this step: dropped
    assert store.num_dropped == 2
    store.check_invariants()
    assert pool.num_free == 2  # the store never takes more than max_blocks


def test_make_room_gives_up_unpinned_slots_for_a_swap_out():
    pool = BlockPool(4)
    store = HostPrefixStore(pool, max_blocks=4)
    for i in range(4):
        store.spill(i, 0, _h(i))
    store.new_step()
    store.pin(store.lookup(_h(0)) or 0)  # a hit read this step
    assert pool.num_free == 0
    assert not store.make_room(4)  # slot 0 is pinned: three at most, nothing changed
    assert len(store) == 4
    assert store.make_room(2)
    assert pool.num_free == 2 and len(store) == 2
    assert store.lookup(_h(0)) == 0 and store.lookup(_h(1)) is None  # LRU order, pin kept
    store.check_invariants()
    assert store.clear() == 1 and len(store) == 1  # the pinned slot stays for its step
    store.new_step()
    assert store.clear() == 1 and pool.num_free == 4
    pool.check_invariants()


def test_salts_and_groups_are_separate_keys():
    pool = BlockPool(8)
    store = HostPrefixStore(pool, max_blocks=8)
    store.spill(0, 0, _h(5, "tenant-a"))
    assert store.lookup(_h(5, "tenant-b")) is None and store.lookup(_h(5)) is None
    assert store.lookup(_h(5, "tenant-a"), group=1) is None
    assert store.lookup(_h(5, "tenant-a")) == 0
    with pytest.raises(ValueError):
        HostPrefixStore(pool, max_blocks=0)


def test_block_manager_spills_an_evicted_prefix_and_loads_it_back():
    store = HostPrefixStore(BlockPool(8), max_blocks=8)
    bm = BlockManager(4, BS, host_store=store)
    a = _Tokens(list(range(1, 14)))  # 13 tokens: 3 full blocks a hit may serve
    assert bm.allocate("a", 13)
    bm.cache_full_blocks("a", a, None, 13)
    a_blocks = list(bm.block_table("a"))
    bm.free("a")
    assert bm.allocate("b", 16)  # takes the whole pool: a's 3 cached blocks are evicted
    assert sorted(d for d, _ in store.spills) == sorted(a_blocks[:3])
    store.drain([], [])
    bm.free("b")
    store.new_step()
    hit = bm.find_cached_prefix("a2", a, 13, None)
    assert len(hit) == 3 and hit.num_host_blocks == 3 and not list(hit.live_blocks())
    assert bm.allocate("a2", 13, hit)
    table = bm.block_table("a2")
    assert [(d, store.key(s)[1]) for s, d in store.loads] == [
        (table[i], bm.block_hashes("a2", a, None, 12)[i]) for i in range(3)
    ]
    # The loaded blocks are ordinary cached pool blocks now: a third request shares them.
    again = bm.find_cached_prefix("a3", a, 13, None)
    assert again.tables[0] == table[:3] and again.num_host_blocks == 0
    assert bm.find_cached_prefix("s", a, 13, "salted").tables == [[]]
    bm.free("a2")
    bm.check_invariants()
    store.check_invariants()


def test_a_host_hit_that_does_not_fit_changes_nothing():
    store = HostPrefixStore(BlockPool(8), max_blocks=8)
    bm = BlockManager(4, BS, host_store=store)
    a = _Tokens(list(range(1, 14)))
    assert bm.allocate("a", 13)
    bm.cache_full_blocks("a", a, None, 13)
    bm.free("a")
    assert bm.allocate("b", 16)
    bm.free("b")
    store.drain([], [])
    assert bm.allocate("c", 4)  # 3 free blocks: 3 host hits + 1 new block do not fit
    hit = bm.find_cached_prefix("a2", a, 13, None)
    assert hit.num_host_blocks == 3
    assert not bm.allocate("a2", 13, hit)
    assert not store.loads and bm.num_free_blocks == 3
    with pytest.raises(BlockPoolError):
        BlockManager(4, BS).allocate("x", 4, hit)  # a host hit with no store to load it
    bm.free("c")
    bm.check_invariants()


# ---------------------------------------------------------------- the scheduler, simulated


def _drive_tiers(sched: Scheduler, store: HostPrefixStore, cache: _SimulatedCache) -> None:
    """:func:`_drive`, checking each plan (the worker copies each list with one gather and
    one scatter: no destination twice) and, after each step, the store and the CPU pool:
    every CPU block free, in the store, or swapped out."""
    cpu = store.pool

    def check(plan: SchedulerOutput) -> None:
        assert len({c for _, c in plan.swap_out}) == len(plan.swap_out)
        assert len({d for _, d in plan.swap_in}) == len(plan.swap_in)
        store.check_invariants()
        cpu.check_invariants()
        swapped = sum(len(r.cpu_blocks or ()) for r in sched.requests.values())
        pending = len(plan.cpu_blocks_to_free)  # freed by the step's update
        assert cpu.num_free + len(store) + swapped in (cpu.num_blocks, cpu.num_blocks - pending)

    _drive(sched, cache, check=check)


@settings(max_examples=40, deadline=None)
@given(
    rounds=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=2, max_size=4),
    num_blocks=st.integers(35, 60),
    cpu_blocks=st.integers(4, 40),
    store_blocks=st.integers(1, 40),
    budget=st.integers(3, 16),
    swap=st.booleans(),
    hybrid=st.booleans(),
)
def test_scheduler_reads_what_it_wrote_through_the_host_tier(
    rounds, num_blocks, cpu_blocks, store_blocks, budget, swap, hybrid
):
    """Rounds of requests on four system prompts (a round's requests arrive together, after
    the previous round finished): a small pool evicts, the host tier spills and loads,
    preemption swaps into the same CPU pool; every position a layer reads holds its K/V,
    and the CPU pool's blocks are free, in the store or swapped out, after every step."""
    groups = KVGroups.of_windows([0, 6, 6, 9, 9, 0, 6, 6] if hybrid else [0, 0])
    cpu = BlockPool(cpu_blocks)
    store = HostPrefixStore(cpu, store_blocks)
    bm = BlockManager(num_blocks, BS, groups=groups, host_store=store)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget,
                      cpu_pool=cpu if swap else None)  # fmt: skip
    cache = _SimulatedCache(bm)
    systems = [list(range(1000 * s + 1, 1000 * s + 19)) for s in range(4)]  # 18 tokens each
    n = 0
    for agents in rounds:
        for s in agents:
            prompt = [*systems[s], 900 + n]
            sched.add_request(Request(f"r{n}", prompt, max_tokens=10, max_model_len=1000,
                                      arrival_time=float(n)))  # fmt: skip
            n += 1
        _drive_tiers(sched, store, cache)


def test_a_prefix_evicted_between_rounds_is_loaded_from_the_host_tier():
    cpu = BlockPool(16)
    store = HostPrefixStore(cpu, 16)
    bm = BlockManager(12, BS, host_store=store)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, cpu_pool=cpu)
    cache = _SimulatedCache(bm)
    system = list(range(1, 17))  # 16 tokens: 4 full blocks, then the user's token
    for n, prompt in enumerate([[*system, 90], list(range(100, 140)), [*system, 91]]):
        sched.add_request(Request(f"r{n}", prompt, max_tokens=4, max_model_len=1000))
        _drive_tiers(sched, store, cache)
    # The system prompt's first block was freed last (tails first): still in the pool.
    assert sched.prefix_cache_hits == 16 and sched.prefix_cache_host_hits == 12
    assert store.num_loaded == 3


class _FakeDisk:
    """The disk tier in memory: files by key, reads done by the next ``completed()``
    (into the simulated cache's CPU slots); keys in ``corrupt`` fail to load."""

    def __init__(self) -> None:
        self.files: dict[tuple[int, bytes], list[object]] = {}
        self.corrupt: set[tuple[int, bytes]] = set()
        self.cache: _SimulatedCache | None = None
        self._reads: list[tuple[tuple[int, bytes], int]] = []

    def has(self, key):
        return key in self.files

    def request_load(self, key, slot):
        self._reads.append((key, slot))

    def completed(self):
        done = []
        for key, slot in self._reads:
            ok = key not in self.corrupt
            if ok:
                self.cache.cpu[slot] = list(self.files[key])
            done.append((key, slot, ok))
        self._reads = []
        return done


def _restart(disk: _FakeDisk, num_blocks: int = 40) -> tuple[Scheduler, HostPrefixStore, Any]:
    store = HostPrefixStore(BlockPool(16), 16)
    store.disk = disk
    bm = BlockManager(num_blocks, BS, host_store=store)
    bm.new_cached = []
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, cpu_pool=store.pool)
    disk.cache = _SimulatedCache(bm)
    return sched, store, disk.cache


def _run_with_disk(sched, store, cache, disk, prompts) -> None:
    bm = sched.block_manager

    def write_through(plan: SchedulerOutput) -> None:
        for block, g, h in bm.new_cached:
            disk.files.setdefault((g, h), list(cache.device[block]))
        bm.new_cached.clear()

    for n, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{n}", prompt, max_tokens=4, max_model_len=1000))
    _drive(sched, cache, check=write_through)
    store.check_invariants()


def test_a_restarted_scheduler_reads_the_system_prompt_from_disk():
    """A first scheduler writes every cached block through; a second one (restarted, empty
    pool and store) waits a step for the system prompt's files, then hits them, and every
    position its layers read holds the right K/V; a corrupt file is recomputed, and a
    different salt never asks the disk."""
    disk = _FakeDisk()
    system = list(range(1, 17))  # 4 full blocks before the user's token
    _run_with_disk(*_restart(disk), disk, [[*system, 90]])
    assert len(disk.files) == 5  # 21 tokens computed: 5 full blocks
    sched, store, cache = _restart(disk)
    sched.add_request(Request("a", [*system, 91], max_tokens=4, max_model_len=1000))
    assert not sched.schedule().chunks  # waiting for its 4 files
    _drive(sched, cache)
    assert sched.prefix_cache_disk_hits == sched.prefix_cache_hits == 16
    assert store.num_disk_loaded == 4
    disk.corrupt.add(next(k for k in disk.files if k[1] == hash_block(None, system[:4])))
    sched, store, cache = _restart(disk)
    _run_with_disk(sched, store, cache, disk, [[*system, 92]])
    assert sched.prefix_cache_hits == 0 and store.num_disk_failed == 1
    sched, store, cache = _restart(disk)
    req = Request("s", [*system, 91], max_tokens=4, max_model_len=1000, cache_salt="other")
    sched.add_request(req)
    assert sched.schedule().chunks and not disk._reads


# ---------------------------------------------------------------- engines


def _shared(n: int, seed: int) -> list[int]:
    return _prompt(n, seed)


async def _run_sequentially(engine, prompts):
    async with engine:
        outs = [(await engine.generate(p, GREEDY)).token_ids for p in prompts]
        return outs, engine.stats()


TINY = dict(dtype="float32", block_size=BS, max_num_batched_tokens=16, max_model_len=96,
            kv_cache_bytes=24 * TINY_BLOCK_BYTES, compile=False)  # fmt: skip


async def test_an_evicted_prefix_comes_back_from_host_memory(tiny_llama_dir, make_engine):
    """A's 9 full prompt blocks are evicted by B and C (a pool of 24 blocks), then A runs
    again: every block is swapped in from the host tier, and the tokens are a recompute's."""
    a, b, c = _shared(37, 1), _shared(50, 2), _shared(50, 3)
    prompts = [a, b, c, a]
    on, s_on = await _run_sequentially(make_engine(tiny_llama_dir, **TINY), prompts)
    off, s_off = await _run_sequentially(
        make_engine(tiny_llama_dir, **TINY, host_prefix_cache_bytes=0), prompts
    )
    none, _ = await _run_sequentially(
        make_engine(tiny_llama_dir, **TINY, enable_prefix_caching=False), prompts
    )
    assert on == off == none and on[3] == on[0]
    assert s_on["prefix_cache_host_hits"] == s_on["prefix_cache_hits"] == 36
    assert s_on["prefix_cache_device_hits"] == 0
    assert s_on["num_total_host_cache_blocks"] == 24 and s_on["num_host_cache_blocks"] > 0
    assert s_off["prefix_cache_hits"] == s_off["prefix_cache_host_hits"] == 0
    assert s_off["num_total_host_cache_blocks"] == 0


async def test_swap_and_the_host_tier_share_the_cpu_pool(tiny_llama_dir, make_engine):
    """Four agents on two system prompts at once, then again, in a pool that preempts and a
    CPU pool of 12 blocks that both the host tier and swap out need: the tokens are a
    recompute's, some blocks come back from the host tier, preempted requests swap, and the
    pools are whole after (the fixture's check: CPU blocks free or held by the store)."""
    systems = [_shared(20, 5), _shared(20, 6)]
    prompts = [[*systems[i % 2], *_shared(3 + i, 10 + i)] for i in range(4)]
    kw = dict(TINY, kv_cache_bytes=30 * TINY_BLOCK_BYTES, cpu_offload_bytes=12 * TINY_BLOCK_BYTES)
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def rounds(engine):
        async with engine:
            out = []
            for _ in range(2):
                res = await asyncio.gather(*(engine.generate(p, long) for p in prompts))
                out.append([r.token_ids for r in res])
            # Other traffic evicts the system prompts; one more agent of each comes back.
            await asyncio.gather(*(engine.generate(_shared(60, 30 + i), long) for i in range(2)))
            res = await asyncio.gather(*(engine.generate(p, long) for p in prompts[:2]))
            out.append([r.token_ids for r in res])
            return out, engine.stats()

    on, s_on = await rounds(make_engine(tiny_llama_dir, **kw))
    ref, _ = await rounds(make_engine(tiny_llama_dir, **kw, enable_prefix_caching=False))
    assert on == ref
    assert s_on["num_preemptions"] > 0 and s_on["num_swapped_out_blocks"] > 0
    assert s_on["num_swapped_in_blocks"] == s_on["num_swapped_out_blocks"]
    assert s_on["prefix_cache_host_hits"] > 0


async def test_hybrid_model_loads_sliding_groups_from_the_host_tier(
    gemma3_dir,
    reference,
    make_engine,
):
    """The tiny Gemma 3 (a full group, two sliding groups of window 6): a 21-token system
    prompt evicted by other traffic comes back from host memory for every group its next
    prompt reads (the sliding groups: only the blocks the window reaches), with
    transformers' tokens. The host tier holds 200 blocks: every group's blocks spill, and
    a smaller one would replace the system prompt's with the other traffic's."""
    engine = make_engine(gemma3_dir, **SMALL, kv_cache_bytes=30 * HYBRID_BLOCK_BYTES,
                         cpu_offload_bytes=200 * HYBRID_BLOCK_BYTES, max_model_len=48)  # fmt: skip
    system = _prompt(21, seed=2)
    prompts = [[*system, 7], *(_prompt(30, seed=s) for s in (3, 4, 5)), [*system, 8]]
    async with engine:
        got = []
        for p in prompts:
            got.append([t async for o in engine.stream(p, _greedy(12)) for t in o.token_ids])
        stats = engine.stats()
    assert got == [reference(p, 12) for p in prompts]
    assert stats["prefix_cache_host_hits"] == stats["prefix_cache_hits"] == 20


async def test_reset_prefix_cache_empties_the_host_tier(tiny_llama_dir, make_engine):
    a, b, c = _shared(37, 1), _shared(50, 2), _shared(50, 3)
    engine = make_engine(tiny_llama_dir, **TINY)
    core = engine.core
    async with engine:
        for p in (a, b, c):
            await engine.generate(p, GREEDY)
        held = len(core.block_manager.host_store)
        assert held > 0
        assert await engine.reset_prefix_cache() >= held
        await engine.generate(a, GREEDY)
        assert engine.stats()["prefix_cache_hits"] == 0


async def test_recompute_mode_gets_a_pool_for_the_store_alone(tiny_llama_dir, make_engine):
    engine = make_engine(tiny_llama_dir, **TINY, preemption_mode="recompute",
                         host_prefix_cache_bytes=16 * TINY_BLOCK_BYTES)  # fmt: skip
    core = engine.core
    assert core.scheduler.cpu_pool is None
    assert core.block_manager.host_store.max_blocks == 16
    a, b, c = _shared(37, 1), _shared(50, 2), _shared(50, 3)
    outs, stats = await _run_sequentially(engine, [a, b, c, a])
    assert outs[3] == outs[0] and stats["prefix_cache_host_hits"] == 36
    plain = make_engine(tiny_llama_dir, **TINY, preemption_mode="recompute")
    assert plain.core.block_manager.host_store is None and plain.core.offload is None


def test_config_has_one_switch_for_recompute():
    """No offload pool is ``preemption_mode="recompute"``, never ``cpu_offload_bytes=0``
    (which once meant the same); the disk tier needs the host tier."""
    with pytest.raises(ValueError, match="host_prefix_cache_bytes"):
        EngineConfig(host_prefix_cache_bytes=-1)
    for host in (None, 0, 1 << 20):
        with pytest.raises(ValueError, match="preemption_mode='recompute'"):
            EngineConfig(host_prefix_cache_bytes=host, cpu_offload_bytes=0)
    with pytest.raises(ValueError, match="cpu_offload_bytes must be an integer >= 1"):
        EngineConfig(cpu_offload_bytes=-5)
    with pytest.raises(ValueError, match="needs host_prefix_cache_bytes other than 0"):
        EngineConfig(prefix_cache_dir="/tmp/x", host_prefix_cache_bytes=0)
    EngineConfig(preemption_mode="recompute", host_prefix_cache_bytes=0)
