"""``MoEDecoder.grad_reduce``: the flat-gradient step against jax's partitioner.

"partitioner" (jax's partitioner reduces each gradient where it is made) is the oracle of
"flat" (the loss and gradients in one shard_map, one all-reduce per reduction group): the same
loss and gradients, with the MoE aux and z losses, padding and packed documents, on the 8
simulated devices; and the compiled step reduces its gradients in fewer, larger collectives
(with ZeRO-1, reduce-scatters straight into the shards). The flat reductions themselves are
checked against numpy on leaves of every layout they meet.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.models import _flat
from test_models_zero import _config  # qwen3_moe, and deepseek_v3 with MLA and a dense layer

from jaxops import models
from jaxops._sharding import axes_of


def _model(kind, mesh_shape, grad_reduce, **kw):
    mesh = jax.make_mesh(mesh_shape, ("data", "expert"))
    kw = {"router_aux_loss_coef": 0.02, "router_z_loss_coef": 0.001, **kw}
    return models.MoEDecoder(_config(kind), mesh, grad_reduce=grad_reduce, **kw)


def _inputs(seed=0):
    """Tokens, targets and masks: left padding in two rows, two documents in another."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 96, (8, 16)).astype(np.int32)
    targets = (tokens * 7 + 3) % 96
    mask = np.ones((8, 16), np.int32)
    mask[1, :5] = 0
    mask[6, :11] = 0
    segments = np.ones((8, 16), np.int32)
    segments[3, 9:] = 2
    return tokens, targets, mask, segments


def _loss_and_grads(model, params, batch):
    tokens, targets, mask, segments = batch
    with jax.set_mesh(model.mesh):
        if segments is None:
            return jax.jit(lambda p: model.loss_and_grads(p, tokens, targets, attention_mask=mask))(
                params
            )
        return jax.jit(lambda p: model.loss_and_grads(p, tokens, targets, segment_ids=segments))(
            params
        )


# Each setting once, the first with both kinds of masks, the others with one kind each (the
# masks reach the flat step as the batch does, whatever the layout).
CASES = [
    ("qwen3", (2, 4), {}, "padding"),
    ("qwen3", (2, 4), {}, "documents"),
    ("qwen3", (1, 8), {"zero": 1}, "documents"),
    ("deepseek", (4, 2), {"scan_unroll": True}, "documents"),
    ("qwen3", (2, 4), {"capacity_factor": 1.0, "remat": "full"}, "padding"),
    ("qwen3", (1, 8), {"exchange": "dense"}, "padding"),
]


@pytest.mark.parametrize(
    ("kind", "shape", "kw", "masks"),
    CASES,
    ids=[f"{m}-{k}-{s[0]}x{s[1]}-{sorted(kw)}" for k, s, kw, m in CASES],
)
def test_flat_grads_equal_the_partitioners(kind, shape, kw, masks):
    flat, oracle = _model(kind, shape, "flat", **kw), _model(kind, shape, "partitioner", **kw)
    assert flat.layout.flat_grads and not oracle.layout.flat_grads
    params = flat.init(jax.random.key(1))
    tokens, targets, mask, segments = _inputs()
    batch = (
        (tokens, targets, mask, None) if masks == "padding" else (tokens, targets, None, segments)
    )
    loss, grads = _loss_and_grads(flat, params, batch)
    want_loss, want = _loss_and_grads(oracle, params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-6)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        scale = max(float(np.abs(b).max()), 1e-6)
        assert float(np.abs(a - b).max()) <= 2e-5 * scale, jax.tree_util.keystr(path)
    # the gradients keep the parameters' layout (the experts split over the expert axis)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim)


def _collectives(text: str, op: str) -> list[tuple[int, str]]:
    """``(elements, replica groups)`` of each `op` in compiled HLO text, a tuple's one by one.

    The elements of a reduce-scatter's operand (its result times the group size, read from
    groups listed in braces), of an all-gather's result, of an all-reduce's operand.
    """
    out = []
    for line in text.splitlines():
        found = re.search(rf"= (.*?) {op}(?:-start)?\(.*replica_groups=(\S+?),? ", line)
        if not found:
            continue
        groups = found.group(2)  # {{0,4},{1,5},...} or mesh['axis_0'=8,...] (not read)
        per_group = len(groups.split("}")[0].split(",")) if groups.startswith("{{") else 0
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", found.group(1)):
            n = int(np.prod([int(d) for d in dims.split(",") if d]))
            out.append((n * per_group if op == "reduce-scatter" else n, groups))
    return out


