"""jaxops.models against transformers' OLMoE (``OlmoeForCausalLM``), beyond the parity suite of
tests/test_models_families.py: the renormalized top-k variant's logits on data x expert, and the
config's defaults and refused keys.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import build, check_logits, hf_config, mesh, random_tokens  # noqa: E402

from jaxops import models  # noqa: E402


def test_renormalized_top_k_logits_match_transformers(tmp_path):
    torch_model = build("olmoe", seed=1, norm_topk_prob=True)
    torch_model.save_pretrained(tmp_path)
    model, params = models.from_pretrained(tmp_path, mesh=mesh("d2e4"))
    assert model.config.moe.normalize_topk and model.config.attention.qk_norm_width == "projection"
    check_logits(model, params, torch_model, random_tokens(16), "olmoe renorm d2e4")


def test_config_defaults_and_refused_keys():
    hf_cfg = hf_config("olmoe").to_dict()
    # Absent keys take transformers' OlmoeConfig defaults.
    bare = {k: v for k, v in hf_cfg.items() if k not in ("rms_norm_eps", "rope_parameters")}
    del bare["num_key_value_heads"], bare["router_aux_loss_coef"]
    got = models.DecoderConfig.from_hf(bare)
    want = models.DecoderConfig.from_hf(transformers.OlmoeConfig(**bare).to_dict())
    assert got == want and got.attention.num_kv_heads == 4 and got.rms_norm_eps == 1e-5
    assert got.moe.router_aux_loss_coef == 0.01 and got.rope.theta == 10000.0
    block = models.moe_block_config(hf_cfg)
    assert (block.num_experts, block.expert_ffn, block.normalize_topk) == (8, 32, False)
    with pytest.raises(models.ConfigError, match=r"clip_qkv = 8\.0 is not supported for olmoe"):
        models.DecoderConfig.from_hf({**hf_cfg, "clip_qkv": 8.0})
    with pytest.raises(models.ConfigError, match="head_dim = 8 is not supported for olmoe"):
        models.DecoderConfig.from_hf({**hf_cfg, "head_dim": 8})
    with pytest.raises(models.ConfigError, match="qk_norm_width must be one of"):
        models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm_width="full")
    with pytest.raises(models.ConfigError, match="needs qk_norm=True"):
        models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm_width="projection")
    # Per-head norms or another head_dim are not OLMoE: to_hf refuses rather than mislabel.
    moe = models.MoESpec(num_experts=8, top_k=2, expert_ffn=32)
    for kw, what in [
        (dict(qk_norm=True), "attention.qk_norm_width='head'"),
        (dict(qk_norm=True, qk_norm_width="projection", head_dim=8), "attention.head_dim=8"),
    ]:
        attention = models.AttentionSpec(
            **{"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, **kw}
        )
        c = models.DecoderConfig("olmoe", 128, 64, 2, attention, moe)
        with pytest.raises(models.ConfigError, match=f"olmoe cannot express {what}"):
            c.to_hf()
