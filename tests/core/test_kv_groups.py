"""The hybrid KV pool's bookkeeping alone (pure Python): layer groups, sliding groups freeing
the blocks behind their window, prefix hits per group, forks, swaps, and a scheduler whose
every read is checked against a simulated cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.core.block_manager import (
    PLACEHOLDER,
    BlockManager,
    BlockPool,
    hash_block,
    longest_hit,
)
from asyncllm.core.kv_groups import KVGroups
from asyncllm.core.plan import SchedulerOutput
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler

#: Gemma 3 270M: 18 layers, every sixth one (5, 11, 17) full, the others a window of 512.
GEMMA3_WINDOWS = [0 if i % 6 == 5 else 512 for i in range(18)]


class _Tokens:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        return self.ids[start:stop]


def test_gemma3_layers_make_six_groups_of_three():
    groups = KVGroups.of_windows(GEMMA3_WINDOWS)
    assert groups.windows == (0, 512, 512, 512, 512, 512)
    assert groups.layers == (
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)
    )  # fmt: skip
    assert groups.num_slots == 3 and groups.num_layers == 18 and groups.is_hybrid
    assert groups.describe() == "6 groups of 3 layers (1 full, 5 window 512)"
    where = groups.layer_slots()
    assert where[5] == (0, 0) and where[17] == (0, 2) and where[6] == (2, 2)
    # 8k tokens in chunks of 512: 512 blocks in the full group, per sliding group its
    # window (32 blocks) plus a chunk (32) plus the partly filled ends
    assert groups.blocks_per_sequence(8192, 16, 512) == 512 + 5 * 65
    assert groups.blocks_per_sequence(8192, 16, 1) == 512 + 5 * 33
    assert groups.blocks_per_sequence(100, 16, 512) == 6 * 7  # shorter than the window


def test_groups_of_other_layouts():
    plain = KVGroups.of_windows([0] * 30)
    assert plain == KVGroups.single(30) and not plain.is_hybrid
    assert plain.describe() == "1 group of 30 layers (full)"
    mistral = KVGroups.of_windows([4096] * 32)  # every layer windowed: one sliding group
    assert mistral.windows == (4096,) and mistral.is_hybrid
    assert mistral.describe() == "1 group of 32 layers (window 4096)"
    # a window no shorter than the longest sequence drops nothing: one full group
    assert KVGroups.of_windows([0, 8], max_model_len=8) == KVGroups.single(2)
    # Gemma 3 1B: 26 layers, 4 full; the sliding kind's last group holds 2
    gemma1b = KVGroups.of_windows([0 if i % 6 == 5 else 512 for i in range(26)])
    assert [len(m) for m in gemma1b.layers] == [4, 4, 4, 4, 4, 4, 2]
    assert gemma1b.describe() == "7 groups of 4 or 2 layers (1 full, 6 window 512)"
    assert KVGroups.of_windows([0, 8]).describe() == "2 groups of 1 layer (1 full, 1 window 8)"
    with pytest.raises(ValueError):
        KVGroups.of_windows([])


def test_first_live_block_follows_the_window():
    g = KVGroups.of_windows([0, 6])
    # position 16 sees 11..16: blocks of 4 from block 2 (8..11) on; block 0-1 are dead
    assert [g.first_live_block(1, s, 4) for s in (0, 5, 6, 8, 16, 17)] == [0, 0, 0, 0, 2, 3]
    assert g.first_live_block(0, 1000, 4) == 0  # the full group keeps everything


def _manager(num_blocks: int = 64, *, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, 4, enable_caching=caching, groups=KVGroups.of_windows([0, 6]))


def test_a_long_prefill_frees_sliding_blocks_mid_prompt():
    """Chunks of 16 tokens, window 6, blocks of 4: after each chunk the sliding group keeps
    only the blocks the next token's window reaches; the full group keeps every block."""
    bm = _manager()
    toks = _Tokens(list(range(100, 148)))
    assert bm.allocate("r", 16, write_from=0)
    assert bm.num_held_blocks("r", 0) == 4 and bm.num_held_blocks("r", 1) == 4
    bm.cache_full_blocks("r", toks, None, 16)
    bm.free_behind_window("r", 16)
    # the next token (16) sees 11..16: blocks 2 and 3 stay, 0 and 1 are free again
    assert bm.block_table("r", 1)[:2] == [PLACEHOLDER] * 2 and bm.live_from("r", 1) == 2
    assert bm.num_held_blocks("r", 1) == 2 and bm.num_free_blocks == 64 - 6
    bm.check_invariants()
    assert bm.allocate("r", 32, write_from=16)
    assert len(bm.block_table("r", 1)) == 8 and bm.num_held_blocks("r", 1) == 6
    bm.cache_full_blocks("r", toks, None, 32)
    bm.free_behind_window("r", 32)
    assert bm.live_from("r", 1) == 6 and bm.num_held_blocks("r", 1) == 2
    # decoding on: the sliding group never holds more than (window - 1) // 4 + 2 blocks
    for n in range(33, 48):
        assert bm.allocate("r", n, write_from=n - 1)
        assert bm.num_held_blocks("r", 1) <= 3
        bm.free_behind_window("r", n)
        bm.check_invariants()
    assert bm.num_held_blocks("r", 0) == 12
    bm.free("r")
    bm.check_invariants()
    assert bm.num_free_blocks == 64


