"""jaxops.gemm, jaxops.fp8.gemm / linear, jaxops.precision and precision_report."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jaxops
from jaxops import _cublaslt, _gemm, _grouped_gemm
from jaxops.testing import assert_allclose, count_collectives

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu"]
# (rows shape, K, N): one element, K = 1, odd N, zero rows, a batch of rows.
SHAPES = {
    "one": ((1,), 1, 1),
    "k1": ((5,), 1, 7),
    "odd": ((13,), 37, 19),
    "zero_rows": ((0,), 8, 4),
    "batched": ((2, 3), 64, 48),
}


def _np_act(name, h):
    if name is None:
        return h
    if name == "relu":
        return np.maximum(h, 0)
    if name == "gelu":
        from math import erf

        return h * 0.5 * (1 + np.vectorize(erf, otypes=[np.float64])(h / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    return h / (1 + np.exp(-h))


def _inputs(rows, k, n, dtype, seed=0, transpose_w=False):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (*rows, k), jnp.float32)
    w = jax.random.normal(keys[1], (n, k) if transpose_w else (k, n), jnp.float32) / math.sqrt(
        max(k, 1)
    )
    b = jax.random.normal(keys[2], (n,), jnp.float32)
    return x.astype(dtype), w.astype(dtype), b.astype(dtype)


def _np_gemm(x, w, b, act, transpose_w=False):
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    h = x64 @ (w64.T if transpose_w else w64)
    if b is not None:
        h = h + np.asarray(b, np.float64)
    return _np_act(act, h)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gemm_matches_float64(dtype, activation, shape):
    rows, k, n = SHAPES[shape]
    x, w, b = _inputs(rows, k, n, dtype)
    with jaxops.precision("fp32"):
        y = jax.jit(lambda x, w, b: jaxops.gemm(x, w, b, activation=activation))(x, w, b)
    assert y.shape == (*rows, n) and y.dtype == x.dtype
    assert_allclose(y, _np_gemm(x, w, b, activation), scale=4)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w_kn", "w_nk"])
def test_gemm_transpose_w_and_no_bias(transpose_w):
    x, w, _ = _inputs((9,), 33, 10, jnp.float32, transpose_w=transpose_w)
    y = jaxops.gemm(x, w, transpose_w=transpose_w, activation="silu", precision="fp32")
    assert_allclose(y, _np_gemm(x, w, None, "silu", transpose_w), scale=4)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w_kn", "w_nk"])
def test_gemm_grads(activation, transpose_w):
    x, w, b = _inputs((6,), 10, 7, jnp.float32, seed=1, transpose_w=transpose_w)
    x = x + 0.05  # keep relu's kink away from the sample points

    def f(x, w, b):
        return jaxops.gemm(x, w, b, activation=activation, transpose_w=transpose_w)

    with jaxops.precision("fp32"):
        check_grads(f, (x, w, b), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)

        # The custom_vjp equals autodiff of the plain composition.
        def plain(x, w, b):
            h = jnp.dot(x, w.T if transpose_w else w, precision="highest") + b
            return _cublaslt.activate(activation, h)

        ct = jax.random.normal(jax.random.key(3), (6, 7))
        got = jax.vjp(f, x, w, b)[1](ct)
        want = jax.vjp(plain, x, w, b)[1](ct)
    for g, r in zip(got, want, strict=True):
        assert_allclose(g, r, scale=8)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot layouts")
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w_kn", "w_nk"])
def test_cpu_weight_grad_is_a_plain_gemm(transpose_w):
    # XLA:CPU sends a dot contracting its LHS's rows to Eigen (a per-call allocation and
    # packing); the twin's weight gradient multiplies a transposed copy instead.
    x, w, b = _inputs((40,), 24, 16, jnp.float32, seed=2, transpose_w=transpose_w)
    dw = jax.jit(jax.grad(lambda w: jnp.sum(jaxops.gemm(x, w, b, transpose_w=transpose_w) ** 2)))
    text = dw.lower(w).compile().as_text()
    dots = re.findall(r"lhs_contracting_dims=\{(\d+)\}", text)
    assert dots and "0" not in dots, dots
    want = jax.grad(
        lambda w: jnp.sum((jnp.dot(x, w.T if transpose_w else w, precision="highest") + b) ** 2)
    )(w)
    assert_allclose(dw(w), want, scale=4)


def test_gemm_vmap_and_jit():
    x, w, b = _inputs((4, 5), 16, 8, jnp.float32)
    batched = jax.jit(jax.vmap(lambda x: jaxops.gemm(x, w, b, activation="gelu_tanh")))(x)
    direct = jaxops.gemm(x, w, b, activation="gelu_tanh")
    assert_allclose(batched, direct)
    ws = jnp.stack([w, 2 * w])
    per_w = jax.vmap(lambda w: jaxops.gemm(x[0], w))(ws)
    assert_allclose(per_w[1], 2 * jaxops.gemm(x[0], w), scale=2)


def test_gemm_bad_input():
    x, w, b = _inputs((4,), 8, 3, jnp.float32)
    with pytest.raises(
        ValueError, match=r"^jaxops\.gemm: w must be \[K, N\] with K = x.shape\[-1\] = 8"
    ):
        jaxops.gemm(x, w[:5])
    with pytest.raises(ValueError, match=r"^jaxops\.gemm: w must be a matrix"):
        jaxops.gemm(x, w[None])
    with pytest.raises(ValueError, match=r"^jaxops\.gemm: activation must be one of"):
        jaxops.gemm(x, w, activation="tanh")
    with pytest.raises(ValueError, match=r"^jaxops\.gemm: bias must be \[3\]"):
        jaxops.gemm(x, w, b[:2])
    with pytest.raises(TypeError, match=r"^jaxops\.gemm: w must have x's dtype"):
        jaxops.gemm(x, w.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=r"^jaxops\.gemm: x must have dtype"):
        jaxops.gemm(x.astype(jnp.int32), w)
    with pytest.raises(ValueError, match=r"^jaxops\.gemm: precision must be None or one of"):
        jaxops.gemm(x, w, precision="tf16")
    with pytest.raises(ValueError, match=r"^jaxops\.gemm: impl must be"):
        jaxops.gemm(x, w, impl="cuda")
    with pytest.raises(ValueError, match=r"^jaxops\.precision: mode must be one of"):
        jaxops.precision("highest")


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 17),
    k=st.integers(1, 40),
    n=st.integers(1, 23),
    act=st.sampled_from(ACTIVATIONS),
    bias=st.booleans(),
)
def test_gemm_fuzz(m, k, n, act, bias):
    x, w, b = _inputs((m,), k, n, jnp.float32, seed=m * 1000 + k * 10 + n)
    y = jaxops.gemm(x, w, b if bias else None, activation=act, precision="fp32")
    assert_allclose(y, _np_gemm(x, w, b if bias else None, act), scale=4)


# -------------------------------------------------------------------------------------------------
# Precision policy.


def _dot_precisions(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return [line.split("dot_general", 1)[1] for line in text.splitlines() if "dot_general" in line]


def test_precision_context_changes_hlo_and_nests():
    x, w, _ = _inputs((4,), 8, 3, jnp.float32)
    assert jaxops.current_precision() == "default"
    with jaxops.precision("fp32"):
        assert "HIGHEST" in _dot_precisions(lambda a, b: a @ b, x, w)[0]
        assert "HIGHEST" in _dot_precisions(lambda a, b: jaxops.gemm(a, b), x, w)[0]
        with jaxops.precision("bf16"):
            assert jaxops.current_precision() == "bf16"
            assert "bf16" in _dot_precisions(lambda a, b: a @ b, x, w)[0]
            assert "bf16" in _dot_precisions(lambda a, b: jaxops.gemm(a, b), x, w)[0]
        assert jaxops.current_precision() == "fp32"
        # An explicit argument wins over the scope.
        explicit = _dot_precisions(lambda a, b: jaxops.gemm(a, b, precision="bf16_3x"), x, w)[0]
        assert "lhs_precision_type = bf16" in explicit and "primitive_operations = 3" in explicit
    assert jaxops.current_precision() == "default"
    assert "HIGHEST" not in _dot_precisions(lambda a, b: a @ b, x, w)[0]

    @jaxops.precision("fp32")
    def decorated(a, b):
        return jaxops.gemm(a, b)

    assert "HIGHEST" in _dot_precisions(decorated, x, w)[0]
    # jax's own setting is honoured by jaxops GEMMs too.
    with jax.default_matmul_precision("float32"):
        assert jaxops.current_precision() == "fp32"


def test_precision_gemm_attribute_in_cuda_lowering():
    """The CUDA path passes the traced mode to the custom call as an attribute."""
    x, w, b = _inputs((16,), 32, 8, jnp.float32)
    for mode, attr in (("fp32", 0), ("tf32", 1), ("bf16", 2)):
        cfg = _gemm._Config("gelu_tanh", False, mode, kernel=True)
        text = (
            jax.jit(lambda x, w, b, cfg=cfg: _gemm._gemm(cfg, x, w, b))
            .trace(x, w, b)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert f"custom_call @{_gemm.TARGET_GEMM}" in text or _gemm.TARGET_GEMM in text
        assert f"precision = {attr} : i32" in text, text[-3000:]
        assert "activation = 2 : i32" in text


def _run_env(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        cwd="/",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_precision_environment_variables():
    code = """
        import jax, jaxops
        print(jaxops.current_precision(), jax.config.jax_default_matmul_precision)
        with jaxops.precision("tf32"):
            print(jaxops.current_precision(), jax.config.jax_default_matmul_precision)
    """
    assert _run_env(code, JAXOPS_MATMUL_PRECISION="fp32").splitlines() == [
        "fp32 float32",
        "tf32 tensorfloat32",
    ]
    # NVIDIA_TF32_OVERRIDE=0: no TF32 anywhere.
    assert _run_env(code, NVIDIA_TF32_OVERRIDE="0").splitlines() == [
        "fp32 float32",
        "fp32 float32",
    ]


def test_precision_report_lists_model_dots():
    x = jnp.ones((4, 16), jnp.float32)
    w1 = jnp.ones((16, 32), jnp.float32)
    w2 = jnp.ones((32, 8), jnp.bfloat16)

    def model(x, w1, w2):
        h = jaxops.gemm(x, w1, activation="relu")
        with jaxops.precision("fp32"):
            g = jnp.dot(h, w1.T)
        return jnp.dot(h.astype(jnp.bfloat16), w2), g

    report = jaxops.precision_report(model, x, w1, w2)
    assert [e.kind for e in report] == ["dot"] * 3, str(report)
    assert sorted(e.precision for e in report) == ["default", "default", "highest,highest"]
    # XLA:CPU has no bf16 dot: it multiplies the bf16 operands in float32, as the report shows.
    runs = sorted(e.runs_as for e in report)
    assert runs == ["fp32", "fp32 (no TF32 on CPU)", "fp32 (no TF32 on CPU)"], str(report)
    table = str(report)
    assert "runs as (cpu)" in table and "f32[4,16] x f32[16,32]" in table


@pytest.mark.skipif(not _grouped_gemm.kernel_available(), reason="no grouped GEMM kernel here")
@pytest.mark.parametrize("mode", ["tf32", "bf16"])
def test_precision_report_lists_grouped_gemm_calls_in_fp32_whatever_the_mode(mode):
    """The expert FFNs' grouped GEMM calls follow no mode: float32 in fp32, 16-bit natively."""
    x = jnp.ones((12, 16), jnp.float32)
    w = jnp.ones((3, 16, 8), jnp.float32)
    sizes = jnp.array([4, 0, 8], jnp.int32)

    def f(x, w, sizes):
        y = _grouped_gemm.grouped_gemm(x, w, sizes)
        dw = _grouped_gemm.grouped_gemm_wgrad(x, y, sizes)
        y16 = _grouped_gemm.grouped_gemm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes)
        return y, dw, y16

    with jaxops.precision(mode):
        report = jaxops.precision_report(f, x, w, sizes)
    entries = sorted((e.kind, e.operands, e.precision, e.runs_as) for e in report)
    assert entries == [
        ("jaxops_grouped_gemm", "bf16[12,16] x bf16[3,16,8]", "fp32", "native 16-bit"),
        ("jaxops_grouped_gemm", "f32[12,16] x f32[3,16,8]", "fp32", "fp32"),
        ("jaxops_grouped_gemm_wgrad", "f32[12,16] x f32[12,8]", "fp32", "fp32"),
    ], str(report)


