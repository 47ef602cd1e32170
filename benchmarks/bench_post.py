"""Post-training throughput: GRPO rollouts and updates, DPO steps, against the SFT step.

Each case is a Qwen3-MoE-shaped decoder (``layers x hidden x experts x top_k x expert_ffn :
batch x seq``, as benchmarks/bench_lora.py's) with LoRA adapters (rank ``--rank`` on the
attention's projections and the routed experts) on one mesh of simulated CPU devices (or the
GPUs), in one process:

- ``rollout``: :func:`jaxops.models.post.rollout` of ``batch / group`` prompts of ``seq / 2``
  tokens, ``group`` completions each, ``seq / 2`` new tokens (sampled, no EOS: every
  completion runs its full length), a trivial reward, the old log-probabilities scored; its
  generation alone (``jaxops.models.generate``, the same arguments) timed too;
- ``grpo``: one :func:`jaxops.models.post.grpo_step` on that rollout's ``batch x (seq - 1)``
  tokens;
- ``dpo``: one :func:`jaxops.models.post.dpo_step` on ``batch / 2`` preference pairs of
  ``seq / 2``-token sequences, packed ``2`` per row: with the reference's forward in the step
  (the adapters disabled), and on reference log-probabilities computed beforehand
  (``ref_logprobs=``, what a run that precomputes them pays per step);
- ``sft``: ``MoEDecoder.train_step`` (the mean cross-entropy step) on the same batches (the
  rollout's, the preference pairs'; targets, masks and packing as they are): the peer of each
  update.

Printed: each one's ms, the generation's tokens/s, the fraction of a GRPO iteration (one
rollout, ``--updates`` updates) spent in the rollout, and each update's time against the SFT
step on its batch. Goals: the GRPO update and the DPO step on precomputed reference
log-probabilities cost <= 1.1x the SFT step (scoring log-probabilities instead of the mean
cross-entropy should cost little more); the DPO step with its reference's forward is reported
(one more forward pass).

Usage, from the repository root: ``python benchmarks/bench_post.py`` (the default case on
data 2 x expert 4), ``--quick`` a smoke test; ``--cases``, ``--mesh``, ``--group``,
``--updates`` and ``--rank`` pick what runs (the common flags: ``_harness.parser``).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
import optax

H = importlib.import_module(f"{__package__}._harness" if __package__ else "_harness")
LORA = importlib.import_module(f"{__package__}.bench_lora" if __package__ else "bench_lora")

CASES = "4x256x16x2x256:16x128"
QUICK_CASES = "2x64x8x2x64:16x32"
COLUMNS = [
    H.Column("case", "L x D x E x K x F : B x S", align="<"),
    H.Column("rollout_ms", "rollout ms", "{:.0f}"),
    H.Column("generate_tok_s", "generate tok/s", "{:.0f}"),
    H.Column("grpo_ms", "GRPO step ms", "{:.1f}"),
    H.Column("dpo_ms", "DPO step ms", "{:.1f}"),
    H.Column("rollout_frac", "rollout share", lambda v: f"{100 * v:.0f}%"),
    H.Column("grpo_vs_sft", "GRPO/SFT", "{:.2f}x"),
    H.Column("dpo_vs_sft", "DPO/SFT", "{:.2f}x"),
    H.Column("dpo_given_vs_sft", "DPO (ref given)/SFT", "{:.2f}x"),
]


def _median_s(fn, repeats: int) -> float:
    """Median wall time of `fn()` (a call that returns host values, or blocks) after one call."""
    fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t)
    return float(np.median(samples))


def _case(args, mesh, case: str) -> dict:
    """One case's row (see the module docstring)."""
    from jaxops.models import MoEDecoder, generate, post

    from jaxops import Lora

    opt = optax.adamw(1e-5)
    cfg, b, s = LORA._config(case)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj")
    model = MoEDecoder(cfg, mesh, lora=Lora(args.rank, 2.0 * args.rank, targets))
    params = model.add_adapters(model.init(jax.random.key(0)), jax.random.key(1))
    rng = np.random.default_rng(0)
    half = s // 2
    prompts = rng.integers(1, cfg.vocab_size, (b // args.group, half)).tolist()
    ids = np.repeat(np.asarray(prompts, np.int32), args.group, 0)
    live = {"params": params}

    def do_rollout():
        return post.rollout(
            model, live["params"], prompts, group_size=args.group, max_new_tokens=half,
            reward_fn=lambda p, c: rng.random(len(c)), key=jax.random.key(2),
        )  # fmt: skip

    def do_generate():
        return generate(model, live["params"], ids, half, temperature=1.0, key=jax.random.key(2))

    r = do_rollout()
    live["state"] = model.init_optimizer(opt, params)
    grpo, dpo, sft = post.grpo_step(model, opt), post.dpo_step(model, opt), model.train_step(opt)
    prompt_part = [rng.integers(1, cfg.vocab_size, half // 2).tolist() for _ in range(b // 2)]
    answers = [rng.integers(1, cfg.vocab_size, half - half // 2).tolist() for _ in range(b)]
    pref = post.preference_batch(prompt_part, answers[0::2], answers[1::2], seq_len=s,
                                 row_multiple=mesh.devices.size)  # fmt: skip
    ref = post.reference_logprobs(model, params, pref)
    # the SFT step's peers: the cross-entropy of the same batches (targets, masks and all)
    sft_roll = (r.batch.tokens, r.batch.targets, r.batch.model_inputs())
    sft_pref = (pref.tokens, pref.targets, pref.model_inputs())

    def updating(fn):  # donating steps: each call trains on the newest parameters
        def call():
            live["params"], live["state"], out = fn(live["params"], live["state"])
            return out

        return call

    timings = H.time_interleaved(
        {
            "grpo": (updating(lambda p, o: grpo(p, o, r.batch, **r.step_inputs())), ()),
            "dpo": (updating(lambda p, o: dpo(p, o, pref)), ()),
            "dpo_given": (updating(lambda p, o: dpo(p, o, pref, ref_logprobs=ref)), ()),
            "sft_roll": (updating(lambda p, o: sft(p, o, *sft_roll[:2], **sft_roll[2])), ()),
            "sft_pref": (updating(lambda p, o: sft(p, o, *sft_pref[:2], **sft_pref[2])), ()),
        },
        repeats=args.repeats,
    )
    rollout_s = _median_s(lambda: do_rollout().old_logprobs, max(3, args.repeats // 2))
    generate_s = _median_s(do_generate, max(3, args.repeats // 2))
    grpo_tokens = int(np.prod(r.batch.tokens.shape))
    dpo_tokens = int(np.prod(pref.tokens.shape))
    ratio = {
        "grpo": timings["grpo"].median / timings["sft_roll"].median,
        "dpo": timings["dpo"].median / timings["sft_pref"].median,
        "dpo_given": timings["dpo_given"].median / timings["sft_pref"].median,
    }
    iteration = rollout_s + args.updates * timings["grpo"].median
    return {
        "case": case,
        "rollout_ms": 1e3 * rollout_s,
        "generate_ms": 1e3 * generate_s,
        "generate_tok_s": ids.shape[0] * half / generate_s,
        "grpo_ms": 1e3 * timings["grpo"].median,
        "grpo_tok_s": grpo_tokens / timings["grpo"].median,
        "dpo_ms": 1e3 * timings["dpo"].median,
        "dpo_tok_s": dpo_tokens / timings["dpo"].median,
        "sft_roll_ms": 1e3 * timings["sft_roll"].median,
        "sft_pref_ms": 1e3 * timings["sft_pref"].median,
        "rollout_frac": rollout_s / iteration,
        "generate_frac_of_rollout": generate_s / rollout_s,
        "grpo_vs_sft": ratio["grpo"],
        "dpo_vs_sft": ratio["dpo"],
        "dpo_given_ms": 1e3 * timings["dpo_given"].median,
        "dpo_given_vs_sft": ratio["dpo_given"],
    }


def run(args) -> H.Result:
    mesh = H.mesh(args.mesh, ("data", "expert"), gpu_axis="data")
    rows = []
    for case in args.case_list:
        rows.append(_case(args, mesh, case))
        H.log_row(rows[-1], COLUMNS)
    goals = [
        H.Goal(
            "GRPO update <= 1.1x the SFT step on its batch",
            f"worst {max(r['grpo_vs_sft'] for r in rows):.2f}x",
            all(r["grpo_vs_sft"] <= 1.1 for r in rows),
        ),
        H.Goal(
            "DPO step on precomputed reference log-probabilities <= 1.1x the SFT step on its batch",
            f"worst {max(r['dpo_given_vs_sft'] for r in rows):.2f}x",
            all(r["dpo_given_vs_sft"] <= 1.1 for r in rows),
        ),
    ]
    lines = [
        f"LoRA rank {args.rank} (attention, routed experts); mesh {dict(mesh.shape)}; group "
        f"{args.group}, {args.updates} updates per rollout; float32; adamw. The rollout's "
        "generation alone: "
        + ", ".join(
            f"{r['case']} {r['generate_ms']:.0f} ms "
            f"({100 * r['generate_frac_of_rollout']:.0f}% of the rollout)"
            for r in rows
        )
    ]
    return H.Result(rows, COLUMNS, goals, lines=lines)


def parse_args(argv: Sequence[str] | None = None):
    """Command-line options: the common ones (:func:`_harness.parser`) and the cases'."""
    p = H.parser(__doc__, name="post", repeats=7, quick=f"case {QUICK_CASES}, 3 repeats")
    p.add_list("--cases", CASES, "comma-separated LxDxExKxF:BxS", quick=QUICK_CASES)
    p.add_argument("--mesh", default="2x4", help="data x expert sizes (default 2x4)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--updates", type=int, default=2, help="GRPO updates per rollout")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(H.main(parse_args, run, cpu_devices=8))
