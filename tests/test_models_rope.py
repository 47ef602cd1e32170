"""Rotary embedding variants (jaxops.models._rope) against transformers, the specification.

Frequencies and attention scaling of every kind against transformers' RotaryEmbedding modules
(float32, within 1e-6 relative: transformers' torch pow and ours differ by at most an ulp);
rotate-half, partial (GLM-4-MoE) and interleaved (DeepSeek-V3) rotation against transformers'
``apply_rotary_pos_emb`` functions; a tiny Qwen3-MoE with scaled RoPE, loaded with
``from_pretrained``, against transformers' logits on a sequence three times the original length;
config.json errors and the round trip through ``to_hf``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import COMMON, FAMILIES, TOL, hf_model, max_rel_err  # noqa: E402
from jaxops.models._rope import (  # noqa: E402
    Rope,
    apply_rotary,
    inv_freq_and_scale,
    read_rope,
    rope_to_hf,
    rotary_dim,
    softmax_scale_factor,
)
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402
from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen  # noqa: E402

from jaxops import models  # noqa: E402

SEQ = 24  # three times the original length 8 of the scaled variants

VARIANTS = {
    # id: (rope_parameters, max_position_embeddings)
    "default": ({"rope_type": "default", "rope_theta": 1e6}, 32),
    "linear": ({"rope_type": "linear", "factor": 2.5}, 32),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, 8),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, 32),
    "yarn-mscale": (
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 8,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 16,
            "beta_slow": 2,
        },
        320,
    ),
    "yarn-no-truncate": (
        {
            "rope_type": "yarn",
            "factor": 3.0,
            "original_max_position_embeddings": 8,
            "truncate": False,
        },
        24,
    ),
    "yarn-attention-factor": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "attention_factor": 1.3,
        },
        32,
    ),
    "yarn-null-factor": (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8},
        40,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 5e5,
        },
        256,
    ),
}


def _qwen_config(params: dict, max_positions: int, head_dim: int = 32):
    return transformers.Qwen3MoeConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters=dict(params),
        max_position_embeddings=max_positions,
    )


def _positions(seq: int, batch: int = 2) -> np.ndarray:
    pos = np.tile(np.arange(seq), (batch, 1))
    pos[1:] += 3  # another offset in the other rows
    return pos.astype(np.int32)


def _our_cos_sin(rope: Rope, dim: int, positions: np.ndarray):
    inv_freq, scale = inv_freq_and_scale(rope, dim, jnp.asarray(positions))
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([angles, angles], -1)
    return np.asarray(jnp.cos(emb) * scale), np.asarray(jnp.sin(emb) * scale)


# -------------------------------------------------------------------------------------------------
# Frequencies and attention scaling


@pytest.mark.parametrize("seq", [SEQ, 6], ids=["long", "short"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cos_sin_equal_transformers_rotary_embedding(variant, seq):
    params, max_positions = VARIANTS[variant]
    config = _qwen_config(params, max_positions)
    rope = read_rope(config.to_dict(), 32)
    assert rope.kind == params["rope_type"]
    module = hf_qwen.Qwen3MoeRotaryEmbedding(config)
    if params["rope_type"] != "default":  # the init function alone (dynamic: at its own length)
        init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]]
        want_inv, want_scale = init(config, "cpu")
        got_inv, got_scale = inv_freq_and_scale(rope, 32)
        np.testing.assert_allclose(np.asarray(got_inv), want_inv.numpy(), rtol=1e-6, atol=0)
        assert math.isclose(got_scale, want_scale, rel_tol=1e-12), (got_scale, want_scale)
    positions = _positions(seq)
    with torch.no_grad():
        cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.tensor(positions))
    got_cos, got_sin = _our_cos_sin(rope, 32, positions)
    np.testing.assert_allclose(got_cos, cos.numpy(), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(got_sin, sin.numpy(), rtol=1e-5, atol=2e-6)


def test_dynamic_grows_only_past_max_position_embeddings():
    rope = Rope("dynamic", 1e4, factor=3.0, max_position_embeddings=8)
    base = np.asarray(inv_freq_and_scale(Rope(theta=1e4), 32)[0])
    for seq, grown in [(8, False), (9, True), (SEQ, True)]:
        got = jax.jit(lambda p: inv_freq_and_scale(rope, 32, p)[0])(jnp.asarray(_positions(seq, 1)))
        assert np.array_equal(np.asarray(got), base) != grown, seq
        if grown:
            assert np.all(np.asarray(got)[1:] < base[1:])  # the base grew: lower frequencies


def test_softmax_scale_factor_equals_deepseek_v3_attention_scaling():
    for params in [
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 0.707},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "default"},
    ]:  # fmt: skip
        config = transformers.DeepseekV3Config(
            hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rope_parameters=dict(params),
            max_position_embeddings=2560,
        )  # fmt: skip
        attention = hf_deepseek.DeepseekV3Attention(config, 0)
        rope = read_rope(config.to_dict(), config.qk_rope_head_dim, interleave=True)
        want = attention.scaling
        assert math.isclose(config.qk_head_dim**-0.5 * softmax_scale_factor(rope), want), params


# -------------------------------------------------------------------------------------------------
# The rotation


def _torch(x):
    return torch.tensor(np.asarray(x, np.float32)).to(
        torch.bfloat16 if x.dtype == jnp.bfloat16 else torch.float32
    )


def _check_rotation(rope, module, apply, head_dim, dtype, seq=SEQ):
    """Our q and k rotation against transformers' `apply(q, k, cos, sin, ...)` ([b, s, h, d])."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, seq, 4, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((2, seq, 2, head_dim)), dtype)
    positions = _positions(seq)
    with torch.no_grad():
        cos, sin = module(_torch(q), torch.tensor(positions))
        want_q, want_k = apply(_torch(q), _torch(k), cos, sin, unsqueeze_dim=2)
    tol = 1e-6 if dtype == jnp.float32 else 4e-3  # measured: ~1e-7 and 0 (bf16 bit-equal)
    for x, want in ((q, want_q), (k, want_k)):
        got = jax.jit(apply_rotary, static_argnums=1)(x, rope, jnp.asarray(positions))
        assert got.dtype == dtype
        assert max_rel_err(got.astype(jnp.float32), want.float().numpy()) <= tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", ["default", "yarn-mscale", "dynamic", "llama3"])
