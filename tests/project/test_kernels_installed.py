"""Every C++ kernel family is installed in every variant this x86-64 CPU runs: setup.py
builds them optionally (a compile error warns and installs without that module), so without
this check a compile error in csrc/ would pass as skipped tests and torch's slower paths."""

from __future__ import annotations

import platform

import pytest

from asyncllm.kernels import native
from asyncllm.kernels.variants import FAMILIES, VARIANTS, variants_for


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the variants are x86-64 builds (other machines build the generic one)",
)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_kernel_family_is_installed(family: str) -> None:
    assert native.enabled(family), f"{family} is switched off in the test environment"
    assert native.module(family) is not None, native.failure(family)
    runnable = [v for v in variants_for(platform.machine()) if VARIANTS[v][2] <= native.cpu_flags()]
    assert runnable
    for variant in runnable:  # what `pip install` builds here (setup.py: the CPU's flags)
        native.import_variant(family, variant)  # ImportError: not built
