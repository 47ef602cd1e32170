"""Low-rank adapters on the routed experts of the expert-parallel MoE layer (MoEConfig.lora):
the layer on 8 CPU devices (data 2 x expert 4) against its dense twin, both against the merged
weights ``W_e + scaling * A_e @ B_e`` (what PEFT's ``target_parameters`` LoRA computes on a fused
``[E, in, out]`` expert tensor), gradients of the adapters only (the base frozen), fresh adapters
adding nothing, FP8 base weights, and the refused settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from jax.sharding import PartitionSpec as P
from jaxops.parallel.expert import (
    LORA_TARGETS,
    MoEConfig,
    init_moe_params,
    moe_layer,
    moe_layer_reference,
    moe_param_specs,
)

from jaxops import ConfigError, Lora
from jaxops.testing import assert_allclose

H = 32


def _config(targets=("w_in", "w_out"), **kw) -> MoEConfig:
    base = dict(
        num_experts=8,
        top_k=2,
        hidden_size=H,
        expert_ffn=16,
        dtype=jnp.float32,
        align=4,
        lora=Lora(rank=4, alpha=8.0, targets=targets),
    )
    return MoEConfig(**{**base, **kw})


def _params(cfg: MoEConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Random float32 params, the adapters' B not zero (a trained adapter)."""
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(
            rng.normal(size=shape) * (shape[-2] ** -0.5 if len(shape) > 1 else 0.2), jnp.float32
        )
        for name, shape in cfg.param_shapes.items()
    }


def _x(seed: int = 1, h: int = H) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(8, 4, h)), jnp.float32)


def _merged(cfg: MoEConfig, params: dict) -> tuple[MoEConfig, dict]:
    """The config without adapters and the weights with them merged in (float64 products)."""
    out = {k: v for k, v in params.items() if k not in cfg.adapter_names}
    for target in cfg.lora.targets:
        a = np.asarray(params[f"{target}_lora_a"], np.float64)
        b = np.asarray(params[f"{target}_lora_b"], np.float64)
        delta = cfg.lora.scaling * np.einsum("eir,ero->eio", a, b)
        out[target] = jnp.asarray(np.asarray(params[target], np.float64) + delta, jnp.float32)
    return dataclasses.replace(cfg, lora=None), out


def _adapter_loss(layer, cfg, params, x):
    """(y, d adapters) of ``sum(y * weights) + aux.loss``, the base weights held fixed."""
    frozen = {k: v for k, v in params.items() if k not in cfg.adapter_names}
    adapters = {k: params[k] for k in cfg.adapter_names}
    weights = jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) * 0.37)

    def loss(adapters):
        y, aux = layer({**frozen, **adapters}, x)
        return jnp.sum(y * weights) + aux.loss, y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapters)
    return y, grads


def _layer(cfg, exchange="gather"):
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    cfg = dataclasses.replace(cfg, exchange=exchange)
    return lambda p, x: moe_layer(p, x, cfg, mesh=mesh)


def _reference(cfg):
    return lambda p, x: moe_layer_reference(p, x, cfg)


@pytest.mark.parametrize("exchange", ["gather", "dense"])
@pytest.mark.parametrize("targets", [("w_in", "w_out"), ("w_in",), ("w_out",)], ids="+".join)
def test_layer_equals_reference_and_merged_weights(targets, exchange):
    cfg = _config(targets)
    params, x = _params(cfg), _x()
    y, grads = _adapter_loss(_layer(cfg, exchange), cfg, params, x)
    y_ref, grads_ref = _adapter_loss(_reference(cfg), cfg, params, x)
    assert_allclose(y, y_ref, jnp.float32, err_msg="y")
    assert (
        set(grads) == set(cfg.adapter_names) == {f"{t}_lora_{ab}" for t in targets for ab in "ab"}
    )
    for name in grads:
        assert np.asarray(grads[name]).any(), name
        assert_allclose(grads[name], grads_ref[name], jnp.float32, scale=4, err_msg=name)
    plain, merged = _merged(cfg, params)
    y_merged, _ = jax.jit(_reference(plain))(merged, x)
    assert rel_error(y, y_merged) < 1e-5
    y_base, _ = jax.jit(_reference(plain))({k: params[k] for k in merged}, x)
    assert rel_error(y, y_base) > 1e-2, "the adapters must change the output"


