"""ZeRO sharding of the decoder (``MoEDecoder.zero``) and its training step.

The unsharded step is the oracle: ZeRO-1 and ZeRO-3 must give the same losses and parameters.
The compiled HLO shows where the collectives run, and the per-device bytes shrink as planned.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from jaxops.models._hlo import collective_traffic

from jaxops import models
from jaxops.testing import count_collectives

_TINY = dict(vocab_size=96, hidden_size=64)


def _config(kind: str) -> models.DecoderConfig:
    if kind == "deepseek":  # MLA, a dense layer first, a shared expert, sigmoid router
        mla = models.Mla(16, 8, 16, 8, q_lora_rank=24)
        return models.DecoderConfig(
            "deepseek_v3",
            num_layers=3,
            attention=models.AttentionSpec(num_heads=4, num_kv_heads=4, head_dim=16, mla=mla),
            moe=models.MoESpec(num_experts=8, top_k=2, expert_ffn=32, shared_ffn=32),
            pattern=models.LayerPattern(dense_layers=(0,), dense_ffn=48),
            **_TINY,
        )
    return models.DecoderConfig(
        "qwen3_moe",
        num_layers=2,
        attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
        moe=models.MoESpec(num_experts=8, top_k=2, expert_ffn=32),
        **_TINY,
    )


def _model(kind, mesh_shape, names, zero, **kw):
    mesh = jax.make_mesh(mesh_shape, names)
    return models.MoEDecoder(_config(kind), mesh, zero=zero, **kw)


def _batch(model, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 96, (8, 16)).astype(np.int32)
    return model.place_batch(tokens, (tokens * 7 + 3) % 96)


_BASE: dict = {}  # the unsharded run of each case, trained once


def _train(model, steps=2):
    """``(losses, params as numpy, compiled text)`` of `steps` adamw steps from one init."""
    # eps 1e-4, not 1e-8: Adam's first update is lr * g / (|g| + eps), so with eps 1e-8 an
    # entry at float32 rounding noise (-1.2e-8 in a gradient whose largest is 3.8e-2, summed
    # in another order by another layout) moved its weight by 1.5e-5, over the tolerance, on
    # a CPU with AVX2 only (ZeRO-3 against the unsharded run)
    opt = optax.adamw(3e-3, eps=1e-4, weight_decay=0.1)
    params = model.init(jax.random.key(0))
    state = model.init_optimizer(opt, params)
    batch = _batch(model)
    step = model.train_step(opt).lower(params, state, *batch).compile()  # one compile
    text = step.as_text()
    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, *batch)
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params), state, text


def _device_bytes(tree) -> int:
    return sum(
        math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)
    )


CASES = [
    ("qwen3-data2-expert4", "qwen3", (2, 4), ("data", "expert"), {}),
    ("deepseek-data4-expert2", "deepseek", (4, 2), ("data", "expert"), {}),
    (
        "qwen3-pipe2-data2-expert2",
        "qwen3",
        (2, 2, 2),
        ("pipe", "data", "expert"),
        {"num_microbatches": 2},
    ),
]


STEPS = [(c, z) for c in CASES for z in (1, 3) if z == 3 or c[0].startswith("qwen3-data")]


@pytest.mark.parametrize(("case", "zero"), STEPS, ids=[f"{c[0]}-zero{z}" for c, z in STEPS])
def test_zero_step_equals_unsharded(case, zero):
    name, kind, shape, names, kw = case
    if name not in _BASE:
        _BASE[name] = _train(_model(kind, shape, names, 0, **kw))
    want_losses, want, _, base_text = _BASE[name]
    model = _model(kind, shape, names, zero, **kw)
    losses, got, state, text = _train(model)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert losses[1] < losses[0], losses
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        scale = max(float(np.abs(b).max()), 1e-3)
        assert float(np.abs(a - b).max()) <= 1e-4 * scale + 1e-6, jax.tree_util.keystr(path)
    # Adam's moments live on the ZeRO shards.
    mu = state[0].mu
    assert mu["embed"].sharding.spec == model.zero_specs()["embed"]
    # The all-gathers: ZeRO-1 gathers the updated parameters once, after the loop; ZeRO-3
    # gathers each layer's weights inside the layer loops (forward and backward again).
    base, traffic = collective_traffic(base_text), collective_traffic(text)
    static = count_collectives(text).get("all-gather", 0)
    assert static > count_collectives(base_text).get("all-gather", 0)
    in_loops = traffic.counts["all-gather"] - static
    base_in_loops = base.counts.get("all-gather", 0) - count_collectives(base_text).get(
        "all-gather", 0
    )
    if zero == 1:
        assert in_loops == base_in_loops, (traffic.counts, base.counts)
    elif model.pipe == 1:  # (with a pipe axis the stage's shard_map gathers, outside the loop)
        assert in_loops > base_in_loops, (traffic.counts, base.counts)
    # The gradients are still reduced (an all-reduce then each device's slice on XLA:CPU).
    assert traffic.counts.get("all-reduce", 0) + traffic.counts.get("reduce-scatter", 0) > 0


@pytest.mark.parametrize("kind", ["qwen3", "deepseek"])
def test_zero_shards_shrink_per_device_bytes(kind):
    """Per device, a weight replicated on the batch axes keeps 1 / N of itself, an expert
    weight 1 / D (D: the data axis), in the optimizer state (ZeRO-1) and the parameters (3)."""
    shape, names = (2, 4), ("data", "expert")
    opt = optax.adam(1e-3)
    sizes = {}
    for zero in (0, 1, 3):
        model = _model(kind, shape, names, zero)
        params = model.abstract_params()
        state = jax.eval_shape(opt.init, params)
        shardings = model.optimizer_shardings(opt, params)
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings
        )
        sizes[zero] = (_device_bytes(params), _device_bytes(state))
    model = _model(kind, shape, names, 3)

    def shard(spec, full):
        return math.prod(jax.sharding.NamedSharding(model.mesh, spec).shard_shape(full))

    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    for (path, spec), compute, full in zip(
        jax.tree_util.tree_leaves_with_path(model.zero_specs(), is_leaf=is_spec),
        jax.tree.leaves(model.compute_specs(), is_leaf=is_spec),
        jax.tree.leaves(model.param_shapes(), is_leaf=lambda s: isinstance(s, tuple)),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        expert = "['moe']['w_" in name or "['moe']['b_" in name
        if math.prod(full) >= 64:  # every leaf of this size has a dimension the axes divide
            assert shard(spec, full) * (2 if expert else 8) == shard(compute, full), (name, spec)
    (p0, s0), (p1, s1), (p3, s3) = sizes[0], sizes[1], sizes[3]
    assert p1 == p0 and s1 < s0 / 2.5 and p3 < p0 / 2.5 and s3 == s1, sizes


def test_zero_specs_split_the_first_dimension_an_axis_divides():
    """Each batch axis splits the first dimension it divides (few contiguous pieces per device:
    a split of the last dimension made XLA:CPU transpose each weight and moment for the update);
    ZeRO-1 splits a stack's layer axis too, ZeRO-3 never (its layer scan slices it)."""
    names = ("data", "expert")
    zero1 = _model("qwen3", (2, 4), names, 1).zero_specs()
    zero3 = _model("qwen3", (2, 4), names, 3).zero_specs()
    # w_in [L=2, E=8 (split over expert), D, 2F]; w_o [L=2, H * Dh, D]; embed [96, 64]
    assert zero1["layers"]["moe"]["w_in"] == P("data", "expert", None, None)
    assert zero3["layers"]["moe"]["w_in"] == P(None, ("expert", "data"), None, None)
    assert zero1["layers"]["w_o"] == P("data", "expert", None)
    assert zero3["layers"]["w_o"] == P(None, ("data", "expert"), None)
    assert zero1["embed"] == zero3["embed"] == P(("data", "expert"), None)


