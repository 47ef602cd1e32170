"""Expert-parallel MoE layer vs its dense single-device reference: 8 CPU devices, 2 processes."""

from __future__ import annotations

import dataclasses
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert
from jaxops.parallel.expert import (
    MoEConfig,
    exchange_bounds,
    init_moe_params,
    moe_layer,
    moe_layer_reference,
)

import jaxops
from jaxops import ConfigError, _ffi, _grouped_gemm
from jaxops.testing import (
    assert_allclose,
    collective_bytes,
    collective_shapes,
    count_collectives,
    run_processes,
)

MESHES = {
    "e8": ((8,), ("expert",), ()),
    "d2e4": ((2, 4), ("data", "expert"), ("data",)),
    "d4e2": ((4, 2), ("data", "expert"), ("data",)),
    # every expert on every device: no exchange when dropless (capacity still all-gathers)
    "d8e1": ((8, 1), ("data", "expert"), ("data",)),
}
# (top_k, router, capacity_factor)
ROUTINGS = [
    (1, "softmax", None),
    (2, "sigmoid", None),
    (8, "softmax", None),
    (2, "softmax", 0.5),
    (8, "sigmoid", 1.0),
]


def _rid(routing) -> str:
    k, router, cf = routing
    return f"top{k}-{router}-cf{cf}"


def _covering(names: list, routings: list = ROUTINGS) -> list:
    """Each routing on two consecutive `names` (cyclically): every name meets every kind of
    routing (dropless, capacity, softmax, sigmoid, top-1 to top-8) at half the full product."""
    return [
        pytest.param(names[(i + j) % len(names)], r, id=f"{names[(i + j) % len(names)]}-{_rid(r)}")
        for i, r in enumerate(routings)
        for j in (0, 1)
    ]


def _mesh(name):
    shape, names, _ = MESHES[name]
    return jax.make_mesh(shape, names)


def _config(mesh_name, **kw):
    kw.setdefault("data_axes", MESHES[mesh_name][2])
    kw.setdefault("dtype", jnp.float32)
    kw.setdefault("align", 4)
    return MoEConfig(**{"num_experts": 16, "top_k": 2, "hidden_size": 32, "expert_ffn": 24, **kw})


def _weights(shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.37)


def _loss(layer):
    """A scalar of the output and the aux loss, to differentiate both paths the same way."""

    def loss(params, x):
        y, aux = layer(params, x)
        return jnp.sum(y.astype(jnp.float32) * _weights(y.shape)) + aux.loss

    return loss


def _run(cfg, mesh, params, x, impl=None):
    layer = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh, impl=impl))
    grad = jax.jit(
        jax.grad(_loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh, impl=impl)), argnums=(0, 1))
    )
    return layer(params, x), grad(params, x)


def _reference(cfg, params, x):
    layer = jax.jit(lambda p, x: moe_layer_reference(p, x, cfg))
    grad = jax.jit(jax.grad(_loss(lambda p, x: moe_layer_reference(p, x, cfg)), argnums=(0, 1)))
    return layer(params, x), grad(params, x)


def _compare(got, want, dtype=jnp.float32, scale=1.0):
    (y, aux), grads = got
    (y_ref, aux_ref), grads_ref = want
    assert_allclose(y, y_ref, dtype, scale=scale, err_msg="y")
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    assert int(aux.dropped) == int(aux_ref.dropped)
    for name in ("loss", "load_balancing_loss", "z_loss"):
        assert_allclose(getattr(aux, name), getattr(aux_ref, name), jnp.float32, err_msg=name)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), g_ref in zip(flat, jax.tree.leaves(grads_ref), strict=True):
        assert_allclose(g, g_ref, dtype, scale=4 * scale, err_msg=f"grad {path}")


# -------------------------------------------------------------------------------------------------
# Router and config.


