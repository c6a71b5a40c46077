"""The fidelity harness's run (``python -m asyncllm bench --fidelity``; what it measures is
described in :mod:`asyncllm.bench.fidelity.measures`).

    python -m asyncllm bench --fidelity [--quick] [--fidelity-paths default,float32,...]
                             [--model default] [--threads N] [--peers llamacpp|none]
                             [--fidelity-text FILE] [--out bench-results]

The reference is computed first, in this process (or read from ``fidelity_reference.json``),
and its model freed; then each path of :data:`asyncllm.bench.fidelity.measures.PATHS` runs
in an engine process of its own, one after the other (the benchmark's
:class:`~asyncllm.bench.processes.WorkerProc` and :mod:`asyncllm.bench.fidelity.workers`),
with its configuration and switches; then llama.cpp, when its venv is found
(``../shared/bench/peers/llamacpp_setup.sh``), else it is reported as not installed. A path
that fails to start or to run is reported with the reason; the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import sys
import time
from typing import Any

from asyncllm.bench.fidelity import measures as fid
from asyncllm.bench.fidelity import reference
from asyncllm.bench.processes import (
    NO_VENV,
    REPO,
    WorkerProc,
    find_llamacpp_venv,
    llamacpp_gguf,
    log,
    peer_env,
)

ENGINE = pathlib.Path(__file__).with_name("workers.py")
#: torch threads of the reference: one. It runs once per model, and on a busy 2-core
#: machine a 2-thread OpenMP forward waits on its descheduled partner: 32 greedy tokens of the
#: default model took 34 s with 2 threads and 4 s with 1 (load average 4).
REFERENCE_THREADS = 1
#: The most seconds one path's start (a first compile included) and its run may take.
START_TIMEOUT_S = 1200.0
RUN_TIMEOUT_S = 3600.0


def prepare(args: argparse.Namespace, threads: int = REFERENCE_THREADS) -> dict[str, Any]:
    """The model directory, the windows, the questions and their prompts, the EOS ids, and
    the reference's figures (computed with ``threads`` torch threads, or read from the cache
    in ``--out``)."""
    from asyncllm.errors import ModelNotFoundError
    from asyncllm.models.loader import resolve_model_dir

    try:
        model_dir = resolve_model_dir(args.model)
    except ModelNotFoundError as e:
        raise SystemExit(f"--model: {e}") from None
    size = fid.QUICK if args.quick else fid.FULL
    text_file = pathlib.Path(args.fidelity_text or fid.TEXT_FILE)
    if not text_file.is_file():
        raise SystemExit(f"no text for the perplexity: {text_file} (pass --fidelity-text FILE)")
    model, tok = reference.load_reference_model(model_dir, threads)
    max_len = int(getattr(model.config, "max_position_embeddings", None) or 2048)
    window = min(size.window, max_len - 1)
    ids = tok.encode(text_file.read_text(), add_special_tokens=False)
    windows = fid.text_windows(ids, window, size.windows)
    if not windows:
        raise SystemExit(f"{text_file} holds {len(ids)} tokens: not one window of {window}")
    questions = fid.load_questions()[: size.questions]
    prompts = [fid.chat_ids(tok, q) for q in questions]
    n = size.answer_tokens
    cache = pathlib.Path(args.out) / reference.CACHE_NAME
    log(f"fidelity reference: {len(windows)} windows of {window} tokens, {len(prompts)} questions")
    ref = reference.compute(model_dir, windows, prompts, n, cache, threads, model)
    log(f"reference ready ({ref['computed_s']:.0f} s computing; cache {cache})")
    eos = reference.eos_ids(model, tok)
    del model
    gc.collect()
    longest = max([window] + [len(p) + n for p in prompts])
    return {
        "model_dir": model_dir, "tokenizer": tok, "text_file": text_file, "window": window,
        "text_tokens": len(ids), "windows": windows, "questions": questions, "prompts": prompts,
        "n": n, "eos": eos, "ref": ref, "max_model_len": min(max_len, max(longest + 1, 512)),
    }  # fmt: skip


def spec_of(data: dict[str, Any]) -> dict[str, Any]:
    """The run spec every path gets."""
    return {
        "fidelity": {"windows": data["windows"], "questions": data["prompts"],
                     "max_tokens": data["n"]},
    }  # fmt: skip


def asyncllm_command(
    args: argparse.Namespace, path: fid.FidelityPath, data: dict[str, Any], threads: int
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``path``'s engine process. A quantized path loads the
    model as the user named it (a GGUF file keeps its own blocks); the others load the
    resolved directory, as the benchmark's asyncllm columns do."""
    cfg = {"max_model_len": data["max_model_len"], "kv_cache_bytes": args.kv_gib * 2**30,
           **path.config}  # fmt: skip
    model = args.model if cfg.get("quantization", "auto") is not None else str(data["model_dir"])
    cmd = [sys.executable, "-m", "asyncllm.bench.fidelity.workers", "--engine", "asyncllm",
           "--threads", str(threads), "--config", json.dumps(cfg), "--max-batch", "64",
           "--max-model-len", str(data["max_model_len"]), "--model", model]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(path.env)
    return cmd, env


def llamacpp_command(
    args: argparse.Namespace, data: dict[str, Any], threads: int
) -> tuple[list[str], dict[str, str]] | str:
    """llama.cpp's command and environment, or why it does not run ("not installed: ...")."""
    venv = find_llamacpp_venv(args.llamacpp_venv)
    if venv is None:
        return f"not installed: {NO_VENV['llamacpp']}"
    gguf, why = llamacpp_gguf(args.model, args.llamacpp_gguf)
    if gguf is None:
        return f"no GGUF file: {why}"
    cmd = [str(venv / "bin" / "python"), str(ENGINE), "--engine", "llamacpp",
           "--threads", str(threads), "--max-model-len", str(data["max_model_len"]),
           "--model", gguf, *(["--extra-bufts"] if args.llamacpp_extra_bufts else [])]  # fmt: skip
    return cmd, peer_env(venv)


