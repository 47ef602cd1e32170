"""jaxops.models against transformers' DeepSeek-V3 (``DeepseekV3ForCausalLM``, multi-head latent
attention) and GLM-4.5 (``Glm4MoeForCausalLM``) beyond the parity suite of
tests/test_models_families.py (MLA with a q LoRA, 4 expert groups, a dense layer ahead of the
MoE layers; GLM's partial RoPE, q/k norms and biases): DeepSeek-V3 without a q LoRA (rotate-half
RoPE, YaRN with mscale_all_dim), the MLA latent cache, multi-token-prediction tensors skipped,
Qwen's dense layers between MoE layers, FP8 block checkpoints, and the refused config keys.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import _hf_families as fam  # noqa: E402
from jaxops.parallel import checkpoint  # noqa: E402

from jaxops import models  # noqa: E402

# Moonlight / DeepSeek-V2-Lite style: no q LoRA, rotate-half pairs, YaRN with mscale_all_dim
# (the softmax-scale correction), no groups.
YARN = dict(
    n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=1.5, q_lora_rank=None,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=False,
    max_position_embeddings=64,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.8,
                         beta_fast=32.0, beta_slow=1.0),
)  # fmt: skip


def test_no_q_lora_yarn_logits_match_transformers(tmp_path):
    torch_model = fam.build("deepseek_v3", **YARN)
    torch_model.save_pretrained(tmp_path, max_shard_size="200KB")
    model, params = models.from_pretrained(tmp_path, mesh=fam.mesh("1dev"), dtype=jnp.float32)
    c = model.config
    assert c.pattern.dense_layers == (0,) and c.moe_layers == (1, 2) and c.pattern.dense_ffn == 96
    assert (c.moe.router, c.moe.router_bias, c.moe.shared_gate) == ("sigmoid", True, False)
    assert c.model_type == "deepseek_v3" and c.attention.mla is not None and not c.rope.interleave
    assert c.attention.mla.q_lora_rank is None and c.rope.kind == "yarn"
    fam.check_logits(
        model, params, torch_model, fam.random_tokens(2), "deepseek_v3 no q LoRA, YaRN"
    )


def test_mla_cache_holds_the_latent():
    from jaxops.models._mla import cache_bytes_per_token

    c = models.DecoderConfig.from_hf(fam.hf_config("deepseek_v3").to_dict())
    assert cache_bytes_per_token(c, 2) == (16 + 8) * 2  # kv_lora_rank + rope dims
    v3 = models.DecoderConfig.from_hf(transformers.DeepseekV3Config().to_dict())
    assert cache_bytes_per_token(v3, 2) == 576 * 2
    assert (
        v3.attention.q_size,
        v3.attention.qk_head_dim,
        v3.attention.v_head_dim,
        v3.moe.n_group,
    ) == (128 * 192, 192, 128, 8)


def test_a_partial_mtp_module_is_refused(hf_families, tmp_path):
    """A config announcing an MTP module whose files hold part of it: the missing-tensor error
    (the whole module, tests/test_models_mtp.py, loads; none at all loads without it)."""
    _, path = hf_families.hf("deepseek_v3")
    dst = shutil.copytree(path, tmp_path / "mtp")
    mtp = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(24, 64),
    }
    safetensors_torch.save_file(mtp, dst / "mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"lacks \d+ tensor\(s\).*model\.layers\.3\."
    ):
        models.from_pretrained(dst)


def test_qwen_dense_layers_between_moe_layers(tmp_path):
    """Qwen2-MoE's mlp_only_layers and decoder_sparse_step: dense layers anywhere (no pipe)."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=2,
        mlp_only_layers=[2],
    )  # fmt: skip
    torch_model = transformers.Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in torch_model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    torch_model.save_pretrained(tmp_path / "q")
    model, params = models.from_pretrained(tmp_path / "q", mesh=fam.mesh("d2e4"))
    # decoder_sparse_step 2: layers 1 and 3 MoE; mlp_only_layers takes 2 (already dense).
    assert model.config.pattern.dense_layers == (0, 2) and model.config.moe_layers == (1, 3)
    assert model.layout.runs == (
        ("dense_layers", 0, 1, 0), ("layers", 0, 1, 1), ("dense_layers", 1, 2, 2),
        ("layers", 1, 2, 3),
    )  # fmt: skip
    fam.check_logits(model, params, torch_model, fam.random_tokens(16), "qwen2_moe dense 0, 2")
    _, aux = jax.jit(model.forward)(params, model.place_batch(fam.random_tokens(16)))
    assert aux.tokens_per_expert.shape == (2, 8)  # the MoE layers only
    out = tmp_path / "back"
    models.save_pretrained(model, params, out)
    back = json.loads((out / "config.json").read_text())
    assert back["mlp_only_layers"] == [0, 2] and back["decoder_sparse_step"] == 1
    trained = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    fam.check_logits(model, params, trained, fam.random_tokens(16, seed=1), "qwen2_moe dense saved")
    with pytest.raises(models.ConfigError, match="dense layers must come first"):
        models.MoEDecoder(model.config, fam.mesh("p2e4"))


