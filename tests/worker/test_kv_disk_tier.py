"""The prefix cache's disk tier (``EngineConfig.prefix_cache_dir``): a new engine, or a new
process, on the same directory serves an earlier one's system prompt from the files with a
recompute's tokens; torn, corrupt, truncated and foreign files are counted and never
loaded; two processes writing at once leave only whole, valid files; another salt never
hits."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest
import torch

from asyncllm import EngineConfig, SamplingParams
from asyncllm.core.block_manager import hash_block
from asyncllm.worker.disk_tier import MAGIC, DiskPrefixCache, namespace_digest
from asyncllm.worker.kv_cache import KVCacheSpec
from tests.worker.test_hybrid_kv import _prompt

BS = 4
TINY_BLOCK_BYTES = BS * 2 * 2 * 2 * 16 * 4  # tiny Llama, float32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
KW = dict(dtype="float32", block_size=BS, max_num_batched_tokens=16, max_model_len=96,
          kv_cache_bytes=64 * TINY_BLOCK_BYTES, compile=False)  # fmt: skip
SYSTEM = _prompt(33, seed=7)  # 8 full blocks before the users' tokens


def _valid_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".kv")


async def _generate(engine, prompts, salt=None):
    async with engine:
        outs = [(await engine.generate(p, GREEDY, cache_salt=salt)).token_ids for p in prompts]
        return outs, engine.stats()


# ---------------------------------------------------------------- the file store alone


def _disk(tmp_path: pathlib.Path, namespace: str = "ns") -> tuple[DiskPrefixCache, torch.Tensor]:
    pool = torch.zeros(4, 3, 5)  # 4 slots of 60 bytes
    return DiskPrefixCache(tmp_path, namespace_digest(model=namespace), [pool], 1 << 20), pool


def _load(disk: DiskPrefixCache, key, slot: int) -> bool:
    disk.request_load(key, slot)
    disk.close()  # the queued read is done
    (done,) = disk.completed()
    assert done[:2] == (key, slot)
    return done[2]


def test_files_round_trip_and_bad_ones_are_counted_and_deleted(tmp_path):
    disk, pool = _disk(tmp_path)
    device = torch.arange(4 * 15, dtype=torch.float32).view(4, 3, 5)
    keys = [(0, hash_block(None, [i])) for i in range(4)]
    disk.save([device], [(i, k) for i, k in enumerate(keys)])
    disk.close()
    assert disk.num_written == 4 and all(disk.has(k) for k in keys)
    assert not list(tmp_path.glob("*.tmp"))
    assert _load(disk, keys[1], 2) and torch.equal(pool[2], device[1])
    # Corrupt (a payload byte flipped), truncated, torn header, foreign (another namespace's
    # file under this name): each counted, deleted, and the slot left as it was.
    data = pathlib.Path(disk.path(keys[0])).read_bytes()
    pathlib.Path(disk.path(keys[0])).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    pathlib.Path(disk.path(keys[2])).write_bytes(data[: len(data) // 2])
    pathlib.Path(disk.path(keys[3])).write_bytes(MAGIC + b"\xff\xff")
    other, _ = _disk(tmp_path, namespace="another model")
    other.save([device], [(0, keys[1])])
    other.close()
    os.replace(other.path(keys[1]), disk.path(keys[1]))
    pool[3] = -1.0
    for k in (keys[0], keys[2], keys[3], keys[1]):
        assert not _load(disk, k, 3)
        assert not disk.has(k)
    assert disk.num_invalid == 4 and bool((pool[3] == -1.0).all())
    assert not _load(disk, keys[0], 3)  # gone: missing, not counted again
    assert disk.num_invalid == 4


def test_a_block_of_several_tensors_is_written_from_its_snapshot(tmp_path):
    """The payload is the block's bytes of each pool tensor in order (K, then V: here of
    two dtypes), taken when ``save`` returns: a step that then overwrites the device block
    does not reach the file."""
    k_pool, v_pool = torch.zeros(2, 3, 5), torch.zeros(2, 2, 4, dtype=torch.bfloat16)
    disk = DiskPrefixCache(tmp_path, "ns", [k_pool, v_pool], 1 << 20)
    k_dev = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0))
    v_dev = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    keys = [(0, hash_block(None, [i])) for i in range(2)]
    want = [(k_dev[b].clone(), v_dev[b].clone()) for b in (2, 0)]
    disk.save([k_dev, v_dev], [(2, keys[0]), (0, keys[1])])
    k_dev.fill_(0.0)
    v_dev.fill_(0.0)
    disk.close()
    for (k, v), key in zip(want, keys, strict=True):
        data = pathlib.Path(disk.path(key)).read_bytes()
        (n,) = struct.unpack("<I", data[8:12])
        assert data[12 + n :] == k.numpy().tobytes() + v.view(torch.uint8).numpy().tobytes()
    assert disk.block_bytes == 60 + 16
    for slot, ((k, v), key) in enumerate(zip(want, keys, strict=True)):
        assert _load(disk, key, slot)
        assert torch.equal(k_pool[slot], k) and torch.equal(v_pool[slot], v)


def test_an_int8_file_of_float32_scales_is_never_read(tmp_path):
    """The int8 rows held a float32 scale (``head_dim + 4``) before float16 scales
    (``head_dim + 2``); files of that layout were keyed by the spec's repr without its
    ``int8_layout``. The new repr names the layout, so such a file has another name and,
    copied under the new one, fails the checks; a model-dtype cache's repr (and files) are
    unchanged."""
    spec = KVCacheSpec(2, 2, 16, torch.float32, BS, kv_cache_dtype="int8")
    fields = ("num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=4, "
              "groups=None, kv_cache_dtype={!r}")  # fmt: skip
    old_repr = f"KVCacheSpec({fields.format('int8')})"
    assert repr(spec) == f"KVCacheSpec({fields.format('int8')}, int8_layout=2)" != old_repr
    auto = KVCacheSpec(2, 2, 16, torch.float32, BS)
    assert repr(auto) == f"KVCacheSpec({fields.format('auto')})"
    old_pool = torch.zeros(2, BS, 2, 16 + 4, dtype=torch.int8)
    old = DiskPrefixCache(tmp_path, namespace_digest(kv=old_repr), [old_pool], 1 << 20)
    key = (0, hash_block(None, [1, 2, 3, 4]))
    old.save([torch.ones(1, BS, 2, 16 + 4, dtype=torch.int8)], [(0, key)])
    old.close()
    assert old.has(key)
    new_pool = torch.zeros(2, *spec.block_shape, dtype=torch.int8)
    new = DiskPrefixCache(tmp_path, namespace_digest(kv=repr(spec)), [new_pool], 1 << 20)
    assert not new.has(key) and new.block_bytes == BS * 2 * 18
    os.replace(old.path(key), new.path(key))
    assert not _load(new, key, 0) and new.num_invalid == 1 and not new_pool.any()


def test_the_directory_stays_within_its_bound(tmp_path):
    pool = torch.zeros(2, 3, 5)
    disk = DiskPrefixCache(tmp_path, "ns", [pool], max_bytes=3 * 400)
    device = torch.ones(8, 3, 5)
    keys = [(0, hash_block(None, [i])) for i in range(8)]
    for i, k in enumerate(keys):
        disk.save([device], [(i, k)])
    disk.close()
    files = _valid_files(tmp_path)
    assert sum(f.stat().st_size for f in files) <= 3 * 400 and disk.num_deleted > 0
    assert disk.has(keys[-1]) and not disk.has(keys[0])  # least recently written first


# ---------------------------------------------------------------- engines


async def test_a_new_engine_serves_the_system_prompt_from_disk(
    tiny_llama_dir, make_engine, tmp_path
):
    first = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    a, _ = await _generate(first, [[*SYSTEM, 5]])
    assert first.core.disk.num_written == 10  # joined on exit: 41 tokens computed
    second = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    b, s2 = await _generate(second, [[*SYSTEM, 6]])
    ref, _ = await _generate(
        make_engine(tiny_llama_dir, **KW, enable_prefix_caching=False), [[*SYSTEM, 5], [*SYSTEM, 6]]
    )
    assert a + b == ref
    assert s2["prefix_cache_disk_hits"] == s2["prefix_cache_host_hits"] == 32
    assert s2["prefix_cache_hits"] == 32 and s2["prefix_cache_dir_invalid"] == 0
    # Another tenant (salt) of the same prompt never hits the files.
    salted = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    c, s3 = await _generate(salted, [[*SYSTEM, 5]], salt="tenant-b")
    assert c == a[:1] and s3["prefix_cache_hits"] == 0


async def test_another_layout_or_model_never_reads_the_files(
    tiny_llama_dir, bos_llama_dir, make_engine, tmp_path
):
    """Files of one model and KV layout are another's misses: the same weights in bfloat16,
    with blocks of 8 or an int8 cache, or with another tokenizer (``bos_llama_dir``), name
    other files."""
    first = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    await _generate(first, [[*SYSTEM, 5]])
    written = set(_valid_files(tmp_path))
    for model, kw in ((tiny_llama_dir, dict(KW, dtype="bfloat16")),
                      (tiny_llama_dir, dict(KW, block_size=8)),
                      (tiny_llama_dir, dict(KW, kv_cache_dtype="int8")),
                      (bos_llama_dir, KW)):  # fmt: skip
        engine = make_engine(model, **kw, prefix_cache_dir=str(tmp_path))
        _, stats = await _generate(engine, [[*SYSTEM, 5]])
        assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_dir_invalid"] == 0
        assert set(_valid_files(tmp_path)) > written  # its own files beside the first's
        written = set(_valid_files(tmp_path))


async def test_a_corrupt_file_is_recomputed_and_counted(tiny_llama_dir, make_engine, tmp_path):
    first = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    a, _ = await _generate(first, [[*SYSTEM, 5]])
    engine = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    disk = engine.core.disk
    hashes = [hash_block(None, SYSTEM[:4])]
    for i in range(1, 4):
        hashes.append(hash_block(hashes[-1], SYSTEM[4 * i : 4 * i + 4]))
    path = pathlib.Path(disk.path((0, hashes[3])))  # the fourth block's file
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    b, stats = await _generate(engine, [[*SYSTEM, 5]])
    assert b == a
    assert stats["prefix_cache_dir_invalid"] == 1
    assert stats["prefix_cache_disk_hits"] == stats["prefix_cache_hits"] == 12  # blocks 0-2


_WRITER = """
import asyncio, json, sys
from asyncllm import AsyncEngine, SamplingParams
model, directory, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kw = json.loads(sys.argv[4])

