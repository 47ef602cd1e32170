"""jaxops.models against transformers' Llama 4 text model (``Llama4ForCausalLM``), beyond the
parity suite of tests/test_models_families.py (chunked attention, NoPE layers with attention
temperature tuning, the L2 q/k norm, top-1 sigmoid routing weighting the expert's input, the
shared expert, dense layers between MoE layers): top-2 routing, the published multimodal
checkpoint's text model, jax.nn.dot_product_attention with the per-layer masks, and the config's
defaults and refusals.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_families as fam  # noqa: E402

from jaxops import models  # noqa: E402


def test_top2_logits_match_transformers(tmp_path):
    torch_model = fam.build("llama4_text", seed=2, num_experts_per_tok=2)
    torch_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path, mesh=fam.mesh("1dev"))
    assert model.config.moe.top_k == 2 and model.config.moe.router == "sigmoid"
    fam.check_logits(model, params, torch_model, fam.random_tokens(2), "llama4_text top2 1dev")


def test_config_defaults_round_trip_and_refusals(hf_families):
    hf_cfg = fam.hf_config("llama4_text").to_dict()
    got = fam.published("llama4_text")  # Llama-4-Scout's shapes
    assert (
        got.moe.num_experts,
        got.moe.top_k,
        got.attention.head_dim,
        got.attention.attention_chunk_size,
    ) == (
        16,
        1,
        128,
        8192,
    )
    assert got.pattern.nope_layers == tuple(range(3, 48, 4)) and got.pattern.dense_layers == ()
    no_chunk = models.DecoderConfig.from_hf({**hf_cfg, "attention_chunk_size": None,
                                             "layer_types": None})  # fmt: skip
    assert no_chunk.pattern.layer_types == ("full_attention",) * 4
    with pytest.raises(models.ConfigError, match=r"router_jitter_noise = 0\.5 is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "router_jitter_noise": 0.5})
    with pytest.raises(models.ConfigError, match="'no_rope_layers' must hold"):
        models.DecoderConfig.from_hf({**hf_cfg, "no_rope_layers": [1, 2, 1, 0]})
    with pytest.raises(models.ConfigError, match="dense layers must come first"):
        models.from_pretrained(hf_families.hf("llama4_text")[1], mesh=fam.mesh("p2e4"))


def test_published_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Llama-4-Scout / Maverick ship as Llama4ForConditionalGeneration: config model_type
    "llama4" with a text_config, the text model under ``language_model.``, a vision tower."""
    torch.manual_seed(3)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=64)  # fmt: skip
    text = {**fam.COMMON, **fam.TABLE["llama4_text"].extra}
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch_model = transformers.Llama4ForConditionalGeneration(config)
    fam.randomize(torch_model.language_model, 4.0)
    torch_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama4"
    with pytest.warns(UserWarning, match=r"skipped \d+ tensor\(s\) of Llama 4's vision tower"):
        model, params = models.from_pretrained(tmp_path, mesh=fam.mesh("d2e4"))
    assert model.config.model_type == "llama4_text" and model.config.pattern.nope_layers == (1, 3)
    # transformers' text path of the multimodal model is its Llama4ForCausalLM
    text_model = torch_model.language_model.eval()
    fam.check_logits(model, params, text_model, fam.random_tokens(8), "llama4_text multimodal")


def test_dot_product_attention_takes_the_per_layer_masks(hf_families):
    """``jax.nn.dot_product_attention`` (cuDNN's on GPUs) gets the chunked and full layers'
    masks from the scanned per-layer patterns: its logits equal the jnp softmax's (gradients of
    that path: tests/test_models_decoder.py)."""
    path = hf_families.hf("llama4_text")[1]
    tokens = fam.random_tokens(2, seed=6)
    out = {}
    for impl in ("xla", "dot_product"):
        model, params = models.from_pretrained(path, mesh=fam.mesh("1dev"), attention_impl=impl)
        out[impl] = np.asarray(jax.jit(model.logits)(params, tokens))
    np.testing.assert_allclose(out["dot_product"], out["xla"], atol=1e-5 * np.abs(out["xla"]).max())