# -------------------------------------------------------------------------------------------------
# Sharding: rows and columns stay local.


def test_gemm_sharded_rows_and_columns_stay_local():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x, w, b = _inputs((16,), 32, 24, jnp.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    bs = jax.device_put(b, NamedSharding(mesh, P("model")))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x, w, b: jaxops.gemm(x, w, b, activation="gelu", precision="fp32"))
        assert count_collectives(f.lower(xs, ws, bs).compile().as_text()) == {}
        y = f(xs, ws, bs)
    assert_allclose(y, _np_gemm(x, w, b, "gelu"), scale=4)


@pytest.mark.parametrize("op", ["gemm", "fp8.linear"])
def test_leading_dims_keep_their_sharding_with_a_size_one_mesh_axis(op):
    """[B, S, K] rows over ("data", "expert") of data 2 x expert 1, B = 2: the result keeps
    B's sharding (the row reshape alone put expert, of size 1, on S), so it multiplies a
    per-token [B, S, 1, D] table of the input's layout."""
    mesh = jax.make_mesh((2, 1), ("data", "expert"), devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((2, 8, 128)), NamedSharding(mesh, P(("data", "expert"))))
    w = jax.device_put(jnp.ones((128, 128)) / 128, NamedSharding(mesh, P()))
    f = jaxops.gemm if op == "gemm" else functools.partial(jaxops.fp8.linear, fp8="tensor")
    with jax.set_mesh(mesh):  # heads, times a per-token [B, S, 1, D] table (as RoPE does)
        y = jax.jit(lambda x, w: f(x, w).reshape(2, 8, 4, 32) * x[:, :, None, :32])(x, w)
    assert y.sharding.spec[:2] in ((("data", "expert"), None), (("data", "expert"),)), y.sharding
    assert_allclose(y, np.ones((2, 8, 4, 32)), jnp.float32 if op == "gemm" else jnp.bfloat16)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("w_on_mesh", [True, False], ids=["w-sharded", "w-host"])
