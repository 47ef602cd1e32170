"""jaxops.models against transformers' gpt-oss (``GptOssForCausalLM``), beyond the parity suite of
tests/test_models_families.py (sliding-window and full layers, attention sinks, biases, YaRN,
the clamped SwiGLU): left-padded batches through the sinks, and the config's defaults and
refusals. The MXFP4 checkpoints gpt-oss is published in are tested in
tests/test_models_mxfp4.py.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _hf_families import hf_config, published, random_tokens  # noqa: E402

from jaxops import models  # noqa: E402


def test_packed_and_padded_batches_match_transformers(hf_families):
    """Left padding (the sinks take a padded query's whole softmax: zeros, not NaN)."""
    run = hf_families.load("gpt_oss", "1dev")
    ids = random_tokens(2, seq=12, seed=4)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    got = jax.jit(run.model.logits)(run.params, ids, attention_mask=mask)
    with torch.no_grad():
        want = run.torch_model(
            torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)
        ).logits.numpy()
    real = mask.astype(bool)
    err = np.abs(np.asarray(got)[real] - want[real]).max() / np.abs(want[real]).max()
    assert np.isfinite(np.asarray(got)).all() and err <= 1e-4, err


def test_config_defaults_and_refusals():
    hf_cfg = hf_config("gpt_oss").to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    got = published("gpt_oss")  # gpt-oss-120b's shapes
    assert (got.moe.num_experts, got.moe.top_k, got.attention.head_dim, got.moe.expert_ffn) == (
        128,
        4,
        64,
        2880,
    )
    assert got.rope.kind == "yarn" and got.rope.factor == 32.0 and not got.rope.truncate
    assert got.pattern.layer_types[:2] == ("sliding_attention", "full_attention")
    with pytest.raises(models.ConfigError, match="'layer_types' must hold"):
        models.DecoderConfig.from_hf({**hf_cfg, "layer_types": ["full_attention"]})
    with pytest.raises(models.ConfigError, match="'layer_types' must hold"):
        models.DecoderConfig.from_hf({**hf_cfg, "layer_types": ["local"] * 4})
    with pytest.raises(models.ConfigError, match="swiglu_limit must be finite and > 0"):
        models.DecoderConfig.from_hf({**hf_cfg, "swiglu_limit": -1.0})
    from jaxops.models import _layers

    with pytest.raises(ValueError, match="different attention patterns"):  # needs the kind
        _layers.attention(_layers.Ops(np.float32), cfg, {}, None, None)
    with pytest.raises(models.ConfigError, match="cannot express"):
        no_sinks = dataclasses.replace(cfg.attention, attention_sinks=False)
        dataclasses.replace(cfg, attention=no_sinks).to_hf()
