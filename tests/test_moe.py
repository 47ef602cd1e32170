"""MoE permute / unpermute: custom calls vs a float64 numpy reference, grads, vmap, sharding."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import moe
from jaxops._moe import TARGET_PERMUTE, TARGET_ROUTE, TARGET_UNPERMUTE, TARGET_UNPERMUTE_BWD
from jaxops.testing import assert_allclose, collective_shapes, count_collectives

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _id(value):
    if isinstance(value, tuple):
        return "x".join(map(str, value)) or "scalar"
    if value is None:
        return "none"
    return np.dtype(value).name


# -------------------------------------------------------------------------------------------------
# float64 numpy reference, written plainly from the definition.


def round_up(a, b):
    return -(-a // b) * b


def np_route(ids, num_experts, align=1, capacity=None):
    """(row_map [T, K], source [R], group_sizes, group_offsets, dropped) by the definition."""
    ids = np.asarray(ids)
    t, k = ids.shape
    slots_of = [[] for _ in range(num_experts)]
    for slot in range(t * k):  # slot order: token order, then k
        e = int(ids.reshape(-1)[slot])
        if 0 <= e < num_experts:
            slots_of[e].append(slot)
    kept = [s if capacity is None else s[:capacity] for s in slots_of]
    sizes = np.array([round_up(len(s), align) for s in kept], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = moe.permuted_rows(t, k, num_experts, align, capacity)
    row_map = np.full(t * k, -1, np.int64)
    source = np.full(rows, -1, np.int64)
    for e in range(num_experts):
        for i, slot in enumerate(kept[e]):
            row_map[slot] = offsets[e] + i
            source[offsets[e] + i] = slot
    dropped = np.array([len(a) - len(b) for a, b in zip(slots_of, kept, strict=True)])
    return row_map.reshape(t, k), source, sizes, offsets, dropped


def np_permute(tokens, ids, num_experts, align=1, capacity=None, probs=None, scales=None):
    row_map, source, sizes, offsets, dropped = np_route(ids, num_experts, align, capacity)
    k = np.asarray(ids).shape[1]
    x = np.asarray(tokens, np.float64)
    out = np.zeros((source.shape[0], x.shape[1]), np.float64)
    out_probs = np.zeros(source.shape[0]) if probs is not None else None
    out_scales = np.zeros((source.shape[0], np.shape(scales)[1])) if scales is not None else None
    for r, slot in enumerate(source):
        if slot >= 0:
            out[r] = x[slot // k]
            if probs is not None:
                out_probs[r] = np.asarray(probs, np.float64).reshape(-1)[slot]
            if scales is not None:
                out_scales[r] = np.asarray(scales, np.float64)[slot // k]
    return dict(
        tokens=out,
        probs=out_probs,
        scales=out_scales,
        row_map=row_map,
        source=source,
        group_sizes=sizes,
        group_offsets=offsets,
        num_rows=offsets[-1],
        dropped=dropped,
    )


def np_unpermute(expert_out, row_map, probs=None):
    x = np.asarray(expert_out, np.float64)
    row_map = np.asarray(row_map)
    t, k = row_map.shape
    out = np.zeros((t, x.shape[1]))
    for i in range(t):
        for j in range(k):
            r = row_map[i, j]
            if r >= 0:
                w = 1.0 if probs is None else float(np.asarray(probs, np.float64)[i, j])
                out[i] += w * x[r]
    return out


def random_ids(t, k, num_experts, seed, unused=0.1, out_of_range=0.05):
    """Top-k ids with -1 slots, out-of-range ids and repeated experts within a token."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, num_experts, size=(t, k))
    u = rng.random((t, k))
    ids[u < unused] = -1
    bad = (u >= unused) & (u < unused + out_of_range)
    ids[bad] = rng.choice([num_experts, num_experts + 7, -5], size=int(bad.sum()))
    return jnp.asarray(ids, jnp.int32)


