"""Tests of jaxops.parallel.pipeline: schedules, pipelined loss and gradients vs the sequential
model on 8 CPU devices, bounded 1F1B memory, data and expert axes, optax, 2 processes, errors."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert as ep
from jaxops.parallel import pipeline as pl
from jaxops.parallel.pipeline import _schedule

from jaxops.testing import assert_allclose, count_collectives, run_processes

# (schedule, virtual_stages)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("gpipe", 2), ("interleaved", 2)]
# P -> (mesh shape, axis names): the pipeline axis with a data axis on the rest of the 8 devices.
MESHES = {2: ((2, 4), ("pipe", "data")), 4: ((4, 2), ("pipe", "data")), 8: ((8,), ("pipe",))}
H = 8


def _mesh(p):
    shape, names = MESHES[p]
    return jax.make_mesh(shape, names)


def _stage(params, x):
    """A residual MLP block."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return x + h @ params["w2"]


def _loss(head, y, t):
    return jnp.mean((y @ head - t) ** 2)


def _model(num_stages, key, dtype=jnp.float32):
    k = jax.random.split(key, 4)
    params = {
        "w1": jax.random.normal(k[0], (num_stages, H, 2 * H)) / np.sqrt(H),
        "b1": jax.random.normal(k[1], (num_stages, 2 * H)) * 0.1,
        "w2": jax.random.normal(k[2], (num_stages, 2 * H, H)) / np.sqrt(2 * H),
    }
    head = jax.random.normal(k[3], (H, 3)) / np.sqrt(H)
    return jax.tree.map(lambda a: a.astype(dtype), params), head.astype(dtype)


def _batch(batch, key, dtype=jnp.float32):
    kx, kt = jax.random.split(key)
    return (
        jax.random.normal(kx, (batch, H), dtype),
        jax.random.normal(kt, (batch, 3), dtype),
    )


def _sequential(params, head, x, t):
    """The model the pipeline splits: every stage in model order on one device."""
    for s in range(jax.tree.leaves(params)[0].shape[0]):
        x = _stage(jax.tree.map(lambda a, s=s: a[s], params), x)
    return _loss(head, x, t)


def _reference(params, head, x, t):
    return jax.jit(jax.value_and_grad(_sequential, argnums=(0, 1, 2, 3)))(params, head, x, t)


def _assert_grads(loss, grads, ref, num_stages, virtual_stages, scale=4.0):
    ref_loss, (dparams, dhead, dx, dt) = ref
    assert_allclose(loss, ref_loss, np.float32, scale=scale, err_msg="loss")
    model_order = pl.deinterleave(
        grads.stage_params, num_stages=num_stages, virtual_stages=virtual_stages
    )
    for name in dparams:
        assert_allclose(model_order[name], dparams[name], np.float32, scale=scale, err_msg=name)
    assert_allclose(grads.loss_params, dhead, np.float32, scale=scale, err_msg="loss_params")
    assert_allclose(grads.inputs, dx, np.float32, scale=scale, err_msg="inputs")
    assert_allclose(grads.targets, dt, np.float32, scale=scale, err_msg="targets")
    assert float(jnp.abs(dt).max()) > 0 and float(jnp.abs(model_order["w1"]).max()) > 0


def _step(mesh, num_microbatches, schedule, virtual_stages, **kw):
    def step(params, head, x, t):
        return pl.pipeline_step(
            _stage,
            params,
            x,
            targets=t,
            loss_params=head,
            loss_fn=_loss,
            mesh=mesh,
            num_microbatches=num_microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            **kw,
        )

    return jax.jit(step)


# -------------------------------------------------------------------------------------------------
# Schedule tables.


