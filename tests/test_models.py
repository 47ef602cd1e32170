"""jaxops.models beyond the float32 parity suite every family runs (tests/test_models_families.py):
the session's tiny random Mixtral, Qwen3-MoE and Qwen2-MoE (tests/_hf_families.TABLE) in
bfloat16 and FP8, DeepSeek-V3's and Qwen2-MoE's MoE blocks against transformers' modules
(within 1e-4 of the output scale), the errors bad configs, files and layouts raise, and the
config's defaults and refusals.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import FAMILIES, TOL, hf_model, mesh  # noqa: E402
from _hf_families import max_rel_err as _max_rel_err  # noqa: E402
from jaxops.parallel import checkpoint  # noqa: E402
from jaxops.parallel import expert as ep  # noqa: E402

from jaxops import models  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(hf_families):
    """family -> the directory transformers' save_pretrained wrote (sharded, with an index) of the
    session's model of the family (tests/_hf_families.TABLE)."""
    return {family: hf_families.hf(family)[1] for family in FAMILIES}


def _tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


# -------------------------------------------------------------------------------------------------
# Other dtypes (float32 parity of every family: tests/test_models_families.py).


def test_bfloat16_and_fp8_load_and_run(tmp_path):
    torch_model = hf_model("qwen2_moe")  # its layers' weights as initialized: bfloat16's bar
    torch_model.save_pretrained(tmp_path)
    tokens = _tokens(128, batch=16)
    with torch.no_grad():
        want = torch_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    model, params = models.from_pretrained(tmp_path, mesh=mesh("d2e4"), dtype="bfloat16")
    assert params["layers"]["w_qkv"].dtype == jnp.bfloat16 and model.dtype == jnp.bfloat16
    got = jax.jit(model.logits)(params, model.place_batch(tokens))
    assert _max_rel_err(got, want) < 0.05
    model8, params8 = models.from_pretrained(tmp_path, mesh=mesh("d2e4"), fp8="block")
    got8 = jax.jit(model8.logits)(params8, model8.place_batch(tokens))
    assert 1e-4 < _max_rel_err(got8, want) < 0.1  # quantized, and close


# -------------------------------------------------------------------------------------------------
# MoE blocks: DeepSeek-V3 and Qwen2-MoE against transformers' modules.


def _deepseek(tmp_path, n_group, topk_group, seed=0):
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=16, n_group=n_group, topk_group=topk_group, num_experts_per_tok=4,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    block = model.model.layers[1].mlp
    with torch.no_grad():  # a trained-looking router: larger logits and a nonzero bias
        block.gate.weight.normal_(0, 0.3)
        block.gate.e_score_correction_bias.copy_(torch.randn(16) * 0.05)
    path = tmp_path / f"ds{n_group}{topk_group}"
    model.save_pretrained(path, max_shard_size="100KB")
    return model, path


@pytest.mark.parametrize(
    "groups", [(4, 2), (8, 3), (1, 1)], ids=["4g-keep2", "8g-keep3", "nogroups"]
)
@pytest.mark.parametrize("mesh_name", ["1dev", "d2e4"])
def test_deepseek_v3_moe_block_matches_transformers(tmp_path, groups, mesh_name):
    model, path = _deepseek(tmp_path, *groups)
    where = mesh(mesh_name)
    data_axes = ("data",) if mesh_name == "d2e4" else ()
    cfg, params = models.load_moe_block(path, 1, mesh=where, data_axes=data_axes)
    assert (cfg.router, cfg.router_bias, cfg.n_group, cfg.topk_group) == ("sigmoid", True, *groups)
    assert cfg.shared_ffn == 64 and cfg.routed_scaling_factor == 2.5
    x = np.random.default_rng(3).normal(size=(16, 8, 64)).astype(np.float32)
    with torch.no_grad():
        want = model.model.layers[1].mlp(torch.tensor(x)).numpy()
    got, _ = jax.jit(lambda p, x: ep.moe_layer(p, x, cfg, mesh=where))(params, x)
    err = _max_rel_err(got, want)
    print(f"DeepSeek-V3 block {groups} {mesh_name}: {err:.2e}")
    assert err <= TOL, err
    ref, _ = ep.moe_layer_reference(jax.device_get(params), x, cfg)
    assert _max_rel_err(ref, want) <= TOL
    if groups[0] > 1:  # the groups decided: without the limit other experts would be chosen
        free = ep.MoEConfig(**{**_fields(cfg), "n_group": 1, "topk_group": 1})
        tokens = jnp.asarray(x.reshape(-1, 64))
        ids = ep._router(cfg, tokens, params["router"], params["router_bias"])[2]
        ids_free = ep._router(free, tokens, params["router"], params["router_bias"])[2]
        differ = np.any(np.sort(ids, -1) != np.sort(ids_free, -1), axis=-1).mean()
        assert differ > 0.1, differ
    # The bias moved the choice: without it the routing differs.
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
        unbiased = model.model.layers[1].mlp(torch.tensor(x)).numpy()
    assert _max_rel_err(unbiased, want) > 1e-3


