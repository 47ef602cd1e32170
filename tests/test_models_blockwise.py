"""Blockwise attention (jaxops.models._blockwise: an online softmax over blocks, a backward
that recomputes per block) against a float64 numpy softmax over the whole mask: every mask the
one mask builder makes (causal, sliding window, Llama 4 chunks, packed documents, padding rows,
KV-cache slots), attention sinks, grouped-query heads, keys and values of different widths
(multi-head latent attention), sizes that are not multiples of the block, zero-size inputs;
gradients by finite differences in float64; block pairs the mask empties are skipped, not
computed (NaN keys there never reach an output); the compiled program holds no ``[S, S]``
array and its temporaries grow about linearly in S. The model families' blockwise logits and
generation against transformers are in tests/test_models_families.py.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from jaxops.models import _blockwise
from jaxops.models._mask import Tokens, Visible

# name: (b, sq, sk, Hkv, G, Dh, Dv, block, mask options, sinks)
CASES = {
    "one-block": (2, 7, 7, 2, 2, 8, 8, 16, {}, False),
    "causal-odd": (2, 37, 37, 2, 3, 8, 8, 16, {}, False),
    "sinks": (2, 37, 37, 2, 2, 8, 8, 16, {}, True),
    "window": (1, 50, 50, 1, 4, 8, 8, 8, {"window": 5}, False),
    "chunks": (2, 33, 33, 2, 1, 4, 4, 8, {"chunk": 10}, False),
    "documents-padding": (3, 41, 41, 2, 2, 8, 8, 16, {"segments": True}, True),
    "mla-widths": (2, 30, 30, 1, 4, 12, 8, 8, {"window": 9, "segments": True}, False),
    "decode-cache": (2, 1, 45, 2, 2, 8, 8, 16, {"cache": True}, True),
    "prefill-cache": (2, 20, 45, 2, 2, 8, 8, 16, {"cache": True}, False),
    "one-element": (1, 1, 1, 1, 1, 1, 1, 4, {}, False),
}


def _case(name: str, dtype=np.float64):
    b, sq, sk, hkv, g, dh, dv, block, opts, sinks = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q = rng.standard_normal((b, sq, hkv, g, dh)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, dh)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    time = np.broadcast_to(np.arange(sk, dtype=np.int32), (b, sk))
    segments, valid = None, None
    if opts.get("segments"):  # documents of random lengths, some rows ending in padding
        segments = np.sort(rng.integers(0, 4, (b, sk)), axis=1)[:, ::-1].astype(np.int32)
        segments[0] = 1  # one whole-row document
    if opts.get("cache"):  # slots not filled yet: unseen
        valid = np.arange(sk)[None, :] < np.array([[sk], [sk - 7]])[:b]
    keys = Tokens(time, time, segments)
    queries = jax.tree.map(lambda a: a[:, sk - sq :], keys)
    visible = Visible(queries, keys, opts.get("window"), opts.get("chunk"), valid)
    s = rng.standard_normal(hkv * g).astype(dtype) if sinks else None
    return q, k, v, visible, s, block


def _oracle(q, k, v, mask, sinks, scale):
    """float64 numpy softmax attention over the whole mask; a query without keys gets 0."""
    scores = np.einsum("bqkgd,bskd->bkgqs", q, k) * scale
    scores = np.where(mask[:, None, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = sinks.reshape(1, q.shape[2], q.shape[3], 1, 1)
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - top)
    total = e.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - top))
    probs = e / np.where(total > 0, total, 1.0)
    return np.einsum("bkgqs,bskd->bqkgd", probs, v)


def _attention(visible, block, scale=0.3, dtype=jnp.float64):
    def f(q, k, v, sinks=None):
        return _blockwise.attention(
            q, k, v, visible, scale=scale, sinks=sinks, dtype=dtype, block=block
        )

    # Jitted: one program per shape (the models run it inside their jitted steps), not one per op.
    return jax.jit(f)


@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_float64_softmax(name):
    with jax.enable_x64(True):
        q, k, v, visible, sinks, block = _case(name)
        mask = np.asarray(visible.dense())
        got = _attention(visible, block)(q, k, v, sinks)
        want = _oracle(q, k, v, mask, sinks, 0.3)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
        unseen = ~mask.any(-1)  # queries that see no key (padding): zeros
        assert not np.asarray(got)[unseen].any()


@pytest.mark.parametrize("name", ["causal-odd", "documents-padding", "mla-widths", "decode-cache"])
def test_gradients_by_finite_differences(name):
    with jax.enable_x64(True):
        q, k, v, visible, sinks, block = _case(name)
        f = _attention(visible, block)
        args = (q, k, v) if sinks is None else (q, k, v, sinks)
        check_grads(f, args, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_float32_gradients_equal_the_whole_softmax():
    """float32 (the models' compute dtype): the gradients of blockwise attention and of the
    float64 oracle's autodiff agree to float32 rounding."""
    q, k, v, visible, sinks, block = _case("documents-padding", np.float32)
    mask = visible.dense()
    cot = np.random.default_rng(1).standard_normal((*q.shape[:-1], v.shape[-1]))

    def whole(q, k, v, sinks):
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * 0.3
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        sink = sinks.reshape(1, q.shape[2], q.shape[3], 1, 1)
        top = jax.lax.stop_gradient(jnp.maximum(scores.max(-1, keepdims=True), sink))
        e = jnp.exp(scores - top)
        probs = e / (e.sum(-1, keepdims=True) + jnp.exp(sink - top))
        return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)

    grads = {}
    for name, f in (("blockwise", _attention(visible, block, dtype=jnp.float32)), ("whole", whole)):
        grads[name] = jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3))(
            q, k, v, sinks
        )
    for a, b in zip(grads["blockwise"], grads["whole"], strict=True):
        scale = float(np.abs(b).max())
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6 * scale)