def test_fresh_adapters_add_nothing_and_are_placed_with_the_experts():
    cfg = _config()
    params = init_moe_params(jax.random.key(0), cfg)
    a_in, b_in = params["w_in_lora_a"], params["w_in_lora_b"]
    assert a_in.shape == (8, H, 4) and b_in.shape == (8, 4, 32)  # [E, H, r], [E, r, 2F]
    assert params["w_out_lora_a"].shape == (8, 16, 4) and params["w_out_lora_b"].shape == (8, 4, H)
    assert not np.asarray(b_in).any() and 0 < float(jnp.abs(a_in).max()) <= H**-0.5
    specs = moe_param_specs(cfg)
    assert all(specs[name] == P("expert") for name in cfg.adapter_names)
    x = _x()
    plain = dataclasses.replace(cfg, lora=None)
    y, _ = jax.jit(_layer(cfg))(params, x)
    y0, _ = jax.jit(_layer(plain))({k: params[k] for k in plain.param_shapes}, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))


def test_grouped_ffn_adapters_ragged_dot_and_tile_loop_agree():
    """The GPU path (jax.lax.ragged_dot, tile 0) and the CPU tile loop give the same output
    and adapter gradients; zero rows (a group's padding) stay zero."""
    from jaxops.parallel.expert import _ffn

    cfg = _config()
    params = _params(cfg, 5)
    local = {k: v[:2] for k, v in params.items() if k.startswith("w_")}  # 2 local experts
    adapters = {k: local[k] for k in cfg.adapter_names}
    group_sizes = jnp.array([32, 64], jnp.int32)
    in_use = (np.arange(128) < 20) | ((np.arange(128) >= 32) & (np.arange(128) < 82))
    rows = np.random.default_rng(6).normal(size=(128, H)) * in_use[:, None]
    rows = jnp.asarray(rows, jnp.float32)
    weights = jnp.sin(jnp.arange(128 * H, dtype=jnp.float32).reshape(128, H))

    def run(tile):
        def f(adapters):
            out = _ffn.grouped_ffn(
                cfg, tile, None, rows, local["w_in"], local["w_out"], group_sizes,
                adapters=adapters,
            )  # fmt: skip
            return jnp.sum(out * weights), out

        return jax.jit(jax.value_and_grad(f, has_aux=True))(adapters)

    (_, out), grads = run(0)
    (_, out32), grads32 = run(32)
    assert_allclose(out, out32, jnp.float32, err_msg="out")
    np.testing.assert_array_equal(np.asarray(out)[~in_use], 0.0)
    for name in cfg.adapter_names:
        assert np.asarray(grads[name]).any(), name
        assert_allclose(grads[name], grads32[name], jnp.float32, err_msg=name)


def test_shared_expert_adapters_equal_the_merged_shared_expert():
    """The shared expert's gate, up and down projections, each its own adapter (gate and up on
    the halves of shared_w_in), replicated; the layer equals its twin and the merged weights."""
    targets = ("shared_gate_proj", "shared_up_proj", "shared_down_proj", "w_out")
    cfg = _config(targets, shared_ffn=24, shared_gate=True)
    params, x = _params(cfg, 7), _x(8)
    assert cfg.param_shapes["shared_gate_proj_lora_a"] == (H, 4)
    assert moe_param_specs(cfg)["shared_up_proj_lora_b"] == P()
    y, grads = _adapter_loss(_layer(cfg), cfg, params, x)
    y_ref, grads_ref = _adapter_loss(_reference(cfg), cfg, params, x)
    assert_allclose(y, y_ref, jnp.float32, err_msg="y")
    for name in cfg.adapter_names:
        assert np.asarray(grads[name]).any(), name
        assert_allclose(grads[name], grads_ref[name], jnp.float32, scale=4, err_msg=name)
    s = cfg.lora.scaling
    merged = {k: v for k, v in params.items() if "_lora_" not in k}

    def delta(name):
        return s * params[f"{name}_lora_a"] @ params[f"{name}_lora_b"]

    merged["shared_w_in"] = params["shared_w_in"] + jnp.concatenate(
        [delta("shared_gate_proj"), delta("shared_up_proj")], axis=-1
    )
    merged["shared_w_out"] = params["shared_w_out"] + delta("shared_down_proj")
    merged["w_out"] = params["w_out"] + s * jnp.einsum(
        "eir,ero->eio", params["w_out_lora_a"], params["w_out_lora_b"]
    )
    plain = dataclasses.replace(cfg, lora=None)
    assert rel_error(y, jax.jit(_reference(plain))(merged, x)[0]) < 1e-5


