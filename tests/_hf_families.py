"""Tiny transformers-made MoE models shared by the models tests: the families, their configs,
the meshes they run on, and the relative error the parity tests measure.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max |jaxops - transformers| / max |transformers| for float32 logits

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)
FAMILIES = {
    # name: (config class, model class, extra config) -- every layer MoE, GQA 4:2
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, intermediate_size=48),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
}
MESHES = {
    "1dev": ((1,), ("expert",)),
    "d2e4": ((2, 4), ("data", "expert")),
    "p2e4": ((2, 4), ("pipe", "expert")),
}


def hf_model(family: str, seed: int = 0):
    """A transformers model of `family` with every weight random (norms and biases too)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms and biases away from their init so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def hf_generate(model, prompt, mask, max_new_tokens: int) -> np.ndarray:
    """transformers' greedy ``generate`` of a (left-padded) int prompt: ``[B, S + new]``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out.numpy()
