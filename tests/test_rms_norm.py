"""RMSNorm and add+RMSNorm: custom calls vs a float64 numpy reference, grads, vmap, sharding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import hypothesis.extra.numpy as hnp
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
from jaxops import _ffi
from jaxops._fp8 import TARGET_AMAX, TARGET_QUANTIZE, TARGET_SPLIT_TRANSPOSE
from jaxops._grouped_gemm import (
    TARGET_ACTIVATION_BWD,
    TARGET_ACTIVATION_FWD,
    TARGET_GROUPED_GEMM,
    TARGET_WGRAD,
)
from jaxops._moe import TARGET_PERMUTE, TARGET_ROUTE, TARGET_UNPERMUTE, TARGET_UNPERMUTE_BWD
from jaxops._rms_norm import TARGET_ADD_FWD, TARGET_BWD, TARGET_FWD
from jaxops.testing import (
    assert_allclose,
    collective_shapes,
    count_collectives,
    tolerance,
)

FP8_TARGETS = (TARGET_AMAX, TARGET_QUANTIZE, TARGET_SPLIT_TRANSPOSE)
MOE_TARGETS = (TARGET_PERMUTE, TARGET_ROUTE, TARGET_UNPERMUTE, TARGET_UNPERMUTE_BWD)
GG_TARGETS = (TARGET_GROUPED_GEMM, TARGET_WGRAD, TARGET_ACTIVATION_FWD, TARGET_ACTIVATION_BWD)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SHAPES = [(1,), (1, 1), (3, 1), (7, 33), (2, 3, 127), (5, 1024), (2, 4096), (1, 65536), (3, 70001)]


def _id(value):
    if isinstance(value, tuple):
        return "x".join(map(str, value)) or "scalar"
    if value is None:
        return "none"
    return np.dtype(value).name


# -------------------------------------------------------------------------------------------------
# float64 numpy references, written from the definition.


def np_weight(weight, zero_centered):
    if weight is None:
        return 1.0
    w = np.asarray(weight, np.float64)
    return 1.0 + w if zero_centered else w


def np_rms_norm(x, weight=None, eps=1e-6, zero_centered=False):
    x64 = np.asarray(x, np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return x64 * rstd * np_weight(weight, zero_centered)


def np_rms_norm_grads(dy, x, weight=None, eps=1e-6, zero_centered=False):
    x64 = np.asarray(x, np.float64)
    dy64 = np.asarray(dy, np.float64)
    hidden = x64.shape[-1]
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    g = dy64 * np_weight(weight, zero_centered)
    dot = np.sum(g * x64, axis=-1, keepdims=True)
    dx = rstd * g - x64 * rstd**3 * dot / hidden
    dw = None
    if weight is not None:
        dw = np.sum((dy64 * x64 * rstd).reshape(-1, hidden), axis=0)
    return dx, dw


def rand(shape, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def assert_grad_close(actual, expected, dtype, err_msg=""):
    # The best the kernel can return is the float64 value rounded to its dtype (which may
    # overflow to inf like any computation in that dtype). Gradients sum many terms: the
    # tolerance is relative to the largest finite magnitude.
    expected = np.asarray(jnp.asarray(np.asarray(expected, np.float32)).astype(dtype), np.float64)
    finite = np.abs(expected[np.isfinite(expected)])
    scale = max(1.0, float(np.max(finite, initial=0.0)))
    assert_allclose(actual, expected, dtype, scale=2.0 * scale, err_msg=err_msg)


def uses_kernel(fn, *args) -> bool:
    return (
        TARGET_FWD in jax.jit(fn).lower(*args).as_text()
        or TARGET_ADD_FWD in jax.jit(fn).lower(*args).as_text()
    )


def run_python(code: str, cwd, **env_overrides) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter outside the source tree (the installed jaxops loads)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


# -------------------------------------------------------------------------------------------------
# Forward.


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_forward_matches_float64(dtype, shape):
    x = rand(shape, dtype, seed=1)
    weight = rand(shape[-1:], jnp.float32, seed=2, scale=0.5) + 1.0
    y = jaxops.rms_norm(x, weight)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_allclose(y, np_rms_norm(x, weight), dtype)


@pytest.mark.parametrize("weight_dtype", [*DTYPES, None], ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["w", "1+w"])
def test_forward_weight_variants(dtype, weight_dtype, zero_centered):
    x = rand((9, 257), dtype, seed=3)
    weight = None if weight_dtype is None else rand((257,), weight_dtype, seed=4, scale=0.3)
    y = jaxops.rms_norm(x, weight, eps=1e-5, zero_centered_weight=zero_centered)
    assert_allclose(y, np_rms_norm(x, weight, 1e-5, zero_centered), dtype)


@pytest.mark.parametrize("shape", [(4, 8), (3, 5, 1000), (1, 65536)], ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_add_rms_norm_matches_float64(dtype, shape):
    x = rand(shape, dtype, seed=5)
    residual = rand(shape, dtype, seed=6)
    weight = rand(shape[-1:], jnp.bfloat16, seed=7)
    y, h = jaxops.add_rms_norm(x, residual, weight)
    h_expected = (np.asarray(x, np.float32) + np.asarray(residual, np.float32)).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(h), h_expected)  # bitwise: one rounding of x + r
    assert_allclose(y, np_rms_norm(h_expected, weight), dtype)
    # y is exactly the unfused rms_norm of the rounded h.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jaxops.rms_norm(h, weight)))


def test_kernel_is_used_and_xla_twin_is_not():
    x, w = jnp.ones((4, 8)), jnp.ones(8)
    assert uses_kernel(lambda a, b: jaxops.rms_norm(a, b), x, w)
    assert uses_kernel(lambda a, b: jaxops.add_rms_norm(a, a, b)[0], x, w)
    assert not uses_kernel(lambda a, b: jaxops.rms_norm(a, b, impl="xla"), x, w)
    grad_text = jax.jit(jax.grad(lambda a: jnp.sum(jaxops.rms_norm(a, w)))).lower(x).as_text()
    assert TARGET_BWD in grad_text


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_nan_and_inf_propagate_like_the_reference(dtype):
    x = np.array(rand((4, 16), jnp.float32, seed=8))
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    x = jnp.asarray(x).astype(dtype)
    y = np.asarray(jaxops.rms_norm(x, jnp.ones(16)), np.float32)
    ref = np.asarray(jaxops.rms_norm(x, jnp.ones(16), impl="xla"), np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert np.isnan(y[1]).all() and np.isnan(y[2]).any()
    assert_allclose(y[[0, 3]], ref[[0, 3]], dtype)


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 8), (0, 1)], ids=_id)
def test_zero_rows(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    w = jnp.ones(shape[-1], jnp.float32)
    assert jaxops.rms_norm(x, w).shape == shape
    y, h = jaxops.add_rms_norm(x, x, w)
    assert y.shape == h.shape == shape
    dx, dw = jax.grad(lambda a, b: jnp.sum(jaxops.rms_norm(a, b)), (0, 1))(x, w)
    assert dx.shape == shape
    np.testing.assert_array_equal(np.asarray(dw), np.zeros(shape[-1], np.float32))


def test_large_hidden_and_many_rows_index_math():
    # Rows far apart in memory: every row must land in its own place (64-bit offsets).
    x = rand((300, 70001), jnp.bfloat16, seed=9)
    y = jaxops.rms_norm(x, None)
    for row in (0, 151, 299):
        assert_allclose(y[row], np_rms_norm(x[row]), jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.bigmem
def test_more_than_2_pow_31_elements():
    # 32769 x 65536 bfloat16 = 2^31 + 65536 elements (4.3 GB): row offsets must be 64-bit.
    rows, hidden = 32769, 65536
    make = jax.jit(
        lambda: ((jnp.arange(rows)[:, None] + jnp.arange(hidden)[None, :]) % 7 + 1).astype(
            jnp.bfloat16
        )
    )
    y = jax.jit(lambda a: jaxops.rms_norm(a))(make())
    for row in (0, 1, rows - 2, rows - 1):
        expected = ((row + np.arange(hidden)) % 7 + 1).astype(np.float32)
        assert_allclose(y[row], np_rms_norm(expected), jnp.bfloat16, err_msg=f"row {row}")
    del y


# -------------------------------------------------------------------------------------------------
# Backward.


@pytest.mark.parametrize(
    "shape", [(1,), (3, 1), (7, 33), (2, 3, 127), (64, 1024), (3, 9000)], ids=_id
)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_grads_match_float64(dtype, shape):
    x = rand(shape, dtype, seed=10)
    weight = rand(shape[-1:], jnp.float32, seed=11, scale=0.5) + 1.0
    dy = rand(shape, dtype, seed=12)
    _, vjp = jax.vjp(lambda a, b: jaxops.rms_norm(a, b), x, weight)
    dx, dw = vjp(dy)
    assert dx.dtype == x.dtype and dw.dtype == weight.dtype
    dx_ref, dw_ref = np_rms_norm_grads(dy, x, weight)
    assert_grad_close(dx, dx_ref, dtype, "dx")
    assert_grad_close(dw, dw_ref, jnp.float32 if dtype == jnp.float32 else dtype, "dweight")


@pytest.mark.parametrize("zero_centered", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("weight_dtype", [jnp.float32, jnp.bfloat16, None], ids=_id)
def test_grads_match_jax_autodiff_of_the_twin(weight_dtype, zero_centered):
    x = rand((6, 5, 96), jnp.float32, seed=13)
    weight = None if weight_dtype is None else rand((96,), weight_dtype, seed=14, scale=0.2)
    proj = rand((96,), jnp.float32, seed=15)

    def loss(impl, a, b):
        y = jaxops.rms_norm(a, b, zero_centered_weight=zero_centered, impl=impl)
        return jnp.sum(jnp.sin(y) * proj)

    argnums = (1, 2) if weight is not None else (1,)
    got = jax.jit(jax.grad(loss, argnums), static_argnums=0)(None, x, weight)
    want = jax.grad(loss, argnums)("xla", x, weight)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert_grad_close(g, w, g.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_add_rms_norm_grads(dtype):
    x, r = rand((5, 130), dtype, seed=16), rand((5, 130), dtype, seed=17)
    w = rand((130,), jnp.float32, seed=18)

    def loss(impl, a, b, c):
        y, h = jaxops.add_rms_norm(a, b, c, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * jnp.arange(130.0)) + jnp.sum(
            jnp.cos(h.astype(jnp.float32))
        )

    got = jax.grad(loss, (1, 2, 3))(None, x, r, w)
    want = jax.grad(loss, (1, 2, 3))("xla", x, r, w)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype
        assert_grad_close(g, e, dtype)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[1]))


def test_check_grads_numerically():
    x = rand((3, 17), jnp.float32, seed=19)
    w = rand((17,), jnp.float32, seed=20) + 2.0
    check_grads(
        lambda a, b: jaxops.rms_norm(a, b),
        (x, w),
        order=1,
        modes=["rev"],
        atol=5e-2,
        rtol=5e-2,
        eps=1e-2,
    )
    r = rand((3, 17), jnp.float32, seed=21)
    check_grads(
        lambda a, b, c: jaxops.add_rms_norm(a, b, c)[0],
        (x, r, w),
        order=1,
        modes=["rev"],
        atol=5e-2,
        rtol=5e-2,
        eps=1e-2,
    )


def test_dweight_is_deterministic():
    x = rand((2048, 512), jnp.float32, seed=22)
    w = rand((512,), jnp.float32, seed=23)
    dy = rand((2048, 512), jnp.float32, seed=24)
    grad = jax.jit(lambda a, b, c: jax.vjp(lambda p, q: jaxops.rms_norm(p, q), a, b)[1](c))
    first = [np.asarray(v) for v in grad(x, w, dy)]
    for _ in range(3):
        again = [np.asarray(v) for v in grad(x, w, dy)]
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(a, b)


def test_checkpoint_and_jit():
    x = rand((8, 64), jnp.bfloat16, seed=25)
    w = rand((64,), jnp.float32, seed=26)

    def loss(a, b):
        return jnp.sum(jaxops.rms_norm(a, b).astype(jnp.float32) ** 2)

    plain = jax.grad(loss, (0, 1))(x, w)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), (0, 1)))(x, w)
    for a, b in zip(plain, remat, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -------------------------------------------------------------------------------------------------
# vmap.


def test_vmap_forward_folds_batch_into_rows():
    x = rand((4, 6, 40), jnp.float32, seed=27)
    w = rand((40,), jnp.float32, seed=28)
    y = jax.vmap(lambda a: jaxops.rms_norm(a, w))(x)
    assert_allclose(y, np_rms_norm(x, w), jnp.float32)
    assert uses_kernel(jax.vmap(lambda a: jaxops.rms_norm(a, w)), x)
    y2 = jax.vmap(jax.vmap(lambda a: jaxops.rms_norm(a, w)), in_axes=1, out_axes=1)(x)
    assert_allclose(y2, np_rms_norm(x, w), jnp.float32)


def test_vmap_batched_weight_and_per_example_grads():
    x = rand((3, 5, 24), jnp.float32, seed=29)
    ws = rand((3, 24), jnp.float32, seed=30)
    y = jax.vmap(lambda a, b: jaxops.rms_norm(a, b))(x, ws)
    assert_allclose(y, np.stack([np_rms_norm(x[i], ws[i]) for i in range(3)]), jnp.float32)

    def loss(impl, a, b):
        return jnp.sum(jnp.tanh(jaxops.rms_norm(a, b, impl=impl)))

    for in_axes in [(0, None), (0, 0), (None, 0)]:
        args = (x if in_axes[0] == 0 else x[0], ws if in_axes[1] == 0 else ws[0])
        got = jax.vmap(jax.grad(lambda a, b: loss(None, a, b), (0, 1)), in_axes)(*args)
        want = jax.vmap(jax.grad(lambda a, b: loss("xla", a, b), (0, 1)), in_axes)(*args)
        for g, e in zip(got, want, strict=True):
            assert g.shape == e.shape
            assert_grad_close(g, e, jnp.float32, f"in_axes={in_axes}")


def test_vmap_add_rms_norm():
    x, r = rand((3, 4, 16), jnp.bfloat16, seed=31), rand((4, 16), jnp.bfloat16, seed=32)
    y, h = jax.vmap(lambda a: jaxops.add_rms_norm(a, r, None))(x)
    yr, hr = jax.vmap(lambda a: jaxops.add_rms_norm(a, r, None, impl="xla"))(x)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(hr))
    assert_allclose(y, yr, jnp.bfloat16)


# -------------------------------------------------------------------------------------------------
# Sharding on 8 CPU devices: count collectives in the compiled HLO.


def _mesh(shape, names, axis_type):
    if len(jax.devices()) < 8:
        pytest.fail("sharded tests need 8 devices (JAX_NUM_CPU_DEVICES=8 is set by conftest)")
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize(
    "mesh_shape,spec",
    [
        ((8,), P("d", None)),
        ((4, 2), P("d", "m", None)),
        ((4, 2), P(("d", "m"), None, None)),
    ],
    ids=["rows8", "rows4x2", "rows-both-axes"],
)
def test_batch_sharded_has_no_collective(axis_type, mesh_shape, spec):
    names = ("d",) if len(mesh_shape) == 1 else ("d", "m")
    mesh = _mesh(mesh_shape, names, axis_type)
    shape = (16, 64) if len(spec) == 2 else (16, 8, 64)
    x = rand(shape, jnp.float32, seed=33)
    w = rand((64,), jnp.float32, seed=34)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        fwd = jax.jit(lambda a, b: jaxops.add_rms_norm(a, a, b)[0] + jaxops.rms_norm(a, b))
        text = fwd.lower(xs, w).compile().as_text()
        assert count_collectives(text) == {}, text
        out = fwd(xs, w)
        assert out.sharding.spec == NamedSharding(mesh, spec).spec
        y_ref, _ = jaxops.add_rms_norm(x, x, w, impl="xla")
        assert_allclose(out, y_ref + jaxops.rms_norm(x, w, impl="xla"), jnp.float32)

        # Backward: the only collective is the all-reduce of dweight, f32[hidden].
        grad = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(jaxops.rms_norm(a, b))), (0, 1)))
        gtext = grad.lower(xs, w).compile().as_text()
        assert count_collectives(gtext) == {"all-reduce": 1}, gtext
        assert [s.split("{")[0] for s in collective_shapes(gtext, "all-reduce")] == ["f32[64]"]
        got = grad(xs, w)
    want = jax.grad(lambda a, b: jnp.sum(jnp.sin(jaxops.rms_norm(a, b, impl="xla"))), (0, 1))(x, w)
    for g, e in zip(got, want, strict=True):
        assert_grad_close(g, e, jnp.float32)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("spec", [P("d", "m"), P(None, ("d", "m"))], ids=["rows+hidden", "hidden8"])
def test_hidden_sharded_reduces_only_row_statistics(axis_type, spec):
    mesh = _mesh((4, 2), ("d", "m"), axis_type)
    x = rand((32, 128), jnp.float32, seed=35)
    w = rand((128,), jnp.float32, seed=36)
    rows_local = 32 // (4 if spec[0] == "d" else 1)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        ws = jax.device_put(w, NamedSharding(mesh, P(spec[1])))
        for fn in (
            lambda a, b: jaxops.rms_norm(a, b),
            lambda a, b: jaxops.add_rms_norm(a, a, b)[0],
        ):
            text = jax.jit(fn).lower(xs, ws).compile().as_text()
            assert count_collectives(text) == {"all-reduce": 1}, text
            assert [s.split("{")[0] for s in collective_shapes(text, "all-reduce")] == [
                f"f32[{rows_local}]"
            ]
        out = jax.jit(lambda a, b: jaxops.rms_norm(a, b))(xs, ws)
        assert out.sharding.spec == NamedSharding(mesh, spec).spec
        assert_allclose(out, np_rms_norm(x, w), jnp.float32)

        def loss(impl, a, b):
            y, h = jaxops.add_rms_norm(a, a * 0.5, b, impl=impl)
            return jnp.sum(jnp.sin(jaxops.rms_norm(y, b, impl=impl)) * h)

        grad = jax.jit(jax.grad(lambda a, b: loss(None, a, b), (0, 1)))
        gtext = grad.lower(xs, ws).compile().as_text()
        assert set(count_collectives(gtext)) == {"all-reduce"}, gtext  # never a gather
        got = grad(xs, ws)
    want = jax.grad(lambda a, b: loss("xla", a, b), (0, 1))(x, w)
    for g, e in zip(got, want, strict=True):
        assert_grad_close(g, e, jnp.float32)


def test_inside_shard_map_results_vary_and_grads_sum_over_devices():
    # Kernel results inside shard_map vary over the mesh axes of their operands (jax's type check
    # of the custom_vjp backward rule needs it), and the weight and residual that every device
    # uses get the sum of the devices' gradients.
    mesh = jax.make_mesh((8,), ("d",))
    x = rand((64, 32), jnp.float32, seed=40)
    r = rand((8, 32), jnp.float32, seed=41)
    w = rand((32,), jnp.float32, seed=42)
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))

    def loss(impl):
        def local(a, res, b):
            y, h = jaxops.add_rms_norm(a, res, b, impl=impl)
            part = jnp.sum(jaxops.rms_norm(y, b, impl=impl) * jnp.cos(h))
            return jax.lax.psum(part, "d")

        return jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P()), out_specs=P())

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss(None), (0, 1, 2)))(xs, r, w)
        text = jax.jit(loss(None)).lower(xs, r, w).compile().as_text()
        want = jax.value_and_grad(loss("xla"), (0, 1, 2))(xs, r, w)
    assert count_collectives(text) == {"all-reduce": 1}, text
    assert_allclose(got[0], want[0], jnp.float32, scale=10)
    for g, e in zip(got[1], want[1], strict=True):
        assert_grad_close(g, e, jnp.float32)


# -------------------------------------------------------------------------------------------------
# Bad input: clear errors at trace time.


@pytest.mark.parametrize(
    "call,error,match",
    [
        (
            lambda: jaxops.rms_norm(jnp.float32(1.0)),
            ValueError,
            r"^jaxops\.rms_norm: x must have rank >= 1",
        ),
        (lambda: jaxops.rms_norm(jnp.ones((2, 3), jnp.int32)), TypeError, "x must have dtype"),
        (lambda: jaxops.rms_norm(np.ones((2, 3), np.float64)), TypeError, "got float64"),
        (lambda: jaxops.rms_norm(jnp.ones((2, 0))), ValueError, "hidden"),
        (
            lambda: jaxops.rms_norm(jnp.ones((2, 3)), jnp.ones(4)),
            ValueError,
            r"weight must have shape \(3,\)",
        ),
        (
            lambda: jaxops.rms_norm(jnp.ones((2, 3)), jnp.ones((1, 3))),
            ValueError,
            "weight must have shape",
        ),
        (
            lambda: jaxops.rms_norm(jnp.ones((2, 3)), jnp.ones(3, jnp.int8)),
            TypeError,
            "weight must have dtype",
        ),
        (
            lambda: jaxops.rms_norm(jnp.ones((2, 3)), eps=0.0),
            ValueError,
            "eps must be finite and > 0",
        ),
        (lambda: jaxops.rms_norm(jnp.ones((2, 3)), eps=-1e-6), ValueError, "eps"),
        (lambda: jaxops.rms_norm(jnp.ones((2, 3)), eps=float("nan")), ValueError, "eps"),
        (lambda: jaxops.rms_norm(jnp.ones((2, 3)), eps=float("inf")), ValueError, "eps"),
        (lambda: jaxops.rms_norm(jnp.ones((2, 3)), eps="small"), TypeError, "eps must be a number"),
        (
            lambda: jax.jit(lambda e: jaxops.rms_norm(jnp.ones((2, 3)), eps=e))(1e-6),
            TypeError,
            "static",
        ),
        (
            lambda: jaxops.rms_norm(jnp.ones((2, 3)), zero_centered_weight=1),
            TypeError,
            "zero_centered_weight must be a bool",
        ),
        (
            lambda: jaxops.rms_norm(jnp.ones((2, 3)), impl="cuda"),
            ValueError,
            r"^jaxops\.rms_norm: impl must be",
        ),
        (lambda: jaxops.rms_norm(3.0), TypeError, "x must be an array"),
        (
            lambda: jaxops.add_rms_norm(jnp.ones((2, 3)), jnp.ones((2, 4))),
            ValueError,
            r"^jaxops\.add_rms_norm: residual must have x's shape",
        ),
        (
            lambda: jaxops.add_rms_norm(jnp.ones((2, 3)), jnp.ones((2, 3), jnp.bfloat16)),
            TypeError,
            "residual must have x's dtype",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input_raises_at_trace_time(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    # Every message starts with the public dotted name of the op that was called.
    assert re.match(r"jaxops(\.\w+)+: ", str(info.value)), str(info.value)


def test_handler_rejects_inconsistent_operands_instead_of_crashing():
    # Bypass the Python checks: the kernel itself must return an error, not read out of bounds.
    call = jax.ffi.ffi_call(
        TARGET_FWD,
        (jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32)),
        vmap_method="broadcast_all",
    )
    cases = [
        (jnp.ones(5), jnp.zeros((0,)), "weight must have shape"),
        (jnp.ones(8), jnp.zeros((3,)), "rstd_in must have 4 elements"),
    ]
    for weight, rstd_in, message in cases:
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            jax.block_until_ready(
                call(
                    jnp.ones((4, 8)),
                    weight,
                    rstd_in,
                    eps=np.float32(1e-6),
                    zero_centered_weight=False,
                )
            )


# -------------------------------------------------------------------------------------------------
# The implementation switch.


def test_global_switch_forces_the_twin_and_retraces():
    x, w = jnp.ones((4, 8)), jnp.ones(8)
    f = jax.jit(lambda a, b: jaxops.rms_norm(a, b))
    assert TARGET_FWD in f.lower(x, w).as_text()
    jaxops.set_default_impl("xla")
    assert jaxops.get_default_impl() == "xla"
    assert TARGET_FWD not in f.lower(x, w).as_text()
    jaxops.set_default_impl(None)
    assert TARGET_FWD in f.lower(x, w).as_text()
    with jaxops.default_impl("xla"):
        assert TARGET_FWD not in f.lower(x, w).as_text()
        # An explicit impl still wins over the default.
        text = jax.jit(lambda a, b: jaxops.rms_norm(a, b, impl="ffi")).lower(x, w).as_text()
        assert TARGET_FWD in text
    assert TARGET_FWD in f.lower(x, w).as_text()


def test_switch_flip_changes_a_cached_jit_result_path():
    x, w = jnp.ones((4, 8)), jnp.ones(8)
    f = jax.jit(lambda a, b: jaxops.rms_norm(a, b))
    f(x, w)
    size_before = f._cache_size()
    with jaxops.default_impl("xla"):
        f(x, w)
    assert f._cache_size() == size_before + 1  # retraced, not served from the kernel trace


def test_environment_variable_forces_the_twin(tmp_path):
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, jaxops
        text = jax.jit(lambda a: jaxops.rms_norm(a)).lower(jnp.ones((2, 4))).as_text()
        print(jaxops.get_default_impl(), "jaxops_rms_norm_fwd" in text)
        """
    )
    out = run_python(code, tmp_path, JAXOPS_IMPL="xla")
    assert out.stdout.split() == ["xla", "False"]