def _fields(cfg):
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_qwen2_moe_sparse_block_matches_transformers(hf_families):
    hf, path = hf_families.hf("qwen2_moe")
    block = hf.model.layers[0].mlp
    assert type(block).__name__ == "Qwen2MoeSparseMoeBlock"
    where = mesh("d2e4")
    cfg, params = models.load_moe_block(path, 0, mesh=where, data_axes=("data",))
    assert cfg.shared_gate and cfg.shared_ffn == 48 and not cfg.normalize_topk
    x = np.random.default_rng(4).normal(size=(8, 6, 64)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.tensor(x)).numpy()
    got, _ = jax.jit(lambda p, x: ep.moe_layer(p, x, cfg, mesh=where))(params, x)
    assert _max_rel_err(got, want) <= TOL


# -------------------------------------------------------------------------------------------------
# Bad input.


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(model_type="llama"), r"model_type 'llama' is not supported; supported: mixtral"),
        (dict(hidden_size=None), r"missing 'hidden_size'"),
        (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported"),
        (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0}), r"'longrope'"),
        (dict(mlp_only_layers=[0, 1]), r"dense_layers \(0, 1\) leave no MoE layer"),
        (dict(num_attention_heads="4"), r"'num_attention_heads' must be int"),
        (
            dict(quantization_config={"quant_method": "gptq", "bits": 4}),
            r"quantization_config.quant_method 'gptq' is not supported; supported: 'fp8'",
        ),
        (dict(rope_parameters=None, rope_scaling="linear"), r"'rope_scaling' must be an object"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}),
            r"rope_parameters.rope_theta must be a finite positive number, got 0.0",
        ),
        (dict(decoder_sparse_step=0), r"decoder_sparse_step"),
    ],
    ids=[
        "model_type",
        "missing-key",
        "activation",
        "rope",
        "dense-layers",
        "type",
        "quantized",
        "rope-scaling-str",
        "rope-theta",
        "sparse-step",
    ],
)
def test_bad_config_names_the_key(hf_dirs, tmp_path, changes, match):
    path = _copy(hf_dirs["qwen3_moe"], tmp_path / "m")
    _edit_config(path, **changes)
    with pytest.raises(models.ConfigError, match=match):
        models.from_pretrained(path)


def test_missing_and_extra_tensors_name_them(hf_dirs, tmp_path):
    # More experts in the files than in config.json.
    path = _copy(hf_dirs["mixtral"], tmp_path / "fewer")
    _edit_config(path, num_local_experts=4)
    with pytest.raises(checkpoint.CheckpointError, match=r"does not account for.*experts\.[4-7]"):
        models.from_pretrained(path)
    # Fewer experts in the files than in config.json.
    path = _copy(hf_dirs["mixtral"], tmp_path / "more")
    _edit_config(path, num_local_experts=16)
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks .*experts\.(8|9|1[0-5])"):
        models.from_pretrained(path)
    # A tensor missing from the files (dropped from the index).
    path = _copy(hf_dirs["qwen3_moe"], tmp_path / "missing")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(checkpoint.CheckpointError, match=r"k_norm\.weight"):
        models.from_pretrained(path)
    with pytest.raises(models.ConfigError, match=r"no config\.json"):
        models.from_pretrained(tmp_path)


