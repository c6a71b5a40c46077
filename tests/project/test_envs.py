"""The environment-variable registry (asyncllm/envs.py): every variable the package and its
build read is registered, docs/configuration.md shows the registry, one parser per kind."""

from __future__ import annotations

import pathlib
import re

import pytest

from asyncllm import envs

ROOT = pathlib.Path(__file__).resolve().parents[2]
_NAME = re.compile(r"\bASYNCLLM_[A-Z0-9_]+\b")


def test_every_variable_read_is_registered():
    sources = [*sorted((ROOT / "asyncllm").rglob("*.py")), ROOT / "setup.py"]
    found = {name for f in sources for name in _NAME.findall(f.read_text())}
    assert found - set(envs.VARS) == set()
    assert set(envs.VARS) - found == set()  # no entry outlives its reader


def test_the_docs_show_the_registry():
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("<!-- envs:begin -->\n", 1)[1].split("<!-- envs:end -->", 1)[0]
    assert table == envs.markdown_table()


def test_parsers(monkeypatch):
    name = "ASYNCLLM_FUSED_SIBLINGS"
    monkeypatch.delenv(name, raising=False)
    assert envs.switch(name)  # the default
    for off in ("0", "false", " OFF ", "No"):
        monkeypatch.setenv(name, off)
        assert not envs.switch(name)
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=r"\$ASYNCLLM_FUSED_SIBLINGS must be 1 or 0"):
        envs.switch(name)
    monkeypatch.setenv("ASYNCLLM_COMPILE", "2")
    with pytest.raises(ValueError, match=r"\$ASYNCLLM_COMPILE must be one of 0, 1"):
        envs.choice("ASYNCLLM_COMPILE")
    monkeypatch.setenv("ASYNCLLM_CACHE", "~/x")
    assert envs.path("ASYNCLLM_CACHE") == pathlib.Path("~/x").expanduser()
    with pytest.raises(KeyError, match="not a registered"):
        envs.text("ASYNCLLM_NOPE")


def test_non_default_names_what_changed_and_hides_secrets(monkeypatch):
    for name in envs.VARS:
        monkeypatch.delenv(name, raising=False)
    assert envs.non_default() == {}
    monkeypatch.setenv("ASYNCLLM_Q8_KERNEL", "1")  # the default: not listed
    monkeypatch.setenv("ASYNCLLM_INT4_DEQUANT_KERNEL", "0")
    monkeypatch.setenv("ASYNCLLM_API_KEY", "sk-secret")
    assert envs.non_default() == {"ASYNCLLM_INT4_DEQUANT_KERNEL": "0", "ASYNCLLM_API_KEY": "***"}
