"""The peer of ``bench_gpu_step.py``: one transformers + torch training step of the same decoder.

Run as a script by ``bench_gpu_step.py`` in a process of its own, before jax starts on the
device (XLA's allocator keeps what it takes, so torch would not find the memory after it): the
cases as a JSON list on the command line, one JSON line of results per case on stdout (each
case's model and optimizer are freed before the next).

The step is the usual torch recipe for training a Hugging Face model: the model built by
transformers from the case's ``config.json`` (``AutoModelForCausalLM.from_config``, random
weights) with parameters and AdamW moments in the case's parameter dtype, the forward under
``torch.autocast`` in the compute dtype, the loss of next-token labels, backward, a fused AdamW
step on a GPU; gradient checkpointing with ``remat="full"``. transformers' fastest expert
implementation that runs is used: ``grouped_mm`` (``torch._grouped_mm``), else ``batched_mm``,
else its eager loop; attention is PyTorch's SDPA (flash attention on Hopper), else eager (a
family whose attention SDPA cannot express, such as gpt-oss' sinks). Reported: the median step
time over the repeats after two warm-up steps, tokens/s, the peak memory torch allocated, which
implementations ran, or the error that stopped it (an out-of-memory included).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

EXPERTS = ("grouped_mm", "batched_mm", "eager")
ATTENTION = ("sdpa", "eager")


def _model(torch, transformers, spec: dict[str, Any], experts: str, attention: str):
    config = transformers.AutoConfig.for_model(**spec["hf"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    if experts != "eager" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts)
    elif experts != "eager":
        raise RuntimeError("this transformers has no set_experts_implementation")
    model.to(device=spec["device"], dtype=getattr(torch, spec["param_dtype"]))
    model.train()
    if spec["remat"] == "full":
        model.gradient_checkpointing_enable()
    return model


def _stepper(torch, model, spec: dict[str, Any]):
    device = spec["device"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (spec["batch"], spec["seq"]), generator=generator)
    tokens = tokens.to(device)
    low = spec["dtype"] != "float32"

    def step():
        with torch.autocast(device, dtype=getattr(torch, spec["dtype"]), enabled=low):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The peer's row fields for one case (``spec``: hf, batch, seq, dtype, param_dtype, remat,
    repeats, device)."""
    import torch
    import transformers

    if spec["device"] == "auto":
        spec = {**spec, "device": "cuda" if torch.cuda.is_available() else "cpu"}
    device = spec["device"]
    errors = []
    for experts in EXPERTS:
        for attention in ATTENTION:
            try:
                model = _model(torch, transformers, spec, experts, attention)
                step = _stepper(torch, model, spec)
                for _ in range(2):
                    step()
                _sync(torch, device)
            except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError) as e:
                return {"error": f"OutOfMemoryError: {str(e)[:300]}", "tried": errors}
            except Exception as e:  # this implementation does not run here: the next one
                errors.append(f"{experts}/{attention}: {type(e).__name__}: {str(e)[:300]}")
                model = step = None
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(spec["repeats"]):
                start = time.perf_counter()
                step()
                _sync(torch, device)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
            return {
                "ms": 1e3 * seconds,
                "tokens_per_s": spec["batch"] * spec["seq"] / seconds,
                "peak_gb": None if peak is None else peak / 1e9,
                "experts": experts,
                "attention": attention,
                "times": times,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tried": errors,
            }
    return {"error": "no implementation ran: " + "; ".join(errors)[-1500:]}


def _free(torch) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    import torch

    for case in json.loads(sys.argv[1]):
        print(json.dumps(run(case)), flush=True)
        _free(torch)
