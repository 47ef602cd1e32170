"""jaxops.models against transformers' Llama 4 text model (``Llama4ForCausalLM``).

A tiny random Llama 4 made by transformers in the test (every weight random, norms included):
chunked attention in the RoPE layers (sequences of 12 over chunks of 4), NoPE full-attention
layers with attention temperature tuning (a small ``floor_scale`` so that it acts), the L2 q/k
norm, interleaved RoPE pairs, the top-1 sigmoid router whose weight scales the expert's input,
the shared expert, and MoE layers interleaved with dense ones (``interleave_moe_layer_step``);
logits on 1 device, data x expert and pipe x expert, training and save_pretrained back to
transformers, greedy generation, and the config's defaults and refusals.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import json

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
    intermediate_size_mlp=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,  # MoE layers 1 and 3, dense 0 and 2
    no_rope_layer_interval=2,  # NoPE layers 1 and 3
    attention_chunk_size=4,  # the RoPE layers attend within chunks of 4 positions
    floor_scale=4,  # temperature tuning acts from time step 3 on
    attn_scale=0.5,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=None,
)


def hf_llama4(seed: int = 0, **extra):
    """A tiny transformers Llama 4 (text) with every weight random."""
    torch.manual_seed(seed)
    config = transformers.Llama4TextConfig(**{**CONFIG, **extra})
    return randomize(transformers.Llama4ForCausalLM(config), 4.0)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (transformers model, its saved directory)."""
    root = tmp_path_factory.mktemp("llama4")
    out = {}
    variants = {
        "interleaved": {},
        "every": dict(interleave_moe_layer_step=1, seed=1),  # every layer MoE: a pipeline
        "top2": dict(num_experts_per_tok=2, seed=2),
    }
    for name, extra in variants.items():
        model = hf_llama4(**extra)
        model.save_pretrained(root / name, max_shard_size="200KB")
        out[name] = (model, root / name)
    return out


def _check_logits(model, params, torch_model, ids, what: str) -> None:
    check_logits(model, params, torch_model, ids, f"llama4_text {what}")


@pytest.mark.parametrize(
    "name,mesh_name",
    [("interleaved", "1dev"), ("top2", "1dev"), ("interleaved", "d2e4"), ("every", "p2e4")],
)
def test_logits_match_transformers(hf, name, mesh_name):
    torch_model, path = hf[name]
    model, params = models.from_pretrained(path, mesh=mesh(mesh_name), num_microbatches=2)
    c = model.config
    assert c.nope_layers == (1, 3) and c.attention_chunk_size == 4 and c.rope.interleave
    assert c.layer_types == ("chunked_attention", "full_attention") * 2
    assert c.qk_l2_norm and c.attn_temperature_tuning and c.weight_inputs
    assert (c.router, c.normalize_topk, c.shared_ffn) == ("sigmoid", False, 32)
    assert c.dense_layers == ((0, 2) if name != "every" else ())
    tokens = random_tokens(2 if mesh_name == "1dev" else 16)
    _check_logits(model, params, torch_model, tokens, f"{name} {mesh_name}")


def test_pipeline_gradients_equal_the_scan_gradients(hf):
    """pipe x expert (each stage slicing its layers' attention patterns) against data x expert."""
    grads = pipeline_and_scan_grads(hf["every"][1])
    assert float(np.abs(grads["layers"]["w_qkv"]).max()) > 0


def test_adamw_steps_and_save_pretrained_round_trip(hf, tmp_path):
    torch_model, path = hf["interleaved"]
    model, params = models.from_pretrained(path, mesh=mesh("d2e4"), router_aux_loss_coef=0.0)
    check_loss(model, params, torch_model)
    names, saved = train_save_reload(model, params, torch_model, tmp_path / "out", "llama4_text")
    assert {"model.layers.1.feed_forward.experts.gate_up_proj",
            "model.layers.2.feed_forward.gate_proj.weight",
            "model.layers.3.feed_forward.shared_expert.down_proj.weight"} <= set(names)  # fmt: skip
    assert saved["moe_layers"] == [1, 3] and saved["no_rope_layers"] == [1, 0, 1, 0]
    assert saved["floor_scale"] == 4 and saved["intermediate_size_mlp"] == 48


def test_greedy_generate_matches_transformers(hf):
    torch_model, path = hf["interleaved"]
    model, params = models.from_pretrained(path, mesh=mesh("1dev"))
    # 10 prompt tokens and 6 new: past two chunk boundaries and the temperature's floor
    check_greedy_generate(model, params, torch_model, seq=10, new=6)


def test_config_defaults_round_trip_and_refusals(hf):
    hf_cfg = hf["interleaved"][0].config.to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    assert models.DecoderConfig.from_hf(cfg.to_hf()) == cfg
    full = transformers.Llama4TextConfig().to_dict()  # Llama-4-Scout's shapes
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    got = models.DecoderConfig.from_hf({k: full[k] for k in keep})
    assert got == models.DecoderConfig.from_hf(full)
    assert (got.num_experts, got.top_k, got.head_dim, got.attention_chunk_size) == (
        16,
        1,
        128,
        8192,
    )
    assert got.nope_layers == tuple(range(3, 48, 4)) and got.dense_layers == ()
    no_chunk = models.DecoderConfig.from_hf({**hf_cfg, "attention_chunk_size": None,
                                             "layer_types": None})  # fmt: skip
    assert no_chunk.layer_types == ("full_attention",) * 4
    with pytest.raises(models.ConfigError, match=r"router_jitter_noise = 0\.5 is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "router_jitter_noise": 0.5})
    with pytest.raises(models.ConfigError, match="'no_rope_layers' must hold"):
        models.DecoderConfig.from_hf({**hf_cfg, "no_rope_layers": [1, 2, 1, 0]})
    with pytest.raises(models.ConfigError, match="dense layers must come first"):
        models.from_pretrained(hf["interleaved"][1], mesh=mesh("p2e4"))


def test_published_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Llama-4-Scout / Maverick ship as Llama4ForConditionalGeneration: config model_type
    "llama4" with a text_config, the text model under ``language_model.``, a vision tower."""
    torch.manual_seed(3)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=64)  # fmt: skip
    config = transformers.Llama4Config(text_config=CONFIG, vision_config=vision)
    torch_model = transformers.Llama4ForConditionalGeneration(config)
    randomize(torch_model.language_model, 4.0)
    torch_model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama4"
    with pytest.warns(UserWarning, match=r"skipped \d+ tensor\(s\) of Llama 4's vision tower"):
        model, params = models.from_pretrained(tmp_path, mesh=mesh("d2e4"))
    assert model.config.model_type == "llama4_text" and model.config.nope_layers == (1, 3)
    # transformers' text path of the multimodal model is its Llama4ForCausalLM
    _check_logits(model, params, torch_model.language_model.eval(), random_tokens(8),
                  "multimodal checkpoint")  # fmt: skip


def test_dot_product_attention_takes_the_per_layer_masks(hf):
    """``jax.nn.dot_product_attention`` (cuDNN's on GPUs) gets the chunked and full layers'
    masks from the scanned per-layer patterns: its logits equal the jnp softmax's (gradients of
    that path: tests/test_models_decoder.py)."""
    path = hf["interleaved"][1]
    tokens = random_tokens(2, seed=6)
    out = {}
    for impl in ("xla", "dot_product"):
        model, params = models.from_pretrained(path, mesh=mesh("1dev"), attention_impl=impl)
        out[impl] = np.asarray(jax.jit(model.logits)(params, tokens))
    np.testing.assert_allclose(out["dot_product"], out["xla"], atol=1e-5 * np.abs(out["xla"]).max())
