"""Triton kernels for the GPU path (paged attention, KV cache writes), and
:mod:`asyncllm._kernels.cpu_build`, which builds and caches the C++ CPU kernels
(:mod:`asyncllm.attention.cpu_paged`, :mod:`asyncllm.worker.int4_dequant`).

The CPU path and the reference these kernels are tested against live in
:mod:`asyncllm.attention.torch_paged`.
"""
