"""The loss over vocabulary chunks (``MoEDecoder.vocab_chunk``, jaxops.models._loss).

Oracles: a float64 numpy cross-entropy and its analytic gradients, and the decoder's loss with
the logits whole. The compiled step must hold less than the whole logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxops.models._layers import IGNORE_INDEX, token_losses
from jaxops.models._loss import chunked_token_losses

from jaxops import models

V, D = 37, 16  # an odd vocabulary: no chunk size below divides it


def _reference(h, w, targets, tied):
    """float64 (sum, dh, dw) of the summed cross-entropy of ``h @ w`` (``h @ w.T`` tied)."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    proj = w64.T if tied else w64
    logits = h64 @ proj
    if h.dtype != np.float32:  # the head's GEMM output rounds to the compute dtype
        logits = np.asarray(jnp.asarray(logits, h.dtype), np.float64)
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    keep = targets != IGNORE_INDEX
    safe = np.where(keep, targets, 0)
    picked = np.take_along_axis(logits, safe[..., None], -1)[..., 0]
    total = np.where(keep, lse - picked, 0.0).sum()
    d = np.exp(logits - lse[..., None])
    np.put_along_axis(d, safe[..., None], np.take_along_axis(d, safe[..., None], -1) - 1, -1)
    d *= keep[..., None]
    dh = d @ proj.T
    dproj = h64.reshape(-1, h64.shape[-1]).T @ d.reshape(-1, d.shape[-1])
    return total, dh, dproj.T if tied else dproj


def _tol(dtype):
    """(loss, gradients) tolerances: the reference rounds its float64 logits as the kernel
    rounds its float32 sums, so a bfloat16 logit may differ by one ulp."""
    return {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (3e-3, 2e-2)}[dtype]


CASES = [
    (dtype, tied, lead, chunk)
    for dtype in (jnp.float32, jnp.bfloat16)
    for tied in (False, True)
    for lead in ((2, 5), (1, 1))
    for chunk in (1, 7, 16, V - 1)
]


@pytest.mark.parametrize(
    ("dtype", "tied", "lead", "chunk"),
    CASES,
    ids=[
        f"{jnp.dtype(d).name}-{'tied' if t else 'head'}-{'x'.join(map(str, s))}-chunk{c}"
        for d, t, s, c in CASES
    ],
)
def test_chunked_losses_match_float64(dtype, tied, lead, chunk):
    rng = np.random.default_rng(chunk)
    h = jnp.asarray(rng.normal(size=(*lead, D)), dtype)
    w = jnp.asarray(rng.normal(size=(V, D) if tied else (D, V)) * 0.5, dtype)
    targets = rng.integers(0, V, lead)
    targets.flat[0] = IGNORE_INDEX if targets.size > 1 else targets.flat[0]
    targets[..., -1] = V - 1  # the last column, which the last chunk shares with an earlier
    f = jax.jit(
        jax.value_and_grad(lambda h, w: chunked_token_losses(h, w, targets, chunk, tied), (0, 1))
    )
    total, (dh, dw) = f(h, w)
    want, want_dh, want_dw = _reference(h, w, targets, tied)
    tol, grad_tol = _tol(dtype)
    assert total.dtype == jnp.float32 and dh.dtype == dtype and dw.dtype == dtype
    np.testing.assert_allclose(float(total), want, rtol=tol, atol=tol)
    for got, ref in ((dh, want_dh), (dw, want_dw)):
        scale = max(float(np.abs(ref).max()), 1e-6)
        assert float(np.abs(np.asarray(got, np.float64) - ref).max()) <= grad_tol * scale