def rand(shape, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def rand_probs(t, k, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.random((t, k)).astype(np.float32))


def assert_permuted_equal(p, want, dtype):
    np.testing.assert_array_equal(np.asarray(p.row_map), want["row_map"])
    np.testing.assert_array_equal(np.asarray(p.source), want["source"])
    np.testing.assert_array_equal(np.asarray(p.group_sizes), want["group_sizes"])
    np.testing.assert_array_equal(np.asarray(p.group_offsets), want["group_offsets"])
    np.testing.assert_array_equal(np.asarray(p.dropped), want["dropped"])
    assert int(p.num_rows) == want["num_rows"]
    assert p.row_map.dtype == p.source.dtype == p.group_sizes.dtype == jnp.int32
    assert p.tokens.dtype == dtype
    # Rows are moved, not computed: bit-exact against the rounded reference.
    expected = np.asarray(jnp.asarray(want["tokens"].astype(np.float32)).astype(dtype))
    np.testing.assert_array_equal(np.asarray(p.tokens).view(np.uint8), expected.view(np.uint8))
    for name in ("probs", "scales"):
        if want[name] is None:
            assert getattr(p, name) is None
        else:
            np.testing.assert_array_equal(np.asarray(getattr(p, name)), want[name])


def uses(fn, target, *args) -> bool:
    return target in jax.jit(fn).lower(*args).as_text()


# -------------------------------------------------------------------------------------------------
# Forward against the reference.

# (T, K, E, H, align, capacity)
CASES = [
    (1, 1, 1, 1, 1, None),  # one element
    (0, 2, 4, 8, 1, None),  # no tokens
    (5, 1, 3, 7, 1, None),  # K = 1, odd hidden
    (33, 8, 6, 33, 8, None),  # K = 8
    (64, 2, 1, 16, 16, None),  # E = 1
    (40, 4, 1000, 24, 1, None),  # E = 1000: most experts empty
    (40, 4, 1000, 24, 128, None),
    (50, 3, 4, 12, 1, 7),  # capacity drops
    (50, 3, 4, 12, 8, 9),
    (9, 2, 3, 5, 1, 0),  # capacity 0: everything dropped, zero rows
    (128, 2, 8, 130, 128, None),
]


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_permute_matches_reference(dtype, case):
    t, k, e, h, align, capacity = case
    tokens = rand((t, h), dtype, seed=t + h)
    ids = random_ids(t, k, e, seed=e + k)
    probs = rand_probs(t, k, seed=3)
    want = np_permute(tokens, ids, e, align, capacity, probs=probs)
    for impl in ("ffi", "xla"):
        p = moe.permute(tokens, ids, e, probs=probs, align=align, capacity=capacity, impl=impl)
        assert p.tokens.shape == (moe.permuted_rows(t, k, e, align, capacity), h)
        assert_permuted_equal(p, want, dtype)
        assert (p.num_experts, p.align, p.capacity) == (e, align, capacity)


@pytest.mark.parametrize("align", [1, 8, 16, 128], ids=lambda a: f"align{a}")
def test_every_align_without_probs(align):
    t, k, e, h = 100, 4, 16, 40
    tokens = rand((t, h), jnp.bfloat16, seed=align)
    ids = random_ids(t, k, e, seed=align, unused=0.3)
    want = np_permute(tokens, ids, e, align)
    p = moe.permute(tokens, ids, e, align=align)
    assert_permuted_equal(p, want, jnp.bfloat16)
    assert np.all(np.asarray(p.group_sizes) % align == 0)
    assert p.probs is None and p.scales is None


@pytest.mark.parametrize("dtype", FP8, ids=_id)
def test_fp8_tokens_move_with_their_scales(dtype):
    t, k, e, h, g = 48, 2, 5, 256, 128
    q = jaxops.fp8.quantize(rand((t, h), jnp.float32, seed=4), dtype=dtype, block=(1, g))
    ids = random_ids(t, k, e, seed=5)
    want = np_permute(q.data.astype(jnp.float32), ids, e, 16, None, scales=q.scale)
    for impl in ("ffi", "xla"):
        p = moe.permute(q.data, ids, e, scales=q.scale, align=16, impl=impl)
        assert p.tokens.dtype == dtype and p.scales.shape == (p.tokens.shape[0], h // g)
        assert_permuted_equal(p, want, dtype)
        # Dequantized permuted rows are the permuted dequantized tokens.
        deq = p.tokens.astype(jnp.float32) * jnp.repeat(p.scales, g, axis=1)
        np.testing.assert_array_equal(
            np.asarray(deq),
            np_permute(q.dequantize(jnp.float32), ids, e, 16)["tokens"].astype(np.float32),
        )


def test_four_thousand_experts_and_many_tokens():
    t, k, e, h = 4096, 8, 4096, 8
    tokens = rand((t, h), jnp.float32, seed=6)
    ids = random_ids(t, k, e, seed=7)
    want = np_permute(tokens, ids, e, align=8)
    assert_permuted_equal(moe.permute(tokens, ids, e, align=8), want, jnp.float32)


# -------------------------------------------------------------------------------------------------
# Unpermute and the round trip.


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_unpermute_matches_reference(dtype, case):
    t, k, e, h, align, capacity = case
    ids = random_ids(t, k, e, seed=11)
    probs = rand_probs(t, k, seed=12)
    p = moe.permute(rand((t, h), dtype, seed=13), ids, e, align=align, capacity=capacity)
    expert_out = rand(p.tokens.shape, dtype, seed=14)
    for weights in (None, probs):
        want = np_unpermute(expert_out, p.row_map, weights)
        for impl in ("ffi", "xla"):
            got = moe.unpermute(expert_out, p, probs=weights, impl=impl)
            assert got.shape == (t, h) and got.dtype == dtype
            assert_allclose(got, want, dtype, scale=k)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_round_trip_is_the_weighted_sum_over_kept_slots(dtype):
    t, k, e, h = 77, 4, 9, 64
    x = rand((t, h), dtype, seed=15)
    ids = random_ids(t, k, e, seed=16)
    probs = rand_probs(t, k, seed=17)
    p = moe.permute(x, ids, e, align=16, capacity=30)
    got = moe.unpermute(p.tokens, p, probs=probs)
    weight = np.where(np.asarray(p.kept), np.asarray(probs, np.float64), 0.0).sum(axis=1)
    assert_allclose(got, np.asarray(x, np.float64) * weight[:, None], dtype, scale=k)
    valid = (np.asarray(ids) >= 0) & (np.asarray(ids) < e)
    assert int(p.dropped.sum()) == int(valid.sum() - p.kept.sum()) > 0


def test_kernels_are_used_and_the_twin_is_not():
    x = rand((8, 16), jnp.float32)
    ids = random_ids(8, 2, 4, seed=1)

    def f(x, impl):
        p = moe.permute(x, ids, 4, impl=impl)
        return moe.unpermute(p.tokens, p, impl=impl)

    assert uses(functools.partial(f, impl="ffi"), TARGET_ROUTE, x)
    assert uses(functools.partial(f, impl="ffi"), TARGET_PERMUTE, x)
    assert uses(functools.partial(f, impl="ffi"), TARGET_UNPERMUTE, x)
    assert not uses(functools.partial(f, impl="xla"), "jaxops_moe", x)
    jaxops.set_default_impl("xla")
    assert not uses(functools.partial(f, impl=None), "jaxops_moe", x)


def test_num_tokens_is_checked():
    p = moe.permute(jnp.ones((4, 8)), jnp.zeros((4, 2), jnp.int32), 2)
    assert moe.unpermute(p.tokens, p, num_tokens=4).shape == (4, 8)
    with pytest.raises(ValueError, match="num_tokens must equal T = 4"):
        moe.unpermute(p.tokens, p, num_tokens=5)


# -------------------------------------------------------------------------------------------------
# Autodiff.


def _loss(impl, x, probs, expert_w, ids, e, align, capacity):
    p = moe.permute(x, ids, e, probs=probs, align=align, capacity=capacity, impl=impl)
    h = jnp.tanh(p.tokens * expert_w) * p.probs[:, None]
    y = moe.unpermute(h, p, probs=probs, impl=impl)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[1], dtype=y.dtype))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] > 0], ids=_id)