@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_router_matches_float64(router, normalize):
    cfg = MoEConfig(
        num_experts=6, top_k=3, hidden_size=5, expert_ffn=4, router=router, normalize_topk=normalize
    )
    tokens = np.random.default_rng(0).normal(size=(7, 5))
    w = np.random.default_rng(1).normal(size=(5, 6))
    logits, dist, ids, probs = expert._router(cfg, jnp.asarray(tokens), jnp.asarray(w))
    z = tokens @ w
    scores = (
        np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        if router == "softmax"
        else 1 / (1 + np.exp(-z))
    )
    want_ids = np.argsort(-scores, axis=-1, kind="stable")[:, :3]
    top = np.take_along_axis(scores, want_ids, -1)
    if normalize:
        top = top / top.sum(-1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    assert_allclose(probs, top, jnp.float32)
    assert_allclose(dist, scores / scores.sum(-1, keepdims=True), jnp.float32)
    assert_allclose(logits, z, jnp.float32)


def test_aux_losses_match_their_formulas():
    cfg = _config(
        "e8", top_k=2, capacity_factor=0.5, router_aux_loss_coef=0.1, router_z_loss_coef=0.01
    )
    params = init_moe_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (16, 3, 32))
    (_, aux), _ = _run(cfg, _mesh("e8"), params, x)
    tokens = np.asarray(x, np.float64).reshape(-1, 32)
    z = tokens @ np.asarray(params["router"], np.float64)
    soft = np.exp(z - z.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    ids = np.argsort(-soft, axis=-1, kind="stable")[:, :2]
    counts = np.bincount(ids.reshape(-1), minlength=16)
    lb = 16 * np.sum(counts / (48 * 2) * soft.mean(0))
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    zl = np.mean(lse**2)
    capacity = int(np.ceil(0.5 * 48 * 2 / 16))
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    assert int(aux.dropped) == int(np.sum(np.maximum(counts - capacity, 0)))
    assert_allclose(aux.load_balancing_loss, lb, jnp.float32)
    assert_allclose(aux.z_loss, zl, jnp.float32)
    assert_allclose(aux.loss, 0.1 * lb + 0.01 * zl, jnp.float32)


def _np_route(z, router, k, *, bias=None, n_group=1, topk_group=None, normalize=True, scale=1.0):
    """Routing in float64 numpy, written from DeepSeek-V3's and Mixtral's descriptions."""
    z = np.asarray(z, np.float64)
    if router == "softmax":
        scores = np.exp(z - z.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-z))
    choice = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    t, e = z.shape
    if n_group > 1:
        grouped = choice.reshape(t, n_group, e // n_group)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
        allowed = np.zeros((t, n_group), bool)
        np.put_along_axis(allowed, keep, True, axis=1)
        choice = np.where(np.repeat(allowed, e // n_group, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, ids, -1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if router == "sigmoid" else 0.0))
    return ids, w * scale


ROUTER_CASES = {
    # name: (router, top_k, n_group, topk_group, bias, normalize, scale)
    "mixtral": ("softmax", 2, 1, None, False, True, 1.0),
    "qwen3-raw": ("softmax", 4, 1, None, False, False, 1.0),
    "deepseek": ("sigmoid", 4, 4, 2, True, True, 2.5),
    "deepseek-1group": ("sigmoid", 3, 4, 1, True, True, 1.0),
    "sigmoid-bias": ("sigmoid", 2, 1, None, True, False, 1.0),
    "softmax-groups": ("softmax", 2, 8, 1, False, True, 1.0),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_variants_match_float64(case):
    router, k, groups, kept, has_bias, normalize, scale = ROUTER_CASES[case]
    e = 16
    cfg = MoEConfig(
        num_experts=e,
        top_k=k,
        hidden_size=12,
        expert_ffn=4,
        router=router,
        n_group=groups,
        topk_group=kept,
        router_bias=has_bias,
        normalize_topk=normalize,
        routed_scaling_factor=scale,
    )
    rng = np.random.default_rng(3)
    tokens = rng.normal(size=(64, 12)).astype(np.float32)
    w = rng.normal(size=(12, e)).astype(np.float32)
    bias = rng.normal(size=(e,)).astype(np.float32) * 0.3 if has_bias else None
    _, _, ids, probs = expert._router(
        cfg, jnp.asarray(tokens), jnp.asarray(w), None if bias is None else jnp.asarray(bias)
    )
    z = tokens.astype(np.float64) @ w.astype(np.float64)
    want_ids, want_w = _np_route(
        z,
        router,
        k,
        bias=bias,
        n_group=groups,
        topk_group=kept,
        normalize=normalize,
        scale=scale,
    )
    np.testing.assert_array_equal(ids, want_ids)
    assert_allclose(probs, want_w, jnp.float32)
    if groups > 1:  # the groups must have decided something, else the case tests nothing
        plain, _ = _np_route(z, router, k, bias=bias)
        assert (np.sort(plain, -1) != np.sort(want_ids, -1)).any(axis=-1).mean() > 0.2
    if has_bias:  # the bias changes the choice but not the weights of what is chosen
        free, _ = _np_route(z, router, k, n_group=groups, topk_group=kept)
        assert (np.sort(free, -1) != np.sort(want_ids, -1)).any()


def test_router_bias_gets_no_gradient_and_weights_use_raw_scores():
    cfg = MoEConfig(
        num_experts=8,
        top_k=2,
        hidden_size=4,
        expert_ffn=4,
        router="sigmoid",
        router_bias=True,
        normalize_topk=False,
    )
    tokens = jax.random.normal(jax.random.key(0), (16, 4))
    w = jax.random.normal(jax.random.key(1), (4, 8))
    bias = jnp.linspace(-1, 1, 8)

    def f(w, bias):
        return jnp.sum(expert._router(cfg, tokens, w, bias)[3])

    gw, gb = jax.grad(f, argnums=(0, 1))(w, bias)
    assert not np.asarray(gb).any() and np.asarray(gw).any()
    _, _, ids, probs = expert._router(cfg, tokens, w, bias)
    scores = jax.nn.sigmoid(tokens @ w)
    np.testing.assert_allclose(probs, jnp.take_along_axis(scores, ids, -1), rtol=1e-6)


def test_sigmoid_router_with_every_score_underflowing_is_finite():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=4, expert_ffn=4, router="sigmoid")
    tokens = jnp.ones((4, 4))
    w = jnp.full((4, 8), -1000.0)  # logits -4000: every sigmoid score is 0 in float32

    def f(w):
        _, dist, _, top = expert._router(cfg, tokens, w)
        return jnp.sum(dist) + jnp.sum(top)

    value, grad = jax.value_and_grad(f)(w)
    assert np.isfinite(value) and np.isfinite(np.asarray(grad)).all()


# (name, MoEConfig keywords): DeepSeek-V3 and Qwen2-MoE blocks through the EP layer.
SHARED_CASES = {
    "deepseek": dict(
        router="sigmoid",
        router_bias=True,
        n_group=4,
        topk_group=2,
        top_k=4,
        routed_scaling_factor=2.5,
        shared_ffn=40,
    ),
    "deepseek-capacity": dict(
        router="sigmoid",
        router_bias=True,
        n_group=4,
        topk_group=2,
        top_k=4,
        shared_ffn=16,
        capacity_factor=0.5,
    ),
    "qwen2": dict(router="softmax", normalize_topk=False, top_k=4, shared_ffn=48, shared_gate=True),
    "qwen2-gelu": dict(
        router="softmax", top_k=2, shared_ffn=8, shared_gate=True, activation="gelu"
    ),
}


@pytest.mark.parametrize(
    "mesh_name,case",
    [("d2e4", c) for c in SHARED_CASES] + [("e8", "deepseek"), ("e8", "qwen2-gelu")],
)
def test_deepseek_and_qwen2_layers_match_dense_reference(mesh_name, case):
    cfg = _config(mesh_name, **SHARED_CASES[case])
    params = init_moe_params(jax.random.key(30), cfg)
    if cfg.router_bias:
        params["router_bias"] = jax.random.normal(jax.random.key(31), (16,)) * 0.2
    x = jax.random.normal(jax.random.key(32), (16, 5, 32))
    got = _run(cfg, _mesh(mesh_name), params, x)
    _compare(got, _reference(cfg, params, x))
    grads = got[1][0]
    for name in params:
        g = np.asarray(grads[name])
        if name == "router_bias":
            assert not g.any(), "the correction bias must get no gradient"
        else:
            assert np.isfinite(g).all() and g.any(), name
    if cfg.capacity_factor is not None:
        assert int(got[0][1].dropped) > 0


def test_shared_experts_bf16_and_fp8():
    cfg = _config("d2e4", **SHARED_CASES["deepseek"], dtype=jnp.bfloat16)
    params = init_moe_params(jax.random.key(33), cfg)
    x = jax.random.normal(jax.random.key(34), (8, 4, 32), jnp.bfloat16)
    _compare(_run(cfg, _mesh("d2e4"), params, x), _reference(cfg, params, x), jnp.bfloat16, 2)

    cfg8 = _config(
        "d2e4",
        **{**SHARED_CASES["qwen2"], "hidden_size": 256, "expert_ffn": 128, "shared_ffn": 128},
        fp8="block",
    )
    params = init_moe_params(jax.random.key(35), cfg8)
    x = jax.random.normal(jax.random.key(36), (8, 6, 256))
    (y, _), grads = _run(cfg8, _mesh("d2e4"), params, x)
    (y8, _), _ = _reference(cfg8, params, x)
    (y32, _), grads32 = _reference(dataclasses.replace(cfg8, fp8=None), params, x)

    assert rel_error(y, y8) < 5e-5  # the same quantized operands; fp32 sums in another order
    assert 1e-3 < rel_error(y, y32) < 0.1
    for name in params:
        assert rel_error(grads[0][name], grads32[0][name]) < 0.1, name


def test_aux_loss_free_balancing_evens_a_skewed_router():
    """DeepSeek-V3's bias update in a jitted train step: the load imbalance falls over steps."""
    cfg = _config(
        "e8",
        router="sigmoid",
        router_bias=True,
        top_k=2,
        router_aux_loss_coef=0.0,
        router_z_loss_coef=0.0,
    )
    mesh = _mesh("e8")
    params = init_moe_params(jax.random.key(40), cfg)
    # Skewed: tokens share a positive component, and experts 0-3 score it far higher.
    params["router"] = params["router"] * 0.1 + jnp.zeros((32, 16)).at[:, :4].set(0.05)

    @jax.jit
    def step(params, x):
        def loss(p):
            y, aux = moe_layer(p, x, cfg, mesh=mesh)
            return jnp.mean(y.astype(jnp.float32) ** 2), aux

        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
        new = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        new["router_bias"] = expert.update_router_bias(
            params["router_bias"], aux.tokens_per_expert, rate=0.01
        )
        load = aux.tokens_per_expert.astype(jnp.float32)
        return new, jnp.std(load) / jnp.mean(load)  # coefficient of variation of the load

    imbalance = []
    for i in range(50):
        x = jax.random.normal(jax.random.key(100 + i), (32, 16, 32)) + 1.0
        params, cv = step(params, x)
        imbalance.append(round(float(cv), 3))
    first, last = np.mean(imbalance[:3]), np.mean(imbalance[-10:])
    assert first > 1.5, imbalance  # 4 of 16 experts take (nearly) every slot
    assert last < 0.35 * first, imbalance
    bias = np.asarray(params["router_bias"])
    assert bias[:4].max() < bias[4:].min()  # the favoured experts were pushed down


def test_update_router_bias_formula_and_errors():
    bias = jnp.zeros((2, 4))
    load = jnp.array([[5, 1, 1, 1], [2, 2, 2, 2]])
    got = expert.update_router_bias(bias, load, rate=0.5)
    np.testing.assert_array_equal(got, [[-0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0]])
    op = r"^jaxops\.parallel\.expert\.update_router_bias: "
    with pytest.raises(ValueError, match=op + r"tokens_per_expert must have bias's shape"):
        expert.update_router_bias(jnp.zeros(4), jnp.zeros(5, jnp.int32))


# -------------------------------------------------------------------------------------------------
# The layer vs the dense reference.


@pytest.mark.parametrize("mesh_name,routing", _covering(list(MESHES)))
def test_layer_matches_dense_reference(mesh_name, routing):
    k, router, cf = routing
    cfg = _config(mesh_name, top_k=k, router=router, capacity_factor=cf)
    params = init_moe_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (16, 5, 32))
    got = _run(cfg, _mesh(mesh_name), params, x)
    want = _reference(cfg, params, x)
    _compare(got, want)
    if cf is not None:
        assert int(got[0][1].dropped) > 0, "the capacity case must drop slots"


@pytest.mark.parametrize(
    "exchange,routing",
    [pytest.param("dense", ROUTINGS[i], id=f"dense-{_rid(ROUTINGS[i])}") for i in (0, 2, 3)]
    + [pytest.param("gather", ROUTINGS[i], id=f"gather-{_rid(ROUTINGS[i])}") for i in (1, 3, 4)],
)
def test_each_exchange_matches_dense_reference(exchange, routing):
    """Both CPU exchanges pinned (auto picks one per config), on a mesh with a data axis; each
    with a capacity case and dropless ones, the routings split between them."""
    k, router, cf = routing
    cfg = _config("d2e4", top_k=k, router=router, capacity_factor=cf, exchange=exchange)
    assert _plan(cfg, "d2e4", 80).kind == exchange
    params = init_moe_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (16, 5, 32))
    got = _run(cfg, _mesh("d2e4"), params, x)
    _compare(got, _reference(cfg, params, x))
    if cf is not None:
        assert int(got[0][1].dropped) > 0, "the capacity case must drop slots"


def _plan(cfg, mesh_name, num_tokens, impl=None):
    shape, names, _ = MESHES[mesh_name]
    mesh = _mesh(mesh_name)
    n = dict(zip(names, shape, strict=True))[cfg.expert_axis]
    return expert._exchange.make_plan(cfg, mesh, n, int(np.prod(shape)), num_tokens, impl)


@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(0, 12),
    k=st.integers(1, 4),
    e=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_drop_beyond_capacity_keeps_each_experts_first_slots(t, k, e, seed):
    """The gather exchange's sender-side capacity: expert e keeps its first kept[e] slots in slot
    order t * K + k (a numpy loop), -1 (masked) slots stay -1."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, e, (t, k)).astype(np.int32)
    kept = rng.integers(0, t * k + 1, e).astype(np.int32)
    want = ids.reshape(-1).copy()
    seen = np.zeros(e, np.int64)
    for s, ex in enumerate(want):
        if ex >= 0:
            if seen[ex] >= kept[ex]:
                want[s] = -1
            seen[ex] += 1
    # Jitted, as the exchange runs it: one program per shape, not one per op.
    got = jax.jit(expert._gather.drop_beyond_capacity)(jnp.asarray(ids), jnp.asarray(kept))
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), want)


def test_auto_exchange_off_gpu_moves_the_fewer_rows():
    """auto: the gather (N * Tl rows) unless the dense form's capacity-bound blocks are smaller."""
    # 4 peers' 64 tokens, 2 slots each; the loop twin (impl "xla") pads the 4 local groups to
    # 32 rows (the buffer is not rounded further: the grouped GEMM takes any row count, and a
    # pad would copy the buffer), the CPU custom calls take them unpadded
    plan = _plan(_config("d2e4", top_k=2), "d2e4", 8 * 64, impl="xla")
    assert (plan.kind, plan.chunk, plan.recv_rows, plan.align) == ("gather", 128, 636, 32)
    assert plan.recv_rows == 4 * 64 * 2 + 4 * 31
    cfg = _config("d2e4", top_k=2)
    plan = _plan(cfg, "d2e4", 8 * 64)
    assert cfg.align == 4
    assert (plan.kind, plan.chunk, plan.recv_rows, plan.align) == ("gather", 128, 524, 4)
    assert plan.recv_rows == 4 * 64 * 2 + 4 * 3
    plan = _plan(_config("d2e4", top_k=2, capacity_factor=1.0), "d2e4", 8 * 64)
    assert plan.kind == "gather"  # C = 64: blocks of min(128, 4 * 64) rows
    tiny = _config("d2e4", top_k=2, capacity_factor=0.05)  # C = 4: blocks of 4 * 4 < 64 rows
    assert _plan(tiny, "d2e4", 8 * 64).kind == "dense"


class _GpuMesh:
    """Stands in for a mesh of `n` GPUs: make_plan reads only ``devices.flat[0].platform``."""

    def __init__(self, n):
        self.devices = np.array([types.SimpleNamespace(platform="gpu")] * n)


@pytest.mark.parametrize(
    ("experts", "n", "tokens", "want_loop"),
    [(128, 1, 4 * 2048, True), (16, 1, 128, False), (1, 1, 1 << 20, False), (128, 8, 8, False)],
    ids=["qwen3-128e-8k-tokens", "16e-128-tokens", "one-expert", "16-local-few-tokens"],
)
def test_gpu_plan_loops_where_ragged_dots_dense_form_is_large(
    experts, n, tokens, want_loop, monkeypatch
):
    """On GPU without jaxops' CUDA grouped GEMM the plan keeps ragged_dot while its dense form's
    [L, R, K] float32 operand fits GPU_RAGGED_DOT_MAX_BYTES (or L = 1), else runs the loop over
    groups, padded to GPU_TILE. With the CUDA kernel every L > 1 takes it (tile GPU_TILE)."""
    monkeypatch.setattr(expert._exchange._grouped_gemm, "kernel_available", lambda *a: False)
    cfg = MoEConfig(
        num_experts=experts, top_k=min(8, experts), hidden_size=2048, expert_ffn=768,
        data_axes=(), exchange="ragged",
    )  # fmt: skip
    plan = expert._exchange.make_plan(cfg, _GpuMesh(n), n, 1, tokens)
    local = experts // n
    rows = expert._exchange.exchange_bounds(cfg, tokens, n, tokens, align=cfg.align)[1]
    big = expert._exchange.ragged_dot_bytes(cfg, local, rows)
    assert big == 4 * local * rows * 2048
    assert want_loop == (local > 1 and big > expert._exchange.GPU_RAGGED_DOT_MAX_BYTES)
    assert plan.tile == (expert._ffn.GPU_TILE if want_loop else 0)
    assert plan.align == (64 if want_loop else cfg.align)
    assert plan.kind == "ragged"
    monkeypatch.setattr(expert._exchange._grouped_gemm, "kernel_available", lambda *a: True)
    plan = expert._exchange.make_plan(cfg, _GpuMesh(n), n, 1, tokens)
    assert plan.tile == (0 if local == 1 else expert._ffn.GPU_TILE)


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "silu"])
@pytest.mark.parametrize("align", [1, 16])
def test_activations_and_alignment(activation, align):
    cfg = _config("d2e4", activation=activation, align=align)
    params = init_moe_params(jax.random.key(2), cfg)
    x = jax.random.normal(jax.random.key(3), (8, 3, 32))
    _compare(_run(cfg, _mesh("d2e4"), params, x), _reference(cfg, params, x))