# -------------------------------------------------------------------------------------------------
# Fuzzing.


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(0, 40),
    hidden=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    has_weight=st.booleans(),
    zero_centered=st.booleans(),
    eps=st.floats(1e-12, 1.0),
    data=st.data(),
)
def test_fuzz_against_float64(rows, hidden, dtype, has_weight, zero_centered, eps, data):
    scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0]))
    x = np.asarray(
        data.draw(hnp.arrays(np.float32, (rows, hidden), elements=st.floats(-4, 4, width=32)))
        * scale
    )
    x = jnp.asarray(x).astype(dtype)
    weight = rand((hidden,), jnp.float32, seed=rows + hidden) if has_weight else None
    y = jaxops.rms_norm(x, weight, eps=eps, zero_centered_weight=zero_centered)
    assert_allclose(y, np_rms_norm(x, weight, eps, zero_centered), dtype)
    if rows:
        dy = rand((rows, hidden), dtype, seed=hidden)
        _, vjp = jax.vjp(
            lambda a, b: jaxops.rms_norm(a, b, eps=eps, zero_centered_weight=zero_centered),
            x,
            weight,
        )
        dx, dw = vjp(dy)
        dx_ref, dw_ref = np_rms_norm_grads(dy, x, weight, eps, zero_centered)
        assert_grad_close(dx, dx_ref, dtype)
        if has_weight:
            assert_grad_close(dw, dw_ref, jnp.float32)


