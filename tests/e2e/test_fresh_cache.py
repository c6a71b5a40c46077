"""Four ``generate`` commands started together on an empty cache (issue 35): the C++
kernels come with the package, so none of them builds anything; the compile child runs one
at a time; nothing any of them started is alive 5 s after the last one exits; and each
says its steps run the installed C++ kernels."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from asyncllm.kernels import native

#: Words of a command line that compiles or links code.
BUILDERS = ("cc1plus", "g++", "gcc", "ninja", "setup.py", "cpu_extension", " ld ")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process /proc shows now."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            cmd = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # ended meanwhile
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        out[int(entry)] = (parent, cmd.decode(errors="replace").strip())
    return out


def _descendants(roots: set[int]) -> dict[int, str]:
    """pid -> command line of the processes under ``roots`` (roots excluded)."""
    procs, found, frontier = _processes(), {}, set(roots)
    while frontier:
        children = {pid for pid, (parent, _) in procs.items() if parent in frontier}
        children -= found.keys() | roots
        found.update({pid: procs[pid][1] for pid in children})
        frontier = children
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc here")
def test_four_generates_on_an_empty_cache(tmp_path, tiny_llama_dir):
    installed = native.status()
    if any(v in ("off", "torch") for v in installed.values()):
        pytest.skip(f"the C++ kernels are not all installed here: {installed}")
    env = {**os.environ, "ASYNCLLM_CACHE": str(tmp_path / "cache")}
    env.pop("ASYNCLLM_COMPILE")  # the suite's "off": a user's start compiles in a child
    args = [sys.executable, "-m", "asyncllm", "generate", "Tell me a story."]
    args += ["--model", str(tiny_llama_dir), "--quantization", "int4", "--max-tokens", "4"]
    procs = [
        subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    seen: dict[int, str] = {}
    compiling_at_once = 0
    while any(p.poll() is None for p in procs):
        now = _descendants({p.pid for p in procs})
        seen.update(now)
        compiling_at_once = max(
            compiling_at_once, sum("compile_worker" in cmd for cmd in now.values())
        )
        time.sleep(0.05)
    results = [(p.returncode, *p.communicate(timeout=60)) for p in procs]
    for status, out, err in results:
        assert status == 0, err[-2000:]
        assert out.strip(), err[-2000:]
        kernels = " ".join(f"{k}={v}" for k, v in installed.items())
        assert f"C++ kernels: {kernels}" in err, err[-2000:]
    assert not [cmd for cmd in seen.values() if any(b in f" {cmd} " for b in BUILDERS)]
    assert compiling_at_once <= 1, seen
    time.sleep(5)
    alive = _processes()
    assert not {pid: cmd for pid, cmd in seen.items() if alive.get(pid, (0, ""))[1] == cmd}
