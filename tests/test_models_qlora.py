"""A frozen base kept as shipped (MoEDecoder(base="fp8")): the decoder layers' linear weights as
float8 bytes and float32 block scales on the device, dequantized one layer at a time.

The oracle is the dequantizing loader nobody changed here (base=None reads a block-FP8
checkpoint as float32(fp8) * scale per block): a checkpoint written with the safetensors library
in the published format (weight_block_size 32 x 32, so fused q/k/v, gate/up, RoPE's row
permutation and partial blocks all cross blocks), loaded both ways, gives bit-identical weights
and the same logits; quantizing an unquantized checkpoint at load gives the same bytes as the
published file. LoRA on the FP8 base trains the adapters alone (no base-weight gradient in the
program), and no float copy of the base outlives its layer (the compiled step's temporaries).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

import _hf_families as fam  # noqa: E402
from jaxops.models import _base  # noqa: E402
from jaxops.models._quant import Fp8Block, quantize_blocks  # noqa: E402
from jaxops.parallel.checkpoint import CheckpointError  # noqa: E402

from jaxops import ConfigError, Lora, models  # noqa: E402

# The published FP8 checkpoints' quantized tensors: every linear projection of the layers (not
# the router "mlp.gate", embeddings or lm_head).
_LINEAR = re.compile(r".*\.(q|k|v|o|q_a|q_b|kv_a|kv_b|gate|up|down)_proj(_with_mqa)?\.weight$")
_BLOCK = (32, 32)


def _rewritten(src, dst, convert, quantization_config):
    """`src` (an unquantized directory) rewritten into `dst` with the safetensors library: each
    tensor through ``convert(name, value) -> {name: array}``, config.json with the given
    ``quantization_config``."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, value in safetensors_numpy.load_file(src / file).items():
            tensors.update(convert(name, value))
        safetensors_numpy.save_file(tensors, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _fp8_checkpoint(src, dst, block=_BLOCK, corrupt: str | None = None):
    """`src` as a block-FP8 checkpoint in `dst`: each linear weight as F8_E4M3 with its
    float32 weight_scale_inv per `block` (jaxops' host quantizer). `corrupt`: the tensor whose
    first scale is NaN."""

    def convert(name, value):
        if not _LINEAR.fullmatch(name):
            return {name: value}
        data, scale = quantize_blocks(value.astype(np.float32), Fp8Block(block))
        if name == corrupt:
            scale = scale.copy()
            scale[0, 0] = np.nan
        return {name: data, name + "_scale_inv": scale}

    return _rewritten(src, dst, convert, Fp8Block(block).to_hf(["lm_head"]))


def _same_logits_and_tokens(model, params, plain, want):
    """`model` on `params` computes `plain`'s logits on `want` (within 1e-6 of the logit scale)
    and generates its greedy tokens (the decode loop dequantizes layer by layer on its own)."""
    tokens = model.place_batch(fam.random_tokens(8, seed=3))
    got, ref = jax.jit(model.logits)(params, tokens), jax.jit(plain.logits)(want, tokens)
    assert fam.max_rel_err(got, ref) < 1e-6
    prompt = fam.random_tokens(8, seq=6, seed=5)
    np.testing.assert_array_equal(
        np.asarray(models.generate(model, params, prompt, 4)),
        np.asarray(models.generate(plain, want, prompt, 4)),
    )


def _load(path, **options):
    return models.from_pretrained(
        path, mesh=fam.mesh("d2e4"), dtype=np.float32, router_aux_loss_coef=0.0, **options
    )


def _base_leaves(model, params):
    """``{key: (fp8 data, float32 scale)}`` of the base weights."""
    out = {}
    for key in model.layout.block_maps:
        *path, name = key.split("/")
        node = params
        for part in path:
            node = node[part]
        out[key] = node[name], node[name + _base.SCALE]
    return out


def _dequantized(model, params):
    """The base weights as float32, by our block maps."""
    return {
        key: np.asarray(_base.dequantize(data, scale, model.layout.block_maps[key], jnp.float32))
        for key, (data, scale) in _base_leaves(model, params).items()
    }


def _at(tree, key):
    for part in key.split("/"):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_published_fp8_bytes_kept_and_equal_to_the_dequantizing_loader(
    hf_families, family, tmp_path
):
    """base="fp8" of a published-format checkpoint: one byte per base parameter on the device
    (measured from the arrays), the weights our block maps make bit-identical to the
    dequantizing loader's, the logits the same; quantized at load from the unquantized
    checkpoint: the same bytes and scales."""
    _, src = hf_families.hf(family)
    fp8_dir = _fp8_checkpoint(src, tmp_path / "fp8")
    model, params = _load(fp8_dir, base="fp8")
    plain, want = _load(fp8_dir)  # base=None: dequantized by the loader
    assert model.base_block == _BLOCK and set(model.layout.block_maps) >= {
        "layers/moe/w_in",
        "layers/moe/w_out",
    }
    for key, (data, scale) in _base_leaves(model, params).items():
        assert data.dtype == jnp.uint8 and scale.dtype == jnp.float32, key  # e4m3 bytes
        shards = data.addressable_shards
        assert sum(s.data.nbytes for s in shards) == sum(s.data.size for s in shards), key
    for key, got in _dequantized(model, params).items():
        np.testing.assert_array_equal(got, np.asarray(_at(want, key)), err_msg=key)
    _same_logits_and_tokens(model, params, plain, want)
    # Quantized at load, block by block on the host: the published file's bytes.
    _, made = _load(src, base="fp8", base_block=_BLOCK)
    for key, (data, scale) in _base_leaves(model, params).items():
        d, s = _base_leaves(model, made)[key]
        np.testing.assert_array_equal(np.asarray(d), np.asarray(data), err_msg=key)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(scale), err_msg=key)


