"""jaxops.models against transformers' MiniMax-M2 (``MiniMaxM2ForCausalLM``), beyond the parity
suite of tests/test_models_families.py (partial RoPE by ``rotary_dim``, whole-projection q/k
norms, sigmoid routing with a correction bias): the config's defaults and refusals.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_families import hf_config, published

from jaxops import models


def test_config_defaults_and_refusals():
    hf_cfg = hf_config("minimax_m2").to_dict()
    got = published("minimax_m2")  # MiniMax-M2's shapes
    assert (got.moe.num_experts, got.moe.top_k, got.attention.head_dim, got.moe.expert_ffn) == (
        256,
        8,
        128,
        1536,
    )
    assert got.rope.theta == 5e6
    with pytest.raises(models.ConfigError, match=r"router_jitter_noise = 0\.1 is not supported"):
        models.DecoderConfig.from_hf({**hf_cfg, "router_jitter_noise": 0.1})
