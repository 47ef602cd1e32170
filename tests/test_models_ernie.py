"""jaxops.models against transformers' ERNIE-4.5-MoE (``Ernie4_5_MoeForCausalLM``).

A tiny random ERNIE-4.5-MoE made by transformers in the test (every weight random, norms and the
router's ``moe_statics.e_score_correction_bias [1, E]`` included; MoE layers by
``moe_layer_start_index`` / ``moe_layer_interval``, interleaved RoPE pairs, shared experts, tied
embeddings), loaded on 1 device and on pipe x expert: logits, training and save_pretrained back
to transformers, greedy generation, and the refused config keys.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import (  # noqa: E402
    check_greedy_generate,
    check_logits,
    check_loss,
    mesh,
    random_tokens,
    randomize,
    train_save_reload,
)

from jaxops import models  # noqa: E402

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_num_experts=8,
    moe_k=2,
    moe_intermediate_size=32,
    moe_num_shared_experts=1,
    moe_layer_start_index=1,
    moe_layer_interval=2,  # MoE layers 1 and 3; dense 0, 2, 4
    eos_token_id=None,
    pad_token_id=0,
)


def _hf_ernie(seed: int = 0, **extra):
    torch.manual_seed(seed)
    config = transformers.Ernie4_5_MoeConfig(**{**CONFIG, **extra})
    return randomize(transformers.Ernie4_5_MoeForCausalLM(config), 4.0)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (transformers model, its saved directory)."""
    root = tmp_path_factory.mktemp("ernie")
    out = {}
    variants = {
        "interval": {},
        "prefix": dict(moe_layer_interval=1, seed=1),
        # Tied embeddings make the tiny model repeat its input token; generation needs variety.
        "untied": dict(tie_word_embeddings=False, seed=1),
    }
    for name, extra in variants.items():
        model = _hf_ernie(**extra)
        model.save_pretrained(root / name, max_shard_size="200KB")
        out[name] = (model, root / name)
    return out


def _check_logits(model, params, torch_model, ids, what: str) -> None:
    check_logits(model, params, torch_model, ids, f"ernie4_5_moe {what}")


@pytest.mark.parametrize(
    "name,mesh_name", [("interval", "1dev"), ("interval", "d2e4"), ("prefix", "p2e4")]
)
def test_logits_match_transformers(hf, name, mesh_name):
    torch_model, path = hf[name]
    model, params = models.from_pretrained(path, mesh=mesh(mesh_name), num_microbatches=2)
    c = model.config
    want_dense = (0, 2, 4) if name == "interval" else (0,)
    assert c.dense_layers == want_dense and c.tie_word_embeddings and c.rope.interleave
    assert (c.router, c.router_bias, c.shared_ffn, c.shared_gate) == ("softmax", True, 32, False)
    bias = params["layers"]["moe"]["router_bias"]  # their [1, E] per layer, ours [E]
    assert bias.shape == (len(c.moe_layers), 8) and bias.dtype == jnp.float32
    tokens = random_tokens(2 if mesh_name == "1dev" else 16)
    _check_logits(model, params, torch_model, tokens, f"{name} {mesh_name}")


def test_adamw_steps_and_save_pretrained_round_trip(hf, tmp_path):
    torch_model, path = hf["interval"]
    model, params = models.from_pretrained(path, mesh=mesh("d2e4"), router_aux_loss_coef=0.0)
    check_loss(model, params, torch_model)
    names, saved = train_save_reload(model, params, torch_model, tmp_path / "out", "ernie4_5_moe")
    assert "model.layers.3.mlp.moe_statics.e_score_correction_bias" in names
    assert (saved["moe_layer_start_index"], saved["moe_layer_end_index"]) == (1, 3)
    assert saved["moe_layer_interval"] == 2 and saved["moe_k"] == 2


def test_greedy_generate_matches_transformers(hf):
    torch_model, path = hf["untied"]
    model, params = models.from_pretrained(path, mesh=mesh("1dev"), dtype=jnp.float32)
    check_greedy_generate(model, params, torch_model)


def test_config_round_trip_defaults_and_refused_keys(hf):
    hf_cfg = hf["interval"][0].config.to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    assert models.DecoderConfig.from_hf(cfg.to_hf()) == cfg
    full = transformers.Ernie4_5_MoeConfig().to_dict()  # ERNIE-4.5-21B-A3B's shapes
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    got = models.DecoderConfig.from_hf({k: full[k] for k in keep})
    assert got == models.DecoderConfig.from_hf(full)
    assert (got.num_experts, got.top_k, got.dense_layers, got.rope.theta) == (64, 6, (0,), 5e5)
    with pytest.raises(models.ConfigError, match="use_bias = true is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "use_bias": True})
    with pytest.raises(models.ConfigError, match=r"moe_norm_min = 0\.5 is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "moe_norm_min": 0.5})
    with pytest.raises(models.ConfigError, match="ernie4_5_moe rotates interleaved pairs"):
        models.DecoderConfig(**{**cfg.__dict__, "rope": models.Rope(theta=5e5)})
