"""transformers' engines for the benchmark (``--peers hf``): ``generate`` on static batches
and transformers' own continuous batching, each in a process of its own
(:mod:`asyncllm.bench.engine_process` runs them)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from asyncllm.bench.engine_process import Timeline, Unsupported, rss_mb


def tensor_bytes(model: Any) -> int:
    """Bytes of a torch module's weights: its parameters, buffers and any other tensors its
    submodules hold as attributes (packed quantized weights), each storage counted once."""
    import torch

    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        tensors += [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


class HFStaticWorker:
    """transformers' ``generate`` on static batches with left padding (its standard offline
    path): the batch runs until its longest request is done; a request's tokens count from
    the step that produced them (as if streamed) and the batch's wall time is the call's."""

    name = "hf"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(args.threads)
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.load_s = time.perf_counter() - t
        self.pad = self.tokenizer.pad_token_id
        if self.pad is None:
            self.pad = self.tokenizer.eos_token_id
        self.max_batch = args.max_batch
        self.attn = getattr(self.model.config, "_attn_implementation", None)

    def info(self) -> dict[str, Any]:
        import torch
        import transformers

        return {
            "engine": self.name,
            "version": transformers.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_s": self.load_s,
            "rss_mb": rss_mb(),
            "precision": "float32",
            "weight_bytes": tensor_bytes(self.model),
        }

    def settings(self) -> dict[str, Any]:
        import torch

        return {
            "dtype": "float32",
            "batching": f"static, left padding, at most {self.max_batch} per batch",
            "attn_implementation": self.attn,
            "threads": torch.get_num_threads(),
        }

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        reqs = spec["requests"]
        if any(r[2] > 0 for r in reqs):
            raise Unsupported("static batching takes no requests while a batch runs (online load)")
        tl = Timeline(len(reqs))
        start = end = time.perf_counter()

        class Clock(StoppingCriteria):
            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        for b0 in range(0, len(reqs), self.max_batch):
            batch = list(range(b0, min(b0 + self.max_batch, len(reqs))))
            width = max(len(reqs[i][0]) for i in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                p = reqs[i][0]
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            new = max(reqs[i][1] for i in batch)
            gc_ = GenerationConfig(
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad,
            )
            clock = Clock()
            t_submit = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=gc_,
                    stopping_criteria=StoppingCriteriaList([clock]),
                )
            done = time.perf_counter()
            gen = out[:, width:].tolist()
            for row, i in enumerate(batch):
                m = reqs[i][1]
                tl.submit[i] = t_submit
                toks = gen[row][:m]
                if len(toks) < m:
                    raise RuntimeError(f"generate stopped early: {len(toks)} of {m} tokens")
                # generate does not stream a batch: its tokens are taken at the step that
                # computed them (as if streamed), the batch's wall time at the call's return.
                times = clock.times
                tl.first[i] = times[0] if times else done
                tl.last[i] = times[m - 1] if len(times) >= m else done
                tl.tokens[i] = toks
            end = max(end, done)
        res = tl.result(start, spec.get("outputs", False))
        res["wall_s"] = end - start
        res["settings"] = self.settings()
        return res


class HFCBWorker:
    """transformers' own continuous batching (the manager behind ``generate_batch``), each
    request with its own ``max_new_tokens``, EOS disabled, streamed."""

    name = "hf_cb"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t
        if not hasattr(self.model, "init_continuous_batching"):
            raise Unsupported("this transformers has no continuous batching (generate_batch)")

    info = HFStaticWorker.info

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig

        try:
            from transformers.generation.continuous_batching import WorkloadHints  # type: ignore
        except ImportError:  # pragma: no cover - older layouts
            WorkloadHints = None

        reqs = spec["requests"]
        if any(r[2] > 0 for r in reqs):
            raise Unsupported("run offline only here (generate_batch's API)")
        gcfg = GenerationConfig(
            do_sample=False, eos_token_id=-1, max_new_tokens=max(r[1] for r in reqs)
        )
        kw: dict[str, Any] = {}
        if WorkloadHints is not None:
            kw["workload_hints"] = WorkloadHints(
                max_prompt_length=max(len(r[0]) for r in reqs),
                max_generated_length=max(r[1] for r in reqs),
                num_requests=len(reqs),
            )
        manager = self.model.init_continuous_batching(generation_config=gcfg, **kw)
        # As generate_batch does, untimed: its warm-up sizes and exercises the batch shapes
        # (without it the first requests of a run are many times slower).
        t_warm = time.perf_counter()
        if not getattr(manager, "warmed_up", True):
            manager.warmup()
        warm_s = time.perf_counter() - t_warm
        manager.start()
        tl = Timeline(len(reqs))
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                index = {}
                for i, (ids, m, _) in enumerate(reqs):
                    rid = f"r{i}"
                    index[rid] = i
                    tl.submit[i] = time.perf_counter()
                    manager.add_request(
                        list(ids), request_id=rid, max_new_tokens=m, streaming=True, eos_token_id=-1
                    )
                seen = [0] * len(reqs)
                finished = 0
                deadline = time.perf_counter() + spec.get("timeout_s", 3600)
                while finished < len(reqs):
                    r = manager.get_result(timeout=1)
                    if r is None:
                        if time.perf_counter() > deadline:
                            raise TimeoutError("continuous batching did not finish in time")
                        if getattr(manager.background_thread_status, "fatal_error", None):
                            raise RuntimeError(f"{manager.background_thread_status.fatal_error}")
                        continue
                    if r.error:
                        raise RuntimeError(f"request {r.request_id}: {r.error}")
                    i = index[r.request_id]
                    toks = list(r.generated_tokens)
                    tl.got(i, toks[seen[i] :], time.perf_counter())
                    seen[i] = len(toks)
                    if r.is_finished():
                        finished += 1
        finally:
            manager.stop(block=True, timeout=30)
            destroy = getattr(self.model, "destroy_cached_continuous_batching_manager", None)
            if destroy is not None:
                destroy()
        res = tl.result(start, spec.get("outputs", False))
        res["settings"] = {
            "dtype": "float32",
            "batching": "transformers continuous batching (generate_batch's manager)",
            "manager_warmup_s": round(warm_s, 1),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "threads": torch.get_num_threads(),
        }
        return res