def test_bfloat16():
    cfg = _config("d4e2", dtype=jnp.bfloat16)
    params = init_moe_params(jax.random.key(4), cfg)
    x = jax.random.normal(jax.random.key(5), (8, 4, 32), jnp.bfloat16)
    got = _run(cfg, _mesh("d4e2"), params, x)
    assert got[0][0].dtype == jnp.bfloat16
    _compare(got, _reference(cfg, params, x), jnp.bfloat16, scale=2)


def test_nothing_routed_to_most_experts_and_devices():
    """All tokens pick experts 0 and 1 (both on the first device of the expert axis)."""
    cfg = _config("e8", num_experts=16, top_k=2)
    params = init_moe_params(jax.random.key(6), cfg)
    router = jnp.full((32, 16), -4.0).at[:, :2].set(4.0).at[:, 1].set(3.0)
    params = {**params, "router": router}
    x = jnp.abs(jax.random.normal(jax.random.key(7), (16, 2, 32))) + 0.1
    got = _run(cfg, _mesh("e8"), params, x)
    counts = np.asarray(got[0][1].tokens_per_expert)
    assert counts[:2].tolist() == [32, 32] and not counts[2:].any()
    _compare(got, _reference(cfg, params, x))
    # Experts that saw no token get a zero gradient, not garbage.
    assert not np.asarray(got[1][0]["w_in"])[2:].any()


def test_tiny_capacity_drops_almost_everything():
    cfg = _config("d2e4", top_k=2, capacity_factor=0.01)
    assert cfg.capacity(64) == 1
    params = init_moe_params(jax.random.key(8), cfg)
    x = jax.random.normal(jax.random.key(9), (8, 8, 32))
    got = _run(cfg, _mesh("d2e4"), params, x)
    counts = np.asarray(got[0][1].tokens_per_expert)
    assert int(got[0][1].dropped) == int(np.sum(np.maximum(counts - 1, 0))) > 0
    _compare(got, _reference(cfg, params, x))


def test_kernels_off_matches_kernels_on():
    cfg = _config("d2e4", top_k=2)
    params = init_moe_params(jax.random.key(10), cfg)
    x = jax.random.normal(jax.random.key(11), (8, 3, 32))
    mesh = _mesh("d2e4")
    on = _run(cfg, mesh, params, x, impl="ffi")
    off = _run(cfg, mesh, params, x, impl="xla")
    _compare(on, off)
    with jaxops.default_impl("xla"):
        text = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)).lower(params, x).as_text()
    assert "jaxops_moe" not in text
    text = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)).lower(params, x).as_text()
    assert "jaxops_moe_permute" in text and "jaxops_moe_unpermute" in text


def test_fp8_block():
    kw = {"hidden_size": 256, "expert_ffn": 128, "fp8": "block"}
    cfg = _config("d2e4", **kw)
    params = init_moe_params(jax.random.key(12), cfg)
    x = jax.random.normal(jax.random.key(13), (8, 10, 256))
    (y, _), grads = _run(cfg, _mesh("d2e4"), params, x)
    (y8, _), grads8 = _reference(cfg, params, x)
    (y32, _), grads32 = _reference(dataclasses.replace(cfg, fp8=None), params, x)

    # The forward quantizes rows and weight tiles exactly as fp8.linear does: same numbers.
    assert rel_error(y, y8) < 1e-5
    assert rel_error(y, y32) < 0.1
    for g, g32 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads32), strict=True):
        assert rel_error(g, g32) < 0.1
    assert rel_error(grads[0]["router"], grads8[0]["router"]) < 1e-4
    # And it is really quantized: far from the fp32 result at FP8's resolution.
    assert rel_error(y, y32) > 1e-3


@pytest.fixture
def fp8_gemm_path(monkeypatch):
    """A function that sends the expert layer down its FP8-kernel path (FP8 operands into
    grouped_gemm_fp8, w quantized again in the backward) while grouped_gemm_fp8 itself runs its
    twin: the path's operands and gradients, checked where the CUTLASS kernel cannot run. jax's
    caches are cleared when it is taken and after the test, so no trace crosses the patch."""
    runs = _grouped_gemm.fp8_kernel_runs

    def take():
        monkeypatch.setattr(
            _grouped_gemm,
            "fp8_kernel_runs",
            lambda shape, impl=None, op="": (
                op == "jaxops.parallel.expert.moe_layer" or runs(shape, impl, op)
            ),
        )
        jax.clear_caches()

    yield take
    jax.clear_caches()


@pytest.mark.parametrize("dispatch", ["dtype", "fp8"])
def test_fp8_block_through_the_fp8_gemm_path_equals_the_dequantized_one(fp8_gemm_path, dispatch):
    """The FP8-kernel path multiplies the same quantized rows and tiles as the dequantized path
    (forward and input gradient; the weight gradient is the same call): equal to f32 rounding."""
    kw = {"hidden_size": 256, "expert_ffn": 128, "fp8": "block", "dtype": jnp.bfloat16}
    cfg = _config("d2e4", **kw, dispatch=dispatch)
    params = init_moe_params(jax.random.key(14), cfg)
    x = jax.random.normal(jax.random.key(15), (8, 10, 256), jnp.bfloat16)
    mesh = _mesh("d2e4")
    (y, aux), grads = _run(cfg, mesh, params, x)
    # impl="ffi" requires jaxops' custom calls, not the FP8 kernel (absent here): the same run.
    (y_ffi, _), _ = _run(cfg, mesh, params, x, impl="ffi")
    np.testing.assert_array_equal(np.asarray(y_ffi, np.float32), np.asarray(y, np.float32))
    forward = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh))
    call = f"@{_grouped_gemm.TARGET_GROUPED_GEMM}("
    assert forward.lower(params, x).as_text().count(call) == 2
    fp8_gemm_path()
    # grouped_gemm_fp8 (its twin here) took both forward GEMMs: the path was taken
    assert call not in forward.lower(params, x).as_text()
    (y8, aux8), grads8 = _run(cfg, mesh, params, x)
    assert rel_error(y8, y) < 1e-2  # bf16 outputs: a rounding apart at most
    np.testing.assert_array_equal(aux8.tokens_per_expert, aux.tokens_per_expert)
    for g8, g in zip(jax.tree.leaves(grads8), jax.tree.leaves(grads), strict=True):
        assert rel_error(g8, g) < 1e-2
    # And both are FP8: far from the float32 layer at FP8's resolution.
    (y32, _), _ = _reference(dataclasses.replace(cfg, fp8=None, dispatch="dtype"), params, x)
    assert 1e-3 < rel_error(y8, y32) < 0.1


@pytest.mark.gpu
def test_gpu_fp8_block_on_the_cutlass_fp8_kernel(monkeypatch):
    """On an H100/H200 with JAXOPS_GPU_GROUPED_GEMM=cutlass the expert GEMMs of fp8="block" run
    CUTLASS's FP8 grouped GEMM (forward and input gradient): within f32 rounding of the
    dequantized path (jaxops' own kernels on the same quantized values)."""
    if not _ffi.build_info().get("CUDA", {}).get("cutlass"):
        pytest.skip("no CUTLASS grouped GEMM in this CUDA module")
    if jax.devices()[0].compute_capability != "9.0":
        pytest.skip("CUTLASS's FP8 grouped GEMM is built for sm_90a only")
    n = len(jax.devices())
    kw = {"hidden_size": 512, "expert_ffn": 256, "fp8": "block", "dtype": jnp.bfloat16}
    kw.update(data_axes=(), exchange="ragged", num_experts=16 * n)
    cfg = _config("d2e4", **kw)
    mesh = jax.make_mesh((n,), ("expert",))
    params = init_moe_params(jax.random.key(16), cfg)
    x = jax.random.normal(jax.random.key(17), (8 * n, 64, 512), jnp.bfloat16)
    (y, _), grads = _run(cfg, mesh, params, x)
    monkeypatch.setenv("JAXOPS_GPU_GROUPED_GEMM", "cutlass")
    text = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)).lower(params, x).as_text()
    assert f"@{_grouped_gemm.TARGET_GROUPED_GEMM_FP8_CUTLASS}(" in text
    (y8, _), grads8 = _run(cfg, mesh, params, x)
    assert rel_error(y8, y) < 1e-2
    for g8, g in zip(jax.tree.leaves(grads8), jax.tree.leaves(grads), strict=True):
        assert rel_error(g8, g) < 1e-2


# -------------------------------------------------------------------------------------------------
# FP8 dispatch: tokens cross the exchange as FP8 + 1 x 128 scales.