def test_grads_match_autodiff_of_the_twin(case):
    t, k, e, h, align, capacity = case
    x = rand((t, h), jnp.float32, seed=20)
    probs = rand_probs(t, k, seed=21)
    w = rand((h,), jnp.float32, seed=22)
    ids = random_ids(t, k, e, seed=23)
    args = (x, probs, w)
    grads = [
        jax.jit(
            jax.grad(
                lambda a, b, c, impl=impl: _loss(impl, a, b, c, ids, e, align, capacity), (0, 1, 2)
            )
        )(*args)
        for impl in ("ffi", "xla")
    ]
    for got, want in zip(*grads, strict=True):
        assert_allclose(got, want, jnp.float32, scale=4)
    fn = jax.jit(jax.grad(lambda a, b, c: _loss("ffi", a, b, c, ids, e, align, capacity)))
    if capacity != 0:  # capacity 0 leaves no rows, and nothing for a kernel to do
        assert TARGET_UNPERMUTE_BWD in fn.lower(*args).as_text()


def test_check_grads_numerically():
    t, k, e, h = 12, 3, 4, 10
    ids = random_ids(t, k, e, seed=24)
    x = rand((t, h), jnp.float32, seed=25)
    probs = rand_probs(t, k, seed=26)
    p0 = moe.permute(x, ids, e, align=4, capacity=7)
    y = rand(p0.tokens.shape, jnp.float32, seed=27)

    def permute_fn(a, b):
        p = moe.permute(a, ids, e, probs=b, align=4, capacity=7)
        return p.tokens, p.probs

    check_grads(permute_fn, (x, probs), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
    check_grads(
        lambda a, b: moe.unpermute(a, p0, probs=b),
        (y, probs),
        order=1,
        modes=("rev",),
        atol=1e-2,
        rtol=1e-2,
    )
    check_grads(lambda a: moe.unpermute(a, p0), (y,), order=1, modes=("rev",))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=_id)