def test_chunked_losses_of_no_tokens_and_bad_targets():
    w = jnp.ones((D, V))
    empty = jnp.zeros((0, D))
    total, (dh, dw) = jax.value_and_grad(
        lambda h, w: chunked_token_losses(h, w, jnp.zeros((0,), int), 8, False), (0, 1)
    )(empty, w)
    assert float(total) == 0.0 and dh.shape == (0, D) and not np.any(np.asarray(dw))
    h = jnp.ones((3, D))
    # a counted id outside [0, V) gives NaN, as token_losses; an ignored one counts nothing
    for bad in (V, -1):
        targets = jnp.array([0, bad, 1])
        assert np.isnan(float(chunked_token_losses(h, w, targets, 8, False))), bad
        assert np.isnan(float(token_losses(h @ w, targets)[0])), bad
    ignored = chunked_token_losses(h, w, jnp.array([0, IGNORE_INDEX, 1]), 8, False)
    assert np.isclose(float(ignored), 2 * np.log(V), rtol=1e-6)


_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
)


def _config(tied):
    moe = models.MoESpec(num_experts=8, top_k=2, expert_ffn=32)
    return models.DecoderConfig(
        "qwen3_moe", num_layers=2, moe=moe, tie_word_embeddings=tied, **_TINY
    )


MESHES = [
    ("2x4", (2, 4), ("data", "expert"), {}),
    ("pipe2x2x2", (2, 2, 2), ("pipe", "data", "expert"), {"num_microbatches": 2}),
]


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize(("name", "shape", "names", "kw"), MESHES, ids=[m[0] for m in MESHES])
def test_decoder_loss_by_vocab_chunks_equals_whole(tied, name, shape, names, kw):
    """loss_and_grads with vocab_chunk=40 (96 columns: 40, 40, 16 new) against the whole
    logits, float32, on 8 devices: batch-split tokens, a pipeline's loss too."""
    mesh = jax.make_mesh(shape, names)
    whole = models.MoEDecoder(_config(tied), mesh, **kw)
    chunked = models.MoEDecoder(_config(tied), mesh, vocab_chunk=40, **kw)
    params = whole.init(jax.random.key(1))
    tokens = np.random.default_rng(0).integers(0, 96, (8, 16)).astype(np.int32)
    targets = (tokens * 7 + 3) % 96
    targets[0, :5] = IGNORE_INDEX
    batch = whole.place_batch(tokens, targets)
    want, want_g = jax.jit(whole.loss_and_grads)(params, *batch)
    got, got_g = jax.jit(chunked.loss_and_grads)(params, *batch)
    np.testing.assert_allclose(float(got), float(want), rtol=2e-6)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert float(np.abs(a - b).max()) <= 1e-5 * max(float(np.abs(b).max()), 1e-4), (
            jax.tree_util.keystr(path)
        )


def test_train_step_by_vocab_chunks_holds_less_than_the_logits():
    """A 4096-token vocabulary, 64 tokens per device: their float32 logits (1 MB) and softmax
    whole, or 512 columns at a time; the same losses over two adamw steps."""
    moe = models.MoESpec(num_experts=4, top_k=2, expert_ffn=32)
    cfg = models.DecoderConfig("qwen3_moe", num_layers=1, moe=moe, **{**_TINY, "vocab_size": 4096})
    mesh = jax.make_mesh((1, 2), ("data", "expert"))
    tokens = np.random.default_rng(0).integers(0, 4096, (8, 16)).astype(np.int32)
    opt = optax.adamw(1e-3)
    out = {}
    for chunk in (None, 512):
        model = models.MoEDecoder(cfg, mesh, vocab_chunk=chunk)
        params = model.init(jax.random.key(0))
        state = model.init_optimizer(opt, params)
        batch = model.place_batch(tokens, (tokens * 7 + 3) % 4096)
        step = model.train_step(opt).lower(params, state, *batch).compile()
        temp = step.memory_analysis().temp_size_in_bytes
        losses = []
        for _ in range(2):
            params, state, loss = step(params, state, *batch)
            losses.append(float(loss))
        out[chunk] = temp, losses
    (whole, want), (chunked, got) = out[None], out[512]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert chunked < whole - 64 * 4096 * 4, (chunked, whole)  # a device's logits fewer


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (2.5, TypeError)])
def test_vocab_chunk_is_checked(value, error):
    with pytest.raises(error, match="vocab_chunk"):
        models.MoEDecoder(_config(False), jax.make_mesh((1,), ("expert",)), vocab_chunk=value)