def run_engine(
    name: str, command: tuple[list[str], dict[str, str]], spec: dict[str, Any], out: pathlib.Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start one engine process, run ``spec`` on it, stop it: ``(its info, the result)``;
    the result is ``{"skipped": why}`` when it failed to start or to run."""
    cmd, env = command
    w = WorkerProc(name, cmd, env, out / "logs" / f"{name}.log")
    log(f"fidelity: starting {name}")
    w.start()
    try:
        if not w.wait_ready(START_TIMEOUT_S):
            log(f"{name} failed to start: {w.failed}\n{getattr(w, 'log_tail', '')[-800:]}")
            return {}, {"skipped": f"failed to start: {w.failed}"}
        log(f"{name} ready in {w.info['start_s']:.0f} s ({w.info.get('precision')})")
        res = w.run(spec, RUN_TIMEOUT_S)
    finally:
        w.stop()
    if "error" in res:
        log(f"{name} failed: {res['error']}\n{res.get('traceback', '')[-1500:]}")
        return w.info, {"skipped": f"failed: {res['error']}"}
    return w.info, res


def record(
    name: str, label: str, info: dict[str, Any], res: dict[str, Any], data: dict[str, Any],
    common: dict[str, Any], path: fid.FidelityPath | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One ``fidelity.jsonl`` line: the path's figures
    (:func:`asyncllm.bench.fidelity.measures.score`) or why it was skipped, what ran, and the
    machine."""
    rec: dict[str, Any] = {"engine": name, "label": label, "workload": "fidelity",
                           "variant": path.name if path else name, "run": 0, **common}  # fmt: skip
    if path is not None:
        rec.update(config=path.config, env=path.env, description=path.label)
    rec.update(engine_version=info.get("version"), threads=info.get("threads"),
               precision=info.get("precision"), start_s=info.get("start_s"))  # fmt: skip
    if "skipped" in res:
        rec.update(counted=False, skipped=res["skipped"])
        return rec
    figures = fid.score(data["ref"], res, data["eos"], data["n"])
    for d in figures["differing"]:
        d["text"] = data["tokenizer"].decode(d["ids"])
    rec.update(counted=True, **figures, settings=res.get("settings"),
               windows_s=res.get("windows_s"), answers_s=res.get("answers_s"))  # fmt: skip
    return rec


def run(args: argparse.Namespace) -> int:
    """Run the fidelity harness; returns the exit code (0 when every asyncllm path ran)."""
    from asyncllm.bench import ceilings
    from asyncllm.bench.fidelity import report as fidelity_report
    from asyncllm.worker.device import default_num_threads

    started = time.perf_counter()
    paths = fid.select_paths(args.fidelity_paths)
    peers = ["llamacpp"] if args.peers is None else [
        p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"
    ]  # fmt: skip
    threads = args.threads or default_num_threads()
    out = pathlib.Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    data = prepare(args)
    machine = ceilings.machine()
    common = {
        "quick": bool(args.quick),
        "workload_params": {"text": data["text_file"].name, "window": data["window"],
                            "windows": len(data["windows"]), "questions": len(data["prompts"]),
                            "answer_tokens": data["n"]},
        "machine": {"cores": machine["cores"], "processor": machine["processor"]},
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    spec = spec_of(data)
    interrupted = False
    with open(out / "fidelity.jsonl", "w") as jsonl:
        try:
            for p in paths:
                name = f"asyncllm-{p.name}"
                info, res = run_engine(name, asyncllm_command(args, p, data, threads), spec, out)
                common["time"] = datetime.datetime.now().isoformat(timespec="seconds")
                rows.append(record(name, f"asyncllm {p.name}", info, res, data, common, p))
                jsonl.write(json.dumps(rows[-1]) + "\n")
                jsonl.flush()
            for peer in peers:
                rows.append(peer_row(peer, args, data, spec, threads, out, common))
                jsonl.write(json.dumps(rows[-1]) + "\n")
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report what finished
            interrupted = True
            log("fidelity interrupted: the report covers the paths that finished")
    summary = fidelity_report.summary(args, data, rows, machine, time.perf_counter() - started)
    summary["interrupted"] = interrupted
    (out / "fidelity.json").write_text(json.dumps(summary, indent=1, default=str))
    md = "\n".join(fidelity_report.markdown(summary)) + "\n"
    (out / "fidelity.md").write_text(md)
    print(md)
    log(f"fidelity done in {summary['elapsed_s'] / 60:.1f} min; results in {out}")
    ok = all("skipped" not in r for r in rows if r["engine"].startswith("asyncllm"))
    return 0 if ok and not interrupted else 1


def peer_row(
    peer: str, args: argparse.Namespace, data: dict[str, Any], spec: dict[str, Any],
    threads: int, out: pathlib.Path, common: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The record of a peer (``--peers``): llama.cpp's figures, or why there are none."""
    label = "llama.cpp (the GGUF file's own blocks)"
    if peer != "llamacpp":
        return record(peer, peer, {}, {"skipped": "not a fidelity peer (llamacpp only)"},
                      data, common)  # fmt: skip
    command = llamacpp_command(args, data, threads)
    if isinstance(command, str):
        log(f"llama.cpp: {command}")
        return record("llamacpp", label, {}, {"skipped": command}, data, common)
    info, res = run_engine("llamacpp", command, spec, out)
    common["time"] = datetime.datetime.now().isoformat(timespec="seconds")
    return record("llamacpp", label, info, res, data, common)