def test_half_precision_grads_are_float64_gradients_rounded(dtype):
    t, k, e, h = 30, 2, 5, 48
    ids = random_ids(t, k, e, seed=28)
    probs = rand_probs(t, k, seed=29)
    p = moe.permute(rand((t, h), dtype, seed=30), ids, e, align=8)
    y = rand(p.tokens.shape, dtype, seed=31)
    g = rand((t, h), dtype, seed=32)
    _, vjp = jax.vjp(lambda a, b: moe.unpermute(a, p, probs=b), y, probs)
    d_y, d_probs = vjp(g)
    row_map = np.asarray(p.row_map)
    g64 = np.asarray(g, np.float64)
    want_dy = np.zeros(y.shape)
    want_dp = np.zeros((t, k))
    for i in range(t):
        for j in range(k):
            if row_map[i, j] >= 0:
                want_dy[row_map[i, j]] = float(probs[i, j]) * g64[i]
                want_dp[i, j] = g64[i] @ np.asarray(y, np.float64)[row_map[i, j]]
    assert d_y.dtype == dtype and d_probs.dtype == jnp.float32
    assert_allclose(d_y, want_dy, dtype)
    assert_allclose(d_probs, want_dp, jnp.float32, scale=4 * 2 ** (24 - 8))


def test_fp8_tokens_permute_under_grad_of_probs():
    t, k, e, h = 16, 2, 3, 128
    q = jaxops.fp8.quantize(rand((t, h), jnp.float32, seed=33), block=(1, 128))
    ids = random_ids(t, k, e, seed=34)
    probs = rand_probs(t, k, seed=35)

    def loss(b, impl):
        p = moe.permute(q.data, ids, e, probs=b, scales=q.scale, impl=impl)
        rows = p.tokens.astype(jnp.float32) * p.scales[:, :1] * p.probs[:, None]
        return jnp.sum(moe.unpermute(rows, p, probs=b, impl=impl) ** 2)

    got = jax.grad(functools.partial(loss, impl="ffi"))(probs)
    want = jax.grad(functools.partial(loss, impl="xla"))(probs)
    assert_allclose(got, want, jnp.float32, scale=8)


# -------------------------------------------------------------------------------------------------
# jit and vmap.


def test_vmap_permutes_each_example_on_its_own():
    b, t, k, e, h = 3, 20, 2, 5, 16
    x = rand((b, t, h), jnp.float32, seed=40)
    ids = jnp.stack([random_ids(t, k, e, seed=41 + i) for i in range(b)])
    probs = jnp.stack([rand_probs(t, k, seed=50 + i) for i in range(b)])

    def one(a, i, pr):
        p = moe.permute(a, i, e, probs=pr, align=8)
        return p.tokens, p.group_sizes, moe.unpermute(p.tokens * 2, p, probs=pr)

    tokens, sizes, back = jax.jit(jax.vmap(one))(x, ids, probs)
    for i in range(b):
        want = np_permute(x[i], ids[i], e, 8)
        np.testing.assert_array_equal(np.asarray(tokens[i]), want["tokens"].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(sizes[i]), want["group_sizes"])
        assert_allclose(
            back[i], 2 * np_unpermute(want["tokens"], want["row_map"], probs[i]), jnp.float32
        )
    # Unbatched routing shared by a batch of tokens, and per-example grads.
    ids0 = ids[0]
    g = jax.vmap(
        jax.grad(lambda a, pr: _loss("ffi", a, pr, jnp.ones(h), ids0, e, 8, None), (0, 1))
    )(x, probs)
    g_ref = jax.vmap(
        jax.grad(lambda a, pr: _loss("xla", a, pr, jnp.ones(h), ids0, e, 8, None), (0, 1))
    )(x, probs)
    for got, want in zip(g, g_ref, strict=True):
        assert_allclose(got, want, jnp.float32, scale=4)