def test_lora_on_the_fp8_base_trains_the_adapters_alone(hf_families):
    """adamw steps of LoRA on an FP8 base (ZeRO 0 and 3): the loss goes down, every adapter
    moves, the base bytes and scales stay bit-identical, the same losses either way."""
    _, src = hf_families.hf("qwen3_moe")
    targets = ("q_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj")
    model, params = _load(src, base="fp8", base_block=_BLOCK, lora=Lora(4, 8.0, targets))
    tokens = fam.random_tokens(16, seed=4)
    opt = optax.adamw(3e-2)
    losses = {}
    for zero in (0, 3):
        m = dataclasses.replace(model, zero=zero)
        p = jax.device_put(jax.tree.map(jnp.copy, params), m.shardings())
        before = jax.tree.map(np.asarray, p)
        state = m.init_optimizer(opt, p)
        step = m.train_step(opt)
        batch = m.place_batch(tokens, np.roll(tokens, -1, axis=1))
        losses[zero] = []
        for _ in range(3):
            p, state, loss = step(p, state, *batch)
            losses[zero].append(float(loss))
        for path, old in jax.tree_util.tree_leaves_with_path(before):
            moved = not np.array_equal(np.asarray(_at(p, "/".join(k.key for k in path))), old)
            assert moved == ("_lora_" in jax.tree_util.keystr(path)), path
        assert losses[zero][-1] < losses[zero][0]
    np.testing.assert_allclose(losses[3], losses[0], rtol=1e-5)


def _product_shapes(f, *args) -> set[tuple[int, ...]]:
    """The result shapes of every matrix product (dot, custom call) in the compiled `f`."""
    hlo = jax.jit(f).lower(*args).compile().as_text()
    found = re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\{[^}]*\} (?:dot|custom-call)\(", hlo)
    return {tuple(int(n) for n in dims.split(",") if n) for dims in found}


# Sizes no activation shares: hidden 40, q 48, k/v 24 each, expert width 56, 4 experts.
_ODD = models.DecoderConfig(
    "qwen3_moe", vocab_size=72, hidden_size=40, num_layers=2,
    attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=12),
    moe=models.MoESpec(num_experts=4, top_k=2, expert_ffn=56),
)  # fmt: skip


@pytest.mark.parametrize("base, pipe", [(None, 1), ("fp8", 1), ("fp8", 2)])
def test_no_base_weight_gradient_is_computed(base, pipe):
    """The compiled LoRA gradient makes no product shaped like a base weight (the weight
    gradients: the attention projections', the experts' stacked), also through a pipeline
    (2 stages, the base weights its frozen leaves); full fine-tuning's makes each of them
    (the check can fail)."""
    mesh = jax.make_mesh((pipe, 1), ("pipe", "expert"), devices=jax.devices()[:pipe])
    kw = dict(num_microbatches=2) if pipe > 1 else {}
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj",
               "experts.down_proj")  # fmt: skip
    weights = {(40, 96), (48, 40), (4, 40, 112), (40, 112), (4, 56, 40), (56, 40)}
    tokens = np.zeros((2, 9), np.int32)
    lora = models.MoEDecoder(_ODD, mesh, base=base, lora=Lora(4, 8.0, targets), **kw)
    p = lora.init(jax.random.key(0))
    shapes = _product_shapes(lora.loss_and_grads, p, tokens, tokens)
    assert not weights & shapes, sorted(weights & shapes)
    full = models.MoEDecoder(_ODD, mesh, **kw)
    p = full.init(jax.random.key(0))
    shapes = _product_shapes(full.loss_and_grads, p, tokens, tokens)
    assert weights - {(40, 112), (56, 40)} <= shapes, sorted(weights - shapes)


