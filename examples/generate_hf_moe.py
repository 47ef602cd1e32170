"""Load a Hugging Face MoE model with jaxops, check it against transformers, generate.

The first thing to do with a published checkpoint, on 8 simulated CPU devices with no download
(or on your GPUs with a downloaded directory):

1. the model: ``--model DIR``, a local Hugging Face directory (config.json, safetensors, and
   the tokenizer if you want text), or by default a tiny random Qwen3-MoE (or any other family
   of ``finetune_hf_moe.py``) that transformers creates and saves;
2. ``jaxops.models.from_pretrained`` reads it onto a ``data x expert`` mesh: experts split
   over the expert axis, the batch over both axes;
3. the check: jaxops' logits beside transformers' on the same prompts (the largest difference,
   absolute and relative to the logits' scale);
4. ``jaxops.models.generate`` answers the prompts greedily (left-padded into one batch, KV
   cache, EOS stops a row), and so does transformers' ``generate``: the tokens must agree.

Usage::

    python examples/generate_hf_moe.py                          # tiny qwen3_moe, data 2 x expert 4
    python examples/generate_hf_moe.py --arch deepseek_v3 --mesh 1,8
    python examples/generate_hf_moe.py --model /data/Qwen3-30B-A3B --mesh 1,8 \\
        --dtype bfloat16 --prompt "The capital of France is" --no-reference   # 8 GPUs
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ARCHS = (
    "qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe", "deepseek_v3", "ernie4_5_moe",
    "gpt_oss", "llama4_text", "minimax_m2",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local Hugging Face model directory")
    parser.add_argument(
        "--arch", choices=ARCHS, default="qwen3_moe", help="the tiny model's family (no --model)"
    )
    parser.add_argument("--mesh", default="2,4", help="data,expert sizes")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="parameter dtype (bfloat16 at size; the token-for-token check against "
        "transformers' float32 model expects float32)",
    )
    parser.add_argument(
        "--prompt", action="append", default=None, help="a prompt (the tokenizer's; repeatable)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument(
        "--no-reference", action="store_true", help="skip transformers (no host copy of the model)"
    )
    return parser.parse_args(argv)


def make_hf_model(arch: str, path: Path) -> None:
    """The tiny random `arch` of finetune_hf_moe.py (2 MoE layers, 8 experts), saved there."""
    name = "finetune_hf_moe"  # examples/ is not a package: load the file beside this one
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_hf_model(arch, path)


def prompts_of(args, path: Path, batch: int, vocab: int):
    """``(tokens, mask, tokenizer)``: the prompts left-padded to one length, `batch` rows
    (repeated to fill the batch axes). Text with the directory's tokenizer, else random ids."""
    import numpy as np

    tokenizer = None
    if args.prompt:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        ids = [tokenizer(p)["input_ids"] for p in args.prompt]
    else:
        rng = np.random.default_rng(0)
        ids = [rng.integers(0, vocab, int(rng.integers(3, 9))).tolist() for _ in range(batch)]
    ids = [ids[i % len(ids)] for i in range(-(-len(ids) // batch) * batch)]
    width = max(map(len, ids))
    tokens = np.zeros((len(ids), width), np.int32)
    mask = np.zeros((len(ids), width), np.int32)
    for i, row in enumerate(ids):
        tokens[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return tokens, mask, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = tuple(int(s) for s in args.mesh.split(","))
    if len(sizes) != 2:
        raise SystemExit(f"--mesh must be data,expert, got {args.mesh!r}")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(sizes[0] * sizes[1]))  # CPU only

    import jax
    import numpy as np
    import torch
    import transformers
    from jaxops.models import from_pretrained, generate

    t_start = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()
    if args.model is None:
        path = Path(tempfile.mkdtemp(prefix="jaxops_generate_")) / args.arch
        make_hf_model(args.arch, path)
        print(f"transformers wrote a tiny random {args.arch} to {path}")
    else:
        path = Path(args.model)

    # [load]
    mesh = jax.make_mesh(sizes, ("data", "expert"))
    model, params = from_pretrained(path, mesh=mesh, dtype=args.dtype, progress=False)
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(f"from_pretrained: {model.config.model_type}, {n:,} parameters on {dict(mesh.shape)}")
    # [/load]

    tokens, mask, tokenizer = prompts_of(args, path, sizes[0] * sizes[1], model.config.vocab_size)
    try:  # the checkpoint's own stop and pad ids, as transformers' generate reads them
        settings = transformers.GenerationConfig.from_pretrained(path)
    except OSError:
        settings = transformers.GenerationConfig.from_model_config(
            transformers.AutoConfig.from_pretrained(path)
        )
    eos, pad = settings.eos_token_id, settings.pad_token_id
    pad = pad if pad is not None else 0 if tokenizer is None else tokenizer.pad_token_id or 0

    # [generate]
    t0 = time.perf_counter()
    ours = np.asarray(
        generate(
            model, params, tokens, args.max_new_tokens, attention_mask=mask,
            eos_token_id=eos, pad_token_id=pad,
        )
    )  # fmt: skip
    print(f"jaxops.models.generate: {ours.shape[0]} rows in {time.perf_counter() - t0:.1f} s")
    # [/generate]
    for row in ours[: len(args.prompt or ())]:
        print("  ", repr(tokenizer.decode(row[tokens.shape[1] :], skip_special_tokens=True)))
    if args.no_reference:
        print(f"total {time.perf_counter() - t_start:.1f} s (transformers not run)")
        return 0

    # [check]
    # transformers in float32 on the host: the reference nobody here wrote.
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    probe = tokens[:, -int(mask.sum(1).min()) :]  # each prompt's last tokens: no padding
    with torch.no_grad():
        want = hf(torch.tensor(probe, dtype=torch.long)).logits.numpy()
        theirs = hf.generate(
            torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
            max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
            pad_token_id=pad,
        ).numpy()  # fmt: skip
    got = np.asarray(jax.jit(model.logits)(params, model.place_batch(probe)), np.float32)
    err = np.abs(got - want).max()
    print(
        f"logits vs transformers: max abs error {err:.2e} "
        f"({err / np.abs(want).max():.1e} of the largest logit)"
    )
    # transformers stops once every row has ended; pad to the full length as jaxops returns it.
    theirs = np.pad(theirs, [(0, 0), (0, ours.shape[1] - theirs.shape[1])], constant_values=pad)
    # [/check]
    if not np.array_equal(ours, theirs):
        rows = np.flatnonzero((ours != theirs).any(1)).tolist()
        raise SystemExit(f"jaxops' generate differs from transformers' in rows {rows}")
    print(f"greedy tokens equal transformers' token for token ({ours.shape[0]} rows)")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