# -------------------------------------------------------------------------------------------------
# Sharding.

AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


def _mesh(shape, names, axis_type):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_hidden_sharded_stays_local(axis_type):
    mesh = _mesh((8,), ("m",), axis_type)
    t, k, e, h = 32, 2, 4, 64
    x = rand((t, h), jnp.float32, seed=60)
    ids = random_ids(t, k, e, seed=61)
    probs = rand_probs(t, k, seed=62)
    w = rand((h,), jnp.float32, seed=63)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "m")))
        ws = jax.device_put(w, NamedSharding(mesh, P("m")))

        def fwd(a, c):
            p = moe.permute(a, ids, e, probs=probs, align=8)
            return moe.unpermute(p.tokens * c, p, probs=probs), p.tokens

        text = jax.jit(fwd).lower(xs, ws).compile().as_text()
        assert count_collectives(text) == {}, text
        y, rows = jax.jit(fwd)(xs, ws)
        assert y.sharding.spec[1] == "m" and rows.sharding.spec[1] == "m"

        grad = jax.jit(jax.grad(lambda a, b, c: _loss(None, a, b, c, ids, e, 8, None), (0, 1, 2)))
        gtext = grad.lower(xs, probs, ws).compile().as_text()
        # Only probability gradients are reduced over the hidden axis ([T, K] from unpermute,
        # [R] from the loss's use of p.probs): never a gather of tokens or rows.
        assert set(count_collectives(gtext)) <= {"all-reduce"}, gtext
        rows = moe.permuted_rows(t, k, e, 8)
        for shape in collective_shapes(gtext, "all-reduce"):
            for part in re.findall(r"f32\[[0-9,]*\]", shape):
                assert part in (f"f32[{t},{k}]", f"f32[{rows}]", "f32[]"), gtext
        got = grad(xs, probs, ws)
    want_y = np_unpermute(
        np_permute(x, ids, e, 8)["tokens"] * np.asarray(w, np.float64),
        np_route(ids, e, 8)[0],
        probs,
    )
    assert_allclose(y, want_y, jnp.float32)
    want = jax.grad(lambda a, b, c: _loss("xla", a, b, c, ids, e, 8, None), (0, 1, 2))(x, probs, w)
    for g, wg in zip(got, want, strict=True):
        assert_allclose(g, wg, jnp.float32, scale=4)


def test_token_sharded_permute_is_refused_not_gathered():
    mesh = _mesh((8,), ("d",), AxisType.Explicit)
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("d")))
        ids = jnp.zeros((16, 2), jnp.int32)
        with pytest.raises(ValueError, match=r"sharded along its token axis.*shard_map"):
            moe.permute(xs, ids, 4)
    auto = _mesh((8,), ("d",), AxisType.Auto)
    with jax.set_mesh(auto):
        xs = jax.device_put(jnp.ones((16, 8)), NamedSharding(auto, P("d")))
        ids = jax.device_put(jnp.zeros((16, 2), jnp.int32), NamedSharding(auto, P("d")))
        with pytest.raises(Exception, match="sharded along its token axis"):
            jax.jit(lambda a, i: moe.permute(a, i, 4).tokens).lower(xs, ids).compile()


