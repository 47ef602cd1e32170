"""jaxops.models against transformers: tiny random Mixtral, Qwen3-MoE and Qwen2-MoE models made by
transformers in the test, loaded with from_pretrained on 1 and 8 CPU devices (data x expert and
pipe x expert meshes), trained, written back with save_pretrained and loaded by transformers;
DeepSeek-V3's and Qwen2-MoE's MoE blocks against transformers' modules.

Tolerance: float32 logits within 1e-4 of the logit scale (max |logit|); measured ~3e-7.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import COMMON, FAMILIES, MESHES, TOL  # noqa: E402
from _hf_families import hf_model as _hf_model  # noqa: E402
from _hf_families import max_rel_err as _max_rel_err  # noqa: E402
from jaxops.parallel import checkpoint  # noqa: E402
from jaxops.parallel import expert as ep  # noqa: E402

from jaxops import models  # noqa: E402


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """family -> a directory written by transformers' save_pretrained, sharded with an index."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        path = root / family
        _hf_model(family).save_pretrained(path, max_shard_size="200KB")
        assert (path / "model.safetensors.index.json").is_file()
        out[family] = path
    return out


def _mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _tokens(vocab: int, batch: int = 2, seq: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


def _hf_logits(path_or_model, tokens: np.ndarray) -> np.ndarray:
    model = path_or_model
    if not isinstance(model, torch.nn.Module):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path_or_model, dtype=torch.float32
        )
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


# -------------------------------------------------------------------------------------------------
# Logits equal transformers'.


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(hf_dirs, family, mesh_name):
    mesh = _mesh(mesh_name)
    model, params = models.from_pretrained(
        hf_dirs[family], mesh=mesh, dtype=jnp.float32, num_microbatches=2
    )
    assert model.config.model_type == family
    assert model.pipe == (2 if mesh_name == "p2e4" else 1)
    # The experts are sharded over the expert axis, the layers over the pipe axis.
    spec = params["layers"]["moe"]["w_in"].sharding.spec
    assert spec[:2] == (("pipe" if mesh_name == "p2e4" else None), "expert")
    tokens = _tokens(model.config.vocab_size, batch=2 if mesh_name == "1dev" else 16)
    got = jax.jit(model.logits)(params, model.place_batch(tokens))
    want = _hf_logits(hf_dirs[family], tokens)
    err = _max_rel_err(got, want)
    print(f"{family} {mesh_name}: max |logit error| / max |logit| = {err:.2e}")
    assert err <= TOL, err