def test_freed_sliding_blocks_stay_cached_and_serve_a_hit():
    bm = _manager()
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks can be hit
    toks = _Tokens(prompt)
    assert bm.allocate("a", 21)
    bm.cache_full_blocks("a", toks, None, 21)
    bm.free_behind_window("a", 21)
    a_tables = [list(t) for t in bm.block_tables("a")]
    assert bm.live_from("a", 1) == 4  # position 21 sees 16..21
    hit = bm.find_cached_prefix("b", _Tokens(prompt), 21, None)
    assert len(hit) == 5
    assert hit.tables[0] == a_tables[0][:5]
    # position 20 sees 15..20: the sliding group needs blocks 3 and 4 only; block 3 was
    # freed by "a" (kept its hash) and block 4 is still held by it
    assert hit.live_from == [0, 3] and hit.tables[1][:3] == [PLACEHOLDER] * 3
    assert bm.pool.ref_count(hit.tables[1][3]) == 0 and hit.tables[1][4] == a_tables[1][4]
    free_before = bm.num_free_blocks
    assert bm.allocate("b", 21, hit)
    # shared: 5 + 1 (block 3 taken back from the free queue); new: one block per group
    assert bm.num_free_blocks == free_before - 1 - 2
    assert bm.pool.ref_count(a_tables[0][0]) == 2
    bm.check_invariants()
    # another salt shares nothing
    assert len(bm.find_cached_prefix("c", _Tokens(prompt), 21, "other")) == 0
    for rid in ("a", "b", "c"):
        bm.free(rid)
    bm.check_invariants()


def _pool_with(cached: dict[int, set[int]], hashes: list[bytes]) -> BlockPool:
    """A pool where group g caches hashes[i] for i in cached[g] (in blocks no table holds)."""
    pool = BlockPool(40, 2)
    for g, entries in cached.items():
        for i in entries:
            (b,) = pool.allocate(1)
            pool.set_hash(b, hashes[i], g)
            pool.free([b])
    return pool


@pytest.mark.parametrize(
    ("sliding", "k", "live"),
    [
        ({0, 1, 2, 3, 4}, 5, 3),
        ({3, 4}, 5, 3),  # the blocks before the window are not needed
        ({0, 1, 2, 3}, 4, 2),  # block 4 missing: 4 blocks, whose window starts at block 2
        ({2}, 0, 0),  # no length whose window blocks are all there
        ({2, 4}, 0, 0),
    ],
)
def test_longest_hit_needs_only_the_window_in_sliding_groups(sliding, k, live):
    groups = KVGroups.of_windows([0, 6])
    hashes = []
    for i in range(5):
        hashes.append(hash_block(hashes[-1] if hashes else None, [i] * 4))
    pool = _pool_with({0: {0, 1, 2, 3, 4}, 1: sliding}, hashes)
    hit = longest_hit(pool, groups, hashes, 4)
    assert len(hit) == k and hit.live_from == [0, live]
    assert [pool.block_hash(b) for b in hit.tables[1][live:]] == hashes[live:k]
    assert [pool.block_hash(b) for b in hit.tables[0]] == hashes[:k]


