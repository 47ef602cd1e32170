"""GRPO of a Hugging Face MoE model with LoRA adapters in jaxops: rollouts from its own generate.

Reinforcement learning with a programmatic reward end to end, on 8 simulated CPU devices, with
no download:

1. transformers creates a tiny random Qwen3-MoE (or Mixtral / Qwen2-MoE) and saves it; jaxops
   loads it on a ``data x expert`` mesh with LoRA adapters on the attention's projections and
   the routed experts;
2. a short supervised warm-up on the reversal task of ``sft_hf_moe.py`` (``<bos> symbols
   <sep>`` answered by the symbols reversed, then ``<eos>``) with ``model.train_step``: the
   policy starts able to answer sometimes, as an SFT model does before RL;
3. GRPO: each iteration ``jaxops.models.post.rollout`` samples G completions of P new prompts
   with ``jaxops.models.generate`` on the parameters being trained (same mesh, no weight
   copy), rewards each by the fraction of positions it gets right (1 for the exact reversal),
   normalizes the rewards within each prompt's group, and ``post.grpo_step`` takes a few
   optimizer steps on it (the clipped objective; ``--importance sequence`` for GSPO). The
   mean reward rises (with 100 iterations or more the example fails if it did not);
4. ``jaxops.models.save_adapter`` writes a PEFT adapter; PEFT on transformers' model answers
   held-out prompts greedily as jaxops does, token for token.

Usage::

    python examples/grpo_hf_moe.py                              # qwen3_moe, data 2 x expert 4
    python examples/grpo_hf_moe.py --sft-steps 5 --iterations 4 --log-every 2 --no-progress
    python examples/grpo_hf_moe.py --rank 8 --lr 5e-3                     # LoRA adapters
    python examples/grpo_hf_moe.py --importance sequence --epsilon 3e-3   # GSPO
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path


def _load(name: str):
    """examples/<name>.py (examples/ is not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", choices=("qwen3_moe", "mixtral", "qwen2_moe"), default="qwen3_moe"
    )
    parser.add_argument("--mesh", default="2,4", help="data,expert sizes")
    parser.add_argument("--sft-steps", type=int, default=80, help="supervised warm-up steps")
    parser.add_argument("--iterations", type=int, default=300, help="rollouts")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--importance", choices=("token", "sequence"), default="token")
    parser.add_argument("--aggregation", choices=("sequence", "token", "constant"),
                        default="token")  # fmt: skip
    parser.add_argument("--epsilon", type=float, default=0.2, help="the clip range")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--lr", type=float, default=1e-3, help="GRPO's learning rate")
    parser.add_argument("--rank", type=int, default=0, help="LoRA rank (0: full weights)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts")
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def reward(prompts: list[list[int]], completions: list[list[int]]) -> list[float]:
    """The fraction of positions right: ``matches / max(len(answer), len(completion))``."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        want = p[1:-1][::-1]  # <bos> symbols <sep>
        hits = sum(a == b for a, b in zip(want, c, strict=False))
        out.append(hits / max(len(want), len(c)))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = tuple(int(s) for s in args.mesh.split(","))
    if len(sizes) != 2:
        raise SystemExit(f"--mesh must be data,expert, got {args.mesh!r}")
    devices = sizes[0] * sizes[1]
    if (args.prompts * args.group) % devices or args.eval_prompts % devices:
        raise SystemExit(f"--prompts x --group and --eval-prompts must be multiples of {devices}")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
    sft = _load("sft_hf_moe")
    lora_example = _load("lora_hf_moe")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from jaxops.models import from_pretrained, generate, post, save_adapter, save_pretrained

    from jaxops import Lora

    if args.no_progress:
        transformers.utils.logging.disable_progress_bar()
    t_start = time.perf_counter()
    work = Path(args.out or tempfile.mkdtemp(prefix="jaxops_grpo_"))
    src, out_dir = work / "base", work / ("adapter" if args.rank else "trained")
    sft.make_hf_model(args.arch, src)
    print(f"transformers wrote a tiny random {args.arch} to {src}")
    mesh = jax.make_mesh(sizes, ("data", "expert"))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
    lora = Lora(rank=args.rank, alpha=2.0 * args.rank, targets=targets) if args.rank else None
    model, params = from_pretrained(
        src, mesh=mesh, dtype=jnp.float32, lora=lora, router_aux_loss_coef=0.0,
        progress=False if args.no_progress else None,
    )  # fmt: skip
    what = f"LoRA rank {args.rank} on {', '.join(targets)}" if lora else "every weight trained"
    print(f"from_pretrained: {model.config.model_type} on mesh {dict(mesh.shape)}, {what}")

    rng = np.random.default_rng(0)
    held_out = {}
    while len(held_out) < args.eval_prompts:
        prompt, response = sft.make_example(rng)
        held_out.setdefault(tuple(prompt), response)
    tokens, mask = sft.left_pad([list(p) for p in held_out])
    max_new = sft.MAX_LEN + 1

    def greedy_accuracy(params) -> tuple[float, np.ndarray]:
        out = np.asarray(generate(model, params, tokens, max_new, attention_mask=mask,
                                  eos_token_id=sft.EOS, pad_token_id=sft.PAD))  # fmt: skip
        right = [sft.answer(out[i], tokens.shape[1]) == r[:-1]
                 for i, r in enumerate(held_out.values())]  # fmt: skip
        return float(np.mean(right)), out

    # 1. the supervised warm-up
    opt = optax.adamw(args.sft_lr, weight_decay=0.0)
    state = model.init_optimizer(opt, params)
    if args.sft_steps:
        step = model.train_step(opt)
        batches = sft.packed_batches(rng, held_out.keys(), args.sft_steps, 16, 64, devices)
        losses = []
        for batch in batches:
            b = batch.model_inputs()
            placed = model.place_batch(b["tokens"], b["targets"], b["segment_ids"],
                                       b["positions"])  # fmt: skip
            params, state, loss = step(params, state, placed[0], placed[1],
                                       segment_ids=placed[2], positions=placed[3])  # fmt: skip
            losses.append(float(loss))  # (one step in flight at a time)
        print(f"SFT warm-up: {args.sft_steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    acc0, _ = greedy_accuracy(params)
    print(f"held-out greedy answers right before GRPO: {acc0:.3f}")

    # 2. GRPO: a rollout, then a few steps on it
    opt = optax.adamw(args.lr, weight_decay=0.0)
    state = model.init_optimizer(opt, params)
    step = post.grpo_step(model, opt, epsilon_low=args.epsilon, importance=args.importance,
                          aggregation=args.aggregation, max_tokens=max_new)  # fmt: skip
    key = jax.random.key(1)
    curve, t_roll, t_update, t0 = [], 0.0, 0.0, time.perf_counter()
    for it in range(args.iterations):
        prompts = []
        while len(prompts) < args.prompts:
            p, _ = sft.make_example(rng)
            if tuple(p) not in held_out:
                prompts.append(p)
        t = time.perf_counter()
        r = post.rollout(
            model, params, prompts, group_size=args.group, max_new_tokens=max_new,
            reward_fn=reward, key=jax.random.fold_in(key, it), temperature=args.temperature,
            eos_token_id=sft.EOS, pad_token_id=sft.PAD,
        )  # fmt: skip
        t_roll += time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.updates):
            params, state, m = step(params, state, r.batch, **r.step_inputs())
        jax.block_until_ready(params)
        t_update += time.perf_counter() - t
        curve.append(float(r.rewards.mean()))
        if (it + 1) % args.log_every == 0 or it + 1 == args.iterations:
            recent = np.mean(curve[-args.log_every :])
            print(f"iteration {it + 1:4d}  mean reward {recent:.3f}  clip ratio "
                  f"{float(m['clip_ratio']):.3f}  ratio {float(m['ratio']):.4f}")  # fmt: skip
    elapsed = time.perf_counter() - t0
    start, end = np.mean(curve[: args.log_every]), np.mean(curve[-args.log_every :])
    acc, ours = greedy_accuracy(params)
    print(f"GRPO ({args.importance} ratio, {args.aggregation} mean): mean reward {start:.3f} -> "
          f"{end:.3f} (first and last {min(args.log_every, len(curve))} rollouts); held-out "
          f"greedy answers right {acc0:.3f} -> {acc:.3f}; {args.iterations} iterations in "
          f"{elapsed:.1f} s, {t_roll / (t_roll + t_update):.0%} of it rolling out")  # fmt: skip
    if args.iterations >= 100 and not end > start:  # (a few iterations prove nothing)
        raise SystemExit("the mean reward did not rise")

    if lora:
        save_adapter(model, params, out_dir)
        theirs = lora_example.peft_generate(src, out_dir, tokens, mask, max_new, sft)
        who = "PEFT on transformers"
    else:
        save_pretrained(model, params, out_dir)
        theirs = sft.hf_generate(out_dir, tokens, mask, max_new)
        who = "transformers"
    print(f"{'save_adapter' if lora else 'save_pretrained'}: {out_dir}")
    if not np.array_equal(ours, theirs):
        rows = np.flatnonzero((ours != theirs).any(1)).tolist()
        raise SystemExit(f"jaxops' generate differs from {who}'s in rows {rows}")
    print(f"{who} answers as jaxops does, token for token ({len(held_out)} held-out prompts)")
    print(f"done in {time.perf_counter() - t_start:.1f} s; outputs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
