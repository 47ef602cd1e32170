"""Context parallelism (a ``context`` mesh axis: each sequence split over its devices in zigzag
chunk pairs, attention as a ring of key/value blocks, everything else treating the chunks as
batch rows): logits, loss and every gradient equal the same model's on a mesh without the axis
(which equals transformers: tests/test_models_families.py), for Qwen3-MoE, DeepSeek-V3 (MLA),
gpt-oss (sinks, sliding windows) and Llama 4 (chunks, NoPE), with packed documents and
padding, on context 2 with data and expert axes and on context 4; the compiled step moves keys
and values with collective-permutes and gathers no sequence; MLA's ring moves the compressed
latent (with a LoRA adapter on its up projection), not per-head keys; with a pipe axis the keys
are all-gathered over the context axis inside the stages; refusals.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

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


def test_pipe_and_context_axes_equal_the_pipeline_without_context(hf_families):
    """pipe 2 x context 2 x expert 2 (2 microbatches; the keys all-gathered over the context
    axis inside each stage: a ring's collective-permute would name the devices of the other
    stage, busy with other work at that tick) equals pipe 2 x expert 4 for DeepSeek-V3 (MLA:
    the latent gathered and expanded per stage): loss, every gradient, logits; more
    all-gathers than without the context axis (the keys')."""
    run = hf_families.load("deepseek_v3", "p2e4")
    want = _step(run.model, run.params)
    mesh = jax.make_mesh((2, 2, 2), ("pipe", "context", "expert"))
    model = dataclasses.replace(run.model, mesh=mesh, attention_block=8)
    assert model.context == 2 and model.pipe == 2 and model.input_axes == ("expert",)
    got = _step(model, jax.device_put(run.params, model.shardings()))
    _same(got, want)
    assert len(_all_gathers(got[3])) > len(_all_gathers(want[3]))


def _zigzag(a: np.ndarray, c: int) -> np.ndarray:
    """``[b, S, ...]`` as the context rows ``[c b, S / c, ...]``: device i's rows hold chunks i
    and 2c - 1 - i of the 2c chunks of each sequence (models._context's placement)."""
    chunks = np.split(a, 2 * c, axis=1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * c - 1 - i]], 1) for i in range(c)])