def test_rotate_half_equals_apply_rotary_pos_emb(variant, dtype):
    params, max_positions = VARIANTS[variant]
    config = _qwen_config(params, max_positions)
    module = hf_qwen.Qwen3MoeRotaryEmbedding(config)
    rope = read_rope(config.to_dict(), 32)
    _check_rotation(rope, module, hf_qwen.apply_rotary_pos_emb, 32, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", ["default", "yarn"])
def test_partial_rotary_equals_glm4_moe(variant, dtype):
    params, max_positions = VARIANTS[variant]
    config = transformers.Glm4MoeConfig(  # partial_rotary_factor 0.5 by default
        hidden_size=64, num_attention_heads=4, head_dim=32, rope_parameters=dict(params),
        max_position_embeddings=max_positions,
    )  # fmt: skip
    rope = read_rope(config.to_dict(), 32)
    assert rope.partial_rotary_factor == 0.5 and rotary_dim(rope, 32) == 16
    module = hf_glm.Glm4MoeRotaryEmbedding(config)
    _check_rotation(rope, module, hf_glm.apply_rotary_pos_emb, 32, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("variant", ["default", "yarn-mscale"])
def test_interleaved_equals_deepseek_v3(variant, dtype):
    params, max_positions = VARIANTS[variant]
    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=16, rope_parameters=dict(params),
        max_position_embeddings=max_positions,
    )  # fmt: skip
    assert config.rope_interleave
    rope = read_rope(config.to_dict(), 16, interleave=config.rope_interleave)
    module = hf_deepseek.DeepseekV3RotaryEmbedding(config)
    _check_rotation(rope, module, hf_deepseek.apply_rotary_pos_emb_interleave, 16, dtype)


def test_interleaved_rotation_rotates_adjacent_pairs():
    """Interleaved: dims (2i, 2i+1) turn together; de-interleaved, it is the rotate-half one."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 5, 1, 8)), jnp.float32)
    order = np.r_[0:8:2, 1:8:2]
    got = apply_rotary(x, Rope(interleave=True))
    want = apply_rotary(x[..., order], Rope())
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# -------------------------------------------------------------------------------------------------
# End to end: Qwen3-MoE with scaled RoPE


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rope") / "qwen3_moe"
    hf_model("qwen3_moe").save_pretrained(path)
    return path


@pytest.mark.parametrize("variant", ["yarn", "yarn-mscale", "llama3", "dynamic", "linear"])
def test_scaled_rope_logits_match_transformers(qwen_dir, tmp_path, variant):
    params, max_positions = VARIANTS[variant]
    params = dict(params, original_max_position_embeddings=8) if variant == "llama3" else params
    config = json.loads((qwen_dir / "config.json").read_text())
    config.update(rope_parameters=params, max_position_embeddings=max_positions)
    for f in qwen_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))

    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    model, weights = models.from_pretrained(tmp_path, mesh=mesh, dtype=jnp.float32)
    assert model.config.rope.kind == params["rope_type"]
    tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], (2, SEQ), np.int32)
    got = jax.jit(model.logits)(weights, model.place_batch(tokens))
    want = _hf_logits(tmp_path, tokens)
    assert max_rel_err(got, want) <= TOL
    # The scaling is in effect: transformers' logits with the default RoPE are others.
    assert max_rel_err(_hf_logits(qwen_dir, tokens), want) > 10 * TOL


def _hf_logits(path, tokens):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


# -------------------------------------------------------------------------------------------------
# config.json


def test_old_rope_scaling_reads_as_transformers():
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, **old)
    new = read_rope(config.to_dict(), 16)
    assert read_rope(old, 16, default_max_positions=32768) == new
    assert new == Rope("yarn", 5e5, factor=4.0, original_max_position_embeddings=32768)
    # rope_scaling wins over rope_parameters; top-level keys fill what rope_parameters lacks.
    both = {"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "linear",
            "factor": 2}, "rope_theta": 7.0, "partial_rotary_factor": 0.5}  # fmt: skip
    assert read_rope(both, 16) == Rope("linear", 7.0, factor=2.0, partial_rotary_factor=0.5)
    assert read_rope({}, 16, 1e6) == Rope(theta=1e6)
    # A null key is transformers' default, even one the kind does not read.
    nulls = {"rope_type": "linear", "factor": 2.0, "mscale": None, "rope_theta": None}
    assert read_rope({"rope_parameters": nulls}, 16) == Rope("linear", factor=2.0)


BAD = [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
     r"^config\.json: rope_parameters\.rope_type = 'longrope' is not supported; supported: "
     r"'default', 'linear', 'dynamic', 'yarn', 'llama3'$"),
    ({"rope_scaling": {"type": "ntk", "factor": 2.0}}, r"rope_scaling\.type = 'ntk' is not"),
    ({"rope_parameters": {"rope_type": "proportional"}}, r"'proportional' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 4]}},
     r"rope_parameters\.mrope_section = \[2, 2, 4\] is not supported for rope_type 'default'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 4}},
     r"rope_parameters\.beta_fast = 4 is not supported for rope_type 'linear' "
     r"\(it reads: rope_theta, partial_rotary_factor, factor\)"),
    ({"rope_parameters": {"rope_type": "linear"}},
     r"rope_parameters\.factor is missing \(rope_type 'linear' needs it\)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2.0}},
     r"rope_parameters\.factor must be a finite positive number, got -2\.0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2"}},
     r"rope_parameters\.factor must be a finite positive number, got '2'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     r"config\.json: max_position_embeddings is missing"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"},
      "max_position_embeddings": 64},
     r"rope_parameters\.truncate must be a bool, got 'no'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                          "original_max_position_embeddings": 0.5}},
     r"rope_parameters\.original_max_position_embeddings must be an int >= 1, got 0\.5"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 64}},
     r"rope_parameters\.high_freq_factor must be a number > low_freq_factor \(4\.0\), got 1\.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     r"rope_parameters\.rope_theta must be a finite positive number, got inf"),
    ({"rope_theta": 0}, r"^config\.json: rope_theta must be a finite positive number, got 0$"),
    ({"partial_rotary_factor": 1.5}, r"^config\.json: partial_rotary_factor must be a number in"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.2}},
     r"rope_parameters\.partial_rotary_factor: .*rotates 3 dims; RoPE 'default' needs an even"),
    ({"rope_parameters": [1]}, r"'rope_parameters' must be an object, got \[1\]"),
    ({"rope_scaling": "linear"}, r"'rope_scaling' must be an object, got 'linear'"),
]  # fmt: skip


@pytest.mark.parametrize("hf,match", BAD)
def test_read_rope_names_the_key(hf, match):
    with pytest.raises(models.ConfigError, match=match):
        read_rope(hf, 16)


def test_rope_refuses_bad_fields():
    with pytest.raises(models.ConfigError, match=r"^jaxops\.models\.Rope: kind = 'ntk' is not"):
        Rope("ntk")
    with pytest.raises(ValueError, match=r"^jaxops\.models\.Rope: factor = 2\.0 is not used by"):
        Rope(factor=2.0)
    with pytest.raises(ValueError, match=r"^jaxops\.models\.Rope: interleave must be a bool"):
        Rope(interleave=1)
    with pytest.raises(ValueError, match=r"max_position_embeddings is missing"):
        Rope("dynamic", factor=2.0)
    with pytest.raises(ValueError, match=r"head_dim 8 with partial_rotary_factor 0.25 rotates 2"):
        rotary_dim(
            Rope("dynamic", factor=2.0, max_position_embeddings=4, partial_rotary_factor=0.25), 8
        )
    assert hash(Rope("linear", factor=2)) == hash(Rope("linear", factor=2.0))


def test_decoder_config_rope_and_rope_theta():
    hf = dict(model_type="qwen3_moe", **COMMON, **FAMILIES["qwen3_moe"][2])
    hf["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(models.ConfigError, match=r"'longrope'"):
        models.DecoderConfig.from_hf(hf)
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}
    with pytest.raises(models.ConfigError, match=r"partial_rotary_factor = 0.5 is not supported"):
        models.DecoderConfig.from_hf(hf)
    # Every kind round-trips through to_hf, and transformers reads the same RoPE.
    for variant, (params, max_positions) in VARIANTS.items():
        hf["rope_parameters"], hf["max_position_embeddings"] = dict(params), max_positions
        cfg = models.DecoderConfig.from_hf(hf)
        out = cfg.to_hf()
        assert models.DecoderConfig.from_hf(out) == cfg, variant
        assert out["rope_parameters"] == rope_to_hf(cfg.rope)["rope_parameters"]
        assert read_rope(transformers.Qwen3MoeConfig(**out).to_dict(), 16) == cfg.rope, variant
    # rope_theta: a keyword (sets the base of rope), a positional number, and a property.
    attention = models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    args = ("qwen3_moe", 128, 64, 2, attention, models.MoESpec(8, 2, 32))
    cfg = models.DecoderConfig(*args, rope_theta=1e6)
    assert cfg.rope == Rope(theta=1e6) and cfg.rope_theta == 1e6
    assert models.DecoderConfig(*args, 1e6) == cfg
    yarn = Rope("yarn", 1e4, factor=4.0, original_max_position_embeddings=8)
    scaled = dataclasses.replace(cfg, rope=yarn)
    assert scaled.rope == yarn and scaled.rope_theta == 1e4
    assert dataclasses.replace(scaled, rope_theta=5.0).rope == dataclasses.replace(yarn, theta=5.0)
    with pytest.raises(models.ConfigError, match=r"rope must use the rotate-half layout for qwen3"):
        dataclasses.replace(cfg, rope=Rope(interleave=True))
    with pytest.raises(models.ConfigError, match=r"rope must rotate the whole head for qwen3_moe"):
        dataclasses.replace(cfg, rope=Rope(partial_rotary_factor=0.5))
