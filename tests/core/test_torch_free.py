"""tests/core runs without torch: the core is pure Python (tests/project/test_import_graph.py
checks the package), and so are its tests and the shared conftest.

A child pytest runs this tier with ``torch`` made unimportable (``sys.modules["torch"] =
None``: ``import torch`` raises ImportError, ``importlib.util.find_spec`` answers None, as
on a machine without it), so a torch import sneaking into a core test, the root conftest or
the code they call fails here. The front end's fake core (tests/frontend/fake_core.py) is
imported there too: the front end never imports torch.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHILD = """
import sys
sys.modules["torch"] = None  # as if not installed
import tests.frontend.fake_core
import pytest
code = pytest.main(["-q", "-p", "no:cacheprovider", "tests/core", "-k", "not torch_free"])
assert "torch" not in sys.modules or sys.modules["torch"] is None
sys.exit(code)
"""


def test_the_core_tier_runs_without_torch():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
