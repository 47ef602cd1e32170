"""The expert layer's grouped GEMMs off GPU (``jaxops.parallel.expert._ffn``), the CPU custom
calls (impl "ffi") and their twin, the loops of XLA GEMMs (impl "xla"): forward, input gradient
and weight gradient against float64 numpy, for random group sizes (empty groups, groups of one
tile, groups longer than the largest chunk, trailing padding rows). And the FFN with the
activation between its GEMMs: the grouped activation calls (impl "ffi") against impl "xla"."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jaxops.parallel.expert import _ffn

TILE = _ffn.CPU_TILE


def _oracle(x, w, dy, sizes):
    """float64 ``(y, dx, dw)`` of ``y[rows of l] = x[rows] @ w[l]``; rows past the groups: 0."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y = np.zeros((x.shape[0], w.shape[2]))
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        y[rows] = x[rows] @ w[e]
        dx[rows] = dy[rows] @ w[e].T
        dw[e] = x[rows].T @ dy[rows]
        start += size
    return y, dx, dw


def _check(sizes, spare_tiles, k, n, seed, impl):
    sizes = np.asarray(sizes, np.int32) * TILE
    rows = int(sizes.sum()) + spare_tiles * TILE
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    dy = rng.standard_normal((rows, n)).astype(np.float32)
    groups = _ffn._groups(jnp.asarray(sizes))

    @jax.jit
    def run(x, w, dy, groups):
        y, vjp = jax.vjp(lambda x, w: _ffn._grouped_linear(TILE, False, impl, x, w, groups), x, w)
        return (y, *vjp(dy))

    calls = set(re.findall(r"jaxops_grouped_gemm\w*", run.lower(x, w, dy, groups).as_text()))
    want_calls = {"jaxops_grouped_gemm", "jaxops_grouped_gemm_wgrad"} if impl == "ffi" else set()
    assert calls == want_calls, calls
    want = _oracle(x, w, dy, sizes)
    # Each element's error against the sum of its products' magnitudes (the float64 GEMMs of
    # |x|, |w|, |dy|): a sum that cancels (dw of one column over hundreds of rows, say) keeps
    # float32's absolute error while its value, and so a relative error, can be near zero.
    scale = _oracle(np.abs(x), np.abs(w), np.abs(dy), sizes)
    results = run(x, w, dy, groups)
    for name, got, ref, mag in zip(("y", "dx", "dw"), results, want, scale, strict=True):
        assert got.shape == ref.shape, name
        assert rel_error(np.asarray(got), ref) < 1e-5 or np.all(
            np.abs(np.asarray(got, np.float64) - ref) <= 1e-5 * mag
        ), name
    # Rows past the groups and the weight gradients of empty groups are exactly zero.
    y, dx, dw = (np.asarray(a) for a in run(x, w, dy, groups))
    used = int(sizes.sum())
    assert not y[used:].any() and not dx[used:].any()
    assert not dw[sizes == 0].any()


@pytest.mark.parametrize(
    "sizes,spare_tiles",
    [
        pytest.param([8], 0, id="one-chunk"),
        pytest.param([9, 7, 0, 1], 2, id="tails-empty-spare"),
        pytest.param([0, 0, 0], 1, id="all-empty"),
        pytest.param([21, 0, 3], 0, id="long-group"),
        pytest.param([1], 0, id="one-tile"),
    ],
)
@pytest.mark.parametrize("impl", ["ffi", "xla"])
def test_grouped_linear(sizes, spare_tiles, impl):
    _check(sizes, spare_tiles, k=24, n=40, seed=0, impl=impl)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    spare_tiles=st.integers(0, 3),
    k=st.integers(1, 40),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    impl=st.sampled_from(["ffi", "xla"]),
)
@example(sizes=[0, 12], spare_tiles=0, k=1, n=1, seed=1, impl="ffi")  # dw's sum cancels
def test_fuzz_grouped_linear(sizes, spare_tiles, k, n, seed, impl):
    if sum(sizes) + spare_tiles == 0:
        spare_tiles = 1  # the loops' buffers hold at least one tile
    _check(sizes, spare_tiles, k, n, seed, impl)


