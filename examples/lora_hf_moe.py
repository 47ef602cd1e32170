"""LoRA fine-tuning of a Hugging Face MoE model with jaxops, handed to PEFT.

Parameter-efficient instruction tuning end to end, on 8 simulated CPU devices, with no download:

1. transformers creates a tiny random Qwen3-MoE (or Mixtral / Qwen2-MoE) and saves it -- the
   stand-in for a downloaded checkpoint;
2. ``jaxops.models.from_pretrained(..., lora=jaxops.Lora(...))`` loads it on a ``data x expert``
   mesh (or ``pipe x data x expert``: the adapters train through the 1F1B pipeline, the base
   weights its frozen leaves) with low-rank adapters on every projection PEFT can target: the
   attention's, the routed experts' fused tensors (one adapter per expert, sharded with the
   experts) and the shared expert's; the base weights stay as loaded (``--base fp8``: QLoRA,
   the layers' linear weights quantized at load to block FP8 and kept so, frozen, one byte a
   weight plus a float32 scale per block, dequantized layer by layer as the step runs);
3. the synthetic instruction set of ``sft_hf_moe.py`` (the answer is the prompt reversed; the
   loss on the responses only; packed rows), trained by ``model.train_step`` with optax adamw:
   gradients and optimizer state for the adapters alone;
4. ``jaxops.models.save_adapter`` writes a PEFT adapter; PEFT loads it onto transformers' model
   (from the base files) and both answer held-out prompts greedily (jaxops on a ``data x
   expert`` mesh: generation runs without pipeline stages): the answers must agree token for
   token (with ``--base fp8`` PEFT's base is the dequantized FP8 base, the weights the
   adapters were trained on, written by jaxops). ``merge_adapter`` + ``save_pretrained`` then
   write a full checkpoint, which transformers answers with the same tokens.

Usage::

    python examples/lora_hf_moe.py                            # qwen3_moe, data 2 x expert 4
    python examples/lora_hf_moe.py --mesh 2,2,2               # pipe 2 x data 2 x expert 2
    python examples/lora_hf_moe.py --base fp8                 # QLoRA: the base kept in FP8
    python examples/lora_hf_moe.py --mesh 2,2,2 --base fp8 --steps 10 --no-progress   # CI
    python examples/lora_hf_moe.py --arch qwen2_moe --rank 8 --out /tmp/lora
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
    """examples/sft_hf_moe.py (the data, packing and greedy-answer helpers), loaded by path."""
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
    parser.add_argument(
        "--mesh", default="2,4", help="data,expert or pipe,data,expert sizes (product 8)"
    )
    parser.add_argument(
        "--microbatches", type=int, default=2, help="per step, with a pipe axis (1F1B)"
    )
    parser.add_argument(
        "--base", choices=("float32", "fp8"), default="float32", help="the frozen base's format"
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seq", type=int, default=64, help="tokens per packed row")
    parser.add_argument("--rows", type=int, default=16, help="packed rows per step")
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts")
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def peft_generate(base: Path, adapter: Path, tokens, mask, max_new_tokens: int, sft):
    """PEFT's model (transformers' from `base`, the adapter from `adapter`): greedy answers."""
    import numpy as np
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sft.EOS,
            pad_token_id=sft.PAD,
        ).numpy()
    return np.pad(out, [(0, 0), (0, tokens.shape[1] + max_new_tokens - out.shape[1])])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = tuple(int(s) for s in args.mesh.split(","))
    if len(sizes) not in (2, 3):
        raise SystemExit(f"--mesh must be data,expert or pipe,data,expert, got {args.mesh!r}")
    sizes = (1, *sizes) if len(sizes) == 2 else sizes
    devices = sizes[0] * sizes[1] * sizes[2]
    micro = args.microbatches if sizes[0] > 1 else 1
    multiple = sizes[1] * sizes[2] * micro  # each microbatch splits over the batch axes
    if args.eval_prompts % devices or args.rows % multiple:
        raise SystemExit(
            f"--eval-prompts must be a multiple of the {devices} devices and --rows of {multiple}"
        )
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
    sft = _sft()

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from jaxops.models import (
        from_pretrained,
        generate,
        merge_adapter,
        save_adapter,
        save_pretrained,
    )

    from jaxops import Lora

    if args.no_progress:
        transformers.utils.logging.disable_progress_bar()
    t_start = time.perf_counter()
    work = Path(args.out or tempfile.mkdtemp(prefix="jaxops_lora_"))
    src, adapter, merged_dir = work / "base", work / "adapter", work / "merged"
    sft.make_hf_model(args.arch, src)
    print(f"transformers wrote a tiny random {args.arch} to {src}")

    mesh = jax.make_mesh(sizes, ("pipe", "data", "expert"))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
    if args.arch == "qwen2_moe":  # its shared expert's projections too
        targets += (
            "shared_experts.gate_proj",
            "shared_experts.up_proj",
            "shared_experts.down_proj",
        )
    # [load]
    lora = Lora(rank=args.rank, alpha=args.alpha, targets=targets)
    progress = False if args.no_progress else None
    model, params = from_pretrained(
        src, mesh=mesh, dtype=jnp.float32, lora=lora, router_aux_loss_coef=0.0,
        num_microbatches=micro, progress=progress,
        base="fp8" if args.base == "fp8" else None,
    )  # fmt: skip
    # [/load]
    if args.base == "fp8":  # PEFT's base: the FP8 weights dequantized, as the adapters saw them
        peft_base = work / "base_dequantized"
        save_pretrained(*merge_adapter(model, params), peft_base)  # fresh adapters add zero
        print(f"base kept in block FP8; its dequantized weights for PEFT: {peft_base}")
    else:
        peft_base = src
    trainable = model.trainable(params)
    count = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))  # noqa: E731
    print(
        f"from_pretrained: {model.config.model_type} on mesh {dict(mesh.shape)}, "
        f"{count(params):,} parameters of which {count(trainable):,} adapters "
        f"({count(trainable) / count(params):.1%}; rank {args.rank}, targets {', '.join(targets)})"
    )

    rng = np.random.default_rng(0)
    held_out = {}
    while len(held_out) < args.eval_prompts:
        prompt, response = sft.make_example(rng)
        held_out.setdefault(tuple(prompt), response)
    batches = sft.packed_batches(rng, held_out.keys(), args.steps, args.rows, args.seq, multiple)
    warmup = min(20, args.steps // 10)
    lr = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr / 10
    )
    # [step]
    opt = optax.adamw(lr, weight_decay=0.0)
    state = model.init_optimizer(opt, params)  # the adapters' moments only
    step = model.train_step(opt)
    # [/step]
    base = {k: np.asarray(v) for k, v in params["layers"]["moe"].items() if "_lora_" not in k}
    losses, t0 = [], time.perf_counter()
    for i, batch in enumerate(batches):
        b = batch.model_inputs()
        tokens, targets_, segments, positions = model.place_batch(
            b["tokens"], b["targets"], b["segment_ids"], b["positions"]
        )
        params, state, loss = step(
            params, state, tokens, targets_, segment_ids=segments, positions=positions
        )
        losses.append(float(loss))
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            recent = losses[-args.log_every :]
            print(f"step {i + 1:4d}  loss {np.mean(recent):.4f} (mean of {len(recent)} steps)")
    elapsed = time.perf_counter() - t0
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps ({elapsed:.1f} s)")
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not fall")
    for name, old in base.items():  # the base weights are as loaded
        if not np.array_equal(np.asarray(params["layers"]["moe"][name]), old):
            raise SystemExit(f"the base weight moe/{name} changed")

    # [adapter]
    save_adapter(model, params, adapter)
    # [/adapter]
    print(f"save_adapter: {adapter} (adapter_config.json, adapter_model.safetensors)")
    if model.pipe > 1:  # generation runs without pipeline stages: the same model on data x expert
        flat = jax.make_mesh((devices // sizes[2], sizes[2]), ("data", "expert"))
        model = dataclasses.replace(model, mesh=flat, num_microbatches=1)
        params = jax.device_put(params, model.shardings())
        print(f"generation on mesh {dict(flat.shape)}")
    max_new = sft.MAX_LEN + 2
    tokens, mask = sft.left_pad([list(p) for p in held_out])
    ours = np.asarray(
        generate(
            model, params, tokens, max_new, attention_mask=mask, eos_token_id=sft.EOS,
            pad_token_id=sft.PAD,
        )
    )  # fmt: skip
    theirs = peft_generate(peft_base, adapter, tokens, mask, max_new, sft)
    if not np.array_equal(ours, theirs):
        rows = np.flatnonzero((ours != theirs).any(1)).tolist()
        raise SystemExit(f"jaxops' generate differs from PEFT's in rows {rows}")
    right = sum(
        sft.answer(ours[i], tokens.shape[1]) == response[:-1]
        for i, response in enumerate(held_out.values())
    )
    print(f"PEFT on transformers answers as jaxops does, token for token ({len(held_out)} prompts)")
    print(f"right answers (the prompt reversed): {right}/{len(held_out)} held-out prompts")

    # [merge]
    plain, merged = merge_adapter(model, params)
    save_pretrained(plain, merged, merged_dir)
    # [/merge]
    full = sft.hf_generate(merged_dir, tokens, mask, max_new)
    if not np.array_equal(ours, full):
        raise SystemExit("transformers' answers from the merged checkpoint differ")
    print(f"merge_adapter + save_pretrained: {merged_dir}, transformers answers the same")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