def test_gemm_grads_with_batch_sharded_rows_on_explicit_mesh(transpose_w, w_on_mesh):
    """The weight gradient contracts over sharded rows: its sharding is the weight's (or
    replicated), and its value the sum over every shard (a data-parallel reduction)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x, w, b = _inputs((16,), 32, 24, jnp.float32)
    if transpose_w:
        w = w.T
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "model"), None)))
    ws = jax.device_put(w, NamedSharding(mesh, P())) if w_on_mesh else w

    def loss(x, w, b):
        y = jaxops.gemm(x, w, b, activation="gelu", transpose_w=transpose_w, precision="fp32")
        return jnp.sum(y * y)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xs, ws, b)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)
    for g, r in zip(grads, want, strict=True):
        assert_allclose(g, r, scale=8)
    assert grads[1].sharding.spec in (P(), P(None, None))


def test_cuda_path_types_its_results_on_explicit_mesh():
    """The cuBLASLt custom calls' result types carry the operands' row sharding on an Explicit
    mesh. Typed replicated, the gradient of a loss whose targets are sharded by batch failed:
    "Expected cotangent type float32[16,24] but got float32[16@data,24]" (seen on an H100)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x, w, b = _inputs((16,), 32, 24, jnp.float32)
    rows = NamedSharding(mesh, P("data", None))
    xs, ws = jax.device_put(x, rows), jax.device_put(w, NamedSharding(mesh, P()))
    idx = jax.device_put(jnp.arange(16, dtype=jnp.int32)[:, None] % 24, rows)
    cfg = _gemm._Config("gelu_tanh", False, "fp32", kernel=True)

    def loss(x, w, b):
        logp = jax.nn.log_softmax(_gemm._gemm(cfg, x, w, b), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, idx, axis=-1))

    with jax.set_mesh(mesh):
        y = jax.eval_shape(lambda x, w, b: _gemm._gemm(cfg, x, w, b), xs, ws, b)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(xs, ws, b)
        text = grads.lower(lowering_platforms=("cuda",)).as_text()
        a8 = jax.device_put(jnp.ones((16, 128), jnp.float8_e4m3fn), rows)
        b8 = jnp.ones((24, 128), jnp.float8_e4m3fn)
        one = jnp.ones((), jnp.float32)
        y8 = jax.eval_shape(
            functools.partial(
                _cublaslt.gemm_fp8_call, out_dtype=jnp.bfloat16, a_mode="tensor", b_mode="tensor"
            ),
            a8,
            b8,
            one,
            one,
            None,
        )
    assert y.sharding.spec == P("data", None), y.sharding
    assert [g.sharding.spec for g in grads.out_info] == [P("data", None), P(None, None), P(None)]
    # dx and dw; the forward is a custom_partitioning call until XLA partitions it.
    assert text.count(_gemm.TARGET_GEMM) == 2 and "CustomSPMDPartitioning" in text
    assert y8.sharding.spec == P("data", None), y8.sharding


