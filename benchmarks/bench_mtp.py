"""The MTP loss's cost: the training step with the multi-token-prediction term and without.

Each case is a DeepSeek-V3- or GLM-4.5-shaped decoder (``family-D : L : B x S``: the family's
tiny config widened to hidden 256, 16 experts of width 128, a vocabulary of 4096, ``L`` layers
of which the first is dense, D MTP modules) on one mesh of simulated CPU devices (or the GPUs).
Jitted ``MoEDecoder.train_step`` s with optax adamw run on the same weights in one process,
timed alternately (:func:`_harness.time_interleaved`, compilation excluded):

- ``trunk``: ``mtp_loss_weight=0``: the modules frozen and outside the loss (what the step
  costs without the term);
- ``mtp``: ``mtp_loss_weight=0.3``: the term of every depth added, the modules trained;
- ``deeper``: a decoder of ``L + D`` layers and no modules, weight 0: the modules' layers as
  trunk layers, the yardstick of what D more decoder layers cost;
- ``lora`` / ``lora_mtp``: the same two steps with rank-16 adapters on every target the model
  has (the base frozen; with the term, the modules' layers carry adapters too).

Per case: each step's ms, ``mtp / trunk`` (what the term costs), ``mtp / deeper`` (what it
costs beyond its layers: the projection ``eh_proj``, the norms, one more pass of the output
head and its cross-entropy per depth), ``lora_mtp / lora``, and the arithmetic the term adds:
``flops`` = (the trunk's active parameters + the modules' + the output head once more per
depth) / the trunk's, each a weight multiply-added once per token forward and twice backward
(6 x active parameters x tokens, as the peers count a step; the routed experts' weights
counted ``top_k / E``, the embedding lookup not at all; attention's scores, small at these
lengths, left out). At published widths the output head outweighs a decoder layer
(DeepSeek-V3: 0.93 B multiply-adds a token against about 0.6 B for a layer), so a module costs
more than one layer: the yardstick is its arithmetic.

Goal: the term's time is in proportion to its arithmetic: ``mtp / trunk <= 1.2 x flops``.

Usage, from the repository root: ``python benchmarks/bench_mtp.py`` (the default cases on one
device), ``--quick`` a smoke test; ``--cases`` and ``--mesh`` pick what runs (the common flags:
``_harness.parser``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

CASES = "deepseek_v3-1:4:8x128,glm4_moe-1:4:8x128,deepseek_v3-2:4:8x128"
QUICK_CASES = "deepseek_v3-1:3:2x32"
WIDTHS = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    n_routed_experts=16,
    vocab_size=4096,
    first_k_dense_replace=1,
)
COLUMNS = [
    H.Column("case", "family-D : L : B x S", align="<"),
    H.Column("trunk_ms", "trunk ms", "{:.1f}"),
    H.Column("mtp_ms", "MTP ms", "{:.1f}"),
    H.Column("deeper_ms", "L + D layers ms", "{:.1f}"),
    H.Column("ratio", "MTP/trunk", "{:.2f}x"),
    H.Column("beyond", "MTP/(L + D)", "{:.2f}x"),
    H.Column("lora_ms", "LoRA ms", "{:.1f}"),
    H.Column("lora_mtp_ms", "LoRA+MTP ms", "{:.1f}"),
    H.Column("lora_ratio", "LoRA: MTP/trunk", "{:.2f}x"),
    H.Column("flops", "FLOPs MTP/trunk", "{:.2f}x"),
]


def _config(family_name: str, depth: int, layers: int):
    from jaxops.models import DecoderConfig, family

    hf = family(family_name).tiny_config(
        num_hidden_layers=layers, num_nextn_predict_layers=depth, **WIDTHS
    )
    return DecoderConfig.from_hf(hf)


def run(args) -> H.Result:
    from jaxops.models import MoEDecoder
    from jaxops.models._adapters import lora_targets

    from jaxops import Lora

    mesh = H.mesh(args.mesh, ("data", "expert"), gpu_axis="data")
    opt = optax.adamw(1e-4)
    rows = []
    for case in args.case_list:
        name, layers, shape = case.split(":")
        fam, depth = name.rsplit("-", 1)
        depth, layers = int(depth), int(layers)
        b, s = (int(v) for v in shape.split("x"))
        cfg = _config(fam, depth, layers)
        deeper_cfg = _config(fam, 0, layers + depth)
        options = dict(router_aux_loss_coef=0.0)
        lora = Lora(16, 32.0, lora_targets(cfg))
        models = {
            "trunk": MoEDecoder(cfg, mesh, **options),
            "mtp": MoEDecoder(cfg, mesh, mtp_loss_weight=0.3, **options),
            "deeper": MoEDecoder(deeper_cfg, mesh, **options),
            "lora": MoEDecoder(cfg, mesh, lora=lora, **options),
            "lora_mtp": MoEDecoder(cfg, mesh, lora=lora, mtp_loss_weight=0.3, **options),
        }
        base = models["trunk"].init(jax.random.key(0))
        params = {
            "trunk": base,
            "mtp": jax.tree.map(jnp.copy, base),
            "deeper": models["deeper"].init(jax.random.key(0)),
            "lora": models["lora"].add_adapters(jax.tree.map(jnp.copy, base), jax.random.key(1)),
            "lora_mtp": models["lora_mtp"].add_adapters(
                jax.tree.map(jnp.copy, base), jax.random.key(1)
            ),
        }
        states = {k: m.init_optimizer(opt, params[k]) for k, m in models.items()}
        steps = {k: m.train_step(opt) for k, m in models.items()}
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
        batch = models["trunk"].place_batch(tokens, np.roll(tokens, -1, axis=1))

        timings = H.time_train_steps(steps, params, states, batch, repeats=args.repeats)
        ms = {k: 1e3 * t.median for k, t in timings.items()}
        row = {
            "case": case,
            **{f"{k}_ms": v for k, v in ms.items()},
            "ratio": ms["mtp"] / ms["trunk"],
            "beyond": ms["mtp"] / ms["deeper"],
            "lora_ratio": ms["lora_mtp"] / ms["lora"],
        }
        counts = H.weight_counts(models["mtp"])
        trunk, modules, head = counts["trunk"], counts["mtp"], cfg.hidden_size * cfg.vocab_size
        row["flops"] = (trunk + modules + depth * head) / trunk
        rows.append(row)
        H.log_row(row, COLUMNS)
    excess = [r["ratio"] / r["flops"] for r in rows]
    goals = [
        H.Goal(
            "the MTP term's time in proportion to its arithmetic: MTP/trunk <= 1.2x FLOPs",
            f"worst {max(excess):.2f}x its FLOPs' ratio",
            all(e <= 1.2 for e in excess),
        )
    ]
    lines = [
        f"mesh {dict(mesh.shape)}; float32 parameters and compute; adamw; mtp_loss_weight 0.3; "
        f"widths {WIDTHS}; LoRA rank 16 (alpha 32) on every target the model has"
    ]
    return H.Result(rows, COLUMNS, goals, lines=lines)


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`), cases and mesh."""
    p = H.parser(__doc__, name="mtp", repeats=7, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated family-D:L:BxS", quick=QUICK_CASES)
    p.add_argument("--mesh", default="1x1", help="data x expert sizes (default 1x1)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
