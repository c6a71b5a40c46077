"""Smoke tests of the benchmark harness (``python -m asyncllm bench``) on the tiny model."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from asyncllm.bench import ceilings, workloads
from asyncllm.bench.worker import AsyncllmWorker, Timeline, percentile


def test_workloads_follow_the_spec():
    data = workloads.load_prompts()
    w = {x.name: x for x in workloads.build(workloads.ALL, data)}
    assert [len(w[n].requests) for n in ("W1", "W2", "W3", "W5", "W6", "C4", "C16")] == [
        64, 32, 1, 64, 64, 4, 16
    ]  # fmt: skip
    assert {r[1] for r in w["W1"].requests} == {128}
    assert {r[1] for r in w["W2"].requests} == {32} and w["W2"].variants == ("on", "off")
    assert w["W3"].requests[0][0] == data["W1"]["ids"][0]
    assert [r[1] for r in w["W6"].requests] == [16 + (37 * i) % 241 for i in range(64)]
    assert w["W5"].kv_fraction == 0.25
    w4 = w["W4"].requests
    assert all(r[1] == 64 for r in w4) and 30 < len(w4) < 100  # ~1 request/s for 60 s
    times = [r[2] for r in w4]
    assert all(0 < a < b < 60 for a, b in itertools.pairwise(times))
    assert workloads.poisson_arrivals(1.0, 60.0) == workloads.poisson_arrivals(1.0, 60.0)
    # Warm-ups: the same prompts, 8 tokens, at most 4096 prompt tokens.
    assert len(w["W1"].warmup()) == 64 and {r[1] for r in w["W1"].warmup()} == {8}
    assert sum(len(r[0]) for r in w["W2"].warmup()) <= 4096 + 600
    # The packaged prompts are W1's chat template applied to its texts.
    assert data["W1"]["ids"][0][-3:] == data["W3"]["ids"][0][-3:]
    quick = {x.name: x for x in workloads.build(workloads.ALL, data, quick=True)}
    assert len(quick["W1"].requests) == 16 and quick["W4"].params["duration_s"] == 15


def test_timeline_and_percentiles():
    tl = Timeline(2)
    tl.submit = [0.0, 1.0]
    tl.got(0, [5], 0.5)
    tl.got(0, [6, 7], 1.5)
    tl.got(1, [8], 2.0)
    res = tl.result(0.0, keep_outputs=True)
    assert res["wall_s"] == 2.0 and res["generated_tokens"] == 4
    assert res["ttft_s"] == [0.5, 1.0] and res["tpot_s"] == [0.5]
    assert res["outputs"] == [[5, 6, 7], [8]]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 99) is None


def test_floors():
    f = ceilings.floors({"copy_gbs": 10.0, "matmul_gflops": 100.0}, 10**9, 10**8, 64)
    assert f["bandwidth_s"] == pytest.approx(0.1) and f["compute_s"] == pytest.approx(0.128)
    assert f["floor_s"] == f["compute_s"]


def test_asyncllm_worker_traces_and_restores(tiny_llama_dir):
    args = argparse.Namespace(
        model=str(tiny_llama_dir), threads=1, config=json.dumps({"kv_cache_bytes": 2**22})
    )
    w = AsyncllmWorker(args)
    ids = [[1, 2, 3, 4, 5], [6, 7, 8]]
    spec = {"requests": [[ids[0], 6, 0.0], [ids[1], 4, 0.0]], "outputs": True}
    res = w.run({**spec, "trace": True, "lag": True})
    assert res["generated_tokens"] == 10 and res["completed"] == 2
    assert [len(o) for o in res["outputs"]] == [6, 4]
    assert res["loop_lag_ms"]["samples"] > 0
    steps = res["trace"]["steps"]
    assert steps and {"schedule", "forward", "sample", "batch", "blocks_held"} <= set(steps[0])
    assert any("dispatch" in s for s in steps)
    engine = w.engine({})
    core = engine._engine
    assert "step" not in core.__dict__ and "schedule" not in core.scheduler.__dict__
    # Untraced, a W5-like small cache, and "cache off" (unique salts) give the same tokens.
    small = {"kv_cache_bytes": 32 * core.kv_cache.spec.bytes_per_token * 16, "max_model_len": 64}
    res2 = w.run({**spec, "cache": "off", "engine_config": small})
    assert res2["outputs"] == res["outputs"] and res2["settings"]["kv_blocks"] == 32


def test_bench_command_quick(tiny_llama_dir, tmp_path):
    """``python -m asyncllm bench`` end to end on the tiny model, asyncllm and transformers."""
    pytest.importorskip("matplotlib")
    from asyncllm.__main__ import main
    from asyncllm.worker.device import default_num_threads

    out = tmp_path / "out"
    code = main(
        ["bench", "--quick", "--model", str(tiny_llama_dir), "--workloads", "W3,W6",
         "--peers", "hf", "--no-cold-start", "--ceiling-mib", "16", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    counted = [x for x in lines if x.get("counted")]
    assert {(x["engine"], x["workload"]) for x in counted} == {
        ("asyncllm", "W3"), ("asyncllm", "W6"), ("hf", "W3"), ("hf", "W6")
    }  # fmt: skip
    for x in counted:
        assert x["machine"]["cores"] and x["threads"] == default_num_threads()
        assert x["tokens_per_s"] > 0
    report = (out / "report.md").read_text()
    assert "W6 tokens/s" in report and "## Targets" in report and "## Step time" not in report
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["agreement"]["W6"]["hf"] <= 1.0
    assert sorted(p.name for p in (out / "img").iterdir()) == [
        "kv_cache_waste.png", "throughput_vs_concurrency.png"
    ]  # fmt: skip


def test_bench_reports_a_missing_peer(tmp_path, monkeypatch):
    from asyncllm.bench import runner

    monkeypatch.setenv("ASYNCLLM_BENCH_VLLM_VENV", str(tmp_path / "nowhere"))
    monkeypatch.setattr(runner, "REPO", tmp_path)
    assert runner.find_vllm_venv(None) is None
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert runner.find_vllm_venv(str(venv)) == venv
    env = runner.vllm_env(venv, 1, "auto")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_model_figures(tiny_llama_dir):
    from asyncllm.bench.runner import model_figures

    f = model_figures(str(tiny_llama_dir))
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert f["num_params"] == sum(p.numel() for p in m.parameters())
    assert f["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, layers, KV heads, head_dim, fp32
    assert f["weight_bytes"] == 4 * f["num_params"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "0"], "--threads must be at least 1"),
        (["--repeats", "-1"], "--repeats must be at least 1"),
        (["--workloads", ","], "names no workload"),
        (["--model", "/nonexistent/model"], "--model:"),
        (["--out", "FILE"], "cannot make that directory"),
    ],
)
def test_bench_rejects_bad_arguments_clearly(args, message, tmp_path):
    from asyncllm.__main__ import main

    afile = tmp_path / "afile"
    afile.write_text("")
    args = [str(afile) if a == "FILE" else a for a in args]
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--quick", "--no-plots", *args])
