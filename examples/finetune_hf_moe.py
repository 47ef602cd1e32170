"""Fine-tune a Hugging Face MoE model with jaxops on 8 devices and write it back for transformers.

What a user does with a published checkpoint, end to end, on 8 simulated CPU devices:

1. transformers creates a tiny random Qwen3-MoE (or Mixtral, Qwen2-MoE, OLMoE, GLM-4.5,
   DeepSeek-V3 or ERNIE-4.5-MoE, the last three with a dense first layer, gpt-oss with its
   sliding-window layers and attention sinks, Llama 4 with its chunked and NoPE layers, or
   MiniMax-M2) and saves it as a sharded safetensors directory -- the stand-in for a downloaded
   model (no network needed);
2. ``jaxops.models.from_pretrained`` reads it onto a mesh (``pipe x data x expert``: layers as
   1F1B pipeline stages, experts over the expert axis, the batch over data and expert) and checks
   its logits against transformers';
3. a few optax adamw steps on a synthetic task (with a tqdm progress bar), in one jitted step;
4. ``jaxops.models.save_pretrained`` writes config.json and safetensors shards, which
   ``transformers.AutoModelForCausalLM.from_pretrained`` loads; its logits are compared with
   jaxops' again.

Usage::

    python examples/finetune_hf_moe.py                     # qwen3_moe on pipe 2 x data 2 x expert 2
    python examples/finetune_hf_moe.py --arch mixtral --mesh 1,2,4 --steps 30 --out /tmp/ft
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch",
        choices=(
            "qwen3_moe",
            "mixtral",
            "qwen2_moe",
            "olmoe",
            "glm4_moe",
            "deepseek_v3",
            "ernie4_5_moe",
            "gpt_oss",
            "llama4_text",
            "minimax_m2",
        ),
        default="qwen3_moe",
    )
    parser.add_argument("--mesh", default="2,2,2", help="pipe,data,expert sizes (product 8)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--out", default=None, help="output directory (default: a temp dir)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def make_hf_model(arch: str, path: Path) -> None:
    """A tiny random model of `arch` saved by transformers (2 MoE layers, 8 experts, top-2;
    GQA, or DeepSeek-V3's multi-head latent attention; GLM-4.5, DeepSeek-V3 and ERNIE-4.5 add
    a dense first layer)."""
    import torch
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=8, intermediate_size=48)
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "olmoe":
        config = transformers.OlmoeConfig(**common, num_experts=8, intermediate_size=32)
        cls = transformers.OlmoeForCausalLM
    elif arch == "gpt_oss":  # a sliding-window layer (window 8), then a full one
        config = transformers.GptOssConfig(
            **common, num_local_experts=8, intermediate_size=32, head_dim=16, sliding_window=8
        )
        cls = transformers.GptOssForCausalLM
    elif arch == "llama4_text":  # chunked attention (chunks of 8), then a NoPE layer; top-1
        config = transformers.Llama4TextConfig(
            **{**common, "num_experts_per_tok": 1}, num_local_experts=8, intermediate_size=32,
            intermediate_size_mlp=64, head_dim=16, attention_chunk_size=8,
            no_rope_layer_interval=2, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        cls = transformers.Llama4ForCausalLM
    elif arch == "minimax_m2":
        config = transformers.MiniMaxM2Config(
            **common, num_local_experts=8, intermediate_size=32, head_dim=16, rotary_dim=8,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        cls = transformers.MiniMaxM2ForCausalLM
    elif arch == "ernie4_5_moe":  # a dense first layer, then 2 MoE layers
        config = transformers.Ernie4_5_MoeConfig(
            **{k: v for k, v in common.items() if k not in ("num_experts_per_tok",
                                                              "num_hidden_layers")},
            num_hidden_layers=3, intermediate_size=96, moe_num_experts=8, moe_k=2,
            moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
        )  # fmt: skip
        cls = transformers.Ernie4_5_MoeForCausalLM
    else:  # a dense first layer, then 2 MoE layers with sigmoid group-limited routing
        routed = dict(num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
                      n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                      n_group=2, topk_group=1)  # fmt: skip
        if arch == "glm4_moe":
            config = transformers.Glm4MoeConfig(
                **{**common, **routed}, head_dim=16, use_qk_norm=True, attention_bias=True
            )
            cls = transformers.Glm4MoeForCausalLM
        else:
            config = transformers.DeepseekV3Config(
                **{**common, **routed, "num_key_value_heads": 4}, q_lora_rank=24,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            )  # fmt: skip
            cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(path, max_shard_size="200KB")


def hf_logits(path: Path, tokens):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = tuple(int(s) for s in args.mesh.split(","))
    if len(sizes) != 3:
        raise SystemExit(f"--mesh must be pipe,data,expert, got {args.mesh!r}")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(sizes[0] * sizes[1] * sizes[2]))

    import jax
    import numpy as np
    import optax
    from jaxops.models import from_pretrained, save_pretrained

    work = Path(args.out or tempfile.mkdtemp(prefix="jaxops_finetune_"))
    src, out = work / "base", work / "finetuned"
    make_hf_model(args.arch, src)
    print(f"transformers wrote a tiny random {args.arch} to {src}")

    mesh = jax.make_mesh(sizes, ("pipe", "data", "expert"))
    model, params = from_pretrained(src, mesh=mesh, num_microbatches=args.microbatches)
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(
        f"from_pretrained: {model.config.model_type}, {n:,} parameters on mesh {dict(mesh.shape)}"
    )

    rng = np.random.default_rng(0)
    probe = rng.integers(0, model.config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    logits = jax.jit(model.logits)
    err = np.abs(np.asarray(logits(params, model.place_batch(probe))) - hf_logits(src, probe))
    print(f"logits vs transformers before training: max abs error {err.max():.2e}")

    # A learnable synthetic task: continue a counting sequence modulo 32.
    def batch(i):
        r = np.random.default_rng([1, i])
        start = r.integers(0, 32, (args.batch, 1))
        seq = (start + np.arange(args.seq + 1)) % 32
        return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)

    opt = optax.adamw(args.lr, weight_decay=0.0)

    @jax.jit
    def step(params, state, tokens, targets):
        loss, grads = model.loss_and_grads(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="fine-tune", unit="step")
    with jax.set_mesh(mesh):
        state = jax.jit(opt.init)(params)
        losses = []
        t0 = time.perf_counter()
        for i in range(args.steps):
            params, state, loss = step(params, state, *model.place_batch(*batch(i)))
            losses.append(float(loss))
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update(1)
        elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps ({elapsed:.1f} s)")
    if not losses[-1] < losses[0]:
        raise SystemExit("the loss did not fall")

    names = save_pretrained(model, params, out, max_shard_size="200KB")
    print(f"save_pretrained: {len(names)} tensors in {out}")
    err = np.abs(np.asarray(logits(params, model.place_batch(probe))) - hf_logits(out, probe))
    print(f"transformers loads it; logits vs jaxops: max abs error {err.max():.2e}")
    if err.max() > 1e-3:
        raise SystemExit("the saved model does not reproduce jaxops' logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
