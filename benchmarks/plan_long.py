"""Memory plans of long-sequence fine-tuning with a context axis (the [long-context] issue's table).

Runs ``python -m jaxops.models.plan`` (a fresh process each, through benchmarks/plan_models.py's
runner: ZeRO-3, remat "full", MoE capacity factor 1.25, the loss over 16384 vocabulary columns at
a time) for one sequence of S tokens per group of context devices (``--mesh ...,context=C``:
each device holds S / C tokens; blockwise attention, the ring over the context axis), bfloat16
parameters and compute: Qwen3-30B-A3B full fine-tuning at 32k and 128k tokens, DeepSeek-V3 with
LoRA on its FP8 base at 32k, gpt-oss-120b with LoRA on its MXFP4 experts at 64k. Writes
benchmarks/results/cpu/plan_long.md.

    python benchmarks/plan_long.py
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
plan_models = importlib.import_module("plan_models")

H100 = 80 * 10**9
H200 = 141 * 10**9
#: (model, sequence, mesh, device memory, extra plan flags, what is trained)
CASES = (
    ("qwen3-30b-a3b", 32768, {"context": 4, "expert": 2}, H100, (), "all"),
    ("qwen3-30b-a3b", 131072, {"context": 8, "expert": 2}, H100, (), "all"),
    ("deepseek-v3", 32768, {"context": 4, "expert": 8}, H200,
     ("--lora", "16", "--base", "fp8"), "LoRA 16, FP8 base"),
    ("gpt-oss-120b", 65536, {"context": 8, "expert": 1}, H100,
     ("--lora", "16", "--base", "mxfp4"), "LoRA 16, MXFP4 experts"),
)  # fmt: skip


def _row(name: str, seq: int, memory: int, trained: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | {seq} | {r['mesh']} | error: {r['error']} |"
    by = r["bytes_per_device"]
    gb = lambda n: f"{n / 1e9:.1f}"  # noqa: E731
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    state = by["params"] + by["optimizer"] + by["gradients"]
    return (
        f"| {name} | {seq // 1024}k | {r['devices']} ({mesh}) | {trained} | {gb(by['params'])} | "
        f"{gb(state - by['params'])} | {gb(by['temp'])} | {gb(by['total'])} | {memory // 10**9} "
        f"GB | {'fits' if r['fits'] else 'does not fit'} |"
    )


def main() -> None:
    rows, raw = [], []
    for name, seq, mesh, memory, extra, trained in CASES:
        flags = ("--param-dtype", "bfloat16", "--dtype", "bfloat16", "--device-memory", str(memory))
        batch = 1
        for axis, size in mesh.items():
            batch *= size if axis not in ("context",) else 1
        r = plan_models._run(name, mesh, seq, (*flags, *extra), batch=batch)
        print(name, seq, json.dumps(r)[:300], flush=True)
        raw.append((name, seq, r))
        rows.append(_row(name, seq, memory, trained, r))
    text = [
        "# Memory plans of long sequences on a context axis (python -m jaxops.models.plan)",
        "",
        f"Written {time.strftime('%Y-%m-%d')} by benchmarks/plan_long.py on this 2-core CPU "
        f"machine (load average {os.getloadavg()[0]:.2f}); jax {plan_models._jax_version()}. "
        "One sequence of S tokens per group of context devices (each device S / C tokens), "
        "bfloat16 parameters, compute and Adam moments, ZeRO-3, remat full, MoE capacity factor "
        f"1.25, the loss over {plan_models.VOCAB_CHUNK} vocabulary columns at a time; blockwise "
        "attention in blocks of 512, the ring over the context axis. Bytes per device in GB "
        "(10^9); temporaries are XLA:CPU's buffer assignment (a GPU's estimate):",
        "",
        "| model | S | devices | trained | params | grads + optimizer | temporaries | total | "
        "device | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    out = plan_models.ROOT / "benchmarks/results/cpu/plan_long.md"
    out.write_text("\n".join(text))
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