DISPATCH_CASES = {
    "softmax-dropless": dict(),
    "sigmoid-capacity": dict(router="sigmoid", capacity_factor=0.5),
    "deepseek-shared": {**SHARED_CASES["deepseek"], "shared_ffn": 128},
    "qwen2-capacity": {**SHARED_CASES["qwen2"], "shared_ffn": 128, "capacity_factor": 1.0},
}
# Relative Frobenius error allowed between the w_in gradients of the two dispatches: the FP8
# dispatch requantizes the received FP8 tokens in 128-token groups for the weight gradient, the
# bf16 dispatch quantizes the original tokens (both within FP8's resolution, 2^-4).
W_IN_BOUND = 0.06


def _check_fp8_dispatch(cfg, mesh, case, batch=8):
    """y, aux, dx and every weight gradient but w_in's of cfg with dispatch="fp8" are bitwise
    those of cfg (the same rows quantized in the same 1 x 128 groups, before the exchange instead
    of after); w_in's gradient is within W_IN_BOUND; all within FP8's bound of f32."""
    cfg8 = dataclasses.replace(cfg, dispatch="fp8")
    params = init_moe_params(jax.random.key(40), cfg)
    if cfg.router_bias:
        params["router_bias"] = jax.random.normal(jax.random.key(41), (cfg.num_experts,)) * 0.2
    x = jax.random.normal(jax.random.key(42), (batch, 10, cfg.hidden_size), jnp.bfloat16)
    (y, aux), grads = _run(cfg, mesh, params, x)
    (y8, aux8), grads8 = _run(cfg8, mesh, params, x)
    np.testing.assert_array_equal(np.asarray(y8, np.float32), np.asarray(y, np.float32))
    for a, b in zip(aux8, aux, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        np.asarray(grads8[1], np.float32), np.asarray(grads[1], np.float32)
    )
    for name in params:
        if name == "w_in":
            err = rel_error(grads8[0][name], grads[0][name])
            print(f"{case}: w_in gradient, fp8 vs bf16 dispatch: {err:.3e}")
            assert 0 < err < W_IN_BOUND, err
        else:
            np.testing.assert_array_equal(grads8[0][name], grads[0][name], err_msg=name)
    if cfg.capacity_factor is not None:
        assert int(aux8.dropped) > 0
    # Both stay within the FP8 recipe's bound of the float32 layer.
    (y32, _), grads32 = _reference(dataclasses.replace(cfg, fp8=None, dtype=jnp.float32), params, x)
    assert rel_error(y8, y32) < 0.1
    for name in params:
        if name != "router_bias":
            assert rel_error(grads8[0][name], grads32[0][name]) < 0.1, name


# Every exchange on the plain router, every routing on one exchange each (the exchanges move
# the same FP8 rows and scales whatever chose them; the routings differ in what is sent).
DISPATCH_PAIRS = [
    ("softmax-dropless", "gather"),
    ("softmax-dropless", "dense"),
    ("softmax-dropless", "ragged"),
    ("sigmoid-capacity", "dense"),
    ("qwen2-capacity", "gather"),
    ("deepseek-shared", "ragged"),
]


@pytest.mark.parametrize(("case", "exchange"), DISPATCH_PAIRS, ids="-".join)
def test_fp8_dispatch_equals_quantizing_after_the_exchange(case, exchange, request):
    if exchange == "ragged":  # the GPU's exchange, ragged_all_to_all run as its dense twin
        request.getfixturevalue("ragged_on_cpu")
    kw = {"hidden_size": 256, "expert_ffn": 128, "fp8": "block", "dtype": jnp.bfloat16}
    cfg = _config("d2e4", **{**kw, **DISPATCH_CASES[case]}, exchange=exchange)
    _check_fp8_dispatch(cfg, _mesh("d2e4"), case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(DISPATCH_CASES))
def test_gpu_fp8_dispatch_over_the_ragged_exchange(case):
    # Every local GPU on the expert axis; the tokens cross ragged_all_to_all as FP8 + scales.
    n = len(jax.devices())
    kw = {"hidden_size": 256, "expert_ffn": 128, "fp8": "block", "dtype": jnp.bfloat16}
    kw.update(data_axes=(), exchange="ragged", num_experts=16 * n)
    cfg = _config("d2e4", **{**kw, **DISPATCH_CASES[case]})
    _check_fp8_dispatch(cfg, jax.make_mesh((n,), ("expert",)), case, batch=8 * n)


def _token_exchanges(hlo: str, hidden: int) -> list[tuple[str, int]]:
    """(element type, bytes) of every all-to-all whose payload has `hidden` (or hidden / 128)
    columns: the token and scale exchanges."""
    out = []
    for shape in collective_shapes(hlo, "all-to-all"):
        first = re.search(r"([a-z0-9]+)\[1,(\d+),(\d+)\]", shape)
        if first and int(first.group(3)) in (hidden, hidden // 128):
            out.append((first.group(1) + f"x{first.group(3)}", collective_bytes(shape)))
    return out


def _fp8_dispatch_programs(exchange):
    """(bf16 dispatch, FP8 dispatch): each (forward, gradient step) compiled HLO text."""
    cfg = _config(
        "d2e4", hidden_size=256, expert_ffn=128, fp8="block", dtype=jnp.bfloat16, exchange=exchange
    )
    params = init_moe_params(jax.random.key(43), cfg)
    x = jax.random.normal(jax.random.key(44), (8, 10, 256), jnp.bfloat16)
    mesh = _mesh("d2e4")

    def programs(c):
        fwd = jax.jit(lambda p, x: moe_layer(p, x, c, mesh=mesh))
        step = jax.jit(jax.grad(_loss(lambda p, x: moe_layer(p, x, c, mesh=mesh)), (0, 1)))
        return fwd.lower(params, x).compile().as_text(), step.lower(params, x).compile().as_text()

    return programs(cfg), programs(dataclasses.replace(cfg, dispatch="fp8"))


def test_fp8_dispatch_exchanges_fp8_tokens_and_scales():
    def exchanges(c):
        return tuple(_token_exchanges(text, 256) for text in c)

    plain, fp8_ = _fp8_dispatch_programs("dense")

    fwd, step = exchanges(plain)
    fwd8, step8 = exchanges(fp8_)
    # bf16 dispatch forward: tokens out and back in the activation dtype (XLA:CPU widens bf16
    # collectives to f32).
    assert [k for k, _ in fwd] == ["f32x256", "f32x256"], fwd
    # FP8 dispatch forward: FP8 bytes (bitcast to u8) and their f32 scales, 1/128 of the
    # elements; only the combine moves activation-dtype tokens.
    assert sorted(k for k, _ in fwd8) == ["f32x2", "f32x256", "u8x256"], fwd8
    u8 = next(b for k, b in fwd8 if k == "u8x256")
    scales = next(b for k, b in fwd8 if k == "f32x2")
    assert scales * 128 == u8 * 4
    dispatch_bf16 = fwd[0][1]
    assert u8 * 4 == dispatch_bf16  # 1 byte per element instead of f32's 4 here (bf16's 2 on GPU)
    # The step: the backward exchanges the dispatch's gradient and the combine's in the
    # activation dtype; the FP8 step has no bf16 token dispatch in its forward.
    assert sorted(k for k, _ in step) == ["f32x256"] * 4, step
    assert sorted(k for k, _ in step8) == ["f32x2", "f32x256", "f32x256", "f32x256", "u8x256"]


def _gathers(hlo: str, hidden: int) -> dict[str, list[str]]:
    """Element type x columns of the all-gathers and reduce-scatters of `hidden` (or hidden / 128)
    columns, per collective: the tokens, their FP8 scales and the outputs."""
    out = {}
    for kind in ("all-gather", "reduce-scatter"):
        found = []
        for shape in collective_shapes(hlo, kind):
            m = re.fullmatch(r"([a-z0-9]+)\[\d+,(\d+)\]\S*", shape)
            if m and int(m.group(2)) in (hidden, hidden // 128):
                found.append(f"{m.group(1)}x{m.group(2)}")
        out[kind] = sorted(found)
    return out


def test_fp8_dispatch_of_the_gather_exchange_gathers_fp8_tokens_and_scales():
    (fwd, step), (fwd8, step8) = _fp8_dispatch_programs("gather")
    for text in (fwd, step, fwd8, step8):
        assert not collective_shapes(text, "all-to-all")
    # bf16 dispatch: the tokens gathered in the activation dtype (widened to f32 on XLA:CPU),
    # the outputs reduce-scattered in f32.
    assert _gathers(fwd, 256) == {"all-gather": ["f32x256"], "reduce-scatter": ["f32x256"]}
    # FP8 dispatch: FP8 bytes (1 byte per element instead of f32's 4 here, bf16's 2 on GPU)
    # and their f32 scales gathered.
    assert _gathers(fwd8, 256) == {
        "all-gather": ["f32x2", "u8x256"],
        "reduce-scatter": ["f32x256"],
    }
    # The gradient step: the outputs' gradient gathered, the tokens' reduce-scattered, both in
    # the activation dtype; the FP8 step gathers no activation-dtype tokens.
    assert _gathers(step, 256) == {
        "all-gather": ["f32x256", "f32x256"],
        "reduce-scatter": ["f32x256"],
    }
    assert _gathers(step8, 256) == {
        "all-gather": ["f32x2", "f32x256", "u8x256"],
        "reduce-scatter": ["f32x256"],
    }


def test_fp8_dispatch_in_a_pipeline_stage():
    """The decoder on a pipe x expert mesh (1F1B stages holding the MoE layer)."""
    from jaxops.models import AttentionSpec, DecoderConfig, MoEDecoder, MoESpec

    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True)
    dcfg = DecoderConfig("qwen3_moe", 64, 128, 2, attention, MoESpec(8, 2, 64))
    mesh = jax.make_mesh((2, 4), ("pipe", "expert"))
    tokens = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    out = {}
    for dispatch in ("dtype", "fp8"):
        model = MoEDecoder(dcfg, mesh, num_microbatches=2, fp8="block", dispatch=dispatch)
        params = model.init(jax.random.key(0))
        out[dispatch] = jax.jit(model.loss_and_grads)(params, *model.place_batch(tokens, targets))
    (loss, grads), (loss8, grads8) = out["dtype"], out["fp8"]
    assert float(loss8) == float(loss)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), g8 in zip(flat, jax.tree.leaves(grads8), strict=True):
        name = jax.tree_util.keystr(path)
        if "w_in" in name and "shared" not in name:
            assert rel_error(g8, g) < W_IN_BOUND, name
        else:
            np.testing.assert_array_equal(g8, g, err_msg=name)