@pytest.mark.parametrize(
    "bound", ["window", "chunk", "traced-window"], ids=["window", "chunk", "traced"]
)
def test_ring_passes_the_keys_only_as_far_as_a_window_reaches(bound):
    """ring_attention on context 8 (64-token sequences: 16 chunks of 4) with a window or chunk
    of 7 tokens (hops 2: 4 sends instead of 7), packed documents and attention sinks: output
    and gradients (queries, keys, values, sinks) equal the full ring's and whole-sequence
    blockwise attention's, also with `near` a traced bool (``lax.cond``: True the near ring,
    False the full one); with 1 hop (too few for this window) the result differs, so the near
    ring is the one that ran."""
    from jaxops.models import _blockwise
    from jaxops.models._mask import Tokens, Visible

    c, b, s, hkv, g, dh = 8, 2, 64, 2, 2, 8
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((b, s, hkv, g, dh), (b, s, hkv, dh), (b, s, hkv, dh)))  # fmt: skip
    sinks = rng.standard_normal(hkv * g).astype(np.float32)
    time = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    segments = np.repeat(np.array([[1, 1, 2, 2], [3, 3, 3, 0]], np.int32), 16, axis=1)
    positions = np.where(segments == 2, time - 32, time).astype(np.int32)  # per document
    where = Tokens(time, positions, segments)
    window, chunk = (7, None) if bound != "chunk" else (None, 7)
    visible = Visible(where, where, window, chunk)
    mesh = jax.make_mesh((c,), ("context",))
    rows = jax.sharding.PartitionSpec("context")

    def whole(q, k, v, sinks):
        return _blockwise.attention(
            q, k, v, visible, scale=0.3, sinks=sinks, dtype=jax.numpy.float32, block=4
        )

    def ring(hops, near):
        def run(q, k, v, sinks, where, near):
            seen = Visible(where, where, window, chunk)
            return _blockwise.ring_attention(
                q, (k, v), seen, axis="context", size=c, scale=0.3, sinks=sinks,
                dtype=jax.numpy.float32, block=4, hops=hops, near=near,
            )  # fmt: skip

        def f(q, k, v, sinks, where, near=near):
            specs = (rows, rows, rows, P(), jax.tree.map(lambda _: rows, where))
            if isinstance(near, bool):
                body = lambda *a: run(*a, near)  # noqa: E731
            else:
                body, specs = run, (*specs, P())
            args = (q, k, v, sinks, where) + (() if isinstance(near, bool) else (near,))
            args = jax.tree.map(
                lambda a, spec: jax.reshard(a, jax.NamedSharding(mesh, spec)), args, specs
            )
            return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rows,
                                 check_vma=False)(*args)  # fmt: skip

        return f

    def value_and_grads(f, *args):
        loss = lambda *a: (f(*a) * weights).sum()  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)

    weights = rng.standard_normal((b, s, hkv, g, dh)).astype(np.float32)
    want_out = _zigzag(np.asarray(jax.jit(whole)(q, k, v, sinks)), c)
    _, want = value_and_grads(whole, q, k, v, sinks)
    want = [_zigzag(np.asarray(a), c) for a in want[:3]] + [np.asarray(want[3])]
    zq, zk, zv = (_zigzag(a, c) for a in (q, k, v))
    zwhere = jax.tree.map(lambda a: _zigzag(np.asarray(a), c), where)
    weights = _zigzag(weights, c)
    near = jax.numpy.asarray(True) if bound == "traced-window" else True
    cases = {"full": ring(None, False), "near": ring(2, near)}
    if bound == "traced-window":
        cases["cond-full"] = ring(2, jax.numpy.asarray(False))
    for name, f in cases.items():
        out = np.asarray(jax.jit(f)(zq, zk, zv, sinks, zwhere))
        np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-6, err_msg=name)
        _, grads = value_and_grads(lambda *a, f=f: f(*a, zwhere), zq, zk, zv, sinks)
        for what, got, ref in zip("qkv", grads, want[:3], strict=False):
            np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5, err_msg=f"{name} d{what}")
        np.testing.assert_allclose(grads[3], want[3], rtol=2e-4, atol=2e-5, err_msg=name)
    short = np.asarray(jax.jit(ring(1, True))(zq, zk, zv, sinks, zwhere))
    assert np.abs(short - want_out).max() > 1e-2  # 1 hop misses keys this window sees


def _permuted_shapes(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array a collective-permute of the compiled program moves."""
    out = []
    for line in hlo.splitlines():
        if " collective-permute(" in line:
            result = line.split("=", 1)[1].split(" collective-permute(")[0]
            for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", result):
                out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def test_mla_ring_carries_the_latent_not_the_keys(hf_families):
    """DeepSeek-V3 (MLA) with LoRA adapters on kv_b_proj (the latent's up projection) and the
    queries on context 2 x data 2 x expert 2: loss, logits and every adapter gradient equal data
    2 x expert 4's, and the ring moves the latent, the shared RoPE key and the adapter's
    rank-wide down projection (with the tokens' placement), never a per-head key or value."""
    run = hf_families.load("deepseek_v3", "d2e4")
    lora = jaxops.Lora(4, 8.0, ("q_b_proj", "kv_b_proj"))
    flat = dataclasses.replace(run.model, lora=lora)
    params = flat.add_adapters(run.params, jax.random.key(3))
    rng = np.random.default_rng(5)
    params = jax.tree_util.tree_map_with_path(  # B not zero: adapters that changed something
        lambda path, x: (
            jax.numpy.asarray(rng.normal(size=x.shape) * 0.05, x.dtype)
            if "_lora_b" in jax.tree_util.keystr(path)
            else x
        ),
        params,
    )
    want = _step(flat, jax.device_put(params, flat.shardings()))
    shape, axes = MESHES["c2d2e2"]
    model = dataclasses.replace(flat, mesh=jax.make_mesh(shape, axes), attention_block=8)
    got = _step(model, jax.device_put(params, model.shardings()))
    _same(got, want)
    mla, heads = model.config.attention.mla, model.config.attention.num_heads
    moved = _permuted_shapes(got[3])
    floats = [s for dtype, s in moved if dtype.startswith(("f", "bf"))]
    widths = {s[-1] for s in floats}
    assert mla.kv_lora_rank in widths and lora.rank in widths, moved
    assert widths <= {mla.kv_lora_rank, mla.qk_rope_head_dim, lora.rank}, moved
    assert not any(heads in s[2:] for s in floats if len(s) > 3), moved


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
