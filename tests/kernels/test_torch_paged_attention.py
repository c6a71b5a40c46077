"""The torch paged attention against dense attention on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from asyncllm.attention.torch_paged import PagedAttentionPlan, paged_attention, write_kv_cache


def dense_attention(q, k, v, scale, window=0, softcap=0.0):
    """q [n, H, D] at the last n positions of k/v [L, Hkv, D], causal; GQA by repetition;
    a sliding window of ``window`` positions and soft-capped scores as transformers' eager
    Gemma 2 attention (``sliding_window_overlay``: kv > q - window)."""
    n, h, _ = q.shape
    length, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    hidden = k_pos > q_pos
    if window > 0:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).to(q.dtype)


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (1, 0.0), (6, 0.0), (0, 2.0), (5, 1.5)])
def test_mixed_prefill_and_decode_over_shuffled_blocks(gqa, block_size, window, softcap):
    g = torch.Generator().manual_seed(gqa * 100 + block_size)
    hkv, d = 2, 16
    h = hkv * gqa
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    # (context already cached, new tokens): decodes, a fresh prefill, a chunk over a prefix,
    # a one-token context, a partial last block.
    seqs = [(20, 1), (0, 13), (9, 6), (0, 1), (block_size * 3, 1), (5, 1)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_k, full_v, new_k, new_v, queries, slots = [], [], [], [], [], [], []
    for cached, n in seqs:
        length = cached + n
        nb = -(-length // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        ks = torch.randn(length, hkv, d, generator=g)
        vs = torch.randn(length, hkv, d, generator=g)
        for p in range(cached):  # the context is already in the cache
            k_cache[table[p // block_size], p % block_size] = ks[p]
            v_cache[table[p // block_size], p % block_size] = vs[p]
        full_k.append(ks)
        full_v.append(vs)
        new_k.append(ks[cached:])
        new_v.append(vs[cached:])
        queries.append(torch.randn(n, h, d, generator=g))
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(cached, length)
        ]
    slot_mapping = torch.tensor(slots)
    write_kv_cache(torch.cat(new_k), torch.cat(new_v), k_cache, v_cache, slot_mapping)
    plan = PagedAttentionPlan.build(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, block_size
    )
    scale = d**-0.5
    out = paged_attention(torch.cat(queries), k_cache, v_cache, plan, scale, window, softcap)
    expected = torch.cat(
        [
            dense_attention(q, k, v, scale, window, softcap)
            for q, k, v in zip(queries, full_k, full_v, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_write_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    key = torch.ones(3, 1, 2)
    write_kv_cache(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 1, 2)[[0, 5]].eq(1).all()
    assert v_cache.view(-1, 1, 2)[[0, 5]].eq(2).all()
    assert k_cache.sum() == 4  # nothing else written
