"""The kernels' Python side: the custom ops' registry (:mod:`~asyncllm.kernels.ops`: schema,
fake and torch reference of each op), the C++ CPU kernels' variants table and loader
(:mod:`~asyncllm.kernels.variants`, :mod:`~asyncllm.kernels.native`, the int4 family's
glue :mod:`~asyncllm.kernels.int4_dequant`), and the Triton kernels of the GPU path
(:mod:`~asyncllm.kernels.paged_decode`, :mod:`~asyncllm.kernels.paged_prefill`,
:mod:`~asyncllm.kernels.kv_cache_write`, :mod:`~asyncllm.kernels.paged_common`; tested
against :mod:`asyncllm.attention.torch_paged`).

The built extension modules themselves live in :mod:`asyncllm._kernels`.
"""
