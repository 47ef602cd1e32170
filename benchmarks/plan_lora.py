"""Memory plans of LoRA fine-tuning of published models on one node, the base in bf16 or FP8.

For the [lora] issue's cases (DeepSeek-V3 and Kimi K2 on 8 and 16 H200s of 141 GB; Qwen3-235B-A22B
and Llama 4 Maverick on 8 H100s; Qwen3-30B-A3B and gpt-oss-120b on one H100), runs
``python -m jaxops.models.plan`` (a fresh process each, through benchmarks/plan_models.py's
runner: ZeRO-3, remat "full", MoE capacity factor 1.25, the loss over 16384 vocabulary columns at
a time, one sequence of ``--seq`` tokens per device) with ``--lora 16`` on every target the model
has and the base frozen in bfloat16, in block FP8 (``--base fp8``: one byte a base weight plus
its 128 x 128 block scales) or, for gpt-oss, with its experts in MXFP4 as published (``--base
mxfp4``: half a byte an expert weight), the other parameters and the adapters' Adam moments in
bfloat16;
the experts over an ``expert`` axis as wide as the devices. Writes
benchmarks/results/cpu/plan_lora.md.

    python benchmarks/plan_lora.py [--seq 4096]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
plan_models = importlib.import_module("plan_models")

H200 = 141 * 10**9
H100 = 80 * 10**9
ATTENTION = "q_proj,k_proj,v_proj,o_proj"
#: (model, devices, device memory, bases, targets: None for every one the model has)
CASES = (
    ("deepseek-v3", 8, H200, ("fp8",), None),
    ("deepseek-v3", 16, H200, ("fp8",), None),
    ("kimi-k2", 8, H200, ("fp8",), None),
    ("kimi-k2", 16, H200, ("fp8",), None),
    ("qwen3-235b-a22b", 8, H100, ("bf16", "fp8"), None),
    ("llama4-maverick", 8, H100, ("bf16", "fp8"), None),
    ("qwen3-30b-a3b", 1, H100, ("bf16", "fp8"), None),
    ("gpt-oss-120b", 1, H100, ("bf16", "fp8", "mxfp4"), None),
    ("gpt-oss-120b", 1, H100, ("mxfp4",), ATTENTION),
)
RANK = 16


def _row(name: str, base: str, memory: int, r: dict, targets: str | None) -> str:
    if "error" in r:
        return f"| {name} | {base} | {r['mesh']} | error: {r['error']} |"
    name += "" if targets is None else " (attention only)"
    by = r["bytes_per_device"]
    gb = lambda n: f"{n / 1e9:.1f}"  # noqa: E731
    gpu = "H200" if memory == H200 else "H100"
    return (
        f"| {name} | {r['params'] / 1e9:.0f} B | {r['devices']} {gpu} | {base} | "
        f"{r['trained_params'] / 1e6:.0f} M | {gb(by['params'])} | "
        f"{gb(by['optimizer'] + by['gradients'])} | {gb(by['temp'])} | {gb(by['total'])} | "
        f"{'fits' if r['fits'] else 'does not fit'} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", default=str(plan_models.ROOT / "benchmarks/results/cpu/plan_lora.md"))
    args = p.parse_args()
    rows, raw = [], []
    for name, devices, memory, bases, targets in CASES:
        mesh = {"data": 1, "expert": devices}
        for base in bases:
            extra = ("--lora", str(RANK), "--base", base, "--device-memory", str(memory))
            extra += () if targets is None else ("--lora-targets", targets)
            extra += () if base == "bf16" else ("--param-dtype", "bfloat16")
            r = plan_models._run(name, mesh, args.seq, extra)
            print(name, devices, base, json.dumps(r)[:300], flush=True)
            raw.append((name, devices, base, r))
            rows.append(_row(name, base, memory, r, targets))
    text = [
        "# Memory plans of LoRA on published models (python -m jaxops.models.plan --lora)",
        "",
        f"Written {time.strftime('%Y-%m-%d')} by benchmarks/plan_lora.py on this 2-core CPU "
        f"machine (load average {os.getloadavg()[0]:.2f}); jax {plan_models._jax_version()}. "
        f"Every step: LoRA rank {RANK} (alpha {2 * RANK}) on every target the model has (or the "
        "attention's q/k/v/o where the row says so), the "
        "base frozen in bfloat16, block FP8 (e4m3 bytes + float32 128 x 128 block scales) or "
        "MXFP4 experts (gpt-oss's published format), "
        "the other parameters and the adapters' Adam moments in bfloat16, ZeRO-3, remat full, "
        "bfloat16 compute, MoE capacity factor 1.25, the loss over "
        f"{plan_models.VOCAB_CHUNK} vocabulary columns at a time, one sequence of {args.seq} "
        "tokens per device, the experts over all devices. Bytes per device in GB (10^9); "
        "temporaries are XLA:CPU's buffer assignment (a GPU's estimate):",
        "",
        "| model | parameters | devices | base | trained | params | grads + optimizer | "
        "temporaries | total | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    pathlib.Path(args.out).write_text("\n".join(text))
    pathlib.Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
