"""jaxops.models against transformers' OLMoE (``OlmoeForCausalLM``).

A tiny random OLMoE made by transformers in the test (every weight random, the q/k norms over
the whole projection included), loaded with from_pretrained on 1 device and on 8 CPU devices
(data x expert, pipe x expert): logits, the loss with ignored targets, training and
save_pretrained back to transformers, greedy generation, and the refused config keys.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import (  # noqa: E402
    check_greedy_generate,
    check_logits,
    mesh,
    random_tokens,
    randomize,
    train_save_reload,
)

from jaxops import models  # noqa: E402

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
    eos_token_id=None,
    pad_token_id=0,
)


def _hf_olmoe(seed: int = 0, **extra):
    """A transformers OLMoE with every weight random: norms and biases moved off their init and
    the layers' matrices scaled up (varied greedy tokens, clear router choices)."""
    torch.manual_seed(seed)
    return randomize(
        transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**CONFIG, **extra)), 5.0
    )


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (transformers model, the directory save_pretrained wrote, sharded)."""
    root = tmp_path_factory.mktemp("olmoe")
    out = {}
    for name, extra in {"base": {}, "renorm": dict(norm_topk_prob=True, seed=1)}.items():
        model = _hf_olmoe(**extra)
        model.save_pretrained(root / name, max_shard_size="200KB")
        assert (root / name / "model.safetensors.index.json").is_file()
        out[name] = (model, root / name)
    return out


def _check_logits(model, params, torch_model, ids: np.ndarray, what: str) -> None:
    check_logits(model, params, torch_model, ids, f"olmoe {what}")


@pytest.mark.parametrize(
    "name,mesh_name", [("base", "1dev"), ("base", "d2e4"), ("base", "p2e4"), ("renorm", "d2e4")]
)
def test_logits_match_transformers(hf, name, mesh_name):
    torch_model, path = hf[name]
    model, params = models.from_pretrained(
        path, mesh=mesh(mesh_name), dtype=jnp.float32, num_microbatches=2
    )
    c = model.config
    assert (c.model_type, c.qk_norm, c.qk_norm_width) == ("olmoe", True, "projection")
    assert c.normalize_topk == (name == "renorm") and not c.qkv_bias and c.shared_ffn == 0
    layers = params["layers"]  # whole-projection q/k norms [L, Hq Dh], [L, Hkv Dh]
    assert layers["q_norm"].shape == (2, 64) and layers["k_norm"].shape == (2, 32)
    tokens = random_tokens(2 if mesh_name == "1dev" else 16)
    _check_logits(model, params, torch_model, tokens, f"{name} {mesh_name}")


def test_loss_with_ignored_targets_matches_transformers(hf):
    torch_model, path = hf["base"]
    model, params = models.from_pretrained(path, mesh=mesh("d2e4"), router_aux_loss_coef=0.0)
    tokens = random_tokens(8, seed=3)
    labels = tokens.copy()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    targets = np.concatenate([labels[:, 1:], np.full((8, 1), -100, np.int32)], axis=1)
    got = jax.jit(model.loss)(params, *model.place_batch(tokens, targets))
    assert not torch_model.config.output_router_logits
    with torch.no_grad():
        want = torch_model(
            torch.tensor(tokens, dtype=torch.long), labels=torch.tensor(labels, dtype=torch.long)
        ).loss.item()
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


def test_adamw_steps_and_save_pretrained_round_trip(hf, tmp_path):
    model, params = models.from_pretrained(hf["base"][1], mesh=mesh("d2e4"))
    names, saved = train_save_reload(model, params, hf["base"][0], tmp_path / "out", "olmoe")
    assert "model.layers.1.self_attn.q_norm.weight" in names
    assert saved["architectures"] == ["OlmoeForCausalLM"] and saved["clip_qkv"] is None
    assert "head_dim" not in saved


def test_greedy_generate_matches_transformers(hf):
    torch_model, path = hf["base"]
    model, params = models.from_pretrained(path, mesh=mesh("1dev"), dtype=jnp.float32)
    check_greedy_generate(model, params, torch_model)


def test_config_round_trip_defaults_and_refused_keys(hf):
    hf_cfg = hf["base"][0].config.to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    assert models.DecoderConfig.from_hf(cfg.to_hf()) == cfg
    assert transformers.AutoConfig.for_model(**cfg.to_hf("bfloat16")).model_type == "olmoe"
    # Absent keys take transformers' OlmoeConfig defaults.
    bare = {k: v for k, v in hf_cfg.items() if k not in ("rms_norm_eps", "rope_parameters")}
    del bare["num_key_value_heads"], bare["router_aux_loss_coef"]
    got = models.DecoderConfig.from_hf(bare)
    want = models.DecoderConfig.from_hf(transformers.OlmoeConfig(**bare).to_dict())
    assert got == want and got.num_kv_heads == 4 and got.rms_norm_eps == 1e-5
    assert got.router_aux_loss_coef == 0.01 and got.rope.theta == 10000.0
    block = models.moe_block_config(hf_cfg)
    assert (block.num_experts, block.expert_ffn, block.normalize_topk) == (8, 32, False)
    with pytest.raises(models.ConfigError, match=r"clip_qkv = 8\.0 is not supported for olmoe"):
        models.DecoderConfig.from_hf({**hf_cfg, "clip_qkv": 8.0})
    with pytest.raises(models.ConfigError, match="head_dim = 8 is not supported for olmoe"):
        models.DecoderConfig.from_hf({**hf_cfg, "head_dim": 8})
    with pytest.raises(models.ConfigError, match="qk_norm_width must be one of"):
        models.DecoderConfig("olmoe", 128, 64, 2, 4, 2, 16, 8, 2, 32, qk_norm_width="full")
    with pytest.raises(models.ConfigError, match="needs qk_norm=True"):
        models.DecoderConfig("olmoe", 128, 64, 2, 4, 2, 16, 8, 2, 32, qk_norm_width="projection")
    # Per-head norms or another head_dim are not OLMoE: to_hf refuses rather than mislabel.
    for kw, what in [
        (dict(qk_norm=True), "qk_norm_width='head'"),
        (dict(qk_norm=True, qk_norm_width="projection", head_dim=8), "head_dim=8"),
    ]:
        c = models.DecoderConfig(
            **{**dict(model_type="olmoe", vocab_size=128, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
                      expert_ffn=32), **kw}
        )  # fmt: skip
        with pytest.raises(models.ConfigError, match=f"olmoe cannot express {what}"):
            c.to_hf()
