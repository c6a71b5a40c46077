"""Triton kernels for the GPU path (paged attention, KV cache writes).

The CPU path and the reference these kernels are tested against live in
:mod:`asyncllm.attention.torch_paged`.
"""
