"""LoRA against full fine-tuning: the decoder's training step with rank-r adapters and without.

Each case is a Qwen3-MoE-shaped decoder (``layers x hidden x experts x top_k x expert_ffn :
batch x seq``, as benchmarks/bench_models.py's) on one mesh of simulated CPU devices (or the
GPUs). Two jitted ``MoEDecoder.train_step`` s with optax adamw run on the same base weights in
one process, timed alternately (:func:`_harness.time_interleaved`, compilation excluded): the
full fine-tuning step, and the LoRA step (``jaxops.Lora`` of rank ``--rank`` on every target
the model has: the attention's q/k/v/o, the routed experts' fused tensors, the router), whose
gradients are the adapters' only, and the same LoRA step on a base kept in FP8
(``MoEDecoder(base="fp8")``: the layers' linear weights as e4m3 bytes with float32 scales per
128 x 128 block, dequantized one layer at a time). Per case: the steps' ms, the LoRA step's
ratio to the full one, the bytes of the gradients and the optimizer state of each (adam: two
moments per trained parameter), and the FP8 base's parameter bytes on the fullest device
against the same base in bfloat16 (both measured from the arrays' shards). The LoRA step
differentiates the adapters only (``MoEDecoder.trainable``): no base weight gradient is
computed, which is most of what it saves.

Goals (the [lora] issue's): the LoRA step takes <= 0.8x the full step's time, its gradient +
optimizer bytes are <= 2% of full fine-tuning's, and the FP8 base's parameter bytes per device
are <= 0.55x the bfloat16 base's.

Usage, from the repository root: ``python benchmarks/bench_lora.py`` (the default cases on
data 2 x expert 4), ``--quick`` a smoke test; ``--cases``, ``--mesh`` and ``--rank`` pick what
runs (the common flags: ``_harness.parser``).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

CASES = "4x256x16x2x256:16x128,2x2048x16x2x768:8x128"
QUICK_CASES = "2x64x8x2x64:16x32"
COLUMNS = [
    H.Column("case", "L x D x E x K x F : B x S", align="<"),
    H.Column("full_ms", "full ms", "{:.1f}"),
    H.Column("lora_ms", "LoRA ms", "{:.1f}"),
    H.Column("ratio", "LoRA/full", "{:.2f}x"),
    H.Column("state_frac", "grad+opt bytes", lambda v: f"{100 * v:.2f}%"),
    H.Column("qlora_ms", "FP8-base LoRA ms", "{:.1f}"),
    H.Column("base_frac", "FP8/bf16 base bytes", "{:.2f}x"),
]


def _config(case: str):
    from jaxops.models import AttentionSpec, DecoderConfig, MoESpec

    model, batch = case.split(":")
    layers, hidden, experts, top_k, ffn = (int(v) for v in model.split("x"))
    b, s = (int(v) for v in batch.split("x"))
    heads = max(hidden // 64, 2)
    attention = AttentionSpec(
        num_heads=heads, num_kv_heads=max(heads // 2, 1), head_dim=hidden // heads, qk_norm=True
    )
    cfg = DecoderConfig("qwen3_moe", 1024, hidden, layers, attention, MoESpec(experts, top_k, ffn))
    return cfg, b, s


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _device_bytes(tree) -> int:
    """The bytes of `tree`'s shards on its fullest device (measured from the arrays)."""
    per: dict = {}
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def run(args) -> H.Result:
    from jaxops.models import MoEDecoder
    from jaxops.models._adapters import lora_targets

    from jaxops import Lora

    mesh = H.mesh(args.mesh, ("data", "expert"), gpu_axis="data")
    opt = optax.adamw(1e-4)
    rows = []
    for case in args.case_list:
        cfg, b, s = _config(case)
        full = MoEDecoder(cfg, mesh, router_aux_loss_coef=0.0)
        lora = dataclasses.replace(full, lora=Lora(args.rank, 2.0 * args.rank, lora_targets(cfg)))
        base = full.init(jax.random.key(0))
        adapted = lora.add_adapters(jax.tree.map(jnp.copy, base), jax.random.key(1))
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
        batch = full.place_batch(tokens, np.roll(tokens, -1, axis=1))
        states = {
            "full": full.init_optimizer(opt, base),
            "lora": lora.init_optimizer(opt, adapted),
        }
        qlora = dataclasses.replace(lora, base="fp8")
        bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), base)
        fp8 = qlora.layout.quantize_base(bf16)
        base_frac = _device_bytes(fp8) / _device_bytes(bf16)
        del bf16
        quantized = qlora.add_adapters(fp8, jax.random.key(1))
        states["qlora"] = qlora.init_optimizer(opt, quantized)
        steps = {
            "full": full.train_step(opt),
            "lora": lora.train_step(opt),
            "qlora": qlora.train_step(opt),
        }
        params = {"full": base, "lora": adapted, "qlora": quantized}

        timings = H.time_train_steps(steps, params, states, batch, repeats=args.repeats)
        grads = {"full": _nbytes(base), "lora": _nbytes(lora.trainable(adapted))}
        state = {k: grads[k] + _nbytes(states[k]) for k in grads}
        row = {
            "case": case,
            "full_ms": 1e3 * timings["full"].median,
            "lora_ms": 1e3 * timings["lora"].median,
            "state_frac": state["lora"] / state["full"],
            "grad_opt_bytes": state,
            "qlora_ms": 1e3 * timings["qlora"].median,
            "base_frac": base_frac,
        }
        row["ratio"] = row["lora_ms"] / row["full_ms"]
        rows.append(row)
        H.log_row(row, COLUMNS)
    goals = [
        H.Goal(
            "LoRA step <= 0.8x the full fine-tuning step",
            f"worst {max(r['ratio'] for r in rows):.2f}x",
            all(r["ratio"] <= 0.8 for r in rows),
        ),
        H.Goal(
            "LoRA gradient + optimizer bytes <= 2% of full fine-tuning's",
            f"worst {100 * max(r['state_frac'] for r in rows):.2f}%",
            all(r["state_frac"] <= 0.02 for r in rows),
        ),
        H.Goal(
            "FP8 base's parameter bytes per device <= 0.55x the bfloat16 base's",
            f"worst {max(r['base_frac'] for r in rows):.2f}x",
            all(r["base_frac"] <= 0.55 for r in rows),
        ),
    ]
    lines = [
        f"rank {args.rank}, alpha {2 * args.rank}, targets: every one the model has; mesh "
        f"{dict(mesh.shape)}; float32 parameters and compute (the FP8 base dequantized to "
        "float32 in each layer, remat 'matmuls'), adamw"
    ]
    return H.Result(rows, COLUMNS, goals, lines=lines)


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`), cases, mesh and rank."""
    p = H.parser(__doc__, name="lora", repeats=7, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated LxDxExKxF:BxS", quick=QUICK_CASES)
    p.add_argument("--mesh", default="2x4", help="data x expert sizes (default 2x4)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