def test_bad_layout_and_block_layer(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"num_experts = 8 must be divisible by the size 3"):
        models.from_pretrained(
            hf_dirs["mixtral"], mesh=jax.make_mesh((3,), ("expert",), devices=jax.devices()[:3])
        )
    with pytest.raises(ValueError, match=r"the mesh has no axis 'expert'"):
        models.from_pretrained(
            hf_dirs["mixtral"], mesh=jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        )
    model, params = models.from_pretrained(hf_dirs["mixtral"], mesh=mesh("d2e4"))
    with pytest.raises(ValueError, match=r"batch \(3\) must be a multiple of 8"):
        model.logits(params, jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(TypeError, match=r"tokens must have dtype int32, int64"):
        model.logits(params, jnp.zeros((8, 4), jnp.float32))
    _, path = _deepseek(tmp_path, 4, 2)
    with pytest.raises(ValueError, match=r"layer 0 of .* is a dense layer"):
        models.load_moe_block(path, 0)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        models.load_moe_block(path, 2)


def test_docstring_examples():
    from jaxops import testing

    assert testing.run_docstring_examples(models) >= 20


def test_config_is_composed_of_specs_and_the_flat_fields_are_deprecated():
    """DecoderConfig: sizes and specs (no more than 20 fields in any); the MoE layer takes the
    config's MoE spec as it is; the former flat keywords, positional order and attributes work,
    each with a DeprecationWarning, and build the same config (with the former defaults)."""
    attention = models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    moe = models.MoESpec(num_experts=8, top_k=2, expert_ffn=32, router_aux_loss_coef=1e-3)
    cfg = models.DecoderConfig("qwen3_moe", 128, 64, 2, attention, moe)
    for value in (cfg, attention, moe, cfg.pattern, cfg.rope, ep.MoEConfig(moe, 64)):
        assert len(dataclasses.fields(value)) <= 20, type(value).__name__
    model = models.MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
    assert model.moe.spec is cfg.moe and model.moe.hidden_size == 64
    weighed = models.MoEDecoder(cfg, model.mesh, router_aux_loss_coef=0.5).moe.spec
    assert weighed == dataclasses.replace(moe, router_aux_loss_coef=0.5)

    moved = "the flat keywords .* moved into the specs"
    with pytest.warns(DeprecationWarning, match=moved):
        assert (
            models.DecoderConfig("qwen3_moe", 128, 64, 2, 4, 2, 16, 8, 2, 32, qk_norm=True) == cfg
        )
    flat = dict(num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, expert_ffn=32)
    with pytest.warns(DeprecationWarning, match=moved):
        assert models.DecoderConfig("qwen3_moe", 128, 64, 2, qk_norm=True, **flat) == cfg
    with pytest.warns(DeprecationWarning, match=r"DecoderConfig\.num_heads moved to attention\."):
        assert cfg.num_heads == 4
    with pytest.warns(DeprecationWarning, match=r"DecoderConfig\.q_size moved to attention\."):
        assert cfg.q_size == 64
    with pytest.warns(DeprecationWarning, match=moved):  # dataclasses.replace with a flat name
        wider = dataclasses.replace(cfg, top_k=4)
    assert wider.moe == dataclasses.replace(moe, top_k=4) and wider.attention is attention
    with pytest.warns(DeprecationWarning, match=moved):  # the former default: a gated shared expert
        qwen2 = models.DecoderConfig("qwen2_moe", 128, 64, 2, shared_ffn=48, qkv_bias=True, **flat)
    assert qwen2.moe.shared_gate and qwen2.moe.router_aux_loss_coef == 1e-3
    with pytest.raises(TypeError, match="DecoderConfig: attention must be a AttentionSpec"):
        models.DecoderConfig("qwen3_moe", 128, 64, 2, moe, attention)


def test_absent_moe_block_keys_take_transformers_defaults():
    """A config.json without DeepSeek-V3's optional MoE keys reads as transformers reads it (the
    decoder's optional keys: tests/test_models_families.py)."""
    full = transformers.DeepseekV3Config(hidden_size=64, moe_intermediate_size=32).to_dict()
    keys = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "n_shared_experts")
    bare = {k: v for k, v in full.items() if k not in keys}
    assert models.moe_block_config(bare) == models.moe_block_config(full)
    assert [models.is_moe_layer(bare, i) for i in range(4)] == [False] * 3 + [True]


def test_quantized_block_and_inexpressible_configs_are_refused(hf_dirs, tmp_path):
    # from_pretrained reads FP8 checkpoints (tests/test_models_fp8_checkpoint.py); the MoE block
    # loader would read their float8 bits without the scales: refused, saying so; and every
    # other quantization by name.
    path = _copy(hf_dirs["qwen2_moe"], tmp_path / "q")
    _edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(models.ConfigError, match="load_moe_block reads unquantized weights only"):
        models.load_moe_block(path, 0)
    _edit_config(path, quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(models.ConfigError, match="quant_method 'awq' is not supported"):
        models.load_moe_block(path, 0)
    with pytest.raises(models.ConfigError, match=r"sparse_step' must be >= 1, got 0"):
        qwen2 = {"num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
        models.is_moe_layer({"model_type": "qwen2_moe", "decoder_sparse_step": 0, **qwen2}, 1)
    # A config transformers would build as another model is not written.
    attention = models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    for family, kw, what in [
        ("qwen3_moe", {}, "attention.qk_norm=False"),
        ("mixtral", {"normalize_topk": False}, "moe.normalize_topk=False"),
        ("mixtral", {"shared_ffn": 32}, "moe.shared_ffn=32"),
    ]:
        moe = models.MoESpec(num_experts=8, top_k=2, expert_ffn=32, **kw)
        cfg = models.DecoderConfig(family, 128, 64, 2, attention, moe)
        with pytest.raises(models.ConfigError, match=f"{family} cannot express {what}"):
            cfg.to_hf()
    # A changed layer count drops the source's now stale layer_types.
    cfg = dataclasses.replace(models.read_config(hf_dirs["qwen2_moe"]), num_layers=4)
    assert len(cfg.to_hf().get("layer_types", [None] * 4)) == 4
