"""One implementation policy for every tier: ``impl=`` takes None, "ffi", "xla" or an order of
preference, means the same in the core ops, the expert-parallel layer and the models, and is
resolved in one place (``jaxops._config.resolve_impl``, queried by ``jaxops.choose_impl``).

On CPU, jaxops has custom calls for every op family but the GEMMs (XLA's dot runs them), which
makes the CPU the place to see "required" and "preferred" apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jaxops.parallel.expert import MoEConfig, init_moe_params, moe_layer

import jaxops

FAMILIES = ("rms_norm", "fp8", "moe", "gemm", "grouped_gemm")


@pytest.mark.parametrize(
    "impl, rms_norm, gemm",
    [
        (None, "ffi", "xla"),  # best available
        ("xla", "xla", "xla"),
        (("ffi", "xla"), "ffi", "xla"),  # preferred: the kernel where it exists
        (("xla", "ffi"), "xla", "xla"),
        ("ffi", "ffi", None),  # required: no CPU GEMM kernel, so an error
        (("ffi",), "ffi", None),
    ],
    ids=["none", "xla", "ffi-then-xla", "xla-then-ffi", "ffi", "ffi-only"],
)
def test_choose_impl_on_cpu(impl, rms_norm, gemm):
    assert jaxops.choose_impl("rms_norm", impl, backend="cpu") == rms_norm
    if gemm is None:
        with pytest.raises(jaxops.InvalidArgumentError, match=r"^jaxops\.choose_impl: impl="):
            jaxops.choose_impl("gemm", impl, backend="cpu")
    else:
        assert jaxops.choose_impl("gemm", impl, backend="cpu") == gemm


@pytest.mark.parametrize("impl", ["cuda", "", ["ffi", "xla"], (), ("ffi", "ffi"), ("ffi", 1)])
def test_bad_impl_is_refused_everywhere_alike(impl):
    x = jnp.ones((2, 8))
    for call in (
        lambda: jaxops.choose_impl("rms_norm", impl),
        lambda: jaxops.rms_norm(x, impl=impl),
        lambda: jaxops.gemm(x, jnp.ones((8, 4)), impl=impl),
    ):
        with pytest.raises(jaxops.InvalidArgumentError, match="impl must be None, 'ffi', 'xla'"):
            call()


def test_unknown_family():
    with pytest.raises(jaxops.InvalidArgumentError, match="family must be one of"):
        jaxops.choose_impl("attention")


def test_global_default_takes_no_preference_and_an_explicit_one_wins():
    with pytest.raises(jaxops.InvalidArgumentError, match=r"^jaxops\.set_default_impl: impl"):
        jaxops.set_default_impl(("ffi", "xla"))
    with jaxops.default_impl("xla"):
        assert jaxops.choose_impl("rms_norm", backend="cpu") == "xla"
        assert jaxops.choose_impl("rms_norm", ("ffi", "xla"), backend="cpu") == "ffi"
    with jaxops.default_impl("ffi"):  # the global default "ffi" is a requirement too
        with pytest.raises(jaxops.InvalidArgumentError):
            jaxops.choose_impl("gemm", backend="cpu")


def _calls(fn, *args) -> set[str]:
    text = jax.jit(fn).lower(*args).as_text()
    return {t for t in ("jaxops_rms_norm_fwd", "jaxops_moe_permute") if t in text}


def test_core_ops_take_the_preference_unchanged():
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    assert _calls(lambda a, b: jaxops.rms_norm(a, b, impl=("ffi", "xla")), x, w) == {
        "jaxops_rms_norm_fwd"
    }
    assert not _calls(lambda a, b: jaxops.rms_norm(a, b, impl=("xla", "ffi")), x, w)
    y = jax.jit(lambda a: jaxops.gemm(a, jnp.ones((8, 4)), impl=("ffi", "xla")))(x)
    assert y.shape == (4, 4)
    with pytest.raises(jaxops.InvalidArgumentError, match=r"^jaxops\.gemm: impl='ffi' requires"):
        jaxops.gemm(x, jnp.ones((8, 4)), impl="ffi")


def test_moe_layer_fp8_ffi_is_required_not_downgraded():
    """The shared expert's FP8 GEMMs (no CPU kernel) once ran XLA's dot under impl="ffi"."""
    cfg = MoEConfig(
        num_experts=4,
        top_k=2,
        hidden_size=128,
        expert_ffn=128,
        shared_ffn=128,
        fp8="block",
        data_axes=(),
    )
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    params = init_moe_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (2, 4, 128))
    layer = jax.jit(lambda p, a, impl: moe_layer(p, a, cfg, mesh=mesh, impl=impl)[0],
                    static_argnums=2)  # fmt: skip
    preferred = layer(params, x, ("ffi", "xla"))
    twin = layer(params, x, "xla")
    assert preferred.shape == twin.shape
    with pytest.raises(jaxops.InvalidArgumentError, match=r"impl='ffi' requires a custom call"):
        layer(params, x, "ffi")