# -------------------------------------------------------------------------------------------------
# The exchange.


def _np_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv):
    """jax.lax.ragged_all_to_all's documented semantics, per device, in numpy."""
    n = len(operands)
    slices = len(in_off[0]) // n
    results = [o.copy() for o in outputs]
    for src in range(n):
        for i in range(n * slices):
            dst = i // slices
            piece = operands[src][in_off[src][i] : in_off[src][i] + send[src][i]]
            j = src * slices + i % slices  # this slice's index on the receiver
            assert recv[dst][j] == send[src][i]
            results[dst][out_off[src][i] : out_off[src][i] + send[src][i]] = piece
    return results


def _received(send, gap):
    """For send sizes ``[n, n * slices]``: (recv sizes, the senders' output offsets, the
    receivers' view of them), each receiver taking its senders' slices in order, `gap` rows
    between them."""
    n = send.shape[0]
    slices = send.shape[1] // n
    recv, out_off, recv_off = (np.zeros_like(send) for _ in range(3))
    for dst in range(n):
        pos = 0
        for src in range(n):
            for s in range(slices):
                size = send[src, dst * slices + s]
                recv[dst, src * slices + s] = size
                out_off[src, dst * slices + s] = pos
                recv_off[dst, src * slices + s] = pos
                pos += size + gap
    return recv, out_off, recv_off


def _random_exchange(rng, n, slices, chunk, totals):
    """Random ragged_all_to_all arguments for n devices (``[n, n * slices]`` each): device d
    sends totals[d] <= chunk rows in random slices, laid out with gaps in its operand, and
    receives them with a gap between slices. Returns (operands, outputs, in_off, send, out_off,
    recv, recv_off); recv_off is the receiver's view of where each sender's slice lands."""
    send = np.zeros((n, n * slices), np.int32)
    in_off = np.zeros_like(send)
    for d in range(n):
        sizes = rng.multinomial(totals[d], [1 / (n * slices)] * n * slices)
        gaps = rng.integers(0, 2, n * slices)
        send[d] = sizes
        in_off[d] = np.cumsum(sizes + gaps) - sizes
    recv, out_off, recv_off = _received(send, gap=1)
    rows = int(max(in_off.max() + send.max(), chunk, 1))
    out_rows = int(max(out_off.max() + send.max(), 1)) + 1
    operands = rng.normal(size=(n, rows, 3)).astype(np.float32)
    outputs = np.full((n, out_rows, 3), -1.0, np.float32)
    return operands, outputs, in_off, send, out_off, recv, recv_off


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), slices=st.sampled_from([1, 2, 3]), block=st.sampled_from([1, 3, 5, 11]))
def test_dense_exchange_has_ragged_all_to_all_semantics(data, slices, block):
    n, chunk = 8, 12
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    totals = [data.draw(st.integers(0, chunk)) for _ in range(n)]
    operands, outputs, in_off, send, out_off, recv, recv_off = _random_exchange(
        rng, n, slices, chunk, totals
    )
    want = _np_ragged_all_to_all(operands, outputs, in_off, send, out_off, recv)
    mesh = jax.make_mesh((n,), ("x",))

    def body(op, out, a, b, c, d, r):
        kw = dict(axis_name="x", chunk=chunk)
        args = (op[0], out[0], a[0], b[0], c[0], d[0])
        exchanged = expert._ragged_all_to_all_dense(*args, **kw)  # output offsets exchanged
        given = expert._ragged_all_to_all_dense(*args, recv_offsets=r[0], **kw)
        # In rounds of `block` rows per peer, their count found by a pmax, or given.
        pmaxed = expert._ragged_all_to_all_dense(*args, recv_offsets=r[0], block=block, **kw)
        most = int(np.max(send.reshape(n, n, slices).sum(axis=2)))
        counted = expert._ragged_all_to_all_dense(
            *args, recv_offsets=r[0], block=block, rounds=-(-most // block), **kw
        )
        return tuple(x[None] for x in (exchanged, given, pmaxed, counted))

    args = jax.device_put(
        (operands, outputs, in_off, send, out_off, recv, recv_off), jax.NamedSharding(mesh, P("x"))
    )
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    for name, got in zip(("exchanged", "given", "pmaxed", "counted"), fn(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.stack(want), err_msg=name)


@pytest.mark.parametrize("skew", ["even", "one-hot-peer", "empty"])
def test_dense_exchange_in_rounds_has_the_one_round_gradient(skew):
    """Rounds (a loop with its transpose as the custom_vjp) against one round (jax's autodiff
    of the straight-line exchange): the gradients of the operand and of the output buffer."""
    n, slices, chunk, block = 4, 2, 24, 5
    rng = np.random.default_rng(7)
    totals = {"even": [20, 24, 17, 9], "one-hot-peer": [24, 0, 3, 24], "empty": [0] * n}[skew]
    operands, outputs, in_off, send, out_off, recv, recv_off = _random_exchange(
        rng, n, slices, chunk, totals
    )
    if skew == "one-hot-peer":  # device 0 sends all its rows to peer 2: ceil(24 / 5) rounds
        send[0] = 0
        send[0, 2 * slices] = 24
        operands, outputs, in_off, send, out_off, recv, recv_off = _relaid(send, operands.shape)
    weights = rng.normal(size=outputs.shape).astype(np.float32)
    mesh = jax.make_mesh((n,), ("x",))

    def loss_fn(block):
        def body(op, out, w, a, b, c, d, r):
            y = expert._ragged_all_to_all_dense(
                op[0],
                out[0],
                a[0],
                b[0],
                c[0],
                d[0],
                axis_name="x",
                chunk=chunk,
                recv_offsets=r[0],
                block=block,
            )
            return jnp.sum(y * w[0])[None]

        fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1)))

    args = jax.device_put(
        (operands, outputs, weights, in_off, send, out_off, recv, recv_off),
        jax.NamedSharding(mesh, P("x")),
    )
    rounds = loss_fn(block)(*args)
    once = loss_fn(chunk)(*args)
    for name, got, want in zip(("operand", "output"), rounds, once, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    # The output buffer's gradient is the weight where nothing was written.
    written = np.stack(
        _np_ragged_all_to_all(operands, outputs * 0 + np.nan, in_off, send, out_off, recv)
    )
    np.testing.assert_array_equal(np.asarray(rounds[1]), np.where(np.isnan(written), weights, 0.0))
    if skew == "empty":
        np.testing.assert_array_equal(np.asarray(rounds[0]), 0.0)


def _relaid(send, operand_shape):
    """The arguments of :func:`_random_exchange` for given send sizes ``[n, n * slices]``."""
    n = send.shape[0]
    in_off = np.cumsum(send, axis=1) - send
    recv, out_off, recv_off = _received(send, gap=0)
    rng = np.random.default_rng(1)
    operands = rng.normal(size=operand_shape).astype(np.float32)
    outputs = np.full((n, int(max(recv.sum(axis=1).max(), 1)) + 2, 3), -1.0, np.float32)
    return operands, outputs, in_off, send, out_off, recv, recv_off


def test_exchange_bounds():
    cfg = MoEConfig(num_experts=16, top_k=8, hidden_size=8, expert_ffn=8, align=16)
    # 4 local experts: a token sends at most 4 rows to one device.
    assert exchange_bounds(cfg, 100, 4) == (400, 4 * 400 + 4 * 15)
    capped = dataclasses.replace(cfg, capacity_factor=1.0)
    c = capped.capacity(400)  # ceil(400 * 8 / 16) = 200
    assert c == 200
    assert exchange_bounds(capped, 100, 4) == (400, 4 * 208)
    tiny = dataclasses.replace(cfg, capacity_factor=0.01)
    assert exchange_bounds(tiny, 100, 4) == (4 * 2, 4 * 16)


def test_ragged_exchange_lowers_on_cpu():
    """XLA:CPU cannot compile ragged_all_to_all, but the GPU program must trace and lower."""
    cfg = _config("d2e4", exchange="ragged")
    params = init_moe_params(jax.random.key(14), cfg)
    x = jax.random.normal(jax.random.key(15), (8, 3, 32))
    mesh = _mesh("d2e4")
    fwd = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)).lower(params, x).as_text()
    assert fwd.count("ragged_all_to_all") == 2
    loss = _loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh))
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
    assert bwd.count("ragged_all_to_all") == 4


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["kernel", "ragged_dot", "loop"])
@pytest.mark.parametrize("routing", ROUTINGS, ids=[f"top{k}-{r}-cf{cf}" for k, r, cf in ROUTINGS])
def test_gpu_ragged_exchange_matches_reference(routing, gemm, monkeypatch):
    # "kernel": jaxops' CUDA grouped GEMM (the plan's choice). Without it: "ragged_dot" (small
    # dense form), and "loop" with the plan's budget for ragged_dot's dense form set to 0, so
    # the grouped GEMMs and their gradients run the loop over groups. All in full float32: the
    # CUDA kernel multiplies float32 in fp32 whatever the precision mode, and XLA:GPU's default
    # for the reference's dots is TF32 (on an H200 that put 36-61% of y's elements up to 1.4e-3
    # from the kernel's, 2026-11-30).
    if gemm != "kernel":
        monkeypatch.setattr(expert._exchange._grouped_gemm, "kernel_available", lambda *a: False)
    if gemm == "loop":
        monkeypatch.setattr(expert._exchange, "GPU_RAGGED_DOT_MAX_BYTES", 0)
    k, router, cf = routing
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("expert",))
    cfg = MoEConfig(
        num_experts=8 * n, top_k=k, hidden_size=32, expert_ffn=24, router=router,
        capacity_factor=cf, data_axes=(), dtype=jnp.float32, exchange="ragged",
    )  # fmt: skip
    plan = expert._exchange.make_plan(cfg, mesh, n, 1, 4 * n * 5)
    assert plan.tile == (0 if gemm == "ragged_dot" else expert._ffn.GPU_TILE)
    assert expert._exchange._grouped_gemm.kernel_available() == (gemm == "kernel")
    params = init_moe_params(jax.random.key(16), cfg)
    x = jax.random.normal(jax.random.key(17), (4 * n, 5, 32))
    with jaxops.precision("fp32"):
        _compare(_run(cfg, mesh, params, x), _reference(cfg, params, x), scale=4)


# -------------------------------------------------------------------------------------------------
# Compiled program: collectives, retracing.