def test_flat_step_reduces_the_gradients_in_few_buffers():
    opt = optax.adamw(1e-3)
    texts = {}
    for how in ("flat", "partitioner"):
        model = _model("qwen3", (2, 4), how, zero=1, scan_unroll=True)
        params = model.init(jax.random.key(0))
        state = model.init_optimizer(opt, params)
        tokens, targets, _, _ = _inputs()
        batch = model.place_batch(tokens, targets)
        texts[how] = model.train_step(opt).lower(params, state, *batch).compile().as_text()
    # one buffer of every weight replicated over both batch axes, one of this device's experts
    experts = [a for k, a in jax.tree_util.tree_leaves_with_path(params) if "'w_" in str(k[-1])]
    experts = [a for a in experts if a.ndim == 4]
    local = sum(int(np.prod(a.sharding.shard_shape(a.shape))) for a in experts)
    replicated = sum(a.size for a in jax.tree.leaves(params)) - sum(a.size for a in experts)
    # (the MoE exchange's collectives run over the expert axis alone: groups {0,1,2,3},{4,...};
    # the all-reduces under 16 elements are the routing statistics' and the loss's sums)
    exchange = "{{0,1,2,3},{4,5,6,7}}"

    def sizes(how, op):
        return sorted(n for n, g in _collectives(texts[how], op) if g != exchange and n >= 16)

    # ZeRO-1: the gradients reduce-scattered straight into the shards, no all-reduce
    assert sizes("flat", "reduce-scatter") == sorted([local, replicated])
    assert sizes("flat", "all-reduce") == []
    assert len(sizes("partitioner", "all-reduce")) > 10  # a gradient (or a few) per operand


# Leaves of every kind the flat moves meet on a 2 x 4 ("data", "expert") mesh: their spec (the
# layout they are computed in), their ZeRO spec and their shape. A ZeRO spec splits a block
# further over the batch axes it is replicated on, each axis on some dimension.
LEAVES = {
    "both-axes-one-dim": (P(), P(("data", "expert")), (16, 3), np.float32),
    "axes-on-two-dims": (P(), P("data", "expert"), (2, 12), np.float32),
    "axes-reversed": (P(), P("expert", "data"), (4, 6), np.float32),
    "left-whole": (P(), P(), (3, 5), np.float32),
    "data-only": (P(), P("data"), (6,), np.float32),
    "expert-block": (P("expert"), P(("expert", "data")), (8, 6), np.float32),
    "expert-block-bf16": (P(None, "expert"), P(None, ("expert", "data")), (3, 8, 4), jnp.bfloat16),
    "expert-block-whole": (P("expert"), P("expert"), (4, 3), np.float32),
}


def test_flat_sums_and_scatters_every_layout():
    """sum_flat and scatter_flat against numpy's sum of each device's block."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    batch = ("data", "expert")
    specs = {k: v[0] for k, v in LEAVES.items()}
    zero = {k: v[1] for k, v in LEAVES.items()}
    rng = np.random.default_rng(0)
    blocks, in_specs, want = {}, {}, {}
    for k, (spec, _, shape, dtype) in LEAVES.items():
        lead = (2,) if "expert" in axes_of(spec) else (2, 4)  # one block per device
        x = rng.standard_normal(lead + shape).astype(dtype)
        blocks[k], in_specs[k] = x, P(*batch[: len(lead)], *spec)
        want[k] = np.asarray(x, np.float64).sum(tuple(range(len(lead))))
    blocks = jax.device_put(blocks, {k: NamedSharding(mesh, s) for k, s in in_specs.items()})

    def strip(tree):  # each device's block without the leading device dimensions
        return {
            k: v.reshape(v.shape[2 - ("expert" in axes_of(specs[k])) :]) for k, v in tree.items()
        }

    def run(fn, out_specs):
        f = jax.shard_map(fn, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False)
        return jax.jit(f)(blocks)

    summed = run(lambda b: _flat.sum_flat(strip(b), specs, mesh, batch), specs)
    scattered = run(lambda b: _flat.scatter_flat(strip(b), specs, zero, mesh, batch), zero)
    for k, (_, _, shape, dtype) in LEAVES.items():
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        for name, got in (("sum", summed), ("scatter", scattered)):
            a = got[k]
            assert a.shape == shape and a.dtype == dtype, (k, name, a.shape, a.dtype)
            np.testing.assert_allclose(
                np.asarray(a, np.float64), want[k], rtol=tol, atol=tol, err_msg=f"{k} {name}"
            )
        assert scattered[k].sharding.is_equivalent_to(NamedSharding(mesh, zero[k]), len(shape)), k
    # one collective per group: reduce-scatters by (reduced axes, shard axes, dtype); the leaves
    # left whole and their partial sums as all-reduces
    text = (
        jax.jit(
            jax.shard_map(
                lambda b: _flat.scatter_flat(strip(b), specs, zero, mesh, batch),
                mesh=mesh,
                in_specs=(in_specs,),
                out_specs=zero,
                check_vma=False,
            )
        )
        .lower(blocks)
        .compile()
        .as_text()
    )
    ops = re.findall(r" (reduce-scatter|all-reduce)(?:-start)?\(", text)
    # groups: (data+expert, data+expert, f32) [both-axes, two-dims, reversed]; (data+expert, data,
    # f32) [data-only] then its psum over expert; (data, data, f32) and (data, data, bf16) [expert
    # blocks]; left-whole and expert-block-whole summed: one all-reduce each (different axes)
    assert sorted(ops) == sorted(["reduce-scatter"] * 4 + ["all-reduce"] * 3), ops