def test_the_full_group_bounds_the_hit():
    groups = KVGroups.of_windows([0, 6])
    hashes = []
    for i in range(5):
        hashes.append(hash_block(hashes[-1] if hashes else None, [i] * 4))
    pool = _pool_with({0: {0, 1}, 1: {0, 1, 2, 3, 4}}, hashes)
    hit = longest_hit(pool, groups, hashes, 4)
    assert len(hit) == 2 and hit.live_from == [0, 0]  # position 8 sees 3..8
    # a hash cached for one group does not hit the other
    assert len(longest_hit(_pool_with({1: {0, 1, 2}}, hashes), groups, hashes, 4)) == 0


def test_fork_shares_every_group_and_copies_on_write_per_group():
    bm = _manager()
    toks = _Tokens(list(range(1, 15)))
    assert bm.allocate("p", 13)
    bm.cache_full_blocks("p", toks, None, 13)
    bm.free_behind_window("p", 13)  # 13 sees 8..13: sliding keeps blocks 2, 3
    bm.fork("p", "c")
    assert bm.block_tables("c") == bm.block_tables("p")
    assert bm.live_from("c", 1) == 2
    last = [t[3] for t in bm.block_tables("p")]
    assert [bm.pool.ref_count(b) for b in last] == [2, 2]
    copies: list[tuple[int, int]] = []
    assert bm.allocate("c", 14, write_from=13, copies=copies)
    assert [src for src, _ in copies] == last  # the partly filled block, in both groups
    assert [t[3] for t in bm.block_tables("c")] == [dst for _, dst in copies]
    bm.check_invariants()
    bm.free("p")
    bm.free("c")
    bm.check_invariants()
    assert bm.num_free_blocks == 64


def test_swap_out_and_in_move_only_the_live_blocks():
    bm = _manager()
    assert bm.allocate("r", 22)
    bm.free_behind_window("r", 22)  # 22 sees 17..22: sliding keeps blocks 4, 5
    out = bm.live_blocks("r", 22, 6)
    assert out == bm.block_table("r", 0)[:6] + bm.block_table("r", 1)[4:6]
    bm.free("r")
    assert bm.num_free_blocks == 64
    assert bm.blocks_needed("r", 23, start=22) == 6 + 2
    assert bm.allocate("r", 23, write_from=22)
    assert bm.live_from("r", 1) == 4 and bm.block_table("r", 1)[:4] == [PLACEHOLDER] * 4
    back = bm.live_blocks("r", 22, 6)
    assert len(back) == len(out) == 8
    assert bm.num_free_blocks == 64 - 8
    bm.free("r")
    bm.check_invariants()


# ---------------------------------------------------------------- the scheduler, simulated


class _SimulatedCache:
    """Stands in for the K/V tensors: each physical block's slots hold what was written
    there, ``(group, the sequence's tokens up to that position)`` (the K/V a layer of that
    group computes for that token, which depends on everything before it). Every read a
    kernel would make (each chunk's query positions over their windows, in each group's
    table) is checked against the request's own tokens."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.device: dict[int, list[object]] = {}
        self.cpu: dict[int, list[object]] = {}

    def run(self, plan: SchedulerOutput) -> None:
        bs = self.bm.block_size
        for d, c in plan.swap_out:
            self.cpu[c] = list(self.device[d])
        for c, d in plan.swap_in:
            self.device[d] = list(self.cpu[c])
        for s, d in plan.copies:
            self.device[d] = list(self.device[s])
        for chunk in plan.chunks:
            seq = [*chunk.prompt_token_ids, *chunk.output_token_ids]
            end = chunk.start_pos + len(chunk.token_ids)
            for g, table in enumerate(chunk.block_tables):
                for p in range(chunk.start_pos, end):
                    block = self.device.setdefault(table[p // bs], [None] * bs)
                    block[p % bs] = (g, tuple(seq[: p + 1]))
        for chunk in plan.chunks:
            seq = [*chunk.prompt_token_ids, *chunk.output_token_ids]
            end = chunk.start_pos + len(chunk.token_ids)
            for g, table in enumerate(chunk.block_tables):
                w = self.bm.groups.windows[g]
                for p in range(chunk.start_pos, end):
                    for k in range(max(0, p - w + 1) if w else 0, p + 1):
                        got = self.device[table[k // bs]][k % bs]
                        assert got == (g, tuple(seq[: k + 1])), (chunk.request_id, g, p, k)


def _drive(
    sched: Scheduler,
    cache: _SimulatedCache,
    max_steps: int = 5000,
    check: Callable[[SchedulerOutput], None] | None = None,
) -> int:
    """Run to the end (``check`` sees each plan before it runs, and again after its
    update); return the most blocks any request's sliding groups held."""
    bm = sched.block_manager
    most = 0
    for _ in range(max_steps):
        if not sched.num_unfinished:
            break
        plan = sched.schedule()
        if check is not None:
            check(plan)
        cache.run(plan)
        for c in plan.chunks:
            most = max(most, sum(bm.num_held_blocks(c.request_id, g) for g in bm.sliding))
        sampled = {
            c.request_id: (sum(c.token_ids) * 31 + c.start_pos) % 97
            for c in plan.chunks
            if c.sample
        }
        sched.update_from_output(plan, sampled)
        bm.check_invariants()
        if sched.cpu_pool is not None:
            sched.cpu_pool.check_invariants()
        if check is not None:
            check(plan)
    assert not sched.num_unfinished
    assert bm.num_free_blocks == bm.num_total_blocks
    return most


