"""The built C++ extension modules (``_<family>_<variant>``), one per kernel family and
instruction-set variant, written here by ``setup.py`` from ``csrc/`` (git-ignored).

They are imported by :mod:`asyncllm.kernels.native`, never directly; the Python side of every
kernel (the op registry, the variants table, the Triton kernels) lives in
:mod:`asyncllm.kernels`.
"""
