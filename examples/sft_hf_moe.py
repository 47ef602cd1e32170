"""Supervised fine-tuning (SFT) of a Hugging Face MoE model with jaxops on 8 devices.

Instruction tuning end to end, on 8 simulated CPU devices, with no download:

1. transformers creates a tiny random Qwen3-MoE (or Mixtral / Qwen2-MoE) and saves it -- the
   stand-in for a downloaded checkpoint;
2. a synthetic instruction dataset: ``<bos> prompt <sep>`` then ``response <eos>``, where the
   response is the prompt reversed. The loss counts the response tokens only (per-token loss
   masks), and ``jaxops.models.pack_sequences`` packs the examples into rows of ``--seq``
   tokens (segment ids keep each example attending to itself, positions restart per example);
3. ``jaxops.models.from_pretrained`` puts the model on a ``pipe x data x expert`` mesh and
   optax adamw (warmup, cosine decay) trains it with ``model.loss_and_grads`` in one jitted
   step (the 1F1B pipeline; ``--mesh 1,4,2``: no pipeline, gradient accumulation instead;
   ``--mesh 1,2,2 --context 2``: ``data x context x expert``, each packed row split over the 2
   devices of the context axis, attention as a ring; ``--mesh 2,1,2 --context 2``: ``pipe x
   context x expert``, the keys all-gathered over the context axis inside the stages;
   ``--fp8 block``: the experts' and attention projections' GEMMs in FP8 with DeepSeek-V3's
   block scales, the parameters and optimizer state in float32 as without it);
4. ``jaxops.models.save_pretrained`` writes the fine-tuned model; transformers and jaxops (on a
   ``data x expert`` mesh, for ``jaxops.models.generate``) both load it and answer held-out
   prompts greedily: the answers must agree token for token, and the right ones are counted.

Usage::

    python examples/sft_hf_moe.py                      # qwen3_moe on pipe 2 x data 2 x expert 2
    python examples/sft_hf_moe.py --steps 10 --no-progress        # a quick check (CI)
    python examples/sft_hf_moe.py --arch mixtral --mesh 1,4,2 --out /tmp/sft
    python examples/sft_hf_moe.py --mesh 1,2,2 --context 2   # data x context x expert
    python examples/sft_hf_moe.py --fp8 block                # block-scaled FP8 GEMMs
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Container
from pathlib import Path

PAD, BOS, EOS, SEP = 0, 1, 2, 3  # special tokens (Mixtral's bos and eos); then symbols
FIRST_SYMBOL, NUM_SYMBOLS = 4, 16
MIN_LEN, MAX_LEN = 2, 6  # prompt symbols per example


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", choices=("qwen3_moe", "mixtral", "qwen2_moe"), default="qwen3_moe"
    )
    parser.add_argument("--mesh", default="2,2,2", help="pipe,data,expert sizes")
    parser.add_argument(
        "--context",
        type=int,
        default=1,
        help="a context axis of this size (devices: the product with --mesh's)",
    )
    parser.add_argument(
        "--fp8",
        choices=("block",),
        default=None,
        help="train with DeepSeek-V3's block-scaled FP8 recipe (the GEMMs of the experts and "
        "the attention projections)",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seq", type=int, default=64, help="tokens per packed row")
    parser.add_argument("--rows", type=int, default=16, help="packed rows per step")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_LEN + 2)
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts")
    parser.add_argument("--show", type=int, default=8, help="held-out answers printed")
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def make_hf_model(arch: str, path: Path) -> None:
    """The tiny random `arch` of finetune_hf_moe.py (2 layers, 8 experts, top-2), saved there."""
    name = "finetune_hf_moe"  # examples/ is not a package: load the file beside this one
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_hf_model(arch, path)


def make_example(rng) -> tuple[list[int], list[int]]:
    """One instruction: ``(prompt, response)`` token lists; the response is the prompt reversed."""
    n = int(rng.integers(MIN_LEN, MAX_LEN + 1))
    symbols = rng.integers(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS, n).tolist()
    return [BOS, *symbols, SEP], [*symbols[::-1], EOS]


def packed_batches(rng, exclude: Container, steps: int, rows: int, seq: int, row_multiple: int):
    """`steps` batches of exactly `rows` rows of `seq` tokens, of new examples.

    Each batch takes examples while their tokens fit ``rows * seq`` and the packing finds room
    for them (an example that does not fit opens the next batch). Prompts in `exclude` (the
    held-out ones) are never trained on. The loss mask is 0 on the prompt, 1 on the response.
    """
    from jaxops.models import pack_sequences

    batches, pending = [], []
    while len(batches) < steps:
        chunk, tokens = [], 0
        while True:
            example = pending.pop() if pending else make_example(rng)
            if tuple(example[0]) in exclude:
                continue
            if tokens + len(example[0]) + len(example[1]) > rows * seq:
                pending.append(example)
                break
            chunk.append(example)
            tokens += len(example[0]) + len(example[1])
        while True:  # first-fit decreasing nearly always fits them; else move some on
            try:
                batch = pack_sequences(
                    [p + r for p, r in chunk],
                    seq,
                    loss_masks=[[0] * len(p) + [1] * len(r) for p, r in chunk],
                    num_rows=rows,
                    row_multiple=row_multiple,
                )
                break
            except ValueError:
                pending.append(chunk.pop())
        batches.append(batch)
    return batches


def left_pad(prompts: list[list[int]]):
    """``(tokens, attention_mask)`` int32 ``[B, S]``: the prompts left-padded to one length."""
    import numpy as np

    width = max(map(len, prompts))
    tokens = np.full((len(prompts), width), PAD, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return tokens, mask


def hf_generate(path: Path, tokens, mask, max_new_tokens: int):
    """transformers' greedy answers from the saved files: int ``[B, S + max_new_tokens]``."""
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=PAD,
        ).numpy()
    # transformers stops once every row has ended; pad to the full length as jaxops returns it.
    return np.pad(out, [(0, 0), (0, tokens.shape[1] + max_new_tokens - out.shape[1])])


