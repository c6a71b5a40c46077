"""Check the bench's llama.cpp peer in its venv (not a CI test: CI has no llama.cpp build).

    bash ../shared/bench/peers/llamacpp_setup.sh ../.venv-llamacpp   # once, 10-30 min
    python benchmarks/check_llamacpp_peer.py

Checks that the workloads' prompt ids are llama.cpp's tokenizer's, that the worker reports
the GGUF file's precision, that a batch of sequences decodes exactly as each sequence alone
does (greedy), and that online arrivals are refused with a reason. Exits 1 on a failure,
2 when the venv or the GGUF file is missing.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tempfile

from asyncllm.bench import processes, workloads


def main() -> int:
    venv = processes.find_llamacpp_venv(None)
    gguf, why = processes.llamacpp_gguf("default", None)
    if venv is None or gguf is None:
        print(f"no llama.cpp venv (../shared/bench/peers/llamacpp_setup.sh) or {why}")
        return 2
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import llama_cpp"], check=False)
    if probe.returncode != 0:
        print(f"{venv} has no llama_cpp")
        return 2
    cmd = [str(venv / "bin" / "python"), str(processes.WORKER), "--engine", "llamacpp",
           "--threads", "1", "--prompts", str(workloads.PROMPTS_FILE), "--model", gguf]  # fmt: skip
    log = pathlib.Path(tempfile.mkdtemp()) / "log"
    w = processes.WorkerProc("llamacpp", cmd, processes.peer_env(venv), log)
    w.start()
    try:
        assert w.wait_ready(120), w.failed
        assert w.info["tokenizer_ids_match"] == {"W1": "64/64", "W2": "32/32", "W3": "1/1"}
        assert w.info["precision"] == "Q4_1 (GGUF)" and w.info["weight_bytes"] > 0
        ids = workloads.load_prompts()["W1"]["ids"]
        reqs = [[ids[0], 6, 0.0], [ids[1], 3, 0.0], [ids[2], 5, 0.0]]
        both = w.run({"requests": reqs, "outputs": True}, 120)
        assert [len(o) for o in both["outputs"]] == [6, 3, 5] and both["completed"] == 3
        assert "3 sequence(s)" in both["settings"]["batching"]
        alone = [w.run({"requests": [r], "outputs": True}, 120)["outputs"][0] for r in reqs]
        assert both["outputs"] == alone, (both["outputs"], alone)
        online = w.run({"requests": [[ids[0], 2, 0.5]]}, 60)
        assert "offline" in online["skipped"]
    except AssertionError as e:
        print(f"FAILED: {e!r}")
        return 1
    finally:
        w.stop()
    print("llama.cpp peer: ok (tokenizer ids, precision, batched == alone, online refused)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
