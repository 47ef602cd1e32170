"""``MoEDecoder.grad_reduce``: the flat-gradient step against jax's partitioner.

"partitioner" (jax's partitioner reduces each gradient where it is made) is the oracle of
"flat" (the loss and gradients in one shard_map, one all-reduce per reduction group): the same
loss and gradients, with the MoE aux and z losses, padding and packed documents, on the 8
simulated devices; and the compiled step reduces its gradients in fewer, larger all-reduces.
"""

import re

import jax
import numpy as np
import optax
import pytest
from test_models_zero import _config  # qwen3_moe, and deepseek_v3 with MLA and a dense layer

from jaxops import models


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


CASES = [
    ("qwen3", (2, 4), {}),
    ("qwen3", (1, 8), {"zero": 1}),
    ("deepseek", (4, 2), {"scan_unroll": True}),
    ("qwen3", (2, 4), {"capacity_factor": 1.0, "remat": "full"}),
    ("qwen3", (1, 8), {"exchange": "dense"}),
]


@pytest.mark.parametrize(
    ("kind", "shape", "kw"), CASES, ids=[f"{k}-{s[0]}x{s[1]}-{sorted(kw)}" for k, s, kw in CASES]
)
@pytest.mark.parametrize("masks", ["padding", "documents"])
def test_flat_grads_equal_the_partitioners(kind, shape, kw, masks):
    flat, oracle = _model(kind, shape, "flat", **kw), _model(kind, shape, "partitioner", **kw)
    assert flat._flat_grads and not oracle._flat_grads
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


def _all_reduce_operands(text: str) -> list[int]:
    """Elements of each all-reduce operand in compiled HLO text (a tuple's one by one)."""
    sizes = []
    for line in text.splitlines():
        found = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", found.group(1) if found else ""):
            sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


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
    flat, oracle = _all_reduce_operands(texts["flat"]), _all_reduce_operands(texts["partitioner"])
    # (the operands under 16 elements are the routing statistics' and the loss's sums)
    flat, oracle = [n for n in flat if n >= 16], [n for n in oracle if n >= 16]
    # one buffer of every weight replicated over both batch axes, one of this device's experts
    experts = [a for k, a in jax.tree_util.tree_leaves_with_path(params) if "'w_" in str(k[-1])]
    experts = [a for a in experts if a.ndim == 4]
    local = sum(int(np.prod(a.sharding.shard_shape(a.shape))) for a in experts)
    replicated = sum(a.size for a in jax.tree.leaves(params)) - sum(a.size for a in experts)
    assert sorted(flat) == sorted([local, replicated]), (flat, local, replicated)
    assert len(oracle) > 10, oracle  # the partitioner's: a gradient (or a few) per operand