def test_no_float_copy_of_the_base_outlives_its_layer():
    """The compiled LoRA step on an FP8 base (remat "matmuls", the default with it) holds
    less than two layers' dequantized weights in temporaries (four layers: the whole base in
    float32 would be twice that), and its parameters a quarter of the float32 model's base
    bytes."""
    cfg = models.DecoderConfig(
        "qwen3_moe", vocab_size=64, hidden_size=256, num_layers=4,
        attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64),
        moe=models.MoESpec(num_experts=8, top_k=2, expert_ffn=256),
    )  # fmt: skip
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    lora = Lora(4, 8.0, ("q_proj", "o_proj", "experts.down_proj"))
    model = models.MoEDecoder(cfg, mesh, base="fp8", lora=lora)
    params = model.init(jax.random.key(0))
    opt = optax.sgd(1e-3)
    state = model.init_optimizer(opt, params)
    tokens = model.place_batch(np.zeros((1, 8), np.int32))
    compiled = model.train_step(opt).lower(params, state, tokens, tokens).compile()
    base = _base_leaves(model, params)
    per_layer = sum(d.size * 4 for d, _ in base.values()) / cfg.num_layers  # float32
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"temporaries {temp / 2**20:.2f} MiB, a layer's float32 base {per_layer / 2**20:.2f} MiB")
    assert temp < 2 * per_layer
    stored = sum(d.nbytes + s.nbytes for d, s in base.values())
    assert stored < 0.27 * per_layer * cfg.num_layers


@pytest.mark.parametrize(
    "options, match",
    [
        ({"base": "int4"}, r"base must be one of \(None, 'fp8', 'mxfp4'\), got 'int4'"),
        ({"base": "fp8", "base_block": (0, 128)}, "base_block must be two ints >= 1"),
        ({"base": "fp8", "remat": False}, "base='fp8' needs remat 'matmuls'"),
    ],
    ids=["unknown-base", "bad-block", "remat-none"],
)
def test_bad_base_options(options, match):
    cfg = models.DecoderConfig(
        "mixtral", 64, 32, 2, models.AttentionSpec(4, 2, 8), models.MoESpec(4, 2, 16)
    )
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="^jaxops.models.MoEDecoder: " + match):
        models.MoEDecoder(cfg, mesh, **options)


def test_refusals(hf_families, tmp_path):
    """Training the FP8 base itself, saving it as a full checkpoint, another block size than
    the checkpoint's, and a NaN scale are refused by name."""
    _, src = hf_families.hf("qwen3_moe")
    model, params = _load(src, base="fp8")
    tokens = model.place_batch(fam.random_tokens(8, seed=0))
    with pytest.raises(ConfigError, match=r"^jaxops.models.MoEDecoder.loss_and_grads: base='fp8'"):
        model.loss_and_grads(params, tokens, tokens)
    with pytest.raises(ConfigError, match=r"^jaxops.models.MoEDecoder.train_step: .*lora="):
        model.train_step(optax.sgd(1e-3))
    with pytest.raises(ConfigError, match=r"^jaxops.models.save_pretrained: .*base='fp8'"):
        models.save_pretrained(model, params, tmp_path / "out")
    fp8_dir = _fp8_checkpoint(src, tmp_path / "fp8")
    with pytest.raises(ConfigError, match=r"base_block=\[128, 128\] differs .* \[32, 32\]"):
        _load(fp8_dir, base="fp8", base_block=(128, 128))
    bad = "model.layers.1.self_attn.k_proj.weight"
    shutil.rmtree(fp8_dir)
    _fp8_checkpoint(src, fp8_dir, corrupt=bad)
    with pytest.raises(CheckpointError, match=re.escape(f"'{bad}_scale_inv' must be finite")):
        _load(fp8_dir, base="fp8")


def test_merge_dequantizes_the_base(hf_families):
    """merge_adapter on an FP8 base: a plain float model whose logits are the adapted ones."""
    _, src = hf_families.hf("deepseek_v3")
    targets = ("q_b_proj", "kv_b_proj", "mlp.down_proj", "experts.gate_up_proj")
    model, params = _load(src, base="fp8", base_block=_BLOCK, lora=Lora(4, 8.0, targets))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            jax.device_put(rng.normal(size=x.shape).astype(np.float32) * 0.1, x.sharding)
            if "_lora_b" in jax.tree_util.keystr(path)
            else x
        ),
        params,
    )
    tokens = model.place_batch(fam.random_tokens(8, seed=2))
    want = jax.jit(model.logits)(params, tokens)
    plain, merged = models.merge_adapter(model, params)
    assert plain.base is None and plain.lora is None
    assert all(np.dtype(a.dtype) == np.float32 for a in jax.tree.leaves(merged))
    assert fam.max_rel_err(jax.jit(plain.logits)(merged, tokens), want) < 1e-5