def test_config_defaults_and_refused_keys():
    yarn = models.DecoderConfig.from_hf(fam.hf_config("deepseek_v3", **YARN).to_dict())
    assert models.DecoderConfig.from_hf(yarn.to_hf()) == yarn
    # Absent keys take transformers' defaults (the published DeepSeek-V3 and GLM-4.5 shapes).
    # (GLM-4.5's config.json gives head_dim = 128; 4096 / 96 heads is no width.)
    v3 = fam.published("deepseek_v3", "num_experts_per_tok")
    m = v3.moe
    assert (m.num_experts, v3.pattern.dense_layers, m.shared_ffn, m.routed_scaling_factor) == (
        256, (0, 1, 2), 2048, 2.5)  # fmt: skip
    glm = fam.published("glm4_moe", "num_experts_per_tok", head_dim=128)
    assert glm.rope.partial_rotary_factor == 0.5 and glm.pattern.dense_layers == (0,)
    ds = fam.hf_config("deepseek_v3").to_dict()
    (bias,) = [r for r in models.name_map(v3) if r.ours == "layers/moe/router_bias"]
    assert bias.dtype == "float32" and bias.index == (("i", tuple(range(3, 61))),)
    with pytest.raises(models.ConfigError, match="attention_bias = true is not supported"):
        models.DecoderConfig.from_hf({**ds, "attention_bias": True})
    with pytest.raises(models.ConfigError, match="scoring_func = 'softmax' is not supported"):
        models.DecoderConfig.from_hf({**ds, "scoring_func": "softmax"})
    with pytest.raises(models.ConfigError, match=r"top_k = 6 exceeds"):
        models.DecoderConfig.from_hf({**ds, "num_experts_per_tok": 6})
    moe = models.MoESpec(num_experts=8, top_k=2, expert_ffn=32)
    attention = models.AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=8)
    with pytest.raises(models.ConfigError, match=r"mla .* is deepseek_v3's"):
        mla = dataclasses.replace(attention, mla=models.Mla(16, 8, 8, 8))
        models.DecoderConfig("mixtral", 128, 64, 2, mla, moe)
    with pytest.raises(models.ConfigError, match="dense_ffn must be an int >= 1"):
        models.LayerPattern(dense_layers=(0,))
    with pytest.raises(models.ConfigError, match="rope must rotate the whole head for mixtral"):
        models.DecoderConfig(
            "mixtral", 128, 64, 2, attention, moe, rope=models.Rope(partial_rotary_factor=0.5)
        )
    # Dense layers not first cannot be said as glm4_moe's first_k_dense_replace.
    glm_cfg = models.DecoderConfig.from_hf(fam.hf_config("glm4_moe").to_dict())
    pattern = dataclasses.replace(glm_cfg.pattern, dense_layers=(1,))
    moved = dataclasses.replace(glm_cfg, pattern=pattern)
    with pytest.raises(models.ConfigError, match="glm4_moe cannot express"):
        moved.to_hf()