# -------------------------------------------------------------------------------------------------
# The installed package.


def test_installed_package_layout(tmp_path):
    code = textwrap.dedent(
        """
        import importlib.util, os, jaxops, jaxops.parallel
        from jaxops import _jaxops_cpu
        print(os.path.isfile(_jaxops_cpu.__file__))
        print(jaxops.parallel.__name__)
        print(sorted(t for t, p in jaxops._ffi.registered_targets() if p == "cpu"))
        spec = importlib.util.find_spec("parallel")
        if spec is None:
            print("no top-level parallel")
        else:  # editable installs put the repository root on sys.path
            try:
                import parallel
                print("top-level parallel imported from", spec.origin)
            except ImportError as e:
                print("no top-level parallel" if "use `import jaxops.parallel`" in str(e) else e)
        """
    )
    out = run_python(code, tmp_path)
    lines = out.stdout.strip().splitlines()
    assert lines == [
        "True",
        "jaxops.parallel",
        str(
            sorted(
                [TARGET_ADD_FWD, TARGET_BWD, TARGET_FWD, *FP8_TARGETS, *MOE_TARGETS, *GG_TARGETS]
            )
        ),
        "no top-level parallel",
    ]


def test_version_skew_check():
    info = {"platform": "cpu", "jaxlib_version": "0.10.2", "ffi_api_major": 0, "ffi_api_minor": 3}
    _ffi.check_compatibility(info, (0, 3))
    _ffi.check_compatibility(info, (0, 4))
    _ffi.check_compatibility(info, None)
    with pytest.raises(jaxops.JaxlibVersionError, match=r"0\.10\.2 \(XLA FFI API 0\.3\).*API 0\.2"):
        _ffi.check_compatibility(info, (0, 2))
    with pytest.raises(jaxops.JaxlibVersionError, match="Rebuild jaxops"):
        _ffi.check_compatibility(info, (1, 0))
    assert (
        _ffi.check_compatibility(jaxops.build_info()["cpu"], _ffi._runtime_ffi_api_version())
        is None
    )