def test_zero3_generate_equals_unsharded():
    shape, names = (2, 4), ("data", "expert")
    base = _model("qwen3", shape, names, 0)
    params = base.init(jax.random.key(1))
    model = _model("qwen3", shape, names, 3)
    sharded = jax.device_put(params, model.shardings())
    assert sharded["layers"]["w_qkv"].sharding.spec != params["layers"]["w_qkv"].sharding.spec
    prompt = np.random.default_rng(3).integers(0, 96, (8, 6)).astype(np.int32)
    want = models.generate(base, params, prompt, 4)
    np.testing.assert_array_equal(np.asarray(models.generate(model, sharded, prompt, 4)), want)
    with jax.set_mesh(model.mesh):
        got = jax.jit(model.logits)(sharded, prompt)
        ref = jax.jit(base.logits)(params, prompt)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_zero_refuses_other_stages():
    with pytest.raises(models.ConfigError, match=r"zero must be one of \(0, 1, 3\), got 2"):
        _model("qwen3", (2, 4), ("data", "expert"), 2)


def test_zero3_save_and_load_pretrained(tmp_path):
    """ZeRO-3 shards write the same files and load back onto ZeRO-3 shards, equal."""
    shape, names = (2, 4), ("data", "expert")
    base = _model("qwen3", shape, names, 0)
    params = base.init(jax.random.key(2))
    model = _model("qwen3", shape, names, 3)
    models.save_pretrained(model, jax.device_put(params, model.shardings()), tmp_path / "z3")
    models.save_pretrained(base, params, tmp_path / "z0")
    for f in sorted(p.name for p in (tmp_path / "z0").iterdir()):
        assert (tmp_path / "z3" / f).read_bytes() == (tmp_path / "z0" / f).read_bytes(), f
    loaded_model, loaded = models.from_pretrained(tmp_path / "z3", mesh=model.mesh, zero=3)
    assert loaded_model.zero == 3
    for a, b, s in zip(
        jax.tree.leaves(loaded),
        jax.tree.leaves(params),
        jax.tree.leaves(model.shardings()),
        strict=True,
    ):
        assert a.sharding.spec == s.spec
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["qwen3", "deepseek"])
def test_zero3_gathers_weights_in_the_compute_dtype(kind, monkeypatch):
    """bfloat16 compute, float32 parameters: ZeRO-3 casts the projections' and experts'
    weights before it gathers them (as 16-bit words), the same losses and parameters bit for
    bit as gathering float32 and casting after, with fewer all-gather bytes."""
    import re

    from jaxops.models import _layout

    def run():
        model = _model(kind, (2, 4), ("data", "expert"), 3, dtype="bfloat16", remat="full")
        return _train(model, steps=2)

    losses, params, _, text = run()
    monkeypatch.setattr(_layout, "_CAST_KEYS", frozenset())  # cast after the gather
    want_losses, want, _, want_text = run()
    assert losses == want_losses
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    gathered = collective_traffic(text).bytes["all-gather"]
    want_gathered = collective_traffic(want_text).bytes["all-gather"]
    assert gathered < 0.75 * want_gathered, (gathered, want_gathered)
    assert "u16" in " ".join(re.findall(r"= (\S+) all-gather", text))