def test_inside_shard_map_each_device_permutes_its_own_tokens():
    mesh = _mesh((8,), ("d",), AxisType.Explicit)
    t, k, e, h = 64, 2, 6, 32
    x = rand((t, h), jnp.float32, seed=70)
    ids = random_ids(t, k, e, seed=71)
    probs = rand_probs(t, k, seed=72)

    def local(a, i, pr, impl):
        p = moe.permute(a, i, e, probs=pr, align=4, impl=impl)
        y = moe.unpermute(jnp.tanh(p.tokens) * p.probs[:, None], p, probs=pr, impl=impl)
        return y, p.tokens, p.group_sizes[None]

    def run(impl):
        return jax.shard_map(
            functools.partial(local, impl=impl),
            mesh=mesh,
            in_specs=(P("d"), P("d"), P("d")),
            out_specs=(P("d"), P("d"), P("d")),
        )

    with jax.set_mesh(mesh):
        args = [jax.device_put(v, NamedSharding(mesh, P("d"))) for v in (x, ids, probs)]
        text = jax.jit(run(None)).lower(*args).compile().as_text()
        assert count_collectives(text) == {}, text
        _, rows, sizes = jax.jit(run(None))(*args)

        def loss(impl):
            return lambda a, pr: jnp.sum(run(impl)(a, args[1], pr)[0] ** 2)

        grads = jax.jit(jax.grad(loss(None), (0, 1)))(args[0], args[2])
        want_grads = jax.grad(loss("xla"), (0, 1))(args[0], args[2])
    per = t // 8
    r = moe.permuted_rows(per, k, e, 4)
    rows, sizes = np.asarray(rows), np.asarray(sizes)
    for d in range(8):
        sl = slice(d * per, (d + 1) * per)
        want = np_permute(x[sl], ids[sl], e, 4)
        np.testing.assert_array_equal(rows[d * r : (d + 1) * r], want["tokens"].astype(np.float32))
        np.testing.assert_array_equal(sizes[d], want["group_sizes"])
    for g, wg in zip(grads, want_grads, strict=True):
        assert_allclose(g, wg, jnp.float32, scale=4)


# -------------------------------------------------------------------------------------------------
# Bad input: clear errors at trace time; the handlers guard themselves too.

