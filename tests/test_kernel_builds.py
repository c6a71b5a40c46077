"""An engine never waits for a C++ kernel to build: it serves through the torch paths while the
build runs in a background process, and takes the kernels once they are there."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import types
from collections.abc import Iterator

import pytest

from asyncllm import SamplingParams
from asyncllm.attention import cpu_paged
from asyncllm.worker import cpu_extension, int4_dequant, q8_linear
from asyncllm.worker import quant_linear as ql
from asyncllm.worker.cpu_extension import CpuExtension

EXTENSIONS = (cpu_paged.EXTENSION, int4_dequant.EXTENSION, q8_linear.EXTENSION)


def _extension(tmp_path, monkeypatch) -> CpuExtension:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ASYNCLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_extension, "_toolchain", lambda: True)
    return CpuExtension("asyncllm_bg", "int f();", ["f"], ["-O2"], "bg kernel", "ASYNCLLM_BG")


def test_a_missing_kernel_builds_in_a_background_process(tmp_path, monkeypatch):
    """ready() answers None at once while the build process runs (one process, however
    often it is asked), load() waits for it, and then both return the built module."""
    ext = _extension(tmp_path, monkeypatch)
    release, specs = threading.Event(), []

    def build_process(spec):  # type: ignore[no-untyped-def]
        specs.append(spec)
        assert release.wait(60)

    built = types.SimpleNamespace(name="built")
    monkeypatch.setattr(cpu_extension, "_run_build_process", build_process)
    monkeypatch.setattr(ext, "_import_built", lambda: built if release.is_set() else None)
    monkeypatch.setattr(ext, "_build", lambda: pytest.fail("built in the calling process"))
    assert ext.ready() is None and ext.ready() is None
    assert ext.expected() and ext.failure() is None
    release.set()
    assert ext.load() is built and ext.ready() is built
    cpu_extension.wait_for_builds()
    assert [s["name"] for s in specs] == ["asyncllm_bg"]
    assert specs[0]["cflags"] == ["-O2"] and specs[0]["env_switch"] == "ASYNCLLM_BG"


def test_a_background_build_that_fails_is_reported_once(tmp_path, monkeypatch, caplog):
    """A build process that fails: its reason is logged once and kept, without a second build
    in the engine's process; ready() stays None and expected() turns False."""
    ext = _extension(tmp_path, monkeypatch)
    why = "RuntimeError: Error building extension 'asyncllm_bg'"
    monkeypatch.setattr(cpu_extension, "_run_build_process", lambda spec: why)
    monkeypatch.setattr(ext, "_import_built", lambda: None)
    monkeypatch.setattr(ext, "_build", lambda: pytest.fail("built in the calling process"))
    with caplog.at_level("WARNING", logger="asyncllm"):
        assert ext.ready() is None
        assert ext.load() is None
        assert ext.ready() is None and not ext.expected()
    assert ext.failure() == f"RuntimeError: {why}"
    assert caplog.text.count("bg kernel unavailable") == 1


def test_a_stale_torch_lock_does_not_stop_the_build(tmp_path, monkeypatch):
    """torch's ``lock`` file, left in the build folder by a builder that was killed, is removed
    under asyncllm's own lock (an OS lock, freed with its holder) instead of being waited on
    forever."""
    from torch.utils import cpp_extension

    ext = _extension(tmp_path, monkeypatch)
    ext.build_dir().mkdir(parents=True)
    (ext.build_dir() / "lock").touch()
    seen = []

    def load_inline(**kwargs):  # type: ignore[no-untyped-def]
        seen.append((ext.build_dir() / "lock").exists())
        return types.SimpleNamespace(name="built")

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    assert ext.load().name == "built"
    assert seen == [False]


def test_no_compiler_means_no_kernel_expected(tmp_path, monkeypatch, caplog):
    """Without a compiler nothing is started, the layout choices take the torch paths and a
    kernel asked for says why, once."""
    ext = _extension(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_extension, "_toolchain", lambda: False)
    monkeypatch.setattr(cpu_extension, "_run_build_process", lambda s: pytest.fail("started"))
    assert not ext.expected()
    with caplog.at_level("WARNING", logger="asyncllm"):
        assert ext.ready() is None and ext.ready() is None
    assert "no C++ compiler" in (ext.failure() or "")
    assert caplog.text.count("bg kernel unavailable") == 1


