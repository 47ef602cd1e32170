"""jaxops.models against transformers' MiniMax-M2 (``MiniMaxM2ForCausalLM``).

A tiny random MiniMax-M2 made by transformers in the test (every weight random: the q/k
RMSNorms over the whole projections, the layer norms and the router's correction bias
included), with partial RoPE (``rotary_dim`` half the head) and sigmoid routing: logits on 1
device, data x expert and pipe x expert, training and save_pretrained back to transformers,
greedy generation, and the config's defaults and refusals.

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
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,  # published configs say partial RoPE this way
    num_local_experts=8,
    num_experts_per_tok=2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)


def hf_minimax(seed: int = 0, **extra):
    """A tiny transformers MiniMax-M2 with every weight random."""
    torch.manual_seed(seed)
    config = transformers.MiniMaxM2Config(**{**CONFIG, **extra})
    return randomize(transformers.MiniMaxM2ForCausalLM(config), 4.0)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(transformers model, its saved directory)."""
    root = tmp_path_factory.mktemp("minimax_m2")
    model = hf_minimax()
    model.save_pretrained(root, max_shard_size="200KB")
    return model, root


@pytest.mark.parametrize("mesh_name", ["1dev", "d2e4", "p2e4"])
def test_logits_match_transformers(hf, mesh_name):
    torch_model, path = hf
    model, params = models.from_pretrained(path, mesh=mesh(mesh_name), num_microbatches=2)
    c = model.config
    assert (c.qk_norm, c.qk_norm_width, c.rope.partial_rotary_factor) == (True, "projection", 0.5)
    assert (c.router, c.router_bias, c.normalize_topk, c.shared_ffn) == ("sigmoid", True, True, 0)
    bias = params["layers"]["moe"]["router_bias"]
    assert bias.dtype == jnp.float32 and float(jnp.abs(bias).max()) > 0
    assert params["layers"]["q_norm"].shape == (2, 64) and params["layers"]["k_norm"].shape == (
        2,
        32,
    )
    tokens = random_tokens(2 if mesh_name == "1dev" else 16)
    check_logits(model, params, torch_model, tokens, f"minimax_m2 {mesh_name}")


def test_adamw_steps_and_save_pretrained_round_trip(hf, tmp_path):
    torch_model, path = hf
    model, params = models.from_pretrained(path, mesh=mesh("p2e4"), num_microbatches=2,
                                           router_aux_loss_coef=0.0)  # fmt: skip
    check_loss(model, params, torch_model)
    names, saved = train_save_reload(model, params, torch_model, tmp_path / "out", "minimax_m2")
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in names
    assert saved["rope_parameters"]["partial_rotary_factor"] == 0.5 and "rotary_dim" not in saved


def test_greedy_generate_matches_transformers(hf):
    torch_model, path = hf
    model, params = models.from_pretrained(path, mesh=mesh("1dev"))
    check_greedy_generate(model, params, torch_model)


def test_config_defaults_and_refusals(hf):
    hf_cfg = hf[0].config.to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    assert models.DecoderConfig.from_hf(cfg.to_hf()) == cfg
    full = transformers.MiniMaxM2Config().to_dict()  # MiniMax-M2's shapes
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    got = models.DecoderConfig.from_hf({k: full[k] for k in keep})
    assert got == models.DecoderConfig.from_hf(full)
    assert (got.num_experts, got.top_k, got.head_dim, got.expert_ffn) == (256, 8, 128, 1536)
    assert got.rope.theta == 5e6
    with pytest.raises(models.ConfigError, match=r"router_jitter_noise = 0\.1 is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "router_jitter_noise": 0.1})
