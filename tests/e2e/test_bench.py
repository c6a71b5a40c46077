"""Smoke tests of the benchmark harness (``python -m asyncllm bench``) on the tiny model."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from asyncllm.bench import ceilings, workloads
from asyncllm.bench.asyncllm_engine import AsyncllmWorker
from asyncllm.bench.engine_process import Timeline, percentile


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
    # W7: one agent turn, a ~1,500-token document in the chat-templated prompt, 256 tokens
    # (quick: 32).
    (w7,) = w["W7"].requests
    assert 1400 < len(w7[0]) < 1600 and w7[1] == 256 and quick["W7"].requests[0][1] == 32
    assert w7[0][-3:] == data["W3"]["ids"][0][-3:]  # ends as W1's: the assistant's turn
    assert data["W7"]["texts"][0].count("Day ") == 26 + 2


def test_w1j_is_w1_under_one_json_schema():
    """W1J: W1's requests, each constrained by the one schema, EOS on (a complete object
    ends a request, in asyncllm and vLLM alike); the peers without a grammar skip it."""
    import types

    from asyncllm.bench import options, runner
    from asyncllm.sampling_params import StructuredOutputsParams

    data = workloads.load_prompts()
    w1, w1j = workloads.build(["W1", "W1J"], data)
    assert w1j.requests == w1.requests and w1.structured_outputs is None and w1.ignore_eos
    assert w1j.structured_outputs == {"json": workloads.W1J_SCHEMA} and not w1j.ignore_eos
    schema = workloads.W1J_SCHEMA
    assert schema["type"] == "object" and set(schema["required"]) == set(schema["properties"])
    StructuredOutputsParams(**w1j.structured_outputs)  # asyncllm takes it as it is
    bench = types.SimpleNamespace(model_info={})
    spec = runner.Bench.spec(bench, "vllm", w1j, "", w1j.requests)  # type: ignore[arg-type]
    assert spec["structured_outputs"] == {"json": schema} and spec["ignore_eos"] is False
    assert spec["outputs"] and json.loads(json.dumps(spec)) == spec  # sent as JSON
    plain = runner.Bench.spec(bench, "vllm", w1, "", w1.requests)  # type: ignore[arg-type]
    assert "structured_outputs" not in plain and "ignore_eos" not in plain
    assert {p for p in options.PEERS if "W1J" in options.UNSUPPORTED.get(p, {})} == {
        "hf", "hf_cb", "llamacpp"
    }  # fmt: skip


def test_grammar_share_and_its_report_section():
    from asyncllm.bench.reporting import markdown as report
    from asyncllm.bench.reporting import summary

    def step(batch, fill, mask, accept=0.0005, step=0.1):
        return {"batch": batch, "tokens": batch, "step": step, "sample": 0.004,
                "grammar_fill": fill, "grammar_mask": mask, "grammar_accept": accept}  # fmt: skip

    steps = [step(64, 0.002, 0.001), step(64, 0.004, 0.001), step(12, 0.05, 0.05)]
    steps.append({"batch": 64, "tokens": 64, "step": 0.1})  # no constrained row: not counted
    g = summary.grammar_share({"trace": {"steps": steps}, "tokens_per_s": 500.0})
    assert g is not None and g["batch"] == 64 and g["steps"] == 2
    assert g["share"] == pytest.approx(0.04) and g["share_with_accept"] == pytest.approx(0.045)
    assert summary.grammar_share(None) is None
    assert summary.grammar_share({"trace": {"steps": steps[3:]}}) is None
    text = "\n".join(report.grammar_lines(g, 600.0, 500.0))
    assert "asyncllm W1J: 500.0 tokens/s against W1's 600.0 (0.83×)" in text
    assert "| token bitmask fill (GrammarMatchers.fill) | 3.00 | 3.0% |" in text
    assert "Grammar share (fill + mask) 4.0% of the step; with the accept 4.5%" in text
    assert report.grammar_lines(None, 600.0, None) == []
    # The engine's step hook times the mask inside sampling: no mask part, share = fill.
    hooked = [{k: v for k, v in x.items() if k != "grammar_mask"} for x in steps]
    h = summary.grammar_share({"trace": {"steps": hooked}})
    assert h is not None and "grammar_mask" not in h["mean_s"]
    assert h["share"] == pytest.approx(0.03) and h["share_with_accept"] == pytest.approx(0.035)
    text = "\n".join(report.grammar_lines(h, 600.0, 500.0))
    assert "sampler's mask" not in text and "Grammar share (fill) 3.0% of the step" in text
    # The target row, met at 4%.
    s = {"ceilings": {}, "model": {}, "figures": {}, "engines": {}, "grammar": g}
    (row,) = [t for t in summary._targets(s, 1) if t["target"].startswith("W1J")]
    assert row["value"] == pytest.approx(0.04) and row["met"] is True


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
    # A bfloat16 engine is bounded by the bfloat16 GEMM ceiling, where one was measured.
    c = {"copy_gbs": 10.0, "matmul_gflops": 100.0, "bf16_matmul_gflops": 400.0}
    f = ceilings.floors(c, 10**8, 10**8, 64, "bfloat16")
    assert f["compute_s"] == pytest.approx(0.032) and f["bandwidth_s"] == pytest.approx(0.01)
    assert ceilings.floors(c, 10**8, 10**8, 64)["compute_s"] == pytest.approx(0.128)
    # The attention's KV reads add to the matmul floor (they run between a layer's matmuls).
    f = ceilings.floors(c, 10**8, 10**8, 64, "bfloat16", kv_bytes=5 * 10**7)
    assert f["kv_s"] == pytest.approx(0.005) and f["floor_with_kv_s"] == pytest.approx(0.037)
    best = ceilings.best_of([{"2": c}, {"2": {**c, "bf16_matmul_gflops": 500.0}}])
    assert best["2"]["bf16_matmul_gflops"] == 500


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
    keys = {"schedule", "prep", "forward", "sample", "update", "execute", "batch", "blocks_held"}
    assert steps and keys <= set(steps[0]) and steps[0]["step"] >= steps[0]["forward"] > 0
    assert any("dispatch" in s for s in steps)
    engine = w.engine({})
    core = engine.core
    assert "step" not in core.__dict__ and "schedule" not in core.scheduler.__dict__
    assert core.step_observer is None  # the hook is unset after a traced run
    # Untraced, a W5-like small cache, and "cache off" (unique salts) give the same tokens.
    small = {"kv_cache_bytes": 32 * core.kv_cache.spec.bytes_per_token * 16, "max_model_len": 64}
    res2 = w.run({**spec, "cache": "off", "engine_config": small})
    assert res2["outputs"] == res["outputs"] and res2["settings"]["kv_blocks"] == 32


def test_bench_command_quick(tiny_llama_dir, tmp_path):
    """``python -m asyncllm bench`` end to end on the tiny model: asyncllm in float32 and, as
    a second column, in bfloat16; transformers; llama.cpp skipped with its reason (the tiny
    model has no GGUF file; or no venv); W1J on asyncllm only, with its grammar section."""
    pytest.importorskip("matplotlib")
    import torch

    from asyncllm.__main__ import main
    from asyncllm.worker.device import default_num_threads, resolve_dtype

    out = tmp_path / "out"
    code = main(
        ["bench", "--quick", "--model", str(tiny_llama_dir), "--workloads", "W1J,W3,W6",
         "--peers", "hf,llamacpp", "--asyncllm-variants", "float32;bfloat16", "--no-cold-start",
         "--ceiling-mib", "16", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    counted = [x for x in lines if x.get("counted")]
    # The main column runs dtype "auto": the variant of the same dtype is dropped.
    auto = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    other = "float32" if auto == "bfloat16" else "bfloat16"
    assert {(x["engine"], x["workload"]) for x in counted} == {
        ("asyncllm", "W3"), ("asyncllm", "W6"), ("hf", "W3"), ("hf", "W6"),
        (f"asyncllm-{other}", "W3"), (f"asyncllm-{other}", "W6"),
        ("asyncllm", "W1J"), (f"asyncllm-{other}", "W1J"),
    }  # fmt: skip
    for x in counted:
        assert x["machine"]["cores"] and x["threads"] == default_num_threads()
        assert x["tokens_per_s"] > 0 and x["weight_bytes"] > 0
        if x["engine"].startswith("asyncllm"):
            assert x["machine"]["dtype"] == (other if x["engine"] != "asyncllm" else auto)
    report = (out / "report.md").read_text()
    assert "W6 tokens/s" in report and "## Targets" in report and "## Step time" not in report
    assert f"| asyncllm ({other}) |" in report and "| precision | weights MB |" in report
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["agreement"]["W6"]["hf"] <= 1.0
    assert "## Structured outputs (W1J" in report and "W1J tokens/s (JSON schema)" in report
    g = summary["grammar"]
    assert g["batch"] == 16 and 0 < g["share"] < 1 and g["mean_s"]["grammar_fill"] > 0
    assert "transformers generate (static), W1J: no JSON-schema" in report
    engines = summary["engines"]
    info = {auto: engines["asyncllm"]["info"], other: engines[f"asyncllm-{other}"]["info"]}
    assert {k: v["precision"] for k, v in info.items()} == {auto: auto, other: other}
    # Half the bytes, give or take buffers kept in float32 (rotary frequencies).
    assert 0.45 < info["bfloat16"]["weight_bytes"] / info["float32"]["weight_bytes"] < 0.55
    w6 = [d for d in summary["agreement_detail"] if d["workload"] == "W6"]
    assert {(d["engine"], d["reference"]) for d in w6} == {
        ("hf", "asyncllm"), ("hf", f"asyncllm-{other}"), (f"asyncllm-{other}", "asyncllm")
    }  # fmt: skip
    skipped = {x["engine"]: x["reason"] for x in summary["skips"] if x["workload"] == "all"}
    assert "GGUF" in skipped["llamacpp"] or "venv" in skipped["llamacpp"]
    assert "llama.cpp" in report  # its reason is listed under Skipped
    assert sorted(p.name for p in (out / "img").iterdir()) == [
        "kv_cache_waste.png", "throughput_vs_concurrency.png"
    ]  # fmt: skip


def test_bench_reports_a_missing_peer(tmp_path, monkeypatch):
    from asyncllm.bench import processes

    monkeypatch.setenv("ASYNCLLM_BENCH_VLLM_VENV", str(tmp_path / "nowhere"))
    monkeypatch.setattr(processes, "REPO", tmp_path)
    assert processes.find_vllm_venv(None) is None
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert processes.find_vllm_venv(str(venv)) == venv
    env = processes.vllm_env(venv, 1, "auto")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_llamacpp_peer_is_found_or_skipped_with_a_reason(tmp_path, monkeypatch):
    from asyncllm.bench import processes

    monkeypatch.setattr(processes, "REPO", tmp_path / "repo")
    monkeypatch.setenv("ASYNCLLM_BENCH_LLAMACPP_VENV", str(tmp_path / "nowhere"))
    assert processes.find_llamacpp_venv(None) is None
    venv = tmp_path / ".venv-llamacpp"  # the repository's parent's, the default place
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert processes.find_llamacpp_venv(None) == venv
    monkeypatch.setenv("ASYNCLLM_BENCH_LLAMACPP_VENV", str(tmp_path / "other"))
    assert processes.find_llamacpp_venv(None) == venv  # a missing one is passed over
    gguf = tmp_path / "m.gguf"
    assert processes.llamacpp_gguf(str(gguf), None)[0] is None
    assert "no such file" in processes.llamacpp_gguf("default", str(gguf))[1]
    gguf.write_bytes(b"GGUF")
    assert processes.llamacpp_gguf(str(gguf), None) == (str(gguf), "")
    assert "not a GGUF file" in processes.llamacpp_gguf(str(tmp_path), None)[1]
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    assert "PYTHONPATH" not in processes.peer_env(venv)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("float32;dtype=bfloat16;quantization=gguf",
         [{"dtype": "float32"}, {"dtype": "bfloat16"}, {"quantization": "gguf"}]),
        (" bfloat16 , int8 ; ", [{"dtype": "bfloat16", "quantization": "int8"}]),
        ("quantization=none", [{"quantization": "none"}]),
        ("speculative_tokens=4", [{"speculative_tokens": "4"}]),
        (None, []),
        ("none", []),
    ],
)  # fmt: skip
def test_asyncllm_variants_parse(text, expected):
    from asyncllm.bench.options import parse_variants

    assert parse_variants(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fp8", "unknown 'fp8'"),
        ("bits=4", "unknown key 'bits'"),
        ("dtype=float32,bfloat16", "dtype given twice"),
        (";", "names no variant"),
    ],
)
def test_asyncllm_variants_reject_bad_text(text, message):
    from asyncllm.bench.options import parse_variants

    with pytest.raises(SystemExit, match=message):
        parse_variants(text)


def test_precision_config_passes_only_what_is_given():
    from asyncllm.bench.options import precision_config, variant_name

    assert precision_config(None, None) == {}
    # "none" is passed on as None: EngineConfig's default quantization is "auto"
    assert precision_config("bfloat16", "none") == {"dtype": "bfloat16", "quantization": None}
    assert variant_name({"quantization": None}) == ("asyncllm-none", "asyncllm (none)")
    # EngineConfig's own check, before any worker starts (a quantization this asyncllm
    # lacks, or does not know, is refused the same way).
    with pytest.raises(SystemExit, match="asyncllm rejects dtype=float64"):
        precision_config("float64", None)
    with pytest.raises(SystemExit, match="asyncllm rejects quantization=fp3"):
        precision_config(None, "fp3")
    assert variant_name({"dtype": "bfloat16", "quantization": "gguf"}) == (
        "asyncllm-bfloat16-gguf", "asyncllm (bfloat16, gguf)"
    )  # fmt: skip
    # speculative decoding as a variant (W3 and W7 with proposals of up to 4 tokens)
    assert precision_config(None, None, "4") == {"speculative_tokens": 4}
    assert variant_name({"speculative_tokens": 4}) == (
        "asyncllm-speculative_4", "asyncllm (speculative 4)"
    )  # fmt: skip
    with pytest.raises(SystemExit, match="speculative_tokens must be an integer"):
        precision_config(None, None, "four")
    with pytest.raises(SystemExit, match="asyncllm rejects speculative_tokens=-1"):
        precision_config(None, None, "-1")


def test_vllm_dtype_columns():
    from asyncllm.bench import options

    assert options.vllm_columns(["float32"]) == [("vllm", "vLLM-CPU", "float32")]
    assert options.vllm_columns(["bfloat16", "float32"]) == [
        ("vllm", "vLLM-CPU (bfloat16)", "bfloat16"), ("vllm-float32", "vLLM-CPU", "float32")
    ]  # fmt: skip
    assert [options.base_engine(e) for e in ("vllm-bfloat16", "asyncllm-t1", "hf_cb")] == [
        "vllm", "asyncllm", "hf_cb"
    ]  # fmt: skip


def test_output_agreement():
    from asyncllm.bench.reporting.summary import output_agreement

    a = output_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [5, 6]])
    assert a == {"identical": 0.5, "prefix": pytest.approx((0.5 + 1.0) / 2)}
    assert output_agreement([[1]], [[2]]) == {"identical": 0.0, "prefix": 0.0}


def test_precision_targets_compare_the_right_columns():
    from asyncllm.bench.reporting import summary

    def eng(dtype, quant=None, precision=None):
        return {"failed": None, "info": {"dtype": dtype, "quantization": quant,
                                         "precision": precision or dtype}}  # fmt: skip

    s = {
        "engines": {
            "asyncllm": eng("float32"),
            "asyncllm-t1": eng("float32"),
            "asyncllm-bfloat16": eng("bfloat16"),
            "asyncllm-gguf": eng("float32", "gguf"),
            "llamacpp": {"failed": None, "info": {"precision": "Q4_1 (GGUF)"}},
            "vllm": eng(None, precision="float32"),
            "vllm-bfloat16": eng(None, precision="bfloat16"),
        },
        "figures": {
            "asyncllm": {"W1": {"tokens_per_s": 100.0}, "W3": {"tpot_mean_s": 0.04,
                                                              "rss_mb_max": 1000}},
            "asyncllm-bfloat16": {"W1": {"tokens_per_s": 170.0}, "W3": {"tpot_mean_s": 0.03}},
            "asyncllm-gguf": {"W1": {"tokens_per_s": 90.0}, "W3": {"tpot_mean_s": 0.01,
                                                                  "ttft_mean_s": 0.2,
                                                                  "rss_mb_max": 300}},
            "llamacpp": {"W1": {"tokens_per_s": 30.0}, "W3": {"tpot_mean_s": 0.0125,
                                                             "ttft_mean_s": 0.1}},
            "vllm": {"W1": {"tokens_per_s": 120.0}},
            "vllm-bfloat16": {"W1": {"tokens_per_s": 200.0}, "W3": {"tpot_mean_s": 0.02}},
        },
    }  # fmt: skip
    got = {}
    summary._precision_targets(
        s, lambda name, value, goal, ok, note="": got.update({name: (value, ok)})
    )
    assert got == {
        "W3 TPOT, asyncllm Q4_1 (gguf) / llama.cpp's": (pytest.approx(0.8), True),
        "W3 TTFT, asyncllm Q4_1 (gguf) / llama.cpp's": (pytest.approx(2.0), False),
        "W1 tokens/s, asyncllm Q4_1 (gguf) / float32": (pytest.approx(0.9), False),
        "W1 tokens/s, asyncllm Q4_1 (gguf) / llama.cpp's": (pytest.approx(3.0), True),
        "W1 tokens/s, asyncllm bfloat16 / float32": (pytest.approx(1.7), True),
        "W3 TPOT, asyncllm bfloat16 / float32": (pytest.approx(0.75), False),
        "W1 tokens/s, asyncllm bfloat16 / vLLM-CPU bfloat16": (pytest.approx(0.85), False),
        "W3 TPOT, asyncllm bfloat16 / vLLM-CPU bfloat16": (pytest.approx(1.5), False),
        "W3 peak RSS, asyncllm Q4_1 (gguf) / float32": (pytest.approx(0.3), True),
    }
    # asyncllm (float32) against vLLM in its precision, not the first vLLM column's.
    s["engines"]["vllm"], s["engines"]["vllm-float32"] = eng(None, precision="bfloat16"), s[
        "engines"].pop("vllm")  # fmt: skip
    s["figures"]["vllm-float32"] = s["figures"].pop("vllm")
    (row,) = [t for t in summary._targets({**s, "ceilings": {}, "model": {}}, 1)
              if t["target"] == "W1 throughput / vLLM-CPU's"]  # fmt: skip
    assert row["value"] == pytest.approx(100 / 120) and row["note"] == "vLLM in float32"
    # Without the columns, no target is claimed.
    got.clear()
    summary._precision_targets({"engines": {"asyncllm": eng("float32")}, "figures": {}},
                              lambda *a, **k: got.update({a[0]: a}))  # fmt: skip
    assert got == {}


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
        (["--vllm-dtype", "float16"], "--vllm-dtype: unknown \\['float16'\\]"),
        (["--vllm-dtype", ","], "--vllm-dtype names no dtype"),
    ],
)
def test_bench_rejects_bad_arguments_clearly(args, message, tmp_path):
    from asyncllm.__main__ import main

    afile = tmp_path / "afile"
    afile.write_text("")
    args = [str(afile) if a == "FILE" else a for a in args]
    with pytest.raises(SystemExit, match=message):
        main(["bench", "--quick", "--no-plots", *args])


def test_counted_runs_wait_for_idle_cpus(monkeypatch):
    """Before a counted run the harness waits until the CPUs are idle (an engine that just
    ran may keep spinning), at most ``max_wait_s``; busy = all but idle and iowait."""
    from asyncllm.bench import processes

    def feed(samples):
        it = iter(samples)
        monkeypatch.setattr(processes, "_busy_jiffies", lambda: next(it))

    # busy, total jiffies: 90% busy in the first window, 5% in the second
    feed([(0, 0), (90, 100), (95, 200), (1000, 2000)])
    waited = processes.wait_until_quiet(window_s=0.01, max_wait_s=5.0)
    assert 0.02 <= waited < 1.0
    feed([(100 * i, 100 * i + 1) for i in range(10_000)])  # always busy
    waited = processes.wait_until_quiet(window_s=0.01, max_wait_s=0.1)
    assert 0.1 <= waited < 1.0
    monkeypatch.setattr(processes, "_busy_jiffies", lambda: None)  # no /proc/stat
    assert processes.wait_until_quiet() == 0.0
    monkeypatch.undo()
    busy, total = processes._busy_jiffies() or (0, 1)
    assert 0 <= busy <= total