def test_wait_for_builds_gives_up_when_its_caller_closes(tmp_path, monkeypatch):
    """A compiled forward waiting for the kernels stops waiting once its engine closes (an
    exit does not wait for a build)."""
    ext = _extension(tmp_path, monkeypatch)
    release = threading.Event()
    monkeypatch.setattr(cpu_extension, "_run_build_process", lambda spec: release.wait(60) and None)
    monkeypatch.setattr(ext, "_import_built", lambda: None)
    monkeypatch.setattr(ext, "_build", lambda: None)
    ext.start()
    try:
        assert cpu_extension.wait_for_builds(lambda: True) is False
    finally:
        release.set()
        assert ext._thread is not None
        ext._thread.join()
        cpu_extension._STARTED.remove(ext)


@contextlib.contextmanager
def _kernels_building() -> Iterator[threading.Event]:
    """The real extensions as a fresh machine has them while their builds run (not loaded,
    a build thread alive); they are back once this exits. A call that waits for a build
    waits for that thread, which gives up after 30 s and fails the test."""
    release, waited = threading.Event(), []
    thread = threading.Thread(target=lambda: waited.append(not release.wait(30)), daemon=True)
    thread.start()
    saved = [(ext._module, ext._thread) for ext in EXTENSIONS]
    try:
        for ext in EXTENSIONS:
            ext._module, ext._thread = None, thread
        yield release
    finally:
        release.set()
        thread.join()
        for ext, (module, t) in zip(EXTENSIONS, saved, strict=True):
            ext._module, ext._thread = module, t
    assert waited == [False], "a call waited for a kernel's build"


def test_engine_serves_through_the_torch_paths_while_its_kernels_build(
    tiny_llama_dir, make_engine, quant_cache, monkeypatch
):
    """An int4 engine made while every kernel is building: its greedy tokens are exactly
    those of an engine with the kernels switched off (the same torch paths), no step calls
    a kernel, and once the builds are done the same engine's steps take the C++ int4 op."""
    if not all(ext.available() for ext in EXTENSIONS):
        pytest.skip("the C++ kernels do not build here")
    prompts = [[1, 5, 9, 200, 7], [3, 3, 3], [100, 2000, 30000, 4, 4, 4, 4, 4]]
    prompts += [[17 * i + 3, 400 + i, 9] for i in range(ql.int4_max_rows())]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = {"quantization": "int4", "dtype": "bfloat16", "kv_cache_bytes": 8 * 2**20}

    async def run(engine):  # type: ignore[no-untyped-def]
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return [out.token_ids for out in outs]

    async def off_run():  # type: ignore[no-untyped-def]
        async with make_engine(tiny_llama_dir, **config) as off:
            assert off._engine.runner.attention_backend.name == "torch"
            return await run(off)

    with monkeypatch.context() as m:
        for ext in EXTENSIONS:
            m.setenv(ext.env_switch, "0")
        want = asyncio.run(off_run())

    async def building_then_built():  # type: ignore[no-untyped-def]
        before = int4_dequant.path_calls()  # the C++ op's own counters
        with _kernels_building():
            engine = make_engine(tiny_llama_dir, **config)
            assert engine._engine.runner.attention_backend.name == "cpu"
            async with engine:
                got = await run(engine)
        assert int4_dequant.path_calls() == before  # no C++ int4 call: none was loaded
        async with engine:
            await run(engine)
        assert sum(int4_dequant.path_calls()) > sum(before)
        return got

    assert asyncio.run(building_then_built()) == want


def test_q8_layer_uses_a_dense_copy_until_its_kernel_is_built():
    """A Q8_0 layer called while its kernel builds multiplies by a dense copy of its weight
    (float32 out, as the kernel's), and drops the copy once the kernel is there."""
    import torch

    from asyncllm.worker.q8_linear import Q8Linear

    torch.manual_seed(0)
    q = torch.randint(-127, 128, (96, 64), dtype=torch.int8)
    layer = Q8Linear(q, torch.rand(96, 2) / 64, torch.randn(96), torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    with _kernels_building(), torch.inference_mode():
        during = layer(x)
        assert layer._interim is not None
        dense = torch.nn.functional.linear(x, layer.weight).float() + layer.bias
        torch.testing.assert_close(during, dense, rtol=0, atol=0)
    with torch.inference_mode():
        after = layer(x)
    assert layer._interim is None
    assert during.dtype == after.dtype == torch.float32
    torch.testing.assert_close(after, during, rtol=2e-2, atol=5e-2)
