"""Generation: plain decoding against speculative decoding with the MTP modules' drafts.

Each case is a family's tiny config (DeepSeek-V3 or GLM-4.5, ``family-D:BxSxN``: D MTP
modules, B rows of S prompt tokens, N new tokens, greedy). Before timing, the model and its
MTP modules are trained (adamw, ``mtp_loss_weight`` 1, ``--train-steps`` steps) on sequences
of one rule, ``t[i + 1] = (5 t[i] + 3) mod V`` from random starts, so that the modules predict
what the trunk will say, as a published checkpoint's modules do; a ``random`` column reports
the same model before training, whose drafts are rarely kept. Both ``generate`` calls are
timed alternately (:func:`_harness.time_interleaved`, compilation excluded), the whole call
(prefill and decode loop).

Per case: plain and speculative tokens/s, their ratio, the tokens per trunk step
(``new_tokens / trunk_steps`` of ``return_stats``, 1 for plain decoding, at most D + 1) of the
trained and the random modules, and whether the speculative output equals the plain one (it
must: greedy).

Goals: with modules that predict the trunk (the trained case), speculative decoding makes
more than 1.5 tokens per trunk step, and on a GPU runs faster than plain decoding. On CPU the
speed is reported, not judged: a step there costs the FLOPs of its tokens (D + 1 tokens and
the MTP layers cost about D + 1 times a plain step), while a GPU's decode step is bound by
reading the weights and the cache, which D + 1 tokens read once.

Usage, from the repository root: ``python benchmarks/bench_generate.py``, ``--quick`` a
smoke test; ``--cases`` and ``--train-steps`` pick what runs (the common flags:
``_harness.parser``).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Sequence

import jax
import numpy as np
import optax

H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")

CASES = "deepseek_v3-1:8x16x64,deepseek_v3-2:8x16x64,glm4_moe-1:8x16x64"
QUICK_CASES = "deepseek_v3-1:4x8x16"
VOCAB = 64
COLUMNS = [
    H.Column("case", "family-D : B x S x N", align="<"),
    H.Column("plain_tok_s", "plain tok/s", "{:.0f}"),
    H.Column("spec_tok_s", "speculative tok/s", "{:.0f}"),
    H.Column("ratio", "speculative/plain", "{:.2f}x"),
    H.Column("per_step", "tokens/trunk step", "{:.2f}"),
    H.Column("per_step_random", "random modules", "{:.2f}"),
    H.Column("same", "same tokens", str),
]


def _rule(tokens: np.ndarray) -> np.ndarray:
    return (5 * tokens + 3) % VOCAB


def _sequences(rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
    out = np.empty((rows, length), np.int32)
    out[:, 0] = rng.integers(0, VOCAB, rows)
    for i in range(1, length):
        out[:, i] = _rule(out[:, i - 1])
    return out


def _train(model, params, steps: int, seq: int):
    """`params` after `steps` adamw steps on the rule's sequences (trunk and MTP modules)."""
    opt = optax.adamw(3e-3)
    state = model.init_optimizer(opt, params)
    step = model.train_step(opt)
    rng = np.random.default_rng(1)
    loss = None
    for _ in range(steps):
        ids = _sequences(rng, 16, seq + 1)
        params, state, loss = step(params, state, *model.place_batch(ids[:, :-1], ids[:, 1:]))
    return params, float(loss) if loss is not None else float("nan")


def run(args) -> H.Result:
    from jaxops.models import DecoderConfig, MoEDecoder, family, generate

    mesh = H.mesh(args.mesh, ("data", "expert"), gpu_axis="data")
    rows = []
    losses = []
    for case in args.case_list:
        name, shape = case.split(":")
        fam, depth = name.rsplit("-", 1)
        b, s, n = (int(v) for v in shape.split("x"))
        hf = family(fam).tiny_config(num_nextn_predict_layers=int(depth), vocab_size=VOCAB)
        model = MoEDecoder(
            DecoderConfig.from_hf(hf), mesh, mtp_loss_weight=1.0, router_aux_loss_coef=0.0
        )
        prompt = model.place_batch(_sequences(np.random.default_rng(2), b, s))
        random = model.init(jax.random.key(0))
        _, stats = generate(model, random, prompt, n, speculative="mtp", return_stats=True)
        per_step_random = float(np.sum(stats["new_tokens"]) / np.sum(stats["trunk_steps"]))
        params, loss = _train(model, random, args.train_steps, max(s, 16))
        losses.append(loss)
        plain = generate(model, params, prompt, n)
        spec, stats = generate(model, params, prompt, n, speculative="mtp", return_stats=True)
        call = (model, params, prompt, n)
        timings = H.time_interleaved(
            {
                "plain": (generate, call),
                "spec": (functools.partial(generate, speculative="mtp"), call),
            },
            repeats=args.repeats,
        )
        row = {
            "case": case,
            "plain_tok_s": b * n / timings["plain"].median,
            "spec_tok_s": b * n / timings["spec"].median,
            "per_step": float(np.sum(stats["new_tokens"]) / np.sum(stats["trunk_steps"])),
            "per_step_random": per_step_random,
            "same": bool((np.asarray(plain) == np.asarray(spec)).all()),
        }
        row["ratio"] = row["spec_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        H.log_row(row, COLUMNS)
    goals = [
        H.Goal(
            "speculative greedy output equals plain greedy output",
            f"{sum(r['same'] for r in rows)} of {len(rows)} cases",
            all(r["same"] for r in rows),
        ),
        H.Goal(
            "trained modules: > 1.5 tokens per trunk step",
            f"worst {min(r['per_step'] for r in rows):.2f}",
            all(r["per_step"] > 1.5 for r in rows),
        ),
    ]
    worst = f"worst {min(r['ratio'] for r in rows):.2f}x"
    speed = "trained modules: speculative tokens/s > plain tokens/s"
    if jax.default_backend() == "cpu":  # a step's cost grows with its tokens here
        goals.append(H.Goal(speed, f"{worst} on CPU, where decoding is not memory-bound", None))
    else:
        goals.append(H.Goal(speed, worst, all(r["ratio"] > 1.0 for r in rows)))
    lines = [
        f"mesh {dict(mesh.shape)}; float32; greedy; vocabulary {VOCAB}; trained "
        f"{args.train_steps} adamw steps (last loss {', '.join(f'{v:.3f}' for v in losses)})"
    ]
    return H.Result(rows, COLUMNS, goals, lines=lines)


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`), cases, mesh, training."""
    p = H.parser(__doc__, name="generate", repeats=5, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated family-D:BxSxN", quick=QUICK_CASES)
    p.add_argument("--mesh", default="1x1", help="data x expert sizes (default 1x1)")
    p.add_argument("--train-steps", type=int, default=150, help="adamw steps before timing")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