_X = jnp.ones((4, 8))
_IDS = jnp.zeros((4, 2), jnp.int32)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (
            lambda: moe.permute(jnp.ones((4, 8), jnp.int32), _IDS, 2),
            TypeError,
            r"^jaxops\.moe\.permute: tokens must have",
        ),
        (lambda: moe.permute(jnp.ones(8), _IDS, 2), ValueError, r"tokens must have shape \(T, H\)"),
        (lambda: moe.permute(_X, _IDS.astype(jnp.int16), 2), TypeError, "expert_ids must have"),
        (lambda: moe.permute(_X, jnp.zeros((3, 2), jnp.int32), 2), ValueError, "T = 4"),
        (lambda: moe.permute(_X, jnp.zeros((4,), jnp.int32), 2), ValueError, r"\(T, K\)"),
        (lambda: moe.permute(_X, _IDS, 0), ValueError, "num_experts must be in"),
        (lambda: moe.permute(_X, _IDS, 2.0), TypeError, "num_experts must be an int"),
        (lambda: moe.permute(_X, _IDS, 2, align=0), ValueError, "align must be in"),
        (lambda: moe.permute(_X, _IDS, 2, align=8192), ValueError, "align must be in"),
        (lambda: moe.permute(_X, _IDS, 2, capacity=-1), ValueError, "capacity must be in"),
        (lambda: moe.permute(_X, _IDS, 2, probs=jnp.ones((4, 3))), ValueError, "probs must have"),
        (
            lambda: moe.permute(_X, _IDS, 2, probs=jnp.ones((4, 2), jnp.int32)),
            TypeError,
            "probs must have dtype",
        ),
        (lambda: moe.permute(_X, _IDS, 2, scales=jnp.ones((4, 3))), ValueError, "divides H"),
        (lambda: moe.permute(_X, _IDS, 2, scales=jnp.ones((5, 2))), ValueError, "scales must"),
        (
            lambda: moe.permute(_X, _IDS, 2, scales=jnp.ones((4, 2), jnp.bfloat16)),
            TypeError,
            "scales must have dtype float32",
        ),
        (
            lambda: jax.jit(lambda n: moe.permute(_X, _IDS, n))(2),
            TypeError,
            "num_experts must be a static",
        ),
        (
            lambda: moe.permute(_X, _IDS, 2, impl="triton"),
            ValueError,
            r"^jaxops\.moe\.permute: impl must be",
        ),
        (
            lambda: moe.unpermute(_X, _X),
            TypeError,
            r"^jaxops\.moe\.unpermute: permuted must be a jaxops\.moe\.Permuted",
        ),
        (
            lambda: moe.unpermute(jnp.ones((3, 8)), moe.permute(_X, _IDS, 2)),
            ValueError,
            r"R = 8",
        ),
        (
            lambda: moe.unpermute(_X.repeat(2, 0), moe.permute(_X, _IDS, 2), probs=jnp.ones(4)),
            ValueError,
            "probs must have",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input_raises_at_trace_time(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    # Every message starts with the public dotted name of the op that was called.
    assert re.match(r"jaxops(\.\w+)+: ", str(info.value)), str(info.value)


def test_handlers_reject_inconsistent_operands_instead_of_crashing():
    i32 = jnp.int32
    route = jax.ffi.ffi_call(
        TARGET_ROUTE,
        (
            jax.ShapeDtypeStruct((4, 2), i32),
            jax.ShapeDtypeStruct((5,), i32),  # too few rows for 8 slots
            jax.ShapeDtypeStruct((2,), i32),
            jax.ShapeDtypeStruct((3,), i32),
            jax.ShapeDtypeStruct((), i32),
            jax.ShapeDtypeStruct((2,), i32),
            jax.ShapeDtypeStruct((1, 2), i32),
        ),
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match="source must have between 8"):
        jax.block_until_ready(route(_IDS, align=np.int64(1), capacity=np.int64(-1)))
    permute = jax.ffi.ffi_call(
        TARGET_PERMUTE,
        (
            jax.ShapeDtypeStruct((6, 8), jnp.float32),
            jax.ShapeDtypeStruct((0,), jnp.float32),
            jax.ShapeDtypeStruct((0,), jnp.float32),
        ),
    )
    z = jnp.zeros((0,), jnp.float32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="out must have shape"):
        jax.block_until_ready(permute(_X, jnp.zeros((5,), i32), _IDS, z, z))
    with pytest.raises(jax.errors.JaxRuntimeError, match="row_map must have shape"):
        jax.block_until_ready(permute(_X, jnp.zeros((6,), i32), _IDS[:3], z, z))
    with pytest.raises(jax.errors.JaxRuntimeError, match="probs must have"):
        jax.block_until_ready(permute(_X, jnp.zeros((6,), i32), _IDS, z, jnp.ones(3)))
    unpermute = jax.ffi.ffi_call(TARGET_UNPERMUTE, jax.ShapeDtypeStruct((4, 8), jnp.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match="out must have shape"):
        jax.block_until_ready(unpermute(_X, _IDS, z))


def test_garbage_indices_are_ignored_not_dereferenced():
    # A hand-built Permuted with out-of-range rows and slots: zero rows / no contribution.
    x = rand((4, 8), jnp.float32, seed=80)
    p = moe.permute(x, _IDS, 2)
    bad = moe.Permuted(
        p.tokens,
        None,
        None,
        p.group_sizes,
        p.group_offsets,
        jnp.array([[0, 10**6], [-7, 1], [2, 3], [4, 5]], jnp.int32),
        jnp.array([0, 10**6, -3, 3, 4, 5, 6, 7], jnp.int32),
        p.num_rows,
        p.dropped,
        2,
    )
    got = moe.unpermute(p.tokens, bad)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(p.tokens[0]))
    g = jax.grad(lambda a: jnp.sum(moe.unpermute(a, bad) * 3))(p.tokens)
    np.testing.assert_array_equal(np.asarray(g[1:3]), 0.0)


# -------------------------------------------------------------------------------------------------
# Large tensors: 64-bit offsets.


@pytest.mark.slow
@pytest.mark.bigmem
def test_more_than_2_pow_31_elements():
    # Permute: 131,072 fp8 rows of 16,400 bytes, offsets up to 2.15e9 > 2^31.
    t, h = 65536, 16400
    ids = jnp.stack([jnp.arange(t, dtype=jnp.int32) % 3, jnp.full((t,), 2, jnp.int32)], axis=1)
    # Token i's row is i % 200 everywhere, built in fp8 by numpy (no 4 GB float32 intermediate).
    row = (np.arange(t) % 200).astype(jnp.float8_e4m3fn)
    tokens = jnp.asarray(np.broadcast_to(row[:, None], (t, h)))
    p = moe.permute(tokens, ids, 3)
    # Expert 2 gets every token's slot 1 and slot 0 of tokens t % 3 == 2; its last row holds
    # slot 1 of token t - 1.
    last = int(p.group_offsets[2]) + t + len(range(2, t, 3)) - 1
    assert int(p.row_map[t - 1, 1]) == last
    np.testing.assert_array_equal(
        np.asarray(p.tokens[last, -4:].astype(jnp.float32)),
        np.asarray(tokens[t - 1, -4:].astype(jnp.float32)),
    )
    del tokens
    # Unpermute: the same rows in bfloat16, 2.15e9 elements, each row its source token's value
    # (built by numpy from p.source: converting the fp8 rows in XLA, or unpermuting them, which
    # accumulates float8 in a float32 copy, took 4x the memory and most of the test's time).
    source = np.asarray(p.source)
    value = np.where(source >= 0, (source // 2) % 200, 0).astype(jnp.bfloat16)
    rows = jnp.asarray(np.broadcast_to(value[:, None], (source.size, h)))
    p = dataclasses.replace(p, tokens=rows)  # the fp8 rows freed
    back = moe.unpermute(rows, p)  # each token: its 2 slots' rows added, 2 * (i % 200)
    for i in (0, 1, t // 2 + 7, t - 1):
        np.testing.assert_array_equal(
            np.asarray(back[i, [0, h // 2, h - 1]].astype(jnp.float32)),
            np.full(3, 2 * (i % 200), np.float32),
            err_msg=f"token {i}",
        )


# -------------------------------------------------------------------------------------------------
# Fuzzing.


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.integers(0, 40),
    k=st.integers(1, 9),
    e=st.integers(1, 70),
    h=st.integers(1, 40),
    align=st.sampled_from([1, 2, 3, 8, 16]),
    capacity=st.one_of(st.none(), st.integers(0, 12)),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_fuzz_against_reference(t, k, e, h, align, capacity, dtype, seed):
    x = rand((t, h), dtype, seed=seed)
    ids = random_ids(t, k, e, seed=seed, unused=0.2, out_of_range=0.1)
    probs = rand_probs(t, k, seed=seed + 1)
    p = moe.permute(x, ids, e, probs=probs, align=align, capacity=capacity)
    assert_permuted_equal(p, np_permute(x, ids, e, align, capacity, probs=probs), dtype)
    y = rand(p.tokens.shape, dtype, seed=seed + 2)
    assert_allclose(
        moe.unpermute(y, p, probs=probs), np_unpermute(y, p.row_map, probs), dtype, scale=k
    )


# -------------------------------------------------------------------------------------------------
# GPU (skipped without a CUDA GPU and the CUDA module).


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        (4096, 8, 128, 7168, 1, None),
        (16384, 2, 8, 4096, 128, None),
        (3000, 4, 4096, 136, 16, 5),
        (1, 1, 1, 1, 1, None),
        (777, 16, 300, 33, 8, 20),
    ],
    ids=_id,
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn], ids=_id)
def test_gpu_kernels_match_the_reference(dtype, case):
    t, k, e, h, align, capacity = case
    x = rand((t, h), jnp.float32, seed=90).astype(dtype)
    ids = random_ids(t, k, e, seed=91)
    probs = rand_probs(t, k, seed=92)
    with jax.default_device(jax.devices("gpu")[0]):
        got = moe.permute(x, ids, e, probs=probs, align=align, capacity=capacity, impl="ffi")
        want = moe.permute(x, ids, e, probs=probs, align=align, capacity=capacity, impl="xla")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(
                np.atleast_1d(np.asarray(a)).view(np.uint8),
                np.atleast_1d(np.asarray(b)).view(np.uint8),
            )
        if dtype != jnp.float8_e4m3fn:
            y = rand(got.tokens.shape, dtype, seed=93)
            out = moe.unpermute(y, got, probs=probs, impl="ffi")
            assert_allclose(out, moe.unpermute(y, got, probs=probs, impl="xla"), dtype, scale=k)
            if dtype == jnp.float32 and t <= 4096:
                g = jax.grad(
                    lambda a, b: _loss("ffi", a, b, jnp.ones(h), ids, e, align, capacity), (0, 1)
                )(x, probs)
                g_ref = jax.grad(
                    lambda a, b: _loss("xla", a, b, jnp.ones(h), ids, e, align, capacity), (0, 1)
                )(x, probs)
                for a, b in zip(g, g_ref, strict=True):
                    # The loss weighs y's columns by up to H (7168 here): the gradients are sums
                    # of terms that large, so they are compared relative to their largest one.
                    top = float(jnp.max(jnp.abs(b)))
                    assert_allclose(a / top, b / top, jnp.float32, scale=8)
