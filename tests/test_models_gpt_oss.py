"""jaxops.models against transformers' gpt-oss (``GptOssForCausalLM``).

A tiny random gpt-oss made by transformers in the test (every weight random: attention sinks,
q/k/v/o biases, the router's bias, the experts' biases and the norms included), with its
alternating sliding-window and full layers (sequences longer than the window), attention sinks,
YaRN RoPE and the clamped SwiGLU experts (a small ``swiglu_limit`` so that the clamp acts):
logits on 1 device, data x expert and pipe x expert, training and save_pretrained back to
transformers, greedy generation, and the config's defaults and refusals. The MXFP4 checkpoints
gpt-oss is published in are tested in tests/test_models_mxfp4.py.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import (  # noqa: E402
    check_greedy_generate,
    check_logits,
    check_loss,
    mesh,
    pipeline_and_scan_grads,
    random_tokens,
    randomize,
    train_save_reload,
)

from jaxops import models  # noqa: E402

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,  # sliding layers 0 and 2 see 4 of the 12 tokens
    swiglu_limit=0.3,  # the clamp acts on the tiny model's activations
    eos_token_id=None,
    pad_token_id=0,
)


def hf_gpt_oss(seed: int = 0, **extra):
    """A tiny transformers gpt-oss with every weight random (sinks and biases included)."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**CONFIG, **extra})
    return randomize(transformers.GptOssForCausalLM(config), 4.0)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(transformers model, its saved directory)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = hf_gpt_oss()
    model.save_pretrained(root, max_shard_size="200KB")
    return model, root


def _check_logits(model, params, torch_model, ids, what: str) -> None:
    check_logits(model, params, torch_model, ids, f"gpt_oss {what}")


@pytest.mark.parametrize("mesh_name", ["1dev", "d2e4", "p2e4"])
def test_logits_match_transformers(hf, mesh_name):
    torch_model, path = hf
    model, params = models.from_pretrained(path, mesh=mesh(mesh_name), num_microbatches=2)
    c = model.config
    assert c.layer_types == ("sliding_attention", "full_attention") * 2 and c.sliding_window == 4
    assert c.attention_sinks and c.expert_bias and c.router_logit_bias and c.qkv_bias
    assert (c.activation, c.swiglu_limit, c.rope.kind) == ("clamped_swiglu", 0.3, "yarn")
    moe = params["layers"]["moe"]
    assert moe["b_in"].shape == (4, 8, 64) and moe["router_logit_bias"].shape == (4, 8)
    assert params["layers"]["sinks"].shape == (4, 4)
    _check_logits(model, params, torch_model, random_tokens(2 if mesh_name == "1dev" else 16),
                  mesh_name)  # fmt: skip


def test_packed_and_padded_batches_match_transformers(hf):
    """Left padding (the sinks take a padded query's whole softmax: zeros, not NaN)."""
    torch_model, path = hf
    model, params = models.from_pretrained(path, mesh=mesh("1dev"))
    ids = random_tokens(2, seq=12, seed=4)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    got = jax.jit(model.logits)(params, ids, attention_mask=mask)
    with torch.no_grad():
        want = torch_model(
            torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)
        ).logits.numpy()
    real = mask.astype(bool)
    err = np.abs(np.asarray(got)[real] - want[real]).max() / np.abs(want[real]).max()
    assert np.isfinite(np.asarray(got)).all() and err <= 1e-4, err


def test_pipeline_gradients_equal_the_scan_gradients(hf):
    """pipe x expert (each stage slicing its layers' attention patterns) against data x expert."""
    grads = pipeline_and_scan_grads(hf[1])
    assert float(np.abs(grads["layers"]["sinks"]).max()) > 0


def test_adamw_steps_and_save_pretrained_round_trip(hf, tmp_path):
    torch_model, path = hf
    model, params = models.from_pretrained(path, mesh=mesh("d2e4"), router_aux_loss_coef=0.0)
    check_loss(model, params, torch_model)
    names, saved = train_save_reload(model, params, torch_model, tmp_path / "out", "gpt_oss")
    assert {"model.layers.3.self_attn.sinks", "model.layers.0.mlp.experts.gate_up_proj_bias",
            "model.layers.1.mlp.router.bias"} <= set(names)  # fmt: skip
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert saved["swiglu_limit"] == 0.3 and saved["rope_parameters"]["rope_type"] == "yarn"


def test_greedy_generate_matches_transformers(tmp_path):
    torch_model = hf_gpt_oss(seed=1, swiglu_limit=7.0)
    torch_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path, mesh=mesh("1dev"))
    check_greedy_generate(model, params, torch_model, seq=8, new=6)


def test_config_defaults_round_trip_and_refusals(hf):
    hf_cfg = hf[0].config.to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    assert models.DecoderConfig.from_hf(cfg.to_hf()) == cfg
    full = transformers.GptOssConfig().to_dict()  # gpt-oss-120b's shapes
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    got = models.DecoderConfig.from_hf({k: full[k] for k in keep})
    assert got == models.DecoderConfig.from_hf(full)
    assert (got.num_experts, got.top_k, got.head_dim, got.expert_ffn) == (128, 4, 64, 2880)
    assert got.rope.kind == "yarn" and got.rope.factor == 32.0 and not got.rope.truncate
    assert got.layer_types[:2] == ("sliding_attention", "full_attention")
    with pytest.raises(models.ConfigError, match="'layer_types' must hold"):
        models.DecoderConfig.from_hf({**hf_cfg, "layer_types": ["full_attention"]})
    with pytest.raises(models.ConfigError, match="'layer_types' must hold"):
        models.DecoderConfig.from_hf({**hf_cfg, "layer_types": ["local"] * 4})
    with pytest.raises(models.ConfigError, match="swiglu_limit must be a finite number > 0"):
        models.DecoderConfig.from_hf({**hf_cfg, "swiglu_limit": -1.0})
    from jaxops.models import _layers

    with pytest.raises(ValueError, match="different attention patterns"):  # needs the kind
        _layers.attention(_layers.Ops(np.float32), cfg, {}, None, None)
    with pytest.raises(models.ConfigError, match="cannot express"):
        models.DecoderConfig(**{**cfg.__dict__, "attention_sinks": False}).to_hf()