# -------------------------------------------------------------------------------------------------
# MXFP4: gpt-oss's experts kept as published.

_EXPERTS = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)$")
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _mxfp4(w):
    """``(blocks [E, out, in / 32, 16], scales [E, out, in / 32])`` of a module-layout expert
    tensor ``[E, in, out]``: the smallest power-of-two scale per 32 inputs that brings them
    within 6, each the nearest E2M1 code, two per byte (the low nibble first)."""
    x = np.swapaxes(w.astype(np.float32), -1, -2)
    x = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = np.abs(x).max(-1, keepdims=True)
    e = np.clip(np.ceil(np.log2(np.maximum(amax, 2.0**-126) / 6)), -127, 127)
    codes = np.abs((x / np.exp2(e))[..., None] - _E2M1).argmin(-1).astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e[..., 0] + 127).astype(np.uint8)


def _mxfp4_checkpoint(src, dst):
    """`src` (an unquantized gpt-oss directory) as gpt-oss publishes it: every expert tensor as
    ``X_blocks`` and ``X_scales``, quant_method mxfp4."""

    def convert(name, value):
        if not _EXPERTS.fullmatch(name):
            return {name: value}
        blocks, scales = _mxfp4(value)
        return {name + "_blocks": blocks, name + "_scales": scales}

    return _rewritten(src, dst, convert, {"quant_method": "mxfp4"})


def test_mxfp4_base_keeps_gpt_oss_bytes_and_trains_adapters(hf_families, tmp_path):
    """base="mxfp4" of a gpt-oss checkpoint in its published format: the experts as packed
    bytes (half a byte a weight) and E8M0 codes, dequantized bit-identical to the dequantizing
    loader's weights, the same logits and greedy tokens; LoRA on it trains the adapters alone."""
    _, src = hf_families.hf("gpt_oss")
    path = _mxfp4_checkpoint(src, tmp_path / "mxfp4")
    model, params = _load(path, base="mxfp4")
    plain, want = _load(path)
    for key in ("w_in", "w_out"):
        data, codes = params["layers"]["moe"][key], params["layers"]["moe"][key + "_scales"]
        full = want["layers"]["moe"][key]
        assert data.dtype == codes.dtype == jnp.uint8 and 2 * data.size == full.size, key
        got = _base.dequantize_mxfp4(data, codes, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(full), err_msg=key)
    assert params["layers"]["w_qkv"].dtype == jnp.float32  # attention as it was
    _same_logits_and_tokens(model, params, plain, want)
    targets = ("q_proj", "experts.gate_up_proj", "experts.down_proj")
    lora = dataclasses.replace(model, lora=Lora(4, 8.0, targets))
    p = lora.add_adapters(params, jax.random.key(0))
    before = jax.tree.map(np.asarray, p)
    opt = optax.adamw(3e-2)
    state, step = lora.init_optimizer(opt, p), lora.train_step(opt)
    batch = lora.place_batch(fam.random_tokens(16, seed=4), fam.random_tokens(16, seed=6))
    losses = []
    for _ in range(3):
        p, state, loss = step(p, state, *batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    for path_, old in jax.tree_util.tree_leaves_with_path(before):
        moved = not np.array_equal(np.asarray(_at(p, "/".join(k.key for k in path_))), old)
        assert moved == ("_lora_" in jax.tree_util.keystr(path_)), path_


def test_mxfp4_base_refusals(hf_families, tmp_path):
    _, src = hf_families.hf("gpt_oss")
    with pytest.raises(ConfigError, match=r"base='mxfp4' keeps a published MXFP4 checkpoint"):
        _load(src, base="mxfp4")
    path = _mxfp4_checkpoint(src, tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match=r"experts are MXFP4 \(gpt-oss\): keep them with"):
        _load(path, base="fp8")
    cfg = models.DecoderConfig(
        "gpt_oss", 64, 48, 2, models.AttentionSpec(4, 2, 12), models.MoESpec(4, 2, 32)
    )
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"\{'hidden_size': 48\} is not a multiple of 32"):
        models.MoEDecoder(cfg, mesh, base="mxfp4")