def test_compiled_dense_exchange_moves_no_tokens_but_by_all_to_all():
    cfg = _config("d2e4", top_k=2, exchange="dense")
    params = init_moe_params(jax.random.key(18), cfg)
    x = jax.random.normal(jax.random.key(19), (8, 5, 32))
    mesh = _mesh("d2e4")
    step = jax.jit(
        jax.value_and_grad(_loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)), argnums=(0, 1))
    )
    hlo = step.lower(params, x).compile().as_text()
    counts = count_collectives(hlo)
    # Forward: tokens out and back; backward: the two transposed exchanges. No offsets cross
    # (each device computes every peer's from the gathered counts). Router gradient: one
    # all-reduce over the token axes.
    data = [s for s in collective_shapes(hlo, "all-to-all") if "f32" in s]
    ints = [s for s in collective_shapes(hlo, "all-to-all") if "f32" not in s]
    assert len(data) == 4 and not ints, counts
    # Only the [N, 2, E] int32 counts are gathered: no token all-gather.
    assert all(re.fullmatch(r"s32\[4,2,16\]\S*", s) for s in collective_shapes(hlo, "all-gather"))
    for shape in collective_shapes(hlo, "all-reduce"):
        assert not re.search(r"\[\d+,32\]", shape), f"tokens all-reduced: {shape}"


@pytest.mark.parametrize("routing", ["random", "one-device"])
def test_dense_exchange_moves_blocks_of_the_mean_rows(routing, monkeypatch):
    """exchange="dense" in rounds of [N, block] rows (block = 1.25x the mean rows a peer:
    64 tokens x top-2 / 4 devices -> 40, not the bound of 128): the compiled step's all-to-alls
    carry those blocks, its temporaries are smaller than one round's, and its output and
    gradients are bit-identical to one round's and match the reference. "one-device" routes
    every token to the experts of expert device 0 (128 rows a peer: 4 rounds)."""
    cfg = _config("d2e4", top_k=2, exchange="dense")
    params = init_moe_params(jax.random.key(20), cfg)
    x = jax.random.normal(jax.random.key(21), (8, 64, 32))
    if routing == "one-device":
        x = jnp.abs(x)
        bias = jnp.where(jnp.arange(16) < 4, 1.0, -1.0) + 0.01 * jnp.arange(16)
        params = {**params, "router": jnp.broadcast_to(bias, (32, 16)) * 0.1}
    mesh = _mesh("d2e4")

    def build():
        layer = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh))
        grad = jax.jit(
            jax.grad(_loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)), argnums=(0, 1))
        )
        compiled = grad.lower(params, x).compile()
        return (layer(params, x), compiled(params, x)), compiled

    def a2a_shapes(compiled):  # XLA:CPU splits an all_to_all into one operand per peer
        text = " ".join(collective_shapes(compiled.as_text(), "all-to-all"))
        return set(re.findall(r"\w+\[[\d,]*\]", text))

    rounds, compiled = build()
    assert a2a_shapes(compiled) == {"f32[1,40,32]"}
    monkeypatch.setattr(expert._exchange, "DENSE_BLOCK_SLACK", 1e9)  # one round of the bound
    once, compiled_once = build()
    assert a2a_shapes(compiled_once) == {"f32[1,128,32]"}
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < compiled_once.memory_analysis().temp_size_in_bytes
    for got, want in zip(jax.tree.leaves(rounds), jax.tree.leaves(once), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if routing == "one-device":
        counts = np.asarray(rounds[0][1].tokens_per_expert)
        assert counts[4:].sum() == 0 and counts[:4].sum() == 2 * 8 * 64, counts
    _compare(rounds, _reference(cfg, params, x))


def test_compiled_gather_exchange_moves_tokens_once_each_way():
    """auto on CPU: no all-to-all, no worst-case block; the tokens and routing gathered, the
    outputs reduce-scattered, and their transposes in the backward."""
    cfg = _config("d2e4", top_k=2)
    params = init_moe_params(jax.random.key(18), cfg)
    x = jax.random.normal(jax.random.key(19), (8, 5, 32))  # 5 tokens per device, 20 per group
    mesh = _mesh("d2e4")
    step = jax.jit(
        jax.value_and_grad(_loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)), argnums=(0, 1))
    )
    hlo = step.lower(params, x).compile().as_text()
    assert not collective_shapes(hlo, "all-to-all")
    gathered = sorted(s.split("{")[0] for s in collective_shapes(hlo, "all-gather"))
    # tokens (forward), probs + ids (forward), the outputs' gradient (backward)
    assert gathered == ["f32[20,32]", "f32[20,32]", "f32[20,4]"], gathered
    scattered = sorted(s.split("{")[0] for s in collective_shapes(hlo, "reduce-scatter"))
    # the outputs (forward), the tokens' and the probs' gradients (backward)
    assert scattered == ["f32[5,32]", "f32[5,32]", "f32[5,4]"], scattered
    for shape in collective_shapes(hlo, "all-reduce"):
        assert not re.search(r"\[\d+,32\]", shape), f"tokens all-reduced: {shape}"
    # jaxops' unpermute and its permute's backward read the routed rows only: no grouped GEMM
    # of the forward or the backward writes the rows past its groups.
    tails = re.findall(r'"jaxops_grouped_gemm".*?zero_tail = (true|false)', hlo)
    assert len(tails) == 4 and set(tails) == {"false"}, tails


def test_jit_does_not_retrace_per_step():
    cfg = _config("e8")
    mesh = _mesh("e8")
    traces = []

    @jax.jit
    def step(params, x):
        traces.append(1)
        return jax.grad(_loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)))(params, x)

    specs = expert.moe_param_specs(cfg)
    params = jax.device_put(
        init_moe_params(jax.random.key(20), cfg),
        {k: jax.NamedSharding(mesh, s) for k, s in specs.items()},
    )
    for i in range(3):
        x = jax.random.normal(jax.random.key(21 + i), (8, 4, 32))
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, step(params, x))
    assert len(traces) == 1
    # An equal config built again hits the same cache entry.
    assert hash(cfg) == hash(_config("e8"))


# -------------------------------------------------------------------------------------------------
# Token mask: padded / packed batches.

# Valid tokens per row of an [8, 4] batch (right padding; rows 2 and 6 are all padding, so on
# the 8-device mesh two devices hold no valid token).
_LENGTHS = np.array([4, 3, 0, 2, 4, 1, 0, 3])
MASK_CASE = dict(num_experts=8, router="sigmoid", router_bias=True, shared_ffn=8, shared_gate=True)


def _masked_case(lengths=_LENGTHS, seq=4, **kw):
    """(cfg, params, x [B, seq, 32], mask [B, seq]) with the first `lengths[b]` tokens valid."""
    cfg = _config("d2e4", **{**MASK_CASE, **kw})
    rng = np.random.default_rng(40)  # numpy draws: no compile per shape, as jax.random has
    # [..., in, out] weights scaled by 1 / sqrt(in); the router bias [E] by 0.2.
    scales = {name: 0.2 if len(s) == 1 else s[-2] ** -0.5 for name, s in cfg.param_shapes.items()}
    params = {
        name: jnp.asarray(rng.normal(size=shape) * scales[name])
        for name, shape in cfg.param_shapes.items()
    }
    x = jnp.asarray(rng.normal(size=(len(lengths), seq, 32)), jnp.float32)
    return cfg, params, x, jnp.asarray(np.arange(seq)[None, :] < lengths[:, None])


def _value_and_grads(layer, params, x, weights):
    """((y, aux), (d params, d x)) of ``sum(y * weights) + aux.loss``, in one compiled call."""

    def loss(p, x):
        y, aux = layer(p, x)
        return jnp.sum(y.astype(jnp.float32) * weights) + aux.loss, (y, aux)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


def _masked_weights(mask, hidden=32):
    """The output weights of the loss, zero at masked tokens."""
    return _weights((*mask.shape, hidden)) * mask[..., None]


def _sharded(mesh, cfg, params, *tokens):
    """params on moe_param_specs and token arrays on the token axes: shard_map's inputs."""
    specs, tok = expert.moe_param_specs(cfg), jax.NamedSharding(mesh, P(cfg.token_axes))
    placed = {k: jax.device_put(v, jax.NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return (placed, *(jax.device_put(a, tok) for a in tokens))


@functools.cache
def _compacted_want():
    """The reference on the unmasked tokens of :func:`_masked_case` only (no mask)."""
    cfg, params, x, mask = _masked_case()
    keep = np.asarray(mask)
    layer = lambda p, x: moe_layer_reference(p, x, cfg)  # noqa: E731
    return _value_and_grads(layer, params, x[keep], _masked_weights(mask)[keep])


def _compare_masked(got, mask):
    """The layer on the padded batch vs the reference on its unmasked tokens only."""
    (y, aux), (grads, dx) = got
    keep = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y)[~keep], 0.0)
    np.testing.assert_array_equal(np.asarray(dx)[~keep], 0.0)
    _compare(((np.asarray(y)[keep], aux), (grads, np.asarray(dx)[keep])), _compacted_want())


@pytest.mark.parametrize("mesh_name", ["1", "d2e4"])
def test_token_mask_equals_reference_on_unmasked_tokens(mesh_name):
    """y, aux and gradients of the masked layer = the reference on the compacted tokens."""
    cfg, params, x, mask = _masked_case()
    if mesh_name == "1":
        mesh = jax.make_mesh((1, 1), ("data", "expert"), devices=jax.devices()[:1])
        given = mask.astype(jnp.int32)  # read as != 0
    else:
        mesh, given = _mesh(mesh_name), mask
    layer = lambda p, x: moe_layer(p, x, cfg, mesh=mesh, token_mask=given)  # noqa: E731
    got = _value_and_grads(layer, params, x, _masked_weights(mask))
    _compare_masked(got, mask)
    assert int(got[0][1].tokens_per_expert.sum()) == int(_LENGTHS.sum()) * cfg.top_k


def test_token_mask_reference_equals_reference_on_unmasked_tokens():
    cfg, params, x, mask = _masked_case()
    layer = lambda p, x: moe_layer_reference(p, x, cfg, token_mask=mask)  # noqa: E731
    _compare_masked(_value_and_grads(layer, params, x, _masked_weights(mask)), mask)