def answer(row, prompt_len: int) -> list[int]:
    """The generated tokens of one row up to (not including) its first EOS."""
    new = [int(t) for t in row[prompt_len:]]
    return new[: new.index(EOS)] if EOS in new else new


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = tuple(int(s) for s in args.mesh.split(","))
    if len(sizes) != 3:
        raise SystemExit(f"--mesh must be pipe,data,expert, got {args.mesh!r}")
    if args.seq < 2 * MAX_LEN + 3:
        raise SystemExit(f"--seq must hold the longest example ({2 * MAX_LEN + 3} tokens)")
    if args.context < 1:
        raise SystemExit(f"--context must be at least 1, got {args.context}")
    if args.seq % (2 * args.context):
        raise SystemExit(f"--seq must be a multiple of {2 * args.context} (2 x --context)")
    devices = sizes[0] * sizes[1] * sizes[2] * args.context
    if args.eval_prompts % devices:
        raise SystemExit(f"--eval-prompts must be a multiple of the {devices} devices")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(devices))

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from jaxops.models import from_pretrained, generate, save_pretrained

    if args.no_progress:
        transformers.utils.logging.disable_progress_bar()
    t_start = time.perf_counter()
    work = Path(args.out or tempfile.mkdtemp(prefix="jaxops_sft_"))
    src, out = work / "base", work / "sft"
    make_hf_model(args.arch, src)
    print(f"transformers wrote a tiny random {args.arch} to {src}")

    # [mesh]
    if args.context > 1:  # each row's tokens split over the context axis
        mesh = jax.make_mesh(
            (sizes[0], sizes[1], args.context, sizes[2]), ("pipe", "data", "context", "expert")
        )
    else:
        mesh = jax.make_mesh(sizes, ("pipe", "data", "expert"))
    progress = False if args.no_progress else None  # None: a bar on a terminal
    model, params = from_pretrained(
        src, mesh=mesh, dtype=jnp.float32, num_microbatches=args.microbatches, progress=progress,
        fp8=args.fp8,
    )  # fmt: skip
    # [/mesh]
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(
        f"from_pretrained: {model.config.model_type}, {n:,} parameters on mesh {dict(mesh.shape)}"
        + (f", FP8 recipe {model.fp8.scaling}" if model.fp8 else "")
    )

    # The data: held-out prompts first, then training examples that never repeat them, packed.
    rng = np.random.default_rng(0)
    held_out = {}
    while len(held_out) < args.eval_prompts:
        prompt, response = make_example(rng)
        held_out.setdefault(tuple(prompt), response)
    shards = int(np.prod([dict(mesh.shape)[a] for a in model.input_axes]))
    multiple = shards * args.microbatches  # every microbatch splits over the batch axes
    if args.rows % multiple:
        raise SystemExit(f"--rows must be a multiple of {multiple} on mesh {dict(mesh.shape)}")
    batches = packed_batches(rng, held_out.keys(), args.steps, args.rows, args.seq, multiple)
    print(
        f"pack_sequences: {sum(b.num_sequences for b in batches):,} examples in {args.steps} "
        f"batches of {args.rows} x {args.seq} tokens, fill ratio "
        f"{np.mean([b.fill_ratio for b in batches]):.1%}, "
        f"{np.mean([b.num_targets for b in batches]):.0f} response targets per batch"
    )

    # [step]
    warmup = min(20, args.steps // 10)
    lr = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr / 10
    )
    opt = optax.adamw(lr, weight_decay=0.0)

    @jax.jit
    def step(params, state, tokens, targets, segment_ids, positions):
        loss, grads = model.loss_and_grads(
            params, tokens, targets, segment_ids=segment_ids, positions=positions
        )
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    # [/step]

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="sft", unit="step")
    log = print if bar is None else bar.write
    losses = []
    with jax.set_mesh(mesh):
        # [train]
        state = jax.jit(opt.init)(params)
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            b = batch.model_inputs()
            inputs = model.place_batch(b["tokens"], b["targets"], b["segment_ids"], b["positions"])
            params, state, loss = step(params, state, *inputs)
            losses.append(float(loss))
            # [/train]
            if i == 0:
                t_first = time.perf_counter() - t0
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update(1)
            if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                recent = losses[-args.log_every :]
                log(f"step {i + 1:4d}  loss {np.mean(recent):.4f} (mean of {len(recent)} steps)")
        elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    rate = (elapsed - t_first) / max(args.steps - 1, 1)
    print(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps ({elapsed:.1f} s: the "
        f"first with compiling {t_first:.1f} s, then {rate * 1e3:.0f} ms/step)"
    )
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not fall")

    # [save]
    names = save_pretrained(model, params, out)
    print(f"save_pretrained: {len(names)} tensors in {out}")
    # [/save]

    # Greedy answers to the held-out prompts from the saved files: jaxops on a data x expert
    # mesh (generation runs without pipeline stages) beside transformers.
    gen_mesh = jax.make_mesh((devices // sizes[2], sizes[2]), ("data", "expert"))
    gen_model, gen_params = from_pretrained(
        out, mesh=gen_mesh, dtype=jnp.float32, progress=progress
    )
    tokens, mask = left_pad([list(p) for p in held_out])
    t0 = time.perf_counter()
    ours = generate(
        gen_model,
        gen_params,
        tokens,
        args.max_new_tokens,
        attention_mask=mask,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    ours = np.asarray(ours)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = hf_generate(out, tokens, mask, args.max_new_tokens)
    t_theirs = time.perf_counter() - t0
    print(
        f"jaxops.models.generate on mesh {dict(gen_mesh.shape)} ({t_ours:.1f} s with compiling) "
        f"and transformers' generate(do_sample=False) ({t_theirs:.1f} s), greedy:"
    )
    right = 0
    for i, (prompt, response) in enumerate(held_out.items()):
        got, hf = answer(ours[i], tokens.shape[1]), answer(theirs[i], tokens.shape[1])
        right += got == response[:-1]
        if i < args.show:
            mark = "ok" if got == response[:-1] else "--"
            print(f"  {mark} prompt {list(prompt[1:-1])}: jaxops {got}, transformers {hf}")
    if not np.array_equal(ours, theirs):
        rows = np.flatnonzero((ours != theirs).any(1)).tolist()
        raise SystemExit(f"jaxops' generate differs from transformers' in rows {rows}")
    print(f"jaxops' answers equal transformers' token for token ({len(held_out)} prompts)")
    print(f"right answers (the prompt reversed): {right}/{len(held_out)} held-out prompts")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