def test_gather_as_lays_out_its_gradient_in_the_stored_dtype():
    """The backward of the cast-and-gather casts the cotangent back to float32 before it lays
    it out on the shards, where the partitioner reduces the devices' partial sums: the order
    in the jaxpr (XLA:CPU computes bfloat16 reductions in float32 anyway, so its HLO cannot
    show it)."""
    from jax.sharding import NamedSharding
    from jaxops.models._layout import _gather_as

    mesh = jax.make_mesh((8,), ("data",))
    source, target = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(16, 4), source)

    def f(x):
        return (_gather_as(x, np.dtype(jnp.bfloat16), np.dtype(np.float32), target, source)).sum()

    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.grad(f))(x).jaxpr
        grad = jax.jit(jax.grad(f))(x)
    layouts = [e for e in jaxpr.eqns if e.primitive.name in ("reshard", "sharding_constraint")]
    last = layouts[-1]  # the cotangent's, onto the shards
    assert last.invars[0].aval.dtype == np.float32, last
    assert grad.dtype == np.float32 and grad.sharding.is_equivalent_to(source, 2)
    np.testing.assert_array_equal(grad, np.ones((16, 4), np.float32))


@pytest.mark.parametrize(
    ("shape", "names", "kw"),
    [
        ((2, 4), ("data", "expert"), {}),
        ((2, 2, 2), ("pipe", "data", "expert"), {"num_microbatches": 2}),
    ],
    ids=["data2-expert4", "pipe2-data2-expert2"],
)
def test_zero3_bfloat16_gradients_keep_the_parameters_dtype(shape, names, kw):
    """bfloat16 compute, float32 parameters: ZeRO-3's gradients are float32 (a pipeline's
    output head too, which it gathers uncast) and match the unsharded step's."""
    models_ = {z: _model("qwen3", shape, names, z, dtype="bfloat16", **kw) for z in (0, 3)}
    params = models_[0].init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 96, (8, 16)).astype(np.int32)
    out = {}
    for z, model in models_.items():
        batch = model.place_batch(tokens, (tokens * 7 + 3) % 96)
        placed = jax.device_put(params, model.shardings())
        out[z] = jax.jit(model.loss_and_grads)(placed, *batch)
    (want, want_g), (got, got_g) = out[0], out[3]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-3)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert a.dtype == b.dtype == np.float32, (name, a.dtype, b.dtype)
        a, b = np.asarray(a), np.asarray(b)
        assert float(np.abs(a - b).max()) <= 3e-2 * max(float(np.abs(b).max()), 1e-4), name
