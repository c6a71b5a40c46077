"""The C++ CPU kernels as installed modules (:mod:`asyncllm.kernels.native`): each family's
switch, the variant a CPU's flags choose, the torch paths (and one warning) where no variant
is installed, no C++ left in the package's Python, and no process started by an engine (the
kernels are built at install time, never at run time)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pathlib
import subprocess
import types
from typing import Any

import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.attention import cpu_paged, torch_paged
from asyncllm.kernels import int4_dequant, native, ops
from asyncllm.kernels.variants import FAMILIES, VARIANTS
from asyncllm.layers import q8_linear
from asyncllm.layers import quant_linear as ql

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "asyncllm"

#: The start of the one warning logged where the kernels are not installed.
NOT_INSTALLED = "the C++ CPU kernels are not installed"


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """native's caches as in a new process (restored after the test: the modules loaded
    before stay loaded, their op kernels registered)."""
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setattr(native, "_warned", False)


def _none_installed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """No variant of any family importable (as without a compiler at install time); returns
    the (family, variant) imports tried."""
    tried: list[tuple[str, str]] = []

    def import_variant(family: str, name: str) -> Any:
        tried.append((family, name))
        raise ImportError(f"No module named 'asyncllm._kernels._{family}_{name}'")

    _fresh(monkeypatch)
    monkeypatch.setattr(native, "import_variant", import_variant)
    return tried


def _best_installed(family: str) -> str | None:
    """The first variant this CPU runs whose module of ``family`` imports."""
    for variant in native._runnable_variants():
        try:
            native.import_variant(family, variant)
        except ImportError:
            continue
        return variant
    return None


# --- (a) the switches -------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(native.SWITCHES))
def test_switch_off_gives_none_and_on_the_module_again(family, monkeypatch):
    """``<switch>=0`` (or false/no/off): module() is None and status() says "off", without
    a failure; switched on again, the same module, a variant this CPU runs."""
    mod = native.module(family)
    if mod is None:
        pytest.skip(f"the {family} kernels are not installed here: {native.failure(family)}")
    variant = mod.__name__.removeprefix(f"asyncllm._kernels._{family}_")
    assert variant == _best_installed(family)
    for off in ("0", "false", "no", "off", " OFF "):
        monkeypatch.setenv(native.SWITCHES[family], off)
        assert not native.enabled(family)
        assert native.module(family) is None
        assert native.status()[family] == "off"
        assert native.failure(family) is None
    monkeypatch.setenv(native.SWITCHES[family], "1")
    assert native.enabled(family)
    assert native.module(family) is mod
    assert native.status()[family] == variant


def test_unknown_family_is_refused():
    with pytest.raises(KeyError, match="unknown kernel family"):
        native.module("fp8")


def test_callers_follow_the_switches(monkeypatch):
    """The layers' own accessors answer None / False while their family is off; the
    attention has no switch of its own (``EngineConfig.attention_backend`` is it)."""
    from asyncllm.worker import native_forward

    assert set(native.SWITCHES) == {"int4", "q8", "decoder"}
    for var in native.SWITCHES.values():
        monkeypatch.setenv(var, "0")
    assert native.status()["int4"] == native.status()["q8"] == native.status()["decoder"] == "off"
    assert native_forward.build(torch.nn.Linear(2, 2)) is None
    assert int4_dequant.kernel() is None and not int4_dequant.op_available()
    assert not int4_dequant.fused_available() and not int4_dequant.gemv_available()
    assert int4_dequant.path_calls() == (0, 0, 0)
    assert q8_linear.kernel() is None and not q8_linear.fast() and not q8_linear.mm_available()


# --- (b) no variant installed -----------------------------------------------------------------


def test_without_kernels_the_callers_run_torch_with_one_warning(monkeypatch, caplog):
    """No variant installed: every family's caller takes torch's path (attention: the torch
    paged attention, bit for bit; int4: torch's int4 kernel through the Python fallback;
    Q8_0: a dense copy of the weight), the reasons are kept per family, each variant import
    is tried once (later calls do not try again), and one warning says why, for all the
    families together."""
    tried = _none_installed(monkeypatch)
    with caplog.at_level("WARNING", logger="asyncllm"):
        # attention
        assert cpu_paged.load() is None and not cpu_paged.available()
        g = torch.Generator().manual_seed(0)
        seq_lens, query_lens, bs = [5, 20, 33], [1, 1, 1], 16
        kc, vc = (torch.randn(8, bs, 2, 16, generator=g) for _ in range(2))
        tables = [[0], [1, 2], [3, 4, 5]]
        q = torch.randn(3, 4, 16, generator=g)
        plan = cpu_paged.CpuPagedPlan.build(query_lens, seq_lens, tables, bs)
        ref = torch_paged.paged_attention(
            q, kc, vc, torch_paged.PagedAttentionPlan.build(query_lens, seq_lens, tables, bs), 0.25
        )
        assert torch.equal(cpu_paged.paged_attention_cpu(q, kc, vc, plan, 0.25), ref)
        # int4: many rows (the dequantize-then-GEMM path where the kernel is) and few
        torch.manual_seed(0)
        codes, s, o = ql.int4_codes(torch.randn(128, 64) * 0.05, 32)
        layer = ql.Int4Linear(codes, s, o, 32, None, torch.bfloat16)
        assert not int4_dequant.op_available() and not int4_dequant.fused_available()
        for rows in (1, 3 * ql.int4_max_rows()):
            x = torch.randn(rows, 64)
            before = ql.path_calls()
            with torch.inference_mode():
                got = layer(x)
            after = ql.path_calls()
            assert after["int4"] - before["int4"] == 1
            assert after["dequant"] == before["dequant"] and after["gemv"] == before["gemv"]
            want = ops.int4_linear_reference(
                x, layer.packed, layer.scales_and_zeros, None, 32, 64, 128
            )
            assert torch.equal(got, want)
        # Q8_0: the dense copy, float32 out
        qq = torch.randint(-127, 128, (96, 64), dtype=torch.int8)
        head = q8_linear.Q8Linear(qq, torch.rand(96, 2) / 64, torch.randn(96), torch.bfloat16)
        xb = torch.randn(3, 64).bfloat16()
        with torch.inference_mode():
            y = head(xb)
        assert head._interim is not None and y.dtype == torch.float32
        dense = torch.nn.functional.linear(xb, head.weight).float() + head.bias
        assert torch.equal(y, dense)
        assert not q8_linear.fast() and not q8_linear.mm_available()
        # asked again: no second try, no second warning
        assert native.status() == {f: "torch" for f in FAMILIES}
        assert all(native.module(f) is None for f in FAMILIES)
    runnable = native._runnable_variants()
    assert sorted(tried) == sorted((f, v) for f in FAMILIES for v in runnable)
    for family in FAMILIES:
        why = native.failure(family)
        assert why is not None
        if runnable:
            assert f"_{family}_{runnable[0]}" in why
    assert caplog.text.count(NOT_INSTALLED) == 1


def test_engine_without_kernels_serves_as_with_them_switched_off(
    tiny_llama_dir, make_engine, quant_cache, monkeypatch
):
    """An int4 engine with no kernel variant installed: the torch attention backend, greedy
    tokens exactly those of an engine with every kernel switched off (the same torch
    paths), and no call of the installed C++ int4 op."""
    installed = native.module("int4")
    prompts = [[1, 5, 9, 200, 7], [3, 3, 3], [100, 2000, 30000, 4, 4, 4, 4, 4]]
    prompts += [[17 * i + 3, 400 + i, 9] for i in range(ql.int4_max_rows())]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    config = {"quantization": "int4", "dtype": "bfloat16", "kv_cache_bytes": 8 * 2**20}

    async def run(engine):  # type: ignore[no-untyped-def]
        async with engine:
            assert engine.core.runner.attention_backend.name == "torch"
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return [out.token_ids for out in outs]

    with monkeypatch.context() as m:  # the weight kernels' switches; attention by setting
        for switch in native.SWITCHES.values():
            m.setenv(switch, "0")
        want = asyncio.run(run(make_engine(tiny_llama_dir, attention_backend="torch", **config)))
    before = None if installed is None else installed.int4_path_calls()
    _none_installed(monkeypatch)
    got = asyncio.run(run(make_engine(tiny_llama_dir, **config)))
    assert got == want
    if installed is not None:
        assert installed.int4_path_calls() == before  # the C++ op was not called


# --- (c) the variant a CPU runs ---------------------------------------------------------------


def _flags(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], machine: str = "x86_64"):
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setattr(native.platform, "machine", lambda: machine)


AVX2_FLAGS = VARIANTS["avx2"][2]
AVX512_BF16_FLAGS = VARIANTS["avx512_bf16"][2]


@pytest.mark.parametrize(
    "flags, want",
    [
        (AVX512_BF16_FLAGS | {"amx_bf16", "sse4_2"}, ["avx512_bf16", "avx2"]),
        (AVX2_FLAGS | {"sse4_2", "avx"}, ["avx2"]),
        # AVX-512 without its BF16 extension (Skylake-X, Ice Lake): the AVX2 variant
        (AVX512_BF16_FLAGS - {"avx512_bf16"}, ["avx2"]),
        (AVX2_FLAGS - {"fma"}, []),  # pre-Haswell: no variant
        (frozenset(), []),
    ],
    ids=["avx512_bf16", "avx2", "avx512-no-bf16", "no-fma", "empty"],
)
def test_runnable_variants_best_first(flags, want, monkeypatch):
    _flags(monkeypatch, frozenset(flags))
    assert native._runnable_variants() == want


def test_the_variant_can_be_capped(monkeypatch):
    """``ASYNCLLM_CPU_VARIANT=avx2`` runs the AVX2 build on an AVX-512 BF16 CPU (an AVX2
    CPU's paths, for tests and benchmarks); an unknown name caps nothing; the cap never
    picks a variant the CPU cannot run."""
    _flags(monkeypatch, AVX512_BF16_FLAGS)
    monkeypatch.setenv(native.VARIANT_ENV, "avx2")
    assert native._runnable_variants() == ["avx2"]
    monkeypatch.setenv(native.VARIANT_ENV, "sse9")
    assert native._runnable_variants() == ["avx512_bf16", "avx2"]
    _flags(monkeypatch, AVX2_FLAGS)
    monkeypatch.setenv(native.VARIANT_ENV, "avx512_bf16")
    assert native._runnable_variants() == ["avx2"]


def test_other_architectures_run_the_generic_variant(monkeypatch):
    _flags(monkeypatch, frozenset(), machine="aarch64")
    assert native._runnable_variants() == ["generic"]


def test_the_best_installed_variant_is_loaded(monkeypatch, caplog):
    """On an AVX-512 BF16 CPU whose avx512_bf16 module is missing the avx2 one is taken
    (its op kernels registered), without a warning; a CPU no variant runs on: None, one
    warning naming the reason."""
    _flags(monkeypatch, AVX512_BF16_FLAGS)
    _fresh(monkeypatch)
    tried, registered = [], []
    stand_in = types.SimpleNamespace(
        __name__="asyncllm._kernels._q8_avx2",
        register_ops=lambda: registered.append(1),
        int4_pack_block_n=lambda: 64,  # status() loads the int4 family too
    )

    def import_variant(family: str, name: str) -> Any:
        tried.append(name)
        if name != "avx2":
            raise ImportError(f"No module named 'asyncllm._kernels._{family}_{name}'")
        return stand_in

    monkeypatch.setattr(native, "import_variant", import_variant)
    with caplog.at_level("WARNING", logger="asyncllm"):
        assert native.module("q8") is stand_in
        assert native.module("q8") is stand_in  # cached: no second import
    assert tried == ["avx512_bf16", "avx2"] and registered == [1]
    assert native.failure("q8") is None and NOT_INSTALLED not in caplog.text
    assert native.status()["q8"] == "avx2"

    _flags(monkeypatch, frozenset())
    _fresh(monkeypatch)
    with caplog.at_level("WARNING", logger="asyncllm"):
        assert native.module("int4") is None
    assert "no kernel variant runs on this CPU" in (native.failure("int4") or "")
    assert caplog.text.count(NOT_INSTALLED) == 1


def test_an_int4_module_that_cannot_read_torch_s_packing_is_not_loaded(monkeypatch):
    """Where torch packs int4 weights in a layout the kernels do not know, the int4 module is
    not loaded (torch's path runs, its reason in failure()): its op would have to convert a
    float32 layer's tile-major scales at every call."""
    _flags(monkeypatch, AVX512_BF16_FLAGS)
    _fresh(monkeypatch)
    registered = []
    stand_in = types.SimpleNamespace(
        __name__="asyncllm._kernels._int4_avx2",
        register_ops=lambda: registered.append(1),
        int4_pack_block_n=lambda: 0,
    )
    monkeypatch.setattr(native, "import_variant", lambda family, name: stand_in)
    assert native.module("int4") is None and registered == []
    assert "layout unknown here" in (native.failure("int4") or "")


def test_installed_variants_import_without_registering():
    """Each installed variant this CPU runs imports on its own (tests compare them) and has
    the functions its family's callers use. A module that was built but does not load (an
    undefined symbol: a torch function that is not exported) fails here, not as dozens of
    kernel tests skipped for "not installed"."""
    wanted = {
        "attention": ("register_ops", "paged_decode", "paged_prefill", "arm_decode"),
        "int4": ("register_ops", "int4_dequant_t", "int4_mm", "int4_pack_block_n"),
        "q8": ("register_ops", "q8_gemv", "q8_fast", "q8_mm_available"),
    }
    found = 0
    for variant in native._runnable_variants():
        for family, names in wanted.items():
            try:
                mod = native.import_variant(family, variant)
            except ModuleNotFoundError:  # not built here
                continue
            found += 1
            assert all(hasattr(mod, n) for n in names), (family, variant)
    if not found:
        pytest.skip("no kernel variant is installed here")


# --- (d) no C++ in the package's Python -------------------------------------------------------

CPP_MARKERS = ("#include <", '#include "', "TORCH_LIBRARY", "PYBIND11_MODULE", "load_inline")


def test_no_cpp_inside_the_python_package():
    """The C++ lives in csrc/ (built by setup.py): no .py file of the package holds C++
    source or compiles any at run time (``torch.utils.cpp_extension``), and no C++ source
    is shipped beside it."""
    import ast

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        found += [f"{rel}: {m}" for m in CPP_MARKERS if m in text]
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{rel}: imports {n}" for n in names if n.endswith("cpp_extension")]
    sources = [p for ext in ("cpp", "cc", "h", "hpp", "cu") for p in PACKAGE.rglob(f"*.{ext}")]
    found += [f"{p.relative_to(PACKAGE.parent)}: C++ source in the package" for p in sources]
    # Nor any other .py of the checkout (benchmarks may build old revisions' csrc/ files).
    for folder in ("benchmarks", "examples", "tests", "docs"):
        for path in sorted((PACKAGE.parent / folder).rglob("*.py")):
            if path.resolve() == pathlib.Path(__file__).resolve():
                continue
            text = path.read_text()
            found += [f"{folder}/{path.name}: {m}" for m in CPP_MARKERS[:4] if m in text]
    assert found == []


# --- (e) no process started -------------------------------------------------------------------


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (``/proc/<pid>/stat``: the fields after the
    command name, in parentheses, are the state then the parent's pid)."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = pathlib.Path("/proc", name, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out.add(int(name))
    return out


def test_an_engine_starts_no_process(tiny_llama_dir, make_engine, quant_cache, monkeypatch):
    """Building an int4 engine (its kernels loaded afresh) and one generate start no child
    process: none seen in /proc before and after, and neither subprocess, os.fork nor
    multiprocessing is called meanwhile."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    started: list[str] = []
    real_execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    real_fork = os.fork
    real_start = multiprocessing.process.BaseProcess.start

    def execute_child(self, args, *rest, **kw):  # type: ignore[no-untyped-def]
        started.append(f"subprocess {args!r}")
        return real_execute(self, args, *rest, **kw)

    def fork() -> int:
        started.append("os.fork")
        return real_fork()

    def start(self):  # type: ignore[no-untyped-def]
        started.append(f"multiprocessing {self!r}")
        return real_start(self)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    _fresh(monkeypatch)  # the kernels are loaded by this engine's start
    me = os.getpid()
    children = _children(me)
    active = set(multiprocessing.active_children())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def one_generate() -> list[int]:
        engine = make_engine(
            tiny_llama_dir,
            compile=False,
            quantization="int4",
            dtype="bfloat16",
            kv_cache_bytes=4 * 2**20,
        )
        async with engine:
            out = await engine.generate([1, 5, 9, 200, 7], params)
        return list(out.token_ids)

    assert len(asyncio.run(one_generate())) == 4
    loaded = {f for f in ("attention", "int4") if native.failure(f) is None}
    assert set(native._modules) >= loaded  # loaded by this engine, in this process
    assert started == []
    assert _children(me) == children
    assert set(multiprocessing.active_children()) == active


def test_an_install_without_a_compiler_builds_nothing_and_succeeds(tmp_path):
    """``setup.py`` with no usable C++ compiler (``CXX=false``) warns and succeeds without
    the kernels (the engine then runs torch's paths with one warning: test (b) above)."""
    import shutil
    import sys

    root = PACKAGE.parent
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / name, tmp_path / name)
    shutil.copytree(root / "csrc", tmp_path / "csrc")
    shutil.copytree(PACKAGE / "kernels", tmp_path / "asyncllm" / "kernels",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    (tmp_path / "asyncllm" / "__init__.py").write_text("")
    env = {**os.environ, "CXX": "false"}
    env.pop("ASYNCLLM_BUILD_VARIANTS", None)
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "without its C++ CPU kernels" in done.stderr
    assert not list((tmp_path / "asyncllm").rglob("*.so"))