def test_shared_targets_need_a_swiglu_shared_expert():
    with pytest.raises(ConfigError, match=r"lora targets \['shared_up_proj'\] need a shared"):
        _config(("shared_up_proj",))


def test_router_adapter_moves_the_choice_and_equals_the_merged_router():
    """A router adapter (float32 logits ``x @ (router + scaling A B)``): the layer equals its
    twin and the merged router, and its own gradient comes through the weights and aux loss."""
    cfg = _config(("router",), router="sigmoid", router_bias=True)
    params, x = _params(cfg, 9), _x(10)
    y, grads = _adapter_loss(_layer(cfg), cfg, params, x)
    y_ref, grads_ref = _adapter_loss(_reference(cfg), cfg, params, x)
    assert_allclose(y, y_ref, jnp.float32, err_msg="y")
    for name in ("router_lora_a", "router_lora_b"):
        assert np.asarray(grads[name]).any(), name
        assert_allclose(grads[name], grads_ref[name], jnp.float32, scale=4, err_msg=name)
    plain, merged = _merged_router(cfg, params)
    assert rel_error(y, jax.jit(_reference(plain))(merged, x)[0]) < 1e-5


def _merged_router(cfg, params):
    s = cfg.lora.scaling
    merged = {k: v for k, v in params.items() if "_lora_" not in k}
    merged["router"] = params["router"] + s * params["router_lora_a"] @ params["router_lora_b"]
    return dataclasses.replace(cfg, lora=None), merged


def test_rslora_scaling():
    rs = _config(lora=Lora(rank=4, alpha=8.0, targets=("w_in",), rslora=True))
    assert rs.lora.scaling == 4.0 and _config().lora.scaling == 2.0
    params, x = _params(rs), _x()
    plain, merged = _merged(rs, params)
    y, _ = jax.jit(_layer(rs))(params, x)
    assert rel_error(y, jax.jit(_reference(plain))(merged, x)[0]) < 1e-5


def test_fp8_base_with_bfloat16_free_adapters():
    """fp8="block": the base GEMMs in block FP8, the adapters not quantized: the layer equals
    its FP8 dense twin, and the adapters' gradients too."""
    cfg = _config(hidden_size=256, expert_ffn=128, fp8="block")
    params, x = _params(cfg, 3), _x(4, 256)
    y, grads = _adapter_loss(_layer(cfg), cfg, params, x)
    y_ref, grads_ref = _adapter_loss(_reference(cfg), cfg, params, x)
    assert rel_error(y, y_ref) < 5e-5
    for name in cfg.adapter_names:
        assert rel_error(grads[name], grads_ref[name]) < 0.06, name


@pytest.mark.parametrize(
    ("lora", "error", "match"),
    [
        (Lora(4, 8.0, ("gate",)), ConfigError, r"lora targets \['gate'\] match no weight"),
        ("lora", TypeError, "lora must be a jaxops.Lora or None"),
    ],
    ids=["unknown-target", "not-a-lora"],
)
def test_bad_lora_is_refused(lora, error, match):
    with pytest.raises(error, match=f"^jaxops.parallel.expert.MoEConfig: {match}"):
        _config(lora=lora)
    assert LORA_TARGETS[:2] == ("w_in", "w_out")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(rank=0, alpha=1.0, targets=("w_in",)), "rank must be an int >= 1"),
        (dict(rank=2, alpha=0.0, targets=("w_in",)), "alpha must be a finite number > 0"),
        (dict(rank=2, alpha=1.0, targets=()), "targets must name distinct weights"),
        (dict(rank=2, alpha=1.0, targets=("w_in", "w_in")), "targets must name distinct"),
    ],
    ids=["rank0", "alpha0", "no-targets", "repeated"],
)
def test_bad_lora_settings(kwargs, match):
    with pytest.raises(ConfigError, match=f"^jaxops.Lora: {match}"):
        Lora(**kwargs)