def test_token_mask_inside_shard_map():
    """The pipeline-stage path: the layer on this device's shards of x and of the mask."""
    cfg, params, x, mask = _masked_case()
    mesh, specs, tok = _mesh("d2e4"), expert.moe_param_specs(cfg), P(cfg.token_axes)

    def body(p, x, m):
        assert x.shape == (1, 4, 32) and m.shape == (1, 4)  # local shards
        return moe_layer(p, x, cfg, mesh=mesh, token_mask=m)

    aux_specs = expert.MoEAux(P(), P(), P(), P(), P())
    layer = jax.shard_map(body, mesh=mesh, in_specs=(specs, tok, tok), out_specs=(tok, aux_specs))
    y, aux = jax.jit(layer)(*_sharded(mesh, cfg, params, x, mask))
    (y_ref, aux_ref), _ = _compacted_want()
    keep = np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(y)[~keep], 0.0)
    assert_allclose(np.asarray(y)[keep], y_ref, jnp.float32, err_msg="y")
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    for name in ("loss", "load_balancing_loss", "z_loss"):
        assert_allclose(getattr(aux, name), getattr(aux_ref, name), jnp.float32, err_msg=name)


@pytest.mark.parametrize("layer", ["moe_layer", "moe_layer_reference"])
def test_token_mask_all_masked_gives_zeros_and_zero_gradients(layer):
    cfg, params, _, _ = _masked_case()
    x = jnp.full((8, 2, 32), jnp.nan)  # padding garbage must not leak either
    mask = jnp.zeros((8, 2), bool)
    if layer == "moe_layer":
        mesh = _mesh("d2e4")
        call = lambda p, x: moe_layer(p, x, cfg, mesh=mesh, token_mask=mask)  # noqa: E731
    else:
        call = lambda p, x: moe_layer_reference(p, x, cfg, token_mask=mask)  # noqa: E731
    (y, aux), (grads, dx) = _value_and_grads(call, params, x, 1.0)
    assert not np.asarray(y).any()
    for name, value in aux._asdict().items():
        assert not np.asarray(value).any(), name
    for name, g in grads.items():
        assert not np.asarray(g).any(), name  # zero, not NaN
    assert not np.asarray(dx).any()


def test_token_mask_padding_takes_no_capacity():
    """Padding rows first: unmasked, they would fill experts 0 and 1 before any real token."""
    lengths = np.array([0, 0, 0, 0, 4, 4, 4, 4])
    cfg, params, x, mask = _masked_case(
        lengths, capacity_factor=0.5, router="softmax", router_bias=False
    )
    assert cfg.capacity(32) == 4  # from the static count: 32 tokens, padding included
    x = jnp.where(mask[..., None], x, 0.0)
    _, _, ids, _ = expert._router(cfg, x.reshape(-1, 32), params["router"])
    assert set(np.asarray(ids)[:16].reshape(-1).tolist()) == {0, 1}  # 16 slots each, > C
    mesh = _mesh("d2e4")
    y, aux = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh, token_mask=mask))(params, x)
    # The 16 real tokens alone, with the same C = ceil(1.0 * 16 * 2 / 8) = 4.
    same_c = dataclasses.replace(cfg, capacity_factor=1.0)
    keep = np.asarray(mask)
    y_ref, aux_ref = jax.jit(lambda p, x: moe_layer_reference(p, x, same_c))(params, x[keep])
    assert int(aux.dropped) == int(aux_ref.dropped) > 0
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    assert_allclose(np.asarray(y)[keep], y_ref, jnp.float32)
    np.testing.assert_array_equal(np.asarray(y)[~keep], 0.0)


# -------------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"top_k": 17}, ConfigError, "top_k must be <= num_experts = 16"),
        ({"top_k": 0}, ConfigError, "top_k must be >= 1"),
        ({"activation": "relu"}, ConfigError, "activation must be one of"),
        ({"router": "argmax"}, ConfigError, "router must be one of"),
        ({"capacity_factor": 0.0}, ConfigError, "capacity_factor must be > 0"),
        ({"capacity_factor": -1.0}, ConfigError, "capacity_factor must be finite and >= 0"),
        ({"fp8": "tensor"}, ConfigError, r"fp8=Recipe\('tensor'\) is not a recipe this call runs"),
        ({"align": 0}, ConfigError, "align must be >= 1"),
        ({"dtype": jnp.int32}, TypeError, "dtype must be float32, bfloat16 or float16"),
        ({"data_axes": ("expert",)}, ConfigError, "data_axes must be mesh axis names other"),
        ({"num_experts": 2.0}, TypeError, "num_experts must be an int"),
        ({"n_group": 3}, ConfigError, "num_experts = 16 must be divisible by n_group"),
        ({"n_group": 16}, ConfigError, "leaves 1 expert per group"),
        ({"n_group": 4, "topk_group": 5}, ConfigError, "topk_group must be <= n_group = 4"),
        ({"n_group": 4, "topk_group": 1, "top_k": 5}, ConfigError, "top_k = 5 exceeds the 4"),
        ({"routed_scaling_factor": 0.0}, ConfigError, "routed_scaling_factor must be > 0"),
        ({"shared_gate": True}, ConfigError, "shared_gate needs a shared expert"),
        ({"shared_ffn": -1}, ConfigError, "shared_ffn must be >= 0"),
        ({"router_bias": 1}, TypeError, "router_bias must be a bool"),
        ({"dispatch": "bf16"}, ConfigError, "dispatch must be one of"),
        ({"dispatch": "fp8"}, ConfigError, "dispatch='fp8' .* needs fp8='block', got fp8=None"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else "",
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=f"^jaxops.parallel.expert.MoEConfig: .*{match}"):
        _config("e8", **kwargs)


LAYER = r"^jaxops\.parallel\.expert\.moe_layer: .*"


def test_bad_layer_input():
    mesh = _mesh("d2e4")
    cfg = _config("d2e4")
    params = init_moe_params(jax.random.key(0), cfg)
    x = jnp.ones((8, 32))
    with pytest.raises(
        ValueError, match=LAYER + r"num_experts = 10 must be divisible by the size 4"
    ):
        bad = _config("d2e4", num_experts=10)
        moe_layer(init_moe_params(jax.random.key(0), bad), x, bad, mesh=mesh)
    with pytest.raises(ValueError, match=LAYER + r"the mesh has no axis 'batch' \(cfg.data_axes\)"):
        moe_layer(params, x, dataclasses.replace(cfg, data_axes=("batch",)), mesh=mesh)
    with pytest.raises(ValueError, match=LAYER + r"no axis 'experts' \(cfg.expert_axis\)"):
        moe_layer(params, x, dataclasses.replace(cfg, expert_axis="experts"), mesh=mesh)
    with pytest.raises(
        ValueError, match=LAYER + r"leading axis \(6\) must be divisible by the 8 devices"
    ):
        moe_layer(params, jnp.ones((6, 32)), cfg, mesh=mesh)
    with pytest.raises(ValueError, match=LAYER + r"H = cfg.hidden_size = 32, got \(8, 16\)"):
        moe_layer(params, jnp.ones((8, 16)), cfg, mesh=mesh)
    with pytest.raises(
        ValueError, match=LAYER + r"params\['w_in'\] must have shape \(16, 32, 48\)"
    ):
        moe_layer({**params, "w_in": params["w_in"][:, :, :24]}, x, cfg, mesh=mesh)
    with pytest.raises(ValueError, match=LAYER + r"params must be a dict with keys"):
        moe_layer({"router": params["router"]}, x, cfg, mesh=mesh)
    with pytest.raises(TypeError, match=LAYER + r"x must have dtype"):
        moe_layer(params, x.astype(jnp.int32), cfg, mesh=mesh)
    with pytest.raises(TypeError, match=LAYER + r"mesh must be a jax.sharding.Mesh"):
        moe_layer(params, x, cfg, mesh="d2e4")
    with pytest.raises(TypeError, match=LAYER + r"cfg must be a MoEConfig"):
        moe_layer(params, x, {"num_experts": 16}, mesh=mesh)


def test_bad_reference_input():
    cfg = _config("e8")
    params = init_moe_params(jax.random.key(0), cfg)
    op = r"^jaxops\.parallel\.expert\.moe_layer_reference: "
    with pytest.raises(ValueError, match=op + r".*H = cfg.hidden_size = 32, got \(4, 16\)"):
        moe_layer_reference(params, jnp.ones((4, 16)), cfg)
    with pytest.raises(TypeError, match=op + "cfg must be a MoEConfig"):
        moe_layer_reference(params, jnp.ones((4, 32)), {"num_experts": 16})
    with pytest.raises(TypeError, match=r"^jaxops\.parallel\.expert\.init_moe_params: cfg must"):
        init_moe_params(jax.random.key(0), {"num_experts": 16})


def test_bad_token_mask():
    cfg, params, x, mask = _masked_case()
    mesh = _mesh("d2e4")
    ref = r"^jaxops\.parallel\.expert\.moe_layer_reference: "
    for op, call in (
        (LAYER, lambda m: moe_layer(params, x, cfg, mesh=mesh, token_mask=m)),
        (ref, lambda m: moe_layer_reference(params, x, cfg, token_mask=m)),
    ):
        with pytest.raises(
            ValueError, match=op + r"token_mask must have x's leading shape \(8, 4\).*got \(8,\)"
        ):
            call(mask[:, 0])
        with pytest.raises(TypeError, match=op + r"token_mask must have dtype bool, .*got float32"):
            call(mask.astype(jnp.float32))
    # Inside a shard_map the mask is this device's shard, like x.
    specs, tok = expert.moe_param_specs(cfg), P(cfg.token_axes)
    layer = jax.shard_map(
        lambda p, x: moe_layer(p, x, cfg, mesh=mesh, token_mask=mask)[0],
        mesh=mesh,
        in_specs=(specs, tok),
        out_specs=tok,
    )
    with pytest.raises(ValueError, match=LAYER + r"leading shape \(1, 4\).*got \(8, 4\)"):
        layer(*_sharded(mesh, cfg, params, x))


# -------------------------------------------------------------------------------------------------
# Renamed names: the old ones still work, with a DeprecationWarning.

# old field name: (new field name, a value other than the default)
RENAMED = {
    "hidden": ("hidden_size", 48),
    "ffn_hidden": ("expert_ffn", 40),
    "shared_ffn_hidden": ("shared_ffn", 16),
    "normalize_probs": ("normalize_topk", False),
    "aux_loss_coef": ("router_aux_loss_coef", 0.5),
    "z_loss_coef": ("router_z_loss_coef", 0.25),
}