@pytest.mark.parametrize("op", ["gemm", "fp8_linear"])
def test_grads_of_a_replicated_weight_inside_shard_map(op):
    """Rows split over a shard_map axis, weight and bias invariant (shared by every device):
    their gradients are the psum of the devices' partial gradients, typed invariant, and equal
    the gradients of the unsplit op (the block recipe's groups of 128 rows stay on one device:
    64 rows per device of 2)."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    x, w, b = _inputs((128,), 128, 256, jnp.float32)

    def fn(x, w, b):
        if op == "gemm":
            return jaxops.gemm(x, w, b, activation="gelu", precision="fp32")
        return jaxops.fp8.linear(x, w, b, fp8="block")

    def loss(f, x, w, b):
        return jnp.sum(jnp.square(f(x, w, b)))

    local = jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P("data"))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    grads = jax.jit(jax.grad(functools.partial(loss, local), argnums=(0, 1, 2)))(xs, w, b)
    if op == "gemm":
        want = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))(x, w, b)
    else:  # the same quantization, per device: the unsplit op on each half, summed
        grad = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2))
        halves = [grad(x[i * 64 : (i + 1) * 64], w, b) for i in (0, 1)]
        want = (
            jnp.concatenate([halves[0][0], halves[1][0]]),
            halves[0][1] + halves[1][1],
            halves[0][2] + halves[1][2],
        )
    for g, r in zip(grads, want, strict=True):
        assert_allclose(g, r, scale=8)
    assert float(jnp.abs(grads[1]).max()) > 0


def test_gemm_partition_rule_locality_and_k_refusal():
    """The custom_partitioning rule of the CUDA path, run with the twin as its local body."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cfg = _gemm._Config("relu", False, "fp32", kernel=False)
    op = _gemm._partitioned_forward(cfg, True, False, 1)
    no_bias = _gemm._partitioned_forward(cfg, False, False, 1)
    x, w, b = _inputs((16,), 32, 24, jnp.float32)
    shard = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    xs, ws, bs = shard(x, P("data", None)), shard(w, P(None, "model")), shard(b, P("model"))
    f = jax.jit(lambda x, w, b: op(x, w, b)[0])
    assert count_collectives(f.lower(xs, ws, bs).compile().as_text()) == {}
    assert_allclose(f(xs, ws, bs), _np_gemm(x, w, b, "relu"), scale=4)
    g = jax.jit(lambda x, w: no_bias(x, w, jnp.zeros((0,), x.dtype))[0])
    assert count_collectives(g.lower(xs, ws).compile().as_text()) == {}
    assert_allclose(g(xs, ws), _np_gemm(x, w, None, "relu"), scale=4)
    # Raised by the partitioner at compile time (jax wraps it in a JaxRuntimeError).
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="axis K is sharded"):
        f.lower(shard(x, P(None, "model")), shard(w, P("model", None)), bs).compile()