@pytest.mark.parametrize("schedule,v", SCHEDULES, ids=[f"{s}-v{v}" for s, v in SCHEDULES])
@pytest.mark.parametrize("p", [2, 4, 8], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("mult", [1, 2, 4], ids=lambda k: f"M{k}P")
def test_schedule_table(schedule, v, p, mult):
    m = mult * p
    table = pl.schedule_table(schedule, p, m, v)
    assert table.num_ticks == 2 * (v * m + p - 1)
    assert table.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert table.bubble_fraction == pytest.approx(table.theoretical_bubble)
    # Every (microbatch, stage) runs forward once and backward once, in dependency order.
    when = {}
    for t in range(table.num_ticks):
        for d in range(p):
            k = int(table.kind[t, d])
            if k:
                key = (k, int(table.microbatch[t, d]), int(table.chunk[t, d]) * p + d)
                assert key not in when, key
                when[key] = t
    stages = p * v
    assert len(when) == 2 * m * stages
    for mb in range(m):
        for s in range(stages):
            if s:
                assert when[(1, mb, s)] > when[(1, mb, s - 1)]
            nxt = (1, mb, s) if s == stages - 1 else (2, mb, s + 1)
            assert when[(2, mb, s)] > when[nxt]
    held = table.in_flight()
    if schedule == "gpipe":
        assert held == m * v
    elif schedule == "1f1b":
        assert held == p
    else:
        assert held == min(2 * (p - 1) + (v - 1) * p + 1, m * v)


def test_schedule_table_print_and_plot(tmp_path):
    text = str(pl.schedule_table("1f1b", 2, 3))
    assert text.splitlines() == [
        "1f1b: P=2 M=3 V=1, 8 ticks, bubble 0.250",
        "d0: F0 F1  . B0 F2 B1  . B2",
        "d1:  . F0 B0 F1 B1 F2 B2  .",
    ]
    path = tmp_path / "interleaved.png"
    fig = pl.plot_schedule("interleaved", 4, 8, 2, path=path)
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 1000
    assert "bubble 15.8%" in fig.axes[0].get_title()


def test_forward_table():
    table = _schedule.cached_table("gpipe", 4, 8, 1, True)
    assert table.num_ticks == 8 + 4 - 1 and not (table.kind == _schedule.BACKWARD).any()
    assert table.schedule == "forward"


# -------------------------------------------------------------------------------------------------
# Loss and gradients vs the sequential model.


# Every schedule on every P, and each of them (and each P) with every M / P: the pairs of the
# 4 x 3 x 3 product in 12 runs (M / P chosen by a Latin square on the schedule and P). The
# schedule tables of the whole product are checked above, without running them.
_SEQUENTIAL = [
    pytest.param(s, v, p, mult, id=f"{s}-v{v}-P{p}-M{mult}P")
    for i, (s, v) in enumerate(SCHEDULES)
    for j, p in enumerate((2, 4, 8))
    for mult in [(1, 2, 4)[(i + j) % 3]]
]


@pytest.mark.parametrize("schedule,v,p,mult", _SEQUENTIAL)
def test_matches_sequential(schedule, v, p, mult):
    m = mult * p
    mesh = _mesh(p)
    shards = 8 // p
    params, head = _model(p * v, jax.random.key(p * 10 + v))
    x, t = _batch(2 * m * shards, jax.random.key(mult))
    ref = _reference(params, head, x, t)
    laid = pl.interleave(params, num_stages=p, virtual_stages=v)
    remat = mult == 2  # both ways of stashing across the sweep
    loss, grads = _step(mesh, m, schedule, v, remat=remat)(laid, head, x, t)
    _assert_grads(loss, grads, ref, p, v)
    assert grads.stage_params["w1"].sharding.spec[0] == "pipe"


@pytest.mark.parametrize(
    "remat",
    [False, True, jax.checkpoint_policies.dots_saveable],
    ids=["residuals", "inputs", "dots_saveable"],
)
def test_remat_options(remat):
    mesh = _mesh(4)
    params, head = _model(8, jax.random.key(1))
    x, t = _batch(32, jax.random.key(2))
    ref = _reference(params, head, x, t)
    laid = pl.interleave(params, num_stages=4, virtual_stages=2)
    loss, grads = _step(mesh, 4, "interleaved", 2, remat=remat)(laid, head, x, t)
    _assert_grads(loss, grads, ref, 4, 2)


def test_odd_microbatch_counts_and_single_microbatch():
    mesh = _mesh(4)
    params, head = _model(4, jax.random.key(3))
    for m in (1, 3, 5):
        x, t = _batch(2 * m * 2, jax.random.key(m))
        ref = _reference(params, head, x, t)
        for schedule in ("gpipe", "1f1b"):
            loss, grads = _step(mesh, m, schedule, 1)(params, head, x, t)
            _assert_grads(loss, grads, ref, 4, 1)


def test_bfloat16():
    mesh = _mesh(4)
    params, head = _model(4, jax.random.key(4), jnp.bfloat16)
    x, t = _batch(32, jax.random.key(5), jnp.bfloat16)
    f64 = functools.partial(jax.tree.map, lambda a: np.asarray(a, np.float32))
    ref_loss, ref = jax.value_and_grad(_sequential, argnums=(0, 1))(
        f64(params), f64(head), f64(x), f64(t)
    )
    loss, grads = _step(mesh, 8, "1f1b", 1)(params, head, x, t)
    assert grads.stage_params["w1"].dtype == jnp.bfloat16 and grads.inputs.dtype == jnp.bfloat16
    assert_allclose(loss, ref_loss, jnp.bfloat16, scale=4)
    for name in ref[0]:
        assert_allclose(grads.stage_params[name], ref[0][name], jnp.bfloat16, scale=8)


def test_pytree_activations_aux_loss_and_no_targets():
    """Activations as a dict, stage aux losses, integer targets, no loss params."""
    mesh = _mesh(4)
    params, _ = _model(4, jax.random.key(6))
    x, _ = _batch(16, jax.random.key(7))
    labels = jax.random.randint(jax.random.key(8), (16,), 0, H)

    def stage(p, act):
        y = _stage(p, act["h"])
        return {"h": y, "skip": act["skip"] * 0.5 + y}, jnp.mean(y**2)

    def loss_fn(_, act, labels):
        logits = act["h"] + act["skip"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    def sequential(params, act, labels, m=4):
        xs = jax.tree.map(lambda a: a.reshape(m, -1, *a.shape[1:]), act)
        total = 0.0
        for i in range(m):
            a = jax.tree.map(lambda b, i=i: b[i], xs)
            for s in range(4):
                a, aux = stage(jax.tree.map(lambda w, s=s: w[s], params), a)
                total += aux / m
            total += loss_fn(None, a, labels.reshape(m, -1)[i]) / m
        return total

    act = {"h": x, "skip": jnp.zeros_like(x)}
    ref_loss, (dparams, dact) = jax.value_and_grad(sequential, argnums=(0, 1))(params, act, labels)
    step = jax.jit(
        lambda p, a, y: pl.pipeline_step(
            stage,
            p,
            a,
            targets=y,
            loss_fn=loss_fn,
            mesh=mesh,
            num_microbatches=4,
            data_axes=(),
            has_aux=True,
        )
    )
    loss, grads = step(params, act, labels)
    assert_allclose(loss, ref_loss, np.float32, scale=4)
    for name in dparams:
        assert_allclose(grads.stage_params[name], dparams[name], np.float32, scale=4)
    for name in dact:
        assert_allclose(grads.inputs[name], dact[name], np.float32, scale=4)
    assert grads.loss_params is None and grads.targets.dtype == jax.dtypes.float0


@pytest.mark.parametrize("v", [1, 2], ids=lambda v: f"v{v}")
def test_pipeline_forward(v):
    mesh = _mesh(4)
    params, _ = _model(4 * v, jax.random.key(9))
    x, _ = _batch(24, jax.random.key(10))

    def sequential(params, x):
        for s in range(4 * v):
            x = _stage(jax.tree.map(lambda a, s=s: a[s], params), x)
        return x

    laid = pl.interleave(params, num_stages=4, virtual_stages=v)
    out = jax.jit(
        lambda p, x: pl.pipeline_forward(
            _stage, p, x, mesh=mesh, num_microbatches=4 if v > 1 else 3, virtual_stages=v
        )
    )(laid, x)
    assert out.shape == x.shape
    assert_allclose(out, sequential(params, x), np.float32, scale=4)


# -------------------------------------------------------------------------------------------------
# Memory and communication.


def _temp_bytes(schedule, p, m, hidden=64, rows=64):
    mesh = jax.make_mesh((p,), ("pipe",))
    params = {
        "w1": jnp.zeros((p, hidden, 4 * hidden)),
        "b1": jnp.zeros((p, 4 * hidden)),
        "w2": jnp.zeros((p, 4 * hidden, hidden)),
    }
    x = jnp.zeros((m * rows, hidden))
    t = jnp.zeros((m * rows, hidden))

    def step(params, x, t):
        return pl.pipeline_step(
            _stage,
            params,
            x,
            targets=t,
            loss_fn=lambda _, y, t: jnp.mean((y - t) ** 2),
            mesh=mesh,
            num_microbatches=m,
            schedule=schedule,
            input_grads=False,
        )

    compiled = jax.jit(step).lower(params, x, t).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


@pytest.mark.parametrize("p", [4, 8], ids=lambda p: f"P{p}")
def test_1f1b_memory_bounded(p):
    """1F1B stashes at most P microbatches: at M = 4P its temp memory is at most half of GPipe's,
    and it does not grow with M (GPipe's does). Without input gradients, which are batch-sized."""
    gpipe, _ = _temp_bytes("gpipe", p, 4 * p)
    f1b = {m: _temp_bytes("1f1b", p, m)[0] for m in (p, 2 * p, 4 * p)}
    assert f1b[4 * p] <= 0.5 * gpipe, (f1b, gpipe)
    assert f1b[4 * p] <= 1.05 * f1b[p], f1b
    assert gpipe > 1.5 * _temp_bytes("gpipe", p, p)[0]


def test_collectives():
    """Per tick one ppermute each way (in the loop); after it one all-reduce; no gathers."""
    _, hlo = _temp_bytes("1f1b", 4, 8)
    counts = count_collectives(hlo)
    assert counts.get("collective-permute", 0) == 2, counts
    assert counts.get("all-reduce", 0) <= 2, counts
    assert not {"all-gather", "all-to-all", "reduce-scatter"} & set(counts), counts


def test_data_parallel_gradients_reduced_once():
    mesh = _mesh(2)
    params, head = _model(2, jax.random.key(11))
    x, t = _batch(64, jax.random.key(12))
    step = _step(mesh, 4, "1f1b", 1)
    hlo = step.lower(params, head, x, t).compile().as_text()
    counts = count_collectives(hlo)
    assert counts.get("collective-permute", 0) == 2, counts
    # The data-axis reduction of the gradients happens after the loop, not per microbatch.
    assert counts.get("all-reduce", 0) <= 3, counts
    _assert_grads(*step(params, head, x, t), _reference(params, head, x, t), 2, 1)


# -------------------------------------------------------------------------------------------------
# With MoE stages, optax and several processes.


def test_moe_stages():
    """Expert-parallel MoE stages: the layer runs on the stage's shards inside the pipeline."""
    mesh = jax.make_mesh((2, 4), ("pipe", "expert"))
    cfg = ep.MoEConfig(
        num_experts=8,
        top_k=2,
        hidden_size=16,
        expert_ffn=24,
        data_axes=(),
        dtype=jnp.float32,
        align=4,
    )
    keys = jax.random.split(jax.random.key(13), 4)
    params = jax.tree.map(lambda *a: jnp.stack(a), *[ep.init_moe_params(k, cfg) for k in keys[:2]])
    m, shards, rows = 2, 4, 4
    x = jax.random.normal(keys[2], (m * shards * rows, 16))
    t = jax.random.normal(keys[3], x.shape)

    def stage(p, x):
        y, aux = ep.moe_layer(p, x, cfg, mesh=mesh)
        return x + y, aux.loss

    def mse(_, y, t):
        return jnp.mean((y - t) ** 2)

    def sequential(params, x, t):
        # Microbatch i is made of local microbatch i of every token shard, in shard order.
        def split(a):
            return a.reshape(shards, m, rows, 16).transpose(1, 0, 2, 3).reshape(m, -1, 16)

        total = 0.0
        for xi, ti in zip(split(x), split(t), strict=True):
            for s in range(2):
                y, aux = ep.moe_layer_reference(jax.tree.map(lambda a, s=s: a[s], params), xi, cfg)
                xi = xi + y
                total += aux.loss / m
            total += mse(None, xi, ti) / m
        return total

    # Jitted: one program, not one per op of the unrolled reference.
    ref_loss, (dparams, dx) = jax.jit(jax.value_and_grad(sequential, argnums=(0, 1)))(params, x, t)
    step = jax.jit(
        lambda p, x, t: pl.pipeline_step(
            stage,
            p,
            x,
            targets=t,
            loss_fn=mse,
            mesh=mesh,
            num_microbatches=m,
            has_aux=True,
            param_specs=ep.moe_param_specs(cfg),
        )
    )
    loss, grads = step(params, x, t)
    assert_allclose(loss, ref_loss, np.float32, scale=8)
    for name in dparams:
        assert_allclose(grads.stage_params[name], dparams[name], np.float32, scale=8, err_msg=name)
    assert_allclose(grads.inputs, dx, np.float32, scale=8)
    assert grads.stage_params["w_in"].sharding.spec[:2] == ("pipe", "expert")


def test_optax_training_reduces_loss():
    mesh = _mesh(4)
    params, head = _model(8, jax.random.key(14))
    params = pl.interleave(params, num_stages=4, virtual_stages=2)
    x, t = _batch(64, jax.random.key(15))
    opt = optax.adam(1e-2)
    state = opt.init((params, head))

    @jax.jit
    def train(params, head, state):
        loss, grads = pl.pipeline_step(
            _stage,
            params,
            x,
            targets=t,
            loss_params=head,
            loss_fn=_loss,
            mesh=mesh,
            num_microbatches=8,
            schedule="interleaved",
            virtual_stages=2,
        )
        updates, state = opt.update((grads.stage_params, grads.loss_params), state)
        params, head = optax.apply_updates((params, head), updates)
        return params, head, state, loss

    losses = []
    for _ in range(15):
        params, head, state, loss = train(params, head, state)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    assert params["w1"].sharding.spec[0] == "pipe"


_TWO_PROCESS_SCRIPT = """
import numpy as np
import jax, jax.numpy as jnp
from jaxops.parallel import pipeline as pl

schedule, v = ARGS[0], int(ARGS[1])
mesh = jax.make_mesh((4, 2), ("pipe", "data"))
H = 8
k = jax.random.split(jax.random.key(0), 5)
L = 4 * v
params = {"w": jax.random.normal(k[0], (L, H, H)) / np.sqrt(H),
          "b": jax.random.normal(k[1], (L, H)) * 0.1}
head = jax.random.normal(k[2], (H, 3))
x = jax.random.normal(k[3], (32, H))
t = jax.random.normal(k[4], (32, 3))

def stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])

def loss_fn(head, y, t):
    return jnp.mean((y @ head - t) ** 2)

def sequential(params, head, x, t):
    for s in range(L):
        x = stage(jax.tree.map(lambda a: a[s], params), x)
    return loss_fn(head, x, t)

ref_loss, ref = jax.value_and_grad(sequential, argnums=(0, 1))(params, head, x, t)
laid = pl.interleave(params, num_stages=4, virtual_stages=v)
ref_laid = pl.interleave(ref[0], num_stages=4, virtual_stages=v)
loss, grads = jax.jit(lambda p, h, x, t: pl.pipeline_step(
    stage, p, x, targets=t, loss_params=h, loss_fn=loss_fn, mesh=mesh,
    num_microbatches=4, schedule=schedule, virtual_stages=v))(laid, head, x, t)
np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
checked = 0
for name, g in grads.stage_params.items():
    for shard in g.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(ref_laid[name][shard.index]),
                                   rtol=1e-4, atol=1e-5)
        checked += 1
np.testing.assert_allclose(np.asarray(grads.loss_params.addressable_shards[0].data),
                           np.asarray(ref[1]), rtol=1e-4, atol=1e-5)
print("OK", PROCESS_ID, checked)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)], ids=["1f1b", "interl"])
def test_two_processes(schedule, v):
    outputs = run_processes(_TWO_PROCESS_SCRIPT, 2, 4, args=(schedule, str(v)), timeout=240)
    for i, out in enumerate(outputs):
        # A search, not the last line: gloo writes to the same pipe from another thread.
        found = re.search(rf"OK {i} (\d+)", out)
        assert found and int(found[1]) == 8, out


# -------------------------------------------------------------------------------------------------
# Layout helpers and bad input.


def test_interleave_roundtrip():
    a = jnp.arange(24).reshape(8, 3)
    laid = pl.interleave({"a": a}, num_stages=4, virtual_stages=2)["a"]
    assert laid[:, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    back = pl.deinterleave({"a": laid}, num_stages=4, virtual_stages=2)["a"]
    assert (back == a).all()
    with pytest.raises(
        ValueError,
        match=r"^jaxops\.parallel\.pipeline\.interleave: .*num_stages \* virtual_stages = 6",
    ):
        pl.interleave(a, num_stages=3, virtual_stages=2)
    with pytest.raises(ValueError, match=r"^jaxops\.parallel\.pipeline\.deinterleave: "):
        pl.deinterleave(a, num_stages=3, virtual_stages=2)


def _call(**kw):
    mesh = kw.pop("mesh", _mesh(4))
    params, head = kw.pop("params", None) or _model(4, jax.random.key(0))
    x, t = _batch(kw.pop("batch", 16), jax.random.key(1))
    args = dict(
        targets=t,
        loss_params=head,
        loss_fn=_loss,
        mesh=mesh,
        num_microbatches=4,
    )
    args.update(kw)
    stage = args.pop("stage_fn", _stage)
    return jax.jit(lambda p, x: pl.pipeline_step(stage, p, x, **args)).lower(params, x)


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(schedule="zb"), ValueError, "schedule must be one of"),
        (dict(virtual_stages=2), ValueError, "schedule='1f1b' runs one stage per device"),
        (dict(schedule="interleaved"), ValueError, "needs virtual_stages >= 2"),
        (
            dict(schedule="interleaved", virtual_stages=2, num_microbatches=6, batch=24),
            ValueError,
            "num_microbatches must be a multiple of 4, got 6",
        ),
        (dict(num_microbatches=0), ValueError, "num_microbatches must be >= 1"),
        (dict(num_microbatches=2.0), TypeError, "num_microbatches must be an int"),
        (dict(batch=12), ValueError, r"must be a multiple of 8; inputs has batch 12"),
        (
            dict(params=_model(8, jax.random.key(0))),
            ValueError,
            r"leading axis of size 4 .*stage_params\['b1'\] has shape \(8, 16\)",
        ),
        (
            dict(params=({"w": jnp.float32(1.0)}, None)),
            ValueError,
            r"stage_params\['w'\] has shape \(\)",
        ),
        (dict(pipe_axis="stages"), ValueError, "pipe_axis 'stages' is not an axis of the mesh"),
        (dict(data_axes=("pipe",)), ValueError, "data_axes must name mesh axes other than"),
        (dict(remat="yes"), TypeError, "remat must be True, False or a"),
        (
            dict(stage_fn=lambda p, x: x[:, :4]),
            ValueError,
            "stage_fn must return its input's structure",
        ),
        (
            dict(loss_fn=lambda h, y, t: (y @ h - t) ** 2),
            ValueError,
            "loss_fn must return a scalar",
        ),
        (dict(has_aux=True), ValueError, r"has_aux=True stage_fn must return \(x, aux_loss\)"),
        (
            dict(param_specs={"w1": P("pipe"), "b1": P(), "w2": P()}),
            ValueError,
            "other than the pipeline axis",
        ),
        (dict(loss_param_specs=P("pipe")), ValueError, "loss_param_specs shard loss_params"),
        (
            dict(loss_param_specs={"head": P()}),
            ValueError,
            "loss_param_specs must be a pytree like loss_params",
        ),
        (dict(mesh="pipe"), TypeError, "mesh must be a jax.sharding.Mesh"),
        (dict(frozen=({"w1": 1}, True)), TypeError, "frozen must hold bools"),
        (dict(frozen=({"w9": True}, True)), ValueError, r"frozen must be bools shaped like"),
    ],
    ids=[
        "schedule",
        "1f1b-virtual",
        "interleaved-v1",
        "M-not-multiple-of-P",
        "M-zero",
        "M-float",
        "batch-indivisible",
        "stage-count",
        "not-stacked",
        "axis",
        "data-axes",
        "remat",
        "stage-shape",
        "loss-not-scalar",
        "aux-missing",
        "param-specs-pipe",
        "loss-param-specs-pipe",
        "loss-param-specs-structure",
        "mesh",
        "frozen-not-bool",
        "frozen-structure",
    ],
)
def test_bad_input(kw, err, match):
    with pytest.raises(err, match=match) as info:
        _call(**kw)
    assert str(info.value).startswith("jaxops.parallel.pipeline.pipeline_step: "), info.value


def test_bad_forward_input():
    mesh = _mesh(4)
    params, _ = _model(4, jax.random.key(0))
    x, _ = _batch(16, jax.random.key(1))
    op = r"^jaxops\.parallel\.pipeline\.pipeline_forward: "
    with pytest.raises(ValueError, match=op + "pipe_axis 'stages' is not an axis of the mesh"):
        pl.pipeline_forward(_stage, params, x, mesh=mesh, num_microbatches=4, pipe_axis="stages")
    with pytest.raises(ValueError, match=op + "the batch, split over"):
        pl.pipeline_forward(_stage, params, x, mesh=mesh, num_microbatches=3)
    with pytest.raises(TypeError, match=op + "stage_fn must be callable"):
        pl.pipeline_forward(None, params, x, mesh=mesh, num_microbatches=4)


def test_bad_schedule_table_input():
    with pytest.raises(
        ValueError, match=r"^jaxops\.parallel\.pipeline\.schedule_table: num_stages must be >= 1"
    ):
        pl.schedule_table("1f1b", 0, 4)
    with pytest.raises(
        TypeError,
        match=r"^jaxops\.parallel\.pipeline\.plot_schedule: .*ScheduleTable or a schedule name",
    ):
        pl.plot_schedule(3)
    with pytest.raises(TypeError, match=r"^jaxops\.parallel\.pipeline\.plot_schedule: "):
        pl.plot_schedule("1f1b", 4)


def test_deprecated_axis_keyword():
    """axis= is the old name of pipe_axis=: it warns, names both, and gives the same results."""
    mesh = jax.make_mesh((4, 2), ("stages", "data"))
    params, head = _model(4, jax.random.key(18))
    x, t = _batch(16, jax.random.key(19))
    kw = dict(targets=t, loss_params=head, loss_fn=_loss, mesh=mesh, num_microbatches=2)
    # The step: traced (not compiled) under both names; the renamed keyword changes nothing
    # else, so the same traced program.
    new = jax.make_jaxpr(lambda p: pl.pipeline_step(_stage, p, x, pipe_axis="stages", **kw))
    old = jax.make_jaxpr(lambda p: pl.pipeline_step(_stage, p, x, axis="stages", **kw))
    want = str(new(params))
    with pytest.warns(
        DeprecationWarning, match=r"pipeline_step: the keyword axis= is renamed pipe_axis="
    ):
        assert str(old(params)) == want
    fkw = dict(mesh=mesh, num_microbatches=2)
    # Jitted (the warning is raised while tracing): one program each, not one per op.
    out = jax.jit(lambda p: pl.pipeline_forward(_stage, p, x, pipe_axis="stages", **fkw))(params)
    with pytest.warns(DeprecationWarning, match=r"pipeline_forward: the keyword axis= is renamed"):
        old_out = jax.jit(lambda p: pl.pipeline_forward(_stage, p, x, axis="stages", **fkw))(params)
    np.testing.assert_array_equal(np.asarray(old_out), np.asarray(out))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name does not warn
        jax.eval_shape(
            lambda p: pl.pipeline_forward(_stage, p, x, pipe_axis="stages", **fkw), params
        )
    with pytest.raises(TypeError, match="got both pipe_axis= and its deprecated name axis="):
        pl.pipeline_forward(_stage, params, x, axis="stages", pipe_axis="stages", **fkw)


def test_loss_params_sharded_over_a_data_axis():
    """A loss_params leaf sharded over the data axis (loss_param_specs) is a different parameter
    on each of its devices: each data shard's rows use its own row of `v`, and v's gradient is
    that row's, not summed over the axis; the replicated head's is summed."""
    mesh = _mesh(4)  # pipe 4 x data 2
    params, head = _model(4, jax.random.key(0))
    x, t = _batch(16, jax.random.key(1))
    v = 1.0 + 0.5 * jax.random.normal(jax.random.key(2), (2, H))

    def loss_fn(lp, y, t):  # lp["v"]: this data shard's row [1, H]
        return _loss(lp["head"], y * lp["v"][0], t)

    step = jax.jit(
        lambda p, lp, x, t: pl.pipeline_step(
            _stage, p, x, targets=t, loss_params=lp, loss_fn=loss_fn, mesh=mesh,
            num_microbatches=2, loss_param_specs={"head": P(), "v": P("data")},
        )
    )  # fmt: skip
    loss, grads = step(params, {"head": head, "v": v}, x, t)

    def reference(params, head, v):  # shard d: rows 8 d .. 8 d + 7, row d of v
        total = 0.0
        for d in range(2):
            y = x[8 * d : 8 * d + 8]
            for s in range(4):
                y = _stage(jax.tree.map(lambda a, s=s: a[s], params), y)
            total += _loss(head, y * v[d], t[8 * d : 8 * d + 8]) / 2
        return total

    ref_loss, (dparams, dhead, dv) = jax.value_and_grad(reference, argnums=(0, 1, 2))(
        params, head, v
    )
    assert_allclose(loss, ref_loss, np.float32, scale=4.0, err_msg="loss")
    assert_allclose(grads.loss_params["head"], dhead, np.float32, scale=4.0, err_msg="head")
    assert_allclose(grads.loss_params["v"], dv, np.float32, scale=4.0, err_msg="v")
    for name in dparams:
        assert_allclose(grads.stage_params[name], dparams[name], np.float32, scale=4.0)
    assert grads.loss_params["v"].sharding.spec[0] == "data"  # not gathered


def test_without_input_grads():
    mesh = _mesh(4)
    params, head = _model(4, jax.random.key(16))
    x, t = _batch(16, jax.random.key(17))
    loss, grads = _step(mesh, 4, "1f1b", 1, input_grads=False)(params, head, x, t)
    ref_loss, (dparams, dhead, _, _) = _reference(params, head, x, t)
    assert grads.inputs is None and grads.targets is None
    assert_allclose(loss, ref_loss, np.float32, scale=4)
    assert_allclose(grads.loss_params, dhead, np.float32, scale=4)
    for name in dparams:
        assert_allclose(grads.stage_params[name], dparams[name], np.float32, scale=4)


@pytest.mark.parametrize("remat", [False, True], ids=["residuals", "inputs"])
def test_frozen_leaves_get_no_gradient(remat):
    """Adapters on a frozen base: with w1, w2 and the head frozen, b1's gradient and the input
    gradients are the sequential model's, the frozen leaves' are None, and the compiled step
    makes fewer matrix products (no weight gradients of w1, w2 or the head)."""
    mesh = _mesh(4)
    params, head = _model(8, jax.random.key(20))
    x, t = _batch(32, jax.random.key(21))
    ref_loss, (dparams, _, dx, dt) = _reference(params, head, x, t)
    laid = pl.interleave(params, num_stages=4, virtual_stages=2)
    frozen = ({"w1": True, "b1": False, "w2": True}, True)
    kw = dict(remat=remat)
    step = _step(mesh, 4, "interleaved", 2, frozen=frozen, **kw)
    loss, grads = step(laid, head, x, t)
    assert grads.stage_params["w1"] is None and grads.stage_params["w2"] is None
    assert grads.loss_params is None
    assert_allclose(loss, ref_loss, np.float32, scale=4)
    b1 = pl.deinterleave(grads.stage_params, num_stages=4, virtual_stages=2)["b1"]
    assert_allclose(b1, dparams["b1"], np.float32, scale=4)
    assert_allclose(grads.inputs, dx, np.float32, scale=4)
    assert_allclose(grads.targets, dt, np.float32, scale=4)

    def dots(f):
        return f.lower(laid, head, x, t).compile().as_text().count(" dot(")

    # Frozen: w1's and w2's weight gradients and the head's are gone (3 of the full step's dots).
    assert dots(step) <= dots(_step(mesh, 4, "interleaved", 2, **kw)) - 3
    # A prefix of the tree: every stage param frozen, the head trained.
    _, grads = _step(mesh, 4, "interleaved", 2, frozen=(True, False), **kw)(laid, head, x, t)
    assert all(g is None for g in grads.stage_params.values())
    assert grads.loss_params is not None


def test_docstring_examples():
    from jaxops import testing

    assert testing.run_docstring_examples(pl) >= 25


def test_residuals_from_params_alone_are_recomputed_not_stashed():
    # A stage that slices its weight out of a stack and casts it: those residuals are functions
    # of the params alone. The backward recomputes them; only activations are stashed.
    from jaxops.parallel.pipeline import _trees

    def stage(p, x):
        w = p["w"][1].astype(jnp.bfloat16)
        h = jnp.tanh(jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
        return h * p["scale"] + 0.5

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (3, 16, 24)), "scale": jax.random.normal(k2, (24,))}
    x = jax.random.normal(k3, (8, 16))
    derived, recompute = _trees.param_derived(stage, params, x)
    y, vjp_fn = jax.vjp(stage, params, x)
    stash, layout = _trees.split_residuals(vjp_fn, params, derived)
    kinds = [kind for kind, _ in layout.where]
    assert "derived" in kinds, layout.where
    # The bf16 weight (16 x 24) is not stashed; what is stashed has a row per token.
    assert all(a.ndim and a.shape[0] == 8 for a in stash), [a.shape for a in stash]
    rebuilt = _trees.join_residuals(layout, stash, params, recompute(params))
    dy = jax.random.normal(jax.random.key(4), y.shape)
    want, got = vjp_fn(dy), rebuilt(dy)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
