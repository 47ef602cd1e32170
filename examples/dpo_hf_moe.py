"""DPO of a Hugging Face MoE model with LoRA adapters in jaxops, handed to PEFT.

Preference tuning end to end, on 8 simulated CPU devices, with no download:

1. transformers creates a tiny random Qwen3-MoE (or Mixtral / Qwen2-MoE) and saves it -- the
   stand-in for a downloaded checkpoint;
2. ``jaxops.models.from_pretrained(..., lora=jaxops.Lora(...))`` loads it on a ``data x expert``
   mesh with adapters on the attention's projections and the routed experts;
3. synthetic preference pairs with a known preferred answer: the prompt of
   ``sft_hf_moe.py`` (``<bos> symbols <sep>``), the chosen response the symbols reversed, the
   rejected one as many symbols the prompt does not hold; the pairs packed into rows
   (``jaxops.models.post.preference_batch``);
4. ``jaxops.models.post.dpo_step`` trains the adapters with the sigmoid DPO loss; the reference
   is the same model with its adapters disabled (no second copy of the weights). On held-out
   pairs the preference accuracy (the chosen response's implicit reward above the rejected
   one's) and the reward margin rise;
5. ``jaxops.models.save_adapter`` writes a PEFT adapter; PEFT loads it onto transformers' model
   and scores the held-out pairs: the same preferences, the same log-probabilities.

Usage::

    python examples/dpo_hf_moe.py                              # qwen3_moe, data 2 x expert 4
    python examples/dpo_hf_moe.py --steps 5 --no-progress      # a quick check (CI)
    python examples/dpo_hf_moe.py --loss ipo --beta 0.5 --out /tmp/dpo
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path


def _sft():
    """examples/sft_hf_moe.py (the data and model helpers), loaded by path."""
    name = "sft_hf_moe"  # examples/ is not a package
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
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--pairs", type=int, default=16, help="preference pairs per step")
    parser.add_argument("--loss", choices=("sigmoid", "ipo"), default="sigmoid")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64, help="tokens per packed row")
    parser.add_argument("--eval-pairs", type=int, default=64, help="held-out pairs")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def make_pair(sft, rng) -> tuple[list[int], list[int], list[int]]:
    """``(prompt, chosen, rejected)``: the prompt's symbols reversed are preferred to as many
    symbols the prompt does not hold."""
    prompt, chosen = sft.make_example(rng)
    symbols = prompt[1:-1]
    others = sorted(set(range(sft.FIRST_SYMBOL, sft.FIRST_SYMBOL + sft.NUM_SYMBOLS)) - set(symbols))
    return prompt, chosen, [*rng.choice(others, len(symbols)).tolist(), sft.EOS]


def peft_sequence_logprobs(base: Path, adapter: Path, pairs) -> list[float]:
    """PEFT's model (transformers' from `base`, the adapter): each response's log-probability."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    out = []
    for prompt, chosen, rejected in pairs:
        for response in (chosen, rejected):
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            picked = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
            out.append(float(picked[len(prompt) - 1 :].sum()))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = tuple(int(s) for s in args.mesh.split(","))
    if len(sizes) != 2:
        raise SystemExit(f"--mesh must be data,expert, got {args.mesh!r}")
    devices = sizes[0] * sizes[1]
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
    sft = _sft()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from jaxops.models import from_pretrained, post, save_adapter

    from jaxops import Lora

    if args.no_progress:
        transformers.utils.logging.disable_progress_bar()
    t_start = time.perf_counter()
    work = Path(args.out or tempfile.mkdtemp(prefix="jaxops_dpo_"))
    src, adapter = work / "base", work / "adapter"
    sft.make_hf_model(args.arch, src)
    print(f"transformers wrote a tiny random {args.arch} to {src}")

    mesh = jax.make_mesh(sizes, ("data", "expert"))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
    lora = Lora(rank=args.rank, alpha=2.0 * args.rank, targets=targets)
    model, params = from_pretrained(
        src, mesh=mesh, dtype=jnp.float32, lora=lora, router_aux_loss_coef=0.0,
        progress=False if args.no_progress else None,
    )  # fmt: skip
    print(f"from_pretrained: {model.config.model_type} on mesh {dict(mesh.shape)}, LoRA rank "
          f"{args.rank} on {', '.join(targets)}")  # fmt: skip

    rng = np.random.default_rng(0)
    held_out = {}
    while len(held_out) < args.eval_pairs:
        p, c, r = make_pair(sft, rng)
        held_out.setdefault(tuple(p), (p, c, r))
    eval_pairs = list(held_out.values())

    def batch_of(pairs):
        return post.preference_batch(*zip(*pairs, strict=True), seq_len=args.seq,
                                     row_multiple=devices)  # fmt: skip

    eval_batch = batch_of(eval_pairs)
    scores = jax.jit(post.sequence_logprobs, static_argnums=0)
    ref_eval = post.reference_logprobs(model, params, eval_batch)

    def evaluate(params):
        """Held-out (accuracy, mean reward margin) of the current adapters."""
        seq = scores(model, params, eval_batch)
        _, m = post.dpo_loss(seq[0::2], seq[1::2], ref_eval[0::2], ref_eval[1::2],
                             beta=args.beta, loss_type=args.loss)  # fmt: skip
        return float(m["rewards/accuracies"]), float(m["rewards/margins"]), np.asarray(seq)

    opt = optax.adamw(args.lr, weight_decay=0.0)
    state = model.init_optimizer(opt, params)
    step = post.dpo_step(model, opt, beta=args.beta, loss_type=args.loss)
    acc0, margin0, _ = evaluate(params)
    print(f"held-out before: preference accuracy {acc0:.3f}, reward margin {margin0:+.4f} (the "
          "policy is its reference: every implicit reward is 0, none above another)")  # fmt: skip
    t0, losses = time.perf_counter(), []
    for i in range(args.steps):
        pairs = []
        while len(pairs) < args.pairs:
            pair = make_pair(sft, rng)
            if tuple(pair[0]) not in held_out:
                pairs.append(pair)
        params, state, m = step(params, state, batch_of(pairs))
        losses.append(float(m["loss"]))
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            acc, margin, _ = evaluate(params)
            print(f"step {i + 1:4d}  loss {np.mean(losses[-args.log_every:]):.4f}  held-out "
                  f"accuracy {acc:.3f}  margin {margin:+.4f}")  # fmt: skip
    elapsed = time.perf_counter() - t0
    acc, margin, seq = evaluate(params)
    print(f"DPO ({args.loss}, beta {args.beta}): loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"held-out accuracy {acc0:.3f} -> {acc:.3f}, margin {margin0:+.4f} -> {margin:+.4f} "
          f"in {args.steps} steps ({elapsed:.1f} s)")  # fmt: skip
    if not (margin > margin0 and acc >= acc0):
        raise SystemExit("the preference margin did not rise")

    save_adapter(model, params, adapter)
    print(f"save_adapter: {adapter}")
    want = peft_sequence_logprobs(src, adapter, eval_pairs)
    err = float(np.abs(seq - np.array(want)).max())
    agree = float(np.mean((seq[0::2] > seq[1::2]) == (np.array(want[0::2]) > want[1::2])))
    print(f"PEFT on transformers: held-out log-probabilities within {err:.1e}, the same "
          f"preference (chosen above rejected) on {agree:.0%} of the pairs")  # fmt: skip
    if err > 1e-3 * max(1.0, float(np.abs(want).max())):
        raise SystemExit("PEFT's log-probabilities differ")
    print(f"done in {time.perf_counter() - t_start:.1f} s; outputs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