def test_tolerance_helper():
    assert (
        tolerance(jnp.float32)["rtol"]
        < tolerance(jnp.float16)["rtol"]
        < tolerance(jnp.bfloat16)["rtol"]
    )
    with pytest.raises(ValueError, match="no tolerance for dtype int32"):
        tolerance(jnp.int32)


# -------------------------------------------------------------------------------------------------
# GPU: the CUDA kernels against the twin (skipped without a GPU).


# The last three: dweight's partial sums in 10 parts (not a multiple of the reduction's 8 slices),
# in 32, and in 256 (the reduction's unrolled loop of 32 parts per slice; the last slice 33).
GPU_SHAPES = [(1, 1), (7, 33), (3, 1023), (256, 1024), (64, 4096), (8, 16384), (2, 65536)]
GPU_SHAPES += [(3, 70001), (300, 1032), (1000, 8192), (8197, 520)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_gpu_kernels_match_float64(dtype, shape):
    gpu = jax.devices("gpu")[0]
    x = jax.device_put(rand(shape, dtype, seed=40), gpu)
    r = jax.device_put(rand(shape, dtype, seed=41), gpu)
    w = jax.device_put(rand(shape[-1:], jnp.bfloat16, seed=42), gpu)
    dy = jax.device_put(rand(shape, dtype, seed=43), gpu)
    f = jax.jit(lambda a, b: jaxops.rms_norm(a, b, impl="ffi"))
    assert TARGET_FWD in f.lower(x, w).compile().as_text()
    assert_allclose(f(x, w), np_rms_norm(x, w), dtype)
    y, h = jax.jit(lambda a, b, c: jaxops.add_rms_norm(a, b, c, impl="ffi"))(x, r, w)
    h_expected = (np.asarray(x, np.float32) + np.asarray(r, np.float32)).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(h), h_expected)
    assert_allclose(y, np_rms_norm(h_expected, w), dtype)
    vjp = jax.jit(
        lambda a, b, c: jax.vjp(lambda p, q: jaxops.rms_norm(p, q, impl="ffi"), a, b)[1](c)
    )
    dx, dw = vjp(x, w, dy)
    dx_ref, dw_ref = np_rms_norm_grads(dy, x, w)
    assert_grad_close(dx, dx_ref, dtype)
    assert_grad_close(dw, dw_ref, jnp.bfloat16)
    again = vjp(x, w, dy)
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(again[1]))  # deterministic