@pytest.mark.parametrize(
    ("activation", "dtype"),
    [
        ("swiglu", jnp.float32),
        ("clamped_swiglu", jnp.float32),
        ("silu", jnp.bfloat16),
        ("gelu", jnp.float32),  # no grouped activation call: XLA's fusion, either impl
    ],
)
def test_grouped_ffn_activation_calls_match_xla(activation, dtype):
    """The FFN (two grouped GEMMs and the activation between them): with impl "ffi" on CPU the
    activation runs as the grouped activation calls on the groups' rows; values and gradients
    match impl "xla" (the loops and XLA's activation on every row)."""
    from jaxops.parallel.expert import MoEConfig

    cfg = MoEConfig(
        num_experts=3, top_k=1, hidden_size=24, expert_ffn=20, activation=activation, dtype=dtype
    )
    sizes = jnp.asarray([TILE, 0, 2 * TILE], jnp.int32)
    rows = 3 * TILE + 2 * TILE  # two tiles of padding rows after the groups
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((rows, 24)), dtype)
    x = x.at[3 * TILE :].set(0)  # padding rows are zero, as the permute leaves them
    w_in = jnp.asarray(rng.standard_normal((3, 24, cfg.w_in_width)) * 0.3, dtype)
    w_out = jnp.asarray(rng.standard_normal((3, 20, 24)) * 0.3, dtype)
    dy = jnp.asarray(rng.standard_normal((rows, 24)), dtype)

    def run(impl):
        def f(x, w_in, w_out):
            return _ffn.grouped_ffn(cfg, TILE, impl, x, w_in, w_out, sizes)

        @jax.jit
        def step(x, w_in, w_out):
            y, vjp = jax.vjp(f, x, w_in, w_out)
            return (y, *vjp(dy))

        text = step.lower(x, w_in, w_out).as_text()
        return step(x, w_in, w_out), set(re.findall(r"jaxops_grouped_activation_\w+", text))

    got, calls = run("ffi")
    want, xla_calls = run("xla")
    gated = activation in _ffn._grouped_gemm.ACTIVATIONS
    fwd_bwd = {"jaxops_grouped_activation_fwd", "jaxops_grouped_activation_bwd"}
    assert calls == (fwd_bwd if gated else set()) and xla_calls == set(), (calls, xla_calls)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("y", "dx", "dw_in", "dw_out"), got, want, strict=True):
        assert a.dtype == b.dtype and rel_error(a, b) < tol, (name, rel_error(a, b))
    assert not np.asarray(got[0], np.float32)[3 * TILE :].any()  # padding rows stay zero


def _tails_case(seed: int):
    """(cfg, group sizes, (x, w_in, w_out), dy): three experts' groups, one empty, that end
    before the buffer's last two tiles of rows (x zero there, as the permute leaves them)."""
    from jaxops.parallel.expert import MoEConfig

    cfg = MoEConfig(num_experts=3, top_k=1, hidden_size=24, expert_ffn=20, dtype=jnp.float32)
    sizes = jnp.asarray([TILE + 3, 0, 2 * TILE - 5], jnp.int32)
    rows = 3 * TILE + 2 * TILE
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32).at[int(sizes.sum()) :].set(0)
    w_in = jnp.asarray(rng.standard_normal((3, 24, cfg.w_in_width)) * 0.3, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((3, 20, 24)) * 0.3, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((rows, 24)), jnp.float32)
    return cfg, sizes, (x, w_in, w_out), dy


def _ffn_and_grads(cfg, sizes, args, dy, **kw):
    """The FFN's y and its gradients (numpy) and the zero_tail attributes of its calls, sorted."""

    def f(x, w_in, w_out):
        return _ffn.grouped_ffn(cfg, TILE, "ffi", x, w_in, w_out, sizes, **kw)

    @jax.jit
    def step(*args):
        y, vjp = jax.vjp(f, *args)
        return (y, *vjp(dy))

    tails = sorted(re.findall(r"zero_tail = (true|false)", step.lower(*args).as_text()))
    return [np.asarray(a) for a in step(*args)], tails


def test_grouped_ffn_intermediates_skip_zeroing_the_rows_past_the_groups():
    """On CPU the FFN's intermediates (the first GEMM's output, the activation, and their
    gradients) leave the rows past the groups unwritten: zero_tail false on those four calls,
    true on the two whose results leave the FFN (its output, its input's gradient). Under
    jax_debug_nans or jax_debug_infs (checks that read every row) all six zero them. Values and
    gradients are the same bit for bit, and the output's padding rows are zero either way."""
    cfg, sizes, args, dy = _tails_case(11)

    def run():
        return _ffn_and_grads(cfg, sizes, args, dy)

    got, tails = run()
    assert tails == ["false"] * 4 + ["true"] * 2, tails
    for check in (jax.debug_nans, jax.debug_infs):
        with check(True):
            want, checked_tails = run()
        assert checked_tails == ["true"] * 6, (check, checked_tails)
        for name, a, b in zip(("y", "dx", "dw_in", "dw_out"), got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    used = int(sizes.sum())
    assert not got[0][used:].any() and not got[1][used:].any()


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "debug_nans"])
def test_grouped_ffn_unread_tail_leaves_the_edges_unwritten_too(checked):
    """tail_read=False (the gather exchange, whose unpermute and permute backward read the
    routed rows only): the FFN's output and its rows' gradient also leave the rows past the
    groups unwritten, all six calls with zero_tail false; the groups' rows and the weight
    gradients equal those of tail_read=True bit for bit. Under jax_debug_nans every call zeroes
    them again."""
    cfg, sizes, args, dy = _tails_case(12)
    used = int(sizes.sum())

    def run(tail_read):
        return _ffn_and_grads(cfg, sizes, args, dy, tail_read=tail_read)

    with jax.debug_nans(checked):
        got, tails = run(False)
        want, want_tails = run(True)
    assert tails == (["true"] * 6 if checked else ["false"] * 6), tails
    assert want_tails == (["true"] * 6 if checked else ["false"] * 4 + ["true"] * 2), want_tails
    for name, a, b in zip(("y", "dx", "dw_in", "dw_out"), got, want, strict=True):
        if name in ("y", "dx"):
            a, b = a[:used], b[:used]
        np.testing.assert_array_equal(a, b, err_msg=name)