@pytest.mark.parametrize("old", list(RENAMED))
def test_renamed_config_field_warns_and_still_works(old):
    new, value = RENAMED[old]
    base = {"num_experts": 8, "top_k": 2, "hidden_size": 32, "expert_ffn": 24}
    want = MoEConfig(**{**base, new: value})
    legacy = {k: v for k, v in base.items() if k != new}
    with pytest.warns(
        DeprecationWarning, match=rf"MoEConfig: the keyword {old}= is renamed {new}="
    ):
        cfg = MoEConfig(**legacy, **{old: value})
    assert cfg == want and hash(cfg) == hash(want)  # the same jit cache entry
    assert getattr(cfg, new) == value
    with pytest.warns(DeprecationWarning, match=rf"MoEConfig\.{old} is renamed {new}"):
        assert getattr(cfg, old) == value
    assert dataclasses.replace(cfg, top_k=1) == dataclasses.replace(want, top_k=1)
    with pytest.raises(TypeError, match=f"got both {new}= and its deprecated name {old}="):
        MoEConfig(**{**base, new: value, old: value})
    # A config built with the old name is a jit static argument like any other.
    params = init_moe_params(jax.random.key(0), cfg)
    layer = jax.jit(moe_layer_reference, static_argnums=2)
    x = jnp.ones((3, cfg.hidden_size))
    np.testing.assert_array_equal(layer(params, x, cfg)[0], layer(params, x, want)[0])


def test_renamed_activations_tuple_warns_and_still_works():
    assert "ACTIVATIONS" not in expert.__all__ and "FFN_ACTIVATIONS" in expert.__all__
    with pytest.warns(DeprecationWarning, match="ACTIVATIONS is renamed FFN_ACTIVATIONS"):
        old = expert.ACTIVATIONS
    assert old == expert.FFN_ACTIVATIONS == ("swiglu", "gelu", "silu", "clamped_swiglu")
    with pytest.raises(AttributeError):
        _ = expert.NO_SUCH_NAME


def test_docstring_examples():
    from jaxops import testing

    attempted = testing.run_docstring_examples(expert)
    assert attempted >= 30, attempted


# -------------------------------------------------------------------------------------------------
# Two processes.

_TWO_PROCESS_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxops.parallel.expert import (
    MoEConfig, init_moe_params, moe_layer, moe_layer_reference, moe_param_specs)

mesh = jax.make_mesh((2, 2), ("data", "expert"))
cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, expert_ffn=24, dtype=jnp.float32,
                capacity_factor=float(ARGS[0]) if ARGS[0] != "none" else None)
params = jax.tree.map(np.asarray, init_moe_params(jax.random.key(0), cfg))
x = np.asarray(jax.random.normal(jax.random.key(1), (8, 5, 32)))
weights = np.sin(np.arange(x.size, dtype=np.float32).reshape(x.shape) * 0.37)

def loss(layer):
    def f(p, x):
        y, aux = layer(p, x)
        return jnp.sum(y * weights) + aux.loss, (y, aux)
    return f

def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

specs = moe_param_specs(cfg)
gp = {k: put(v, specs[k]) for k, v in params.items()}
gx = put(x, P(("data", "expert")))
def value_and_grad(layer):
    return jax.jit(jax.value_and_grad(loss(layer), argnums=(0, 1), has_aux=True))

step = value_and_grad(lambda p, x: moe_layer(p, x, cfg, mesh=mesh))
(l, (y, aux)), (gparams, gxg) = step(gp, gx)
ref = value_and_grad(lambda p, x: moe_layer_reference(p, x, cfg))
local = jax.local_devices()[0]  # the reference runs on one device of this process
(l_r, (y_r, aux_r)), (gparams_r, gx_r) = ref(*jax.device_put((params, x), local))

def check(glob, want, name):
    for shard in glob.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index],
                                   rtol=1e-4, atol=1e-5, err_msg=name)

check(y, y_r, "y")
check(gxg, gx_r, "dx")
for k in params:
    check(gparams[k], gparams_r[k], k)
check(aux.tokens_per_expert, aux_r.tokens_per_expert, "tokens_per_expert")
check(aux.dropped, aux_r.dropped, "dropped")
check(l, l_r, "loss")
print("OK", PROCESS_ID, int(np.asarray(aux.dropped.addressable_shards[0].data)))
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("capacity", ["none", "0.5"])
def test_two_processes_match_reference(capacity):
    outputs = run_processes(_TWO_PROCESS_SCRIPT, 2, 2, args=(capacity,), timeout=240)
    for i, out in enumerate(outputs):
        # A search, not the last line: gloo writes to the same pipe from another thread.
        found = re.search(rf"OK {i} (\d+)", out)
        assert found, out
        assert (int(found[1]) > 0) == (capacity != "none"), out


_TWO_PROCESS_FP8_DISPATCH = """
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxops.parallel.expert import MoEConfig, init_moe_params, moe_layer, moe_param_specs

mesh = jax.make_mesh((2, 2), ("data", "expert"))
cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=256, expert_ffn=128, dtype=jnp.bfloat16,
                fp8="block", capacity_factor=1.0)
params = jax.tree.map(np.asarray, init_moe_params(jax.random.key(0), cfg))
x = np.asarray(jax.random.normal(jax.random.key(1), (8, 5, 256)))
weights = np.sin(np.arange(x.size, dtype=np.float32).reshape(x.shape) * 0.37)

def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])

specs = moe_param_specs(cfg)
gp = {k: put(v, specs[k]) for k, v in params.items()}
gx = put(x.astype(jnp.bfloat16), P(("data", "expert")))
out = {}
for dispatch in ("dtype", "fp8"):
    c = dataclasses.replace(cfg, dispatch=dispatch)
    def loss(p, x):
        y, aux = moe_layer(p, x, c, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32) * weights) + aux.loss, y
    out[dispatch] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(gp, gx)

def local(a):
    return [np.asarray(s.data, np.float32) for s in a.addressable_shards]

(l, y), (g, gxg) = out["dtype"]
(l8, y8), (g8, gx8) = out["fp8"]
for a, b in zip(local(y8) + local(gx8), local(y) + local(gxg)):
    np.testing.assert_array_equal(a, b)
for k in params:
    for a, b in zip(local(g8[k]), local(g[k])):
        if k == "w_in":
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.06, k
        else:
            np.testing.assert_array_equal(a, b, err_msg=k)
print("OK", PROCESS_ID)
"""


@pytest.mark.multiprocess
def test_two_processes_fp8_dispatch():
    outputs = run_processes(_TWO_PROCESS_FP8_DISPATCH, 2, 2, timeout=240)
    for i, out in enumerate(outputs):
        assert re.search(rf"OK {i}\b", out), out


@pytest.mark.parametrize(
    "exchange,mesh_name,local,gemm",
    [("gather", "e8", 1, "ragged_dot"), ("dense", "e8", 2, "ragged_dot"),
     ("gather", "d2e4", 4, "ragged_dot"), ("gather", "e8", 2, "loop"),
     ("dense", "d2e4", 4, "loop")],
)  # fmt: skip
def test_gpu_gemm_paths_on_cpu_devices(exchange, mesh_name, local, gemm, monkeypatch):
    """The GPU plan's grouped GEMMs without jaxops' CUDA kernel, run on the 8 CPU devices:
    jax.lax.ragged_dot (plan tile 0: one local expert, or a small dense form) and the loop over
    GPU_TILE chunks (the dense form's budget set to 0). The expert weights' gradients are each
    device's own: ragged_dot's weight gradient from an invariant zero primal was summed over
    the mesh inside shard_map, mixing different experts' gradients (found 2026-11-29)."""
    monkeypatch.setattr(expert._exchange, "_platform", lambda mesh: "gpu")
    monkeypatch.setattr(expert._exchange._grouped_gemm, "kernel_available", lambda *a: False)
    if gemm == "loop":
        monkeypatch.setattr(expert._exchange, "GPU_RAGGED_DOT_MAX_BYTES", 0)
    mesh = _mesh(mesh_name)
    n = dict(mesh.shape)["expert"]
    cfg = _config(mesh_name, num_experts=local * n, exchange=exchange)
    x = jax.random.normal(jax.random.key(30), (8, 5, 32))
    tile = expert._exchange.make_plan(cfg, mesh, n, 8 // n, 40).tile
    assert tile == (0 if gemm == "ragged_dot" else expert._ffn.GPU_TILE)
    params = init_moe_params(jax.random.key(31), cfg)
    _compare(_run(cfg, mesh, params, x), _reference(cfg, params, x))


@pytest.mark.parametrize(
    "placement,routing", _covering(["e8-cpu", "d2e4-cpu", "e8-gpu", "d2e4-gpu"], ROUTINGS[:4])
)
def test_ragged_exchange_emulated_on_cpu_matches_reference(
    placement, routing, ragged_on_cpu, monkeypatch
):
    """exchange="ragged" (the GPU's choice) with ragged_all_to_all run as its dense twin: y and
    every gradient equal the reference's. The rows received into the zero buffer were typed
    invariant, so their cotangents were summed over the mesh: every gradient wrong (2026-11-29).
    "-gpu": the GPU plan's ragged_dot grouped GEMMs instead of the CPU kernels."""
    mesh_name, gpu = placement.split("-")[0], placement.endswith("-gpu")
    if gpu:
        monkeypatch.setattr(expert._exchange, "_platform", lambda mesh: "gpu")
        monkeypatch.setattr(expert._exchange._grouped_gemm, "kernel_available", lambda *a: False)
    k, router, cf = routing
    cfg = _config(mesh_name, top_k=k, router=router, capacity_factor=cf, exchange="ragged")
    mesh = _mesh(mesh_name)
    n = dict(mesh.shape)["expert"]
    tile = expert._exchange.make_plan(cfg, mesh, n, 8 // n, 40).tile
    assert tile == (0 if gpu else expert._ffn.CPU_TILE)
    params = init_moe_params(jax.random.key(32), cfg)
    x = jax.random.normal(jax.random.key(33), (8, 5, 32))
    _compare(_run(cfg, mesh, params, x), _reference(cfg, params, x))


def test_ragged_exchange_gradient_reduces_no_rows(ragged_on_cpu):
    """The ragged layer's gradient program all-reduces only weights (router, shared), never
    exchanged rows: with the receive buffers typed invariant it also all-reduced the cotangents
    of the received and returned rows over all 8 devices."""
    cfg = _config("d2e4", exchange="ragged")
    params = init_moe_params(jax.random.key(34), cfg)
    x = jax.random.normal(jax.random.key(35), (8, 5, 32))
    mesh = _mesh("d2e4")
    step = jax.jit(jax.grad(_loss(lambda p, x: moe_layer(p, x, cfg, mesh=mesh)), (0, 1)))
    hlo = step.lower(params, x).compile().as_text()
    for shape in collective_shapes(hlo, "all-reduce"):
        assert not re.search(r"\[\d+,32\]", shape), f"rows all-reduced: {shape}"
