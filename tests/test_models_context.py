"""Context parallelism (a ``context`` mesh axis: each sequence split over its devices in zigzag
chunk pairs, attention as a ring of key/value blocks, everything else treating the chunks as
batch rows): logits, loss and every gradient equal the same model's on a mesh without the axis
(which equals transformers: tests/test_models_families.py), for Qwen3-MoE, DeepSeek-V3 (MLA),
gpt-oss (sinks, sliding windows) and Llama 4 (chunks, NoPE), with packed documents and
padding, on context 2 with data and expert axes and on context 4; the compiled step moves keys
and values with collective-permutes and gathers no sequence; refusals (a pipe axis with a
context axis is not built yet).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import _hf_families as fam  # noqa: E402

import jaxops  # noqa: E402
from jaxops import models  # noqa: E402

AUTO = jax.sharding.AxisType.Auto
MESHES = {
    "c2d2e2": ((2, 2, 2), ("context", "data", "expert")),
    "c4e2": ((4, 2), ("context", "expert")),
}
# Packed documents (one crossing every chunk boundary) and padding; 32 tokens: 8 chunks of 4
# on context 4, 4 chunks of 8 on context 2.
SEGMENTS = np.tile(
    np.repeat([[1, 1, 2, 0], [1, 2, 3, 3], [1, 1, 1, 1], [4, 4, 5, 0]], 8, axis=1), (4, 1)
).astype(np.int32)
TOKENS = fam.random_tokens(16, 32, seed=21)
TARGETS = np.where(SEGMENTS > 0, np.roll(TOKENS, -1, axis=1), -100)


def _step(model, params):
    """(loss, grads, logits) of the batch, and the compiled loss_and_grads' HLO."""
    segments = model.place_batch(SEGMENTS)
    f = jax.jit(model.loss_and_grads)
    args = (params, *model.place_batch(TOKENS, TARGETS))
    loss, grads = f(*args, segment_ids=segments)
    logits = jax.jit(model.logits)(params, model.place_batch(TOKENS), segment_ids=segments)
    return loss, grads, logits, f.lower(*args, segment_ids=segments).compile().as_text()


def _same(got, want):
    loss, grads, logits, _ = got
    np.testing.assert_allclose(float(loss), float(want[0]), rtol=2e-6)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(want[1]), jax.tree.leaves(grads), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(float(np.abs(a).max()), 1e-6)
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-5 * scale, err_msg=str(where))
    real = (SEGMENTS > 0)[..., None]  # logits at padding are meaningless
    np.testing.assert_allclose(
        np.where(real, np.asarray(logits), 0), np.where(real, np.asarray(want[2]), 0), atol=2e-5
    )


def _all_gathers(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if " all-gather(" in line]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text"])
def test_context_axis_equals_the_model_without_it(hf_families, family):
    run = hf_families.load(family, "d2e4")
    want = _step(run.model, run.params)
    for name, (shape, axes) in MESHES.items():
        model = dataclasses.replace(run.model, mesh=jax.make_mesh(shape, axes), attention_block=8)
        assert model.context == shape[0] and model.input_axes == axes[1:]
        got = _step(model, jax.device_put(run.params, model.shardings()))
        _same(got, want)
        # The keys and values move around the ring; no all-gather beyond the model's own
        # (no sequence is gathered).
        assert got[3].count(" collective-permute(") >= 2 * shape[0], name
        assert len(_all_gathers(got[3])) <= len(_all_gathers(want[3])), name


def test_refusals(hf_families):
    run = hf_families.load("qwen3_moe", "d2e4")
    mesh = jax.make_mesh(*MESHES["c2d2e2"])
    model = dataclasses.replace(run.model, mesh=mesh)
    params = jax.device_put(run.params, model.shardings())
    with pytest.raises(
        jaxops.InvalidArgumentError,
        match=r"^jaxops.models.MoEDecoder.logits: tokens' sequence length \(30\) must be a "
        r"multiple of 4: the context axis 'context' of size 2",
    ):
        model.logits(params, model.place_batch(TOKENS[:, :30]))
    with pytest.raises(models.ConfigError, match="attention_impl must be 'auto' or 'blockwise'"):
        dataclasses.replace(model, attention_impl="xla")
    with pytest.raises(models.ConfigError, match="generation needs a mesh without a context"):
        models.generate(model, params, TOKENS[:4, :8], 2)
    auto = jax.make_mesh((2, 2, 2), ("context", "data", "expert"), axis_types=(AUTO,) * 3)
    with pytest.raises(models.ConfigError, match="needs a mesh of Explicit axes"):
        dataclasses.replace(model, mesh=auto)
    pipe = jax.make_mesh((2, 2, 2), ("pipe", "context", "expert"))
    with pytest.raises(models.ConfigError, match=r"together with a pipe axis .* not built yet"):
        dataclasses.replace(model, mesh=pipe)