def test_pipeline_loss_and_grads_equal_the_unpipelined_model(hf_dirs):
    """The 1F1B pipe x expert model and the data x expert model: same loss and gradients."""
    tokens = _tokens(128, batch=16, seq=12, seed=1)
    targets = np.roll(tokens, -1, axis=1)
    results = {}
    for mesh_name in ("d2e4", "p2e4"):
        model, params = models.from_pretrained(
            hf_dirs["qwen3_moe"],
            mesh=_mesh(mesh_name),
            num_microbatches=2,
            router_aux_loss_coef=0.0,
        )
        results[mesh_name] = jax.jit(model.loss_and_grads)(
            params, *model.place_batch(tokens, targets)
        )
    (l1, g1), (l2, g2) = results["d2e4"], results["p2e4"]
    np.testing.assert_allclose(l1, l2, rtol=2e-6)
    flat = jax.tree_util.tree_leaves_with_path(g1)
    for (path, a), b in zip(flat, jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
    # Tied embeddings: the gradient adds the input and the output uses.
    assert "lm_head" not in g2 and float(jnp.abs(g2["embed"]).max()) > 0


# -------------------------------------------------------------------------------------------------
# Round trip: HF -> train on 8 devices -> HF, loaded by transformers.


@pytest.mark.parametrize(
    "family,mesh_name",
    [("qwen3_moe", "d2e4"), ("mixtral", "p2e4")],
    ids=["qwen3-d2e4", "mixtral-p2e4"],
)
def test_finetune_and_save_round_trip(hf_dirs, tmp_path, family, mesh_name):
    model, params = models.from_pretrained(
        hf_dirs[family], mesh=_mesh(mesh_name), num_microbatches=2
    )
    opt = optax.adam(3e-3)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 16, (16, 12)).astype(np.int32)  # a small sub-vocabulary: learnable
    targets = (tokens + 1) % 16

    @jax.jit
    def step(params, state, tokens, targets):
        loss, grads = model.loss_and_grads(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    with jax.set_mesh(model.mesh):
        state = jax.jit(opt.init)(params)
        losses = []
        for _ in range(3):
            params, state, loss = step(params, state, *model.place_batch(tokens, targets))
            losses.append(float(loss))
    assert losses[2] < losses[1] < losses[0], losses
    out = tmp_path / "trained"
    names = models.save_pretrained(model, params, out, max_shard_size="200KB")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names or (
        "model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    )
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == family and saved["dtype"] == "float32"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] > 0
    probe = _tokens(128, batch=16, seed=9)
    want = _hf_logits(out, probe)
    got = jax.jit(model.logits)(params, model.place_batch(probe))
    err = _max_rel_err(got, want)
    print(f"{family} trained on {mesh_name}: losses {losses}, saved logit error {err:.2e}")
    assert err <= TOL, err
    # And back in: the written files load into the same parameters.
    _, again = models.from_pretrained(out, mesh=_mesh(mesh_name), num_microbatches=2)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_and_fp8_load_and_run(hf_dirs):
    tokens = _tokens(128, batch=16)
    want = _hf_logits(hf_dirs["qwen2_moe"], tokens)
    model, params = models.from_pretrained(
        hf_dirs["qwen2_moe"], mesh=_mesh("d2e4"), dtype="bfloat16"
    )
    assert params["layers"]["w_qkv"].dtype == jnp.bfloat16 and model.dtype == jnp.bfloat16
    got = jax.jit(model.logits)(params, model.place_batch(tokens))
    assert _max_rel_err(got, want) < 0.05
    model8, params8 = models.from_pretrained(hf_dirs["qwen2_moe"], mesh=_mesh("d2e4"), fp8="block")
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
    mesh = _mesh(mesh_name)
    data_axes = ("data",) if mesh_name == "d2e4" else ()
    cfg, params = models.load_moe_block(path, 1, mesh=mesh, data_axes=data_axes)
    assert (cfg.router, cfg.router_bias, cfg.n_group, cfg.topk_group) == ("sigmoid", True, *groups)
    assert cfg.shared_ffn == 64 and cfg.routed_scaling_factor == 2.5
    x = np.random.default_rng(3).normal(size=(16, 8, 64)).astype(np.float32)
    with torch.no_grad():
        want = model.model.layers[1].mlp(torch.tensor(x)).numpy()
    got, _ = jax.jit(lambda p, x: ep.moe_layer(p, x, cfg, mesh=mesh))(params, x)
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


def test_qwen2_moe_sparse_block_matches_transformers(hf_dirs):
    hf = _hf_model("qwen2_moe")
    block = hf.model.layers[0].mlp
    assert type(block).__name__ == "Qwen2MoeSparseMoeBlock"
    mesh = _mesh("d2e4")
    cfg, params = models.load_moe_block(hf_dirs["qwen2_moe"], 0, mesh=mesh, data_axes=("data",))
    assert cfg.shared_gate and cfg.shared_ffn == 48 and not cfg.normalize_topk
    x = np.random.default_rng(4).normal(size=(8, 6, 64)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.tensor(x)).numpy()
    got, _ = jax.jit(lambda p, x: ep.moe_layer(p, x, cfg, mesh=mesh))(params, x)
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
    model, params = models.from_pretrained(hf_dirs["mixtral"], mesh=_mesh("d2e4"))
    with pytest.raises(ValueError, match=r"batch \(3\) must be a multiple of 8"):
        model.logits(params, jnp.zeros((3, 4), jnp.int32))
    with pytest.raises(TypeError, match=r"tokens must have dtype int32, int64"):
        model.logits(params, jnp.zeros((8, 4), jnp.float32))
    _, path = _deepseek(tmp_path, 4, 2)
    with pytest.raises(ValueError, match=r"layer 0 of .* is a dense layer"):
        models.load_moe_block(path, 0)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        models.load_moe_block(path, 2)


def test_decoder_config_round_trips_through_hf_dict(hf_dirs):
    for family, path in hf_dirs.items():
        cfg = models.read_config(path)
        again = models.DecoderConfig.from_hf(cfg.to_hf())
        assert again == cfg, family
        hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf("bfloat16"))
        assert hf_cfg.model_type == family


def test_docstring_examples():
    from jaxops import testing

    assert testing.run_docstring_examples(models) >= 20


def test_absent_config_keys_take_transformers_defaults():
    """A config.json without the optional keys reads as transformers reads it (its defaults)."""
    optional = ("rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling")
    for family, (cfg_cls, _, extra) in FAMILIES.items():
        full = getattr(transformers, cfg_cls)(**COMMON, **extra).to_dict()
        bare = {k: v for k, v in full.items() if k not in optional}
        assert models.DecoderConfig.from_hf(bare) == models.DecoderConfig.from_hf(full), family
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
        models.is_moe_layer({"model_type": "qwen2_moe", "decoder_sparse_step": 0}, 1)
    # A config transformers would build as another model is not written.
    for family, kw, what in [
        ("qwen3_moe", {}, "qk_norm=False"),
        ("mixtral", {"normalize_topk": False}, "normalize_topk=False"),
        ("mixtral", {"shared_ffn": 32}, "shared_ffn=32"),
    ]:
        cfg = models.DecoderConfig(family, 128, 64, 2, 4, 2, 16, 8, 2, 32, **kw)
        with pytest.raises(models.ConfigError, match=f"{family} cannot express {what}"):
            cfg.to_hf()
    # A changed layer count drops the source's now stale layer_types.
    cfg = dataclasses.replace(models.read_config(hf_dirs["qwen2_moe"]), num_layers=4)
    assert len(cfg.to_hf().get("layer_types", [None] * 4)) == 4