# DeepSeek-V3's FP8 files: every linear weight of the decoder layers (MLA projections, the dense
# layers' MLP, routed and shared experts) as F8_E4M3 with 128 x 128 float32 scales.
DEEPSEEK_FP8 = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|"
    r"o_proj)|mlp\.((experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj))\.weight"
)


def test_fp8_deepseek_checkpoint_loads_and_saves(hf_families, tmp_path):
    import test_models_fp8_checkpoint as f8

    fp8, deq = f8.fp8_checkpoint(hf_families.hf("deepseek_v3")[1], tmp_path, quantized=DEEPSEEK_FP8)
    source = f8.read_dir(deq)
    quantized = {n for n in source if DEEPSEEK_FP8.fullmatch(n)}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in quantized
    assert (
        "model.layers.0.mlp.gate_proj.weight" in quantized and len(quantized) == 72
    )  # 3 x 5 MLA, 3 dense, 2 x 27 MoE
    _, got = models.from_pretrained(fp8)  # dequantized tensor by tensor
    _, want = models.from_pretrained(deq)
    f8._assert_same(got, want)
    # Written back as the same format: the same tensors quantized, the rest as they are.
    model, params = models.from_pretrained(deq, mesh=fam.mesh("d2e4"))
    out = tmp_path / "saved"
    names = models.save_pretrained(model, params, out, quantize="fp8-block")
    stored = f8.read_dir(out)
    assert set(stored) == set(names) == set(source) | {n + "_scale_inv" for n in quantized}
    assert {n for n, a in stored.items() if a.dtype == f8.E4M3} == quantized
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head", "mlp.gate"]
    reference = {
        n: f8.np_dequantize(a, stored[n + "_scale_inv"]) if a.dtype == f8.E4M3 else a
        for n, a in stored.items()
        if not n.endswith("_scale_inv")
    }
    ref = f8.write_dir(tmp_path / "ref", reference, {**config, "quantization_config": None})
    _, again = models.from_pretrained(out)
    f8._assert_same(again, models.from_pretrained(ref)[1])


def test_fp8_training_requantizes_fp8_files_exactly(hf_families, tmp_path):
    """fp8="block" on weights loaded from FP8 files (float32): the 128 x 128 quantization of the
    forward gives back the very FP8 values stored (no requantization error), for every weight
    whose blocks our layout keeps (unfused ones; fused q/k/v and gate/up keep them when the
    split sizes are multiples of 128, as in every published model)."""
    import ml_dtypes
    import test_models_fp8_checkpoint as f8

    import jaxops

    fp8, _ = f8.fp8_checkpoint(hf_families.hf("deepseek_v3")[1], tmp_path, quantized=DEEPSEEK_FP8)
    stored = f8.read_dir(fp8)
    _, params = models.from_pretrained(fp8, dtype=jnp.float32, fp8="block")
    checks = {  # our [K, N] weight -> their [N, K] tensor
        "model.layers.1.self_attn.kv_b_proj.weight": params["layers"]["w_kv_b"][0],
        "model.layers.2.self_attn.o_proj.weight": params["layers"]["w_o"][1],
        "model.layers.0.self_attn.q_a_proj.weight": params["dense_layers"]["w_q_a"][0],
        "model.layers.0.mlp.down_proj.weight": params["dense_layers"]["mlp"]["w_out"][0],
        "model.layers.2.mlp.experts.5.down_proj.weight": params["layers"]["moe"]["w_out"][1, 5],
    }
    for name, w in checks.items():
        # What jaxops.fp8.linear does to a weight: 128 x 128 tiles with the transposed copy.
        _, q_t = jaxops.fp8.quantize(
            w, block=(128, 128), transpose=True, amax_floor=1e-4, impl="xla"
        )
        data = np.asarray(q_t.data).view(np.uint8)
        assert np.array_equal(data, stored[name].view(ml_dtypes.float8_e4m3fn).view(np.uint8)), name
        np.testing.assert_allclose(
            np.asarray(q_t.scale).reshape(stored[name + "_scale_inv"].shape),
            stored[name + "_scale_inv"],
            rtol=2e-7,
            err_msg=name,
        )