async def main():
    engine = AsyncEngine.from_pretrained(model, prefix_cache_dir=directory, **kw)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with engine:
        outs = [(await engine.generate(p, params)).token_ids for p in prompts]
    print(json.dumps(outs))

asyncio.run(main())
"""


@pytest.mark.slow  # three processes each load the tiny model: ~50 s
async def test_two_processes_write_at_once_and_a_third_reads(tiny_llama_dir, make_engine, tmp_path):
    """Two processes run the same system prompt (and one other prompt each) at once on one
    directory: afterwards every file is whole and valid, no temporary file is left, and an
    engine in this process serves the system prompt from the files with their tokens."""
    others = [_prompt(30, seed=40), _prompt(30, seed=41)]
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WRITER,
                str(tiny_llama_dir),
                str(tmp_path),
                json.dumps([[*SYSTEM, 5], other]),
                json.dumps(KW),
            ],
            stdout=subprocess.PIPE,
            env=env,
        )
        for other in others
    ]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    assert outs[0][0] == outs[1][0]
    assert not list(tmp_path.glob("*.tmp"))
    engine = make_engine(tiny_llama_dir, **KW, prefix_cache_dir=str(tmp_path))
    disk = engine.core.disk
    files = _valid_files(tmp_path)
    assert len(files) >= 8 + 2 * 7
    for f in files:  # whole and valid: the header names this namespace and the payload's sum
        data = f.read_bytes()
        n = int.from_bytes(data[8:12], "little")
        header = json.loads(data[12 : 12 + n])
        assert header["namespace"] == disk.namespace
        key = (header["group"], bytes.fromhex(header["hash"]))
        assert disk.path(key) == str(f) and disk._check(data, key) is not None
    got, stats = await _generate(engine, [[*SYSTEM, 5], others[1]])
    assert got == [outs[0][0], outs[1][1]]
    assert stats["prefix_cache_disk_hits"] == 32 + 28 and stats["prefix_cache_dir_invalid"] == 0


def test_config_needs_the_host_tier_for_a_directory(tmp_path):
    with pytest.raises(ValueError, match="prefix_cache_dir"):
        EngineConfig(prefix_cache_dir=str(tmp_path), host_prefix_cache_bytes=0)
    with pytest.raises(ValueError, match="prefix_cache_dir"):
        EngineConfig(prefix_cache_dir="")
    with pytest.raises(ValueError, match="prefix_cache_dir_bytes"):
        EngineConfig(prefix_cache_dir_bytes=0)


def test_odd_entries_in_the_directory_are_passed_over(tmp_path):
    """A dangling ``*.kv`` link, a directory named like a file and a file deleted between
    the listing and its stat (another process's trim) neither stop the thread nor count."""
    (tmp_path / "dangling.kv").symlink_to(tmp_path / "gone")
    (tmp_path / "dir.kv").mkdir()
    disk, _ = _disk(tmp_path)
    key = (0, b"\x01" * 16)
    assert not _load(disk, key, 0)  # the thread ran its listing and answers loads
    assert disk._lru == {}
    disk.close()


def test_two_users_of_a_directory_share_one_bound(tmp_path):
    """The bound is on the directory: an engine's trim counts the other's files (listed
    again at most every second)."""
    import time

    from asyncllm.worker import disk_tier

    a, cache_a = _disk(tmp_path, "a")
    b, cache_b = _disk(tmp_path, "b")
    for i in range(6):
        a.save([cache_a], [(0, (0, bytes([i]) * 16))])
        b.save([cache_b], [(0, (0, bytes([100 + i]) * 16))])
    a.close()
    b.close()
    files = _valid_files(tmp_path)
    assert len(files) == 12
    bound = 5 * files[0].stat().st_size
    a.max_bytes = bound
    time.sleep(disk_tier._RESCAN_S + 0.1)
    a.save([cache_a], [(0, (0, b"\xaa" * 16))])
    a.close()
    assert sum(f.stat().st_size for f in _valid_files(tmp_path)) <= bound


def test_a_path_object_is_a_directory(tmp_path):
    from asyncllm.config import EngineConfig

    assert EngineConfig(prefix_cache_dir=tmp_path).prefix_cache_dir == str(tmp_path)