def _workload(lens: list[int], shared: int, max_tokens: int) -> list[Request]:
    prefix = list(range(1, shared + 1))
    return [
        Request(f"r{i}", [*prefix, *range(200 + 50 * i, 200 + 50 * i + n)],
                max_tokens=max_tokens, max_model_len=1000, arrival_time=float(i))
        for i, n in enumerate(lens)
    ]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    shared=st.integers(0, 13),
    num_blocks=st.integers(35, 70),  # 35: the most one sequence of 55 tokens holds
    budget=st.integers(3, 16),
    swap=st.booleans(),
    parallel=st.booleans(),
)
def test_scheduler_reads_what_it_wrote_in_every_group(
    lens, shared, num_blocks, budget, swap, parallel
):
    """Requests after a shared prefix (prefix hits), a small pool (preemption: swap or
    recompute), chunked prefill, parallel samples (forks and copy-on-write): every position
    each group's layers read holds that group's K/V of that token."""
    # 4 groups of 2 layers: windows 0, 6, 6 and 9
    groups = KVGroups.of_windows([0, 6, 6, 9, 9, 0, 6, 6])
    assert groups.windows == (0, 6, 6, 9)
    assert groups.blocks_per_sequence(13 + 30 + 12, 4, 16) == 14 + 3 * 7
    bm = BlockManager(num_blocks, 4, groups=groups)
    cpu = BlockPool(16) if swap else None
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget, cpu_pool=cpu)
    cache = _SimulatedCache(bm)
    requests = _workload(lens, shared, max_tokens=12)
    for r in requests:
        sched.add_request(r)
    if parallel:
        samples = [
            Request(f"s{i}", list(range(500, 511)), max_tokens=5, max_model_len=1000,
                    arrival_time=9.0)
            for i in range(3)
        ]  # fmt: skip
        sched.add_parallel_requests(samples)
    _drive(sched, cache)
    assert all(len(r.output_token_ids) == 12 for r in requests)


def test_windowed_generation_holds_a_bounded_number_of_sliding_blocks():
    """One request generating 200 tokens with windows of 6 and 9 (blocks of 4), one token
    a step: each sliding group holds at most the 3 blocks that positions p - w + 1 .. p
    span, where the full group ends with 53."""
    groups = KVGroups.of_windows([0, 6, 9])
    bm = BlockManager(200, 4, groups=groups)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1)
    cache = _SimulatedCache(bm)
    (r,) = _workload([10], 0, max_tokens=200)
    sched.add_request(r)
    held: list[int] = []
    orig = bm.free_behind_window

    def spy(request_id: str, num_computed: int) -> None:
        orig(request_id, num_computed)
        held.append(bm.num_held_blocks(request_id, 0))

    bm.free_behind_window = spy  # type: ignore[method-assign]
    most = _drive(sched, cache)
    assert most == 3 + 3
    assert max(held) == 53 and len(r.output_token_ids) == 200