# -------------------------------------------------------------------------------------------------
# FP8 GEMM and linear.

FP8_CASES = {
    "tensor": dict(a_block=None, b_block=None, b_transposed=False),
    "deepseek": dict(a_block=(1, 128), b_block=(128, 128), b_transposed=True),
    "deepseek_b_kn": dict(a_block=(1, 128), b_block=(128, 128), b_transposed=False),
    "rows_rows": dict(a_block=(1, 128), b_block=(1, 128), b_transposed=True),
    "tiles_rows": dict(a_block=(128, 128), b_block=(1, 128), b_transposed=True),
}


def _quantized_pair(m, k, n, a_block, b_block, b_transposed, layout="row"):
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    a = jaxops.fp8.quantize(x, block=a_block, scale_layout=layout if a_block else "row")
    if b_transposed:
        b = jaxops.fp8.quantize(
            w, block=b_block, transpose=True, scale_layout=layout if b_block else "row"
        )[1]
    else:
        b = jaxops.fp8.quantize(w, block=b_block)
    return a, b


@pytest.mark.parametrize("activation", [None, "gelu"], ids=str)
@pytest.mark.parametrize("case", list(FP8_CASES), ids=list(FP8_CASES))
def test_fp8_gemm_reference_matches_float64(case, activation):
    m, k, n = 33, 256, 130
    a, b = _quantized_pair(m, k, n, **FP8_CASES[case])
    bias = jnp.linspace(-1, 1, n)
    y = jaxops.fp8.gemm(a, b, bias=bias, activation=activation, out_dtype=jnp.float32)
    a64 = np.asarray(a.dequantize(jnp.float32), np.float64)
    b64 = np.asarray(b.dequantize(jnp.float32), np.float64)
    want = _np_act(activation, a64 @ b64 + np.asarray(bias, np.float64))
    assert_allclose(y, want, scale=4)
    y16 = jaxops.fp8.gemm(a, b, bias=bias, activation=activation)
    assert y16.dtype == jnp.bfloat16
    assert_allclose(y16, want, scale=2)


