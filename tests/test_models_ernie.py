"""jaxops.models against transformers' ERNIE-4.5-MoE (``Ernie4_5_MoeForCausalLM``), beyond the
parity suite of tests/test_models_families.py (MoE layers by ``moe_layer_start_index`` /
``moe_layer_interval``, interleaved RoPE pairs, shared experts, tied embeddings, the router's
``moe_statics.e_score_correction_bias``): the config's defaults and refused keys.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_families import hf_config, published

from jaxops import models


def test_config_defaults_and_refused_keys():
    hf_cfg = hf_config("ernie4_5_moe").to_dict()
    cfg = models.DecoderConfig.from_hf(hf_cfg)
    got = published("ernie4_5_moe")  # ERNIE-4.5-21B-A3B's shapes
    assert (got.moe.num_experts, got.moe.top_k, got.pattern.dense_layers, got.rope.theta) == (
        64,
        6,
        (0,),
        5e5,
    )
    with pytest.raises(models.ConfigError, match="use_bias = true is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "use_bias": True})
    with pytest.raises(models.ConfigError, match=r"moe_norm_min = 0\.5 is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "moe_norm_min": 0.5})
    with pytest.raises(models.ConfigError, match="ernie4_5_moe rotates interleaved pairs"):
        models.DecoderConfig(**{**cfg.__dict__, "rope": models.Rope(theta=5e5)})
