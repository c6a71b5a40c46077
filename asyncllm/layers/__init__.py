"""The linear layers and embeddings that replace a loaded model's ``nn.Linear`` and
``nn.Embedding``: weight-only int4/int8 (:mod:`~asyncllm.layers.quant_linear`), GGUF's
Q8_0 family (:mod:`~asyncllm.layers.q8_linear`), oneDNN-packed float
(:mod:`~asyncllm.layers.cpu_linear`) and fused siblings
(:mod:`~asyncllm.layers.sibling_linears`). Their ops are declared in :mod:`asyncllm.kernels`.
"""