def test_fp8_gemm_bad_input():
    x = jnp.ones((8, 256))
    w = jnp.ones((256, 128))
    qa = jaxops.fp8.quantize(x, block=(1, 128))
    qw_rows_wrong_axis = jaxops.fp8.quantize(w, block=(1, 128))  # groups along N
    with pytest.raises(ValueError, match=r"^jaxops\.fp8\.gemm: b must be quantized .* non-contr"):
        jaxops.fp8.gemm(qa, qw_rows_wrong_axis)
    qa_t = jaxops.fp8.quantize(x, block=(1, 128), transpose=True)[1]  # groups along M
    qw = jaxops.fp8.quantize(w, block=(128, 128))
    with pytest.raises(ValueError, match=r"^jaxops\.fp8\.gemm: a must be quantized"):
        jaxops.fp8.gemm(qa_t, qw)
    with pytest.raises(ValueError, match=r"^jaxops\.fp8\.gemm: at most one of a and b may use 128"):
        jaxops.fp8.gemm(jaxops.fp8.quantize(x[:, :256], block=(128, 128)), qw)
    with pytest.raises(
        ValueError, match=r"^jaxops\.fp8\.gemm: .* both be per-tensor or both block"
    ):
        jaxops.fp8.gemm(qa, jaxops.fp8.quantize(w, block=None))
    with pytest.raises(ValueError, match=r"^jaxops\.fp8\.gemm: .* must share K"):
        jaxops.fp8.gemm(qa, jaxops.fp8.quantize(w[:128], block=(128, 128)))
    with pytest.raises(TypeError, match=r"^jaxops\.fp8\.gemm: b must be a jaxops\.fp8\.Quantized"):
        jaxops.fp8.gemm(qa, w)
    with pytest.raises(ValueError, match=r"^jaxops\.fp8\.linear: fp8 must be None, a jaxops"):
        jaxops.fp8.linear(x, w, fp8="mx")
    with pytest.raises(ValueError, match=r"^jaxops\.fp8\.linear: w must be a matrix"):
        jaxops.fp8.linear(x, w[None])


def test_fp8_linear_recipe_keyword_is_deprecated():
    """``recipe=`` is the old name of ``fp8=``: it warns and still selects the recipe."""
    x = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16) / 16
    with pytest.warns(DeprecationWarning, match=r"jaxops\.fp8\.linear: .*recipe= is renamed fp8="):
        old = jaxops.fp8.linear(x, w, recipe="tensor")
    np.testing.assert_array_equal(old, jaxops.fp8.linear(x, w, fp8="tensor"))
    assert not np.array_equal(old, jaxops.fp8.linear(x, w, fp8="block"))
    with pytest.raises(TypeError, match="both fp8= and its deprecated name recipe="):
        jaxops.fp8.linear(x, w, recipe="tensor", fp8="block")


# Stated FP8 error bounds of jaxops.fp8.linear against the bf16 layer, as relative Frobenius
# errors: e4m3 rounds to 3 mantissa bits (relative step 2^-3, rms rounding error ~2^-3/sqrt(12)
# per operand, so ~5% per product for two quantized operands before averaging over K); the
# tensor recipe's e5m2 gradients have 2 bits. Bounds: 0.06 (block), 0.12 (tensor gradients).
LINEAR_BOUNDS = {"block": (0.06, 0.06), "tensor": (0.06, 0.12)}