@pytest.mark.parametrize("sq, sk", [(0, 0), (0, 5), (3, 0)], ids=["empty", "no-query", "no-key"])
def test_zero_size(sq, sk):
    q, k, v = jnp.ones((2, sq, 1, 2, 4)), jnp.ones((2, sk, 1, 4)), jnp.ones((2, sk, 1, 3))
    tq, tk = (Tokens(*(jnp.zeros((2, n), jnp.int32),) * 2) for n in (sq, sk))
    f = _attention(Visible(tq, tk), 4, dtype=jnp.float32)
    assert f(q, k, v).shape == (2, sq, 1, 2, 3) and not f(q, k, v).any()
    grads = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_emptied_block_pairs_are_skipped():
    """Two documents of 32 tokens in blocks of 16: the first document's queries never read the
    second's key blocks, so NaN values there reach none of their outputs or gradients (a
    computed-and-masked block would: 0 * NaN); the whole softmax is NaN everywhere."""
    time = jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (1, 64))
    docs = jnp.where(time < 32, 1, 2)
    where = Tokens(time, time, docs)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 64, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 64, 1, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 64, 1, 8)), jnp.float32).at[:, 40].set(jnp.nan)
    f = _attention(Visible(where, where), 16, dtype=jnp.float32)
    out = np.asarray(f(q, k, v))
    assert np.isfinite(out[:, :32]).all() and np.isnan(out[:, 40:]).all()
    dq = np.asarray(jax.grad(lambda q: jnp.sum(f(q, k, v)[:, :32]))(q))
    assert np.isfinite(dq[:, :32]).all()
    whole = _attention(Visible(where, where), 64, dtype=jnp.float32)(q, k, v)
    assert np.isnan(np.asarray(whole)[:, :32]).any()


def _compiled_grad(s: int, block: int):
    b, hkv, g, d = 1, 2, 2, 32
    time = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    visible = Visible(Tokens(time, time), Tokens(time, time))
    f = _attention(visible, block, dtype=jnp.float32)
    q, k = jnp.zeros((b, s, hkv, g, d)), jnp.zeros((b, s, hkv, d))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
    return grad.lower(q, k, k).compile()


def test_no_square_array_and_memory_linear_in_the_sequence():
    """The compiled forward and backward at S = 1k, 2k, 4k (blocks of 256): no array with two
    dimensions of S or more, and temporaries that grow at most 2.3x when S doubles."""
    temps = []
    for s in (1024, 2048, 4096):
        compiled = _compiled_grad(s, 256)
        shapes = re.findall(r"[a-z0-9]+\[([0-9,]+)\]", compiled.as_text())
        square = [d for d in shapes if sum(int(n) >= s for n in d.split(",")) >= 2]
        assert not square, (s, square[:3])
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    print("temporaries (MiB):", [round(t / 2**20, 2) for t in temps])
    assert all(b <= 2.3 * a for a, b in itertools.pairwise(temps)), temps


def test_the_models_training_step_grows_about_linearly_in_the_sequence():
    """The compiled loss_and_grads of a tiny Qwen3-MoE on one device (its layers in a
    differentiated lax.scan): blockwise attention's temporaries grow at most 2.3x when S
    doubles (1k, 2k, 4k tokens); the whole-scores softmax's ("xla") about 4x."""
    from jaxops import models

    cfg = models.DecoderConfig(
        "qwen3_moe", vocab_size=96, hidden_size=64, num_layers=2,
        attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
        moe=models.MoESpec(num_experts=8, top_k=2, expert_ffn=32),
    )  # fmt: skip
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    temps = {}
    for impl in ("blockwise", "xla"):
        model = models.MoEDecoder(cfg, mesh, attention_impl=impl)
        params = model.abstract_params()
        for s in (1024, 2048, 4096) if impl == "blockwise" else (1024, 2048):
            tokens = jax.ShapeDtypeStruct((1, s), jnp.int32)
            compiled = jax.jit(model.loss_and_grads).lower(params, tokens, tokens).compile()
            temps.setdefault(impl, []).append(compiled.memory_analysis().temp_size_in_bytes)
    print({k: [round(t / 2**20, 1) for t in v] for k, v in temps.items()})
    assert all(b <= 2.3 * a for a, b in itertools.pairwise(temps["blockwise"])), temps
    assert temps["xla"][1] > 3 * temps["xla"][0], temps  # the check can fail