@pytest.mark.parametrize("recipe", ["block", "tensor"])
def test_fp8_linear_grads_within_fp8_bounds(recipe):
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (256, 384), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (384, 256), jnp.float32) / math.sqrt(384)).astype(jnp.bfloat16)
    b = jax.random.normal(keys[2], (256,), jnp.bfloat16)
    ct = jax.random.normal(keys[3], (256, 256), jnp.bfloat16)

    def fp8(x, w, b):
        return jaxops.fp8.linear(x, w, b, activation="gelu", fp8=recipe)

    def ref(x, w, b):
        return jaxops.gemm_reference(x, w, b, activation="gelu", precision="fp32")

    y, vjp = jax.vjp(fp8, x, w, b)
    y_ref, vjp_ref = jax.vjp(ref, x, w, b)
    grads, grads_ref = vjp(ct), vjp_ref(ct)

    fwd_bound, grad_bound = LINEAR_BOUNDS[recipe]
    assert rel_error(y, y_ref) < fwd_bound
    for name, g, r in zip(("dx", "dw", "db"), grads, grads_ref, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert rel_error(g, r) < grad_bound, (name, rel_error(g, r))


# -------------------------------------------------------------------------------------------------
# GPU: the cuBLASLt custom calls against the twins.


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_gpu_gemm_matches_twin(dtype, activation):
    for rows, k, n in [((256,), 512, 384), ((7,), 1, 9), ((3, 33), 65, 17)]:
        x, w, b = _inputs(rows, k, n, dtype)
        with jaxops.precision("fp32"):
            y = jax.jit(lambda x, w, b: jaxops.gemm(x, w, b, activation=activation, impl="ffi"))(
                x, w, b
            )
            text = jax.jit(lambda x, w, b: jaxops.gemm(x, w, b, activation=activation)).lower(
                x, w, b
            )
            ref = jaxops.gemm_reference(x, w, b, activation=activation)
        assert _gemm.TARGET_GEMM in text.as_text()
        assert_allclose(y, ref, scale=4)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w_kn", "w_nk"])
def test_gpu_gemm_grads_match_twin(activation, transpose_w):
    x, w, b = _inputs((128,), 256, 136, jnp.bfloat16, transpose_w=transpose_w)
    ct = jax.random.normal(jax.random.key(5), (128, 136), jnp.bfloat16)

    def f(impl):
        return lambda x, w, b: jaxops.gemm(
            x, w, b, activation=activation, transpose_w=transpose_w, impl=impl
        )

    got = jax.vjp(f("ffi"), x, w, b)[1](ct)
    want = jax.vjp(f("xla"), x, w, b)[1](ct)
    for g, r in zip(got, want, strict=True):
        assert_allclose(g, r, scale=8)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "silu"], ids=str)
@pytest.mark.parametrize("case", list(FP8_CASES), ids=list(FP8_CASES))
@pytest.mark.parametrize("layout", ["row", "col_tma"])
def test_gpu_fp8_gemm_matches_reference(case, activation, layout):
    a, b = _quantized_pair(256, 512, 384, **FP8_CASES[case], layout=layout)
    bias = jnp.linspace(-1, 1, 384).astype(jnp.bfloat16)
    got = jaxops.fp8.gemm(a, b, bias=bias, activation=activation, impl="ffi")
    want = jaxops.fp8.gemm_reference(a, b, bias=bias, activation=activation)
    assert_allclose(got, want, scale=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(FP8_CASES), ids=list(FP8_CASES))
@pytest.mark.parametrize(
    "mkn",
    [(130, 640, 200), (250, 384, 136), (8, 256, 264), (300, 1152, 516), (1, 128, 8)],
    ids=lambda mkn: "x".join(map(str, mkn)),
)
def test_gpu_fp8_gemm_odd_shapes(case, mkn):
    # cuBLASLt has no algorithm for some of these (N % 8, M % 4 with 1 x 128 groups on a,
    # measured on an H100): those run the reference, the rest the custom call; both are right.
    m, k, n = mkn
    a, b = _quantized_pair(m, k, n, **FP8_CASES[case])
    f = jax.jit(lambda a, b: jaxops.fp8.gemm(a, b, impl="ffi"))
    uses_kernel = _cublaslt.TARGET_GEMM_FP8 in f.lower(a, b).as_text()
    a_rows = FP8_CASES[case]["a_block"] == (1, 128)
    assert uses_kernel == (n % 8 == 0 and (not a_rows or m % 4 == 0)), (case, mkn)
    assert_allclose(f(a, b), jaxops.fp8.gemm_reference(a, b), scale=2)
