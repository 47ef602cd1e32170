"""MoEDecoder without transformers: `impl` reaching every op, the forward-only pipeline loss,
one validation per call, and the deprecated names of the decoder and its package."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from jaxops.parallel import checkpoint

import jaxops
from jaxops import models

CFG = models.DecoderConfig(
    "qwen3_moe",
    vocab_size=64,
    hidden_size=32,
    num_layers=4,
    attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True),
    moe=models.MoESpec(num_experts=4, top_k=2, expert_ffn=16),
)
_CALL = re.compile(r'custom_call_target="(jaxops_[a-z0-9_]+)"')


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


# The custom calls wherever jaxops has them (every op but the GEMMs on CPU; every op on a GPU).
KERNELS = ("ffi", "xla")


def _batch(batch=8, seq=8, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    return tokens, np.roll(tokens, -1, axis=1)


def _custom_calls(fn, *args) -> set[str]:
    return set(_CALL.findall(jax.jit(fn).lower(*args).compile().as_text()))


@pytest.mark.parametrize("fp8", [None, "block"], ids=["bf16-free", "fp8"])
def test_impl_reaches_every_op_of_the_loss_gradient(fp8):
    mesh = _mesh((1,), ("expert",))
    tokens, targets = _batch()
    found = {}
    for impl in ("xla", KERNELS):
        model = models.MoEDecoder(CFG, mesh, impl=impl, fp8=fp8)
        params = model.init(jax.random.key(0))
        found[impl] = _custom_calls(jax.grad(model.loss), params, tokens, targets)
    assert found["xla"] == set(), found["xla"]
    # "ffi" requires a custom call of every op: on CPU, XLA's dot runs the GEMMs.
    with pytest.raises(models.ConfigError, match=r"impl='ffi' requires .* no gemm custom call"):
        models.MoEDecoder(CFG, mesh, impl="ffi", fp8=fp8)
    # The CPU kernels: RMSNorm (q/k norms, layer and final norms) forward and backward, the
    # fused add + RMSNorm, the MoE permute / unpermute, and with FP8 the quantization.
    want = {
        "jaxops_rms_norm_fwd",
        "jaxops_rms_norm_bwd",
        "jaxops_add_rms_norm_fwd",
        "jaxops_moe_permute",
        "jaxops_moe_unpermute",
    }
    if fp8:
        want.add("jaxops_fp8_quantize")
    assert want <= found[KERNELS], found[KERNELS]


def _loss_and_grads(devices, fp8, impl):
    """The decoder's float32 loss and gradients on `devices`, compiled with `impl`'s ops."""
    mesh = jax.make_mesh((len(devices),), ("expert",), devices=devices)
    tokens, targets = _batch()
    model = models.MoEDecoder(CFG, mesh, impl=impl, fp8=fp8, dtype=jnp.float32)
    params = model.init(jax.random.key(0))
    step = jax.jit(model.loss_and_grads).lower(params, tokens, targets).compile()
    if impl != "xla":
        calls = set(_CALL.findall(step.as_text()))
        assert {"jaxops_rms_norm_bwd", "jaxops_moe_permute"} <= calls, calls
    return step(params, tokens, targets)


def _kernels_vs_twins(devices, fp8, bound):
    """The decoder's loss and gradients with the custom calls against the pure-JAX twins."""
    (loss, grads), (loss_ref, grads_ref) = (
        _loss_and_grads(devices, fp8, impl) for impl in (KERNELS, "xla")
    )
    assert abs(float(loss) - float(loss_ref)) <= bound * abs(float(loss_ref)), (loss, loss_ref)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), g_ref in zip(flat, jax.tree.leaves(grads_ref), strict=True):
        assert rel_error(g, g_ref) < bound, (jax.tree_util.keystr(path), rel_error(g, g_ref))


def test_kernels_match_twins_in_the_train_step():
    _kernels_vs_twins(jax.devices("cpu")[:1], None, 1e-5)


def test_fp8_kernels_match_twins_in_the_train_step():
    """On the CPU both paths quantize with the correctly rounded division, but their sums differ
    in order (the grouped GEMM, RMSNorm and permute kernels against XLA's), so a value within a
    rounding of an FP8 midpoint can take the next code in one path: a few such codes per step
    move a gradient by up to 0.6% of its FP8 error (measured on an AVX2 machine; 1e-4 relative
    on an AMD AVX-512 one; up to 7.0% on an Intel Xeon AVX-512 machine, 2026-12-02, and the
    same there with that session's loss changes undone). A kernel's wiring bug (a scale, a
    transpose, a block) moves it by the FP8 error's own size. So the kernels and the twins
    agree within 15% of the FP8 error against the float32 step, the loss within 1e-4."""
    cpu = jax.devices("cpu")[:1]
    _, grads32 = _loss_and_grads(cpu, None, "xla")
    (loss, grads), (loss_twin, grads_twin) = (
        _loss_and_grads(cpu, "block", impl) for impl in (KERNELS, "xla")
    )
    assert abs(float(loss) - float(loss_twin)) <= 1e-4 * abs(float(loss_twin)), (loss, loss_twin)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    leaves = zip(
        jax.tree.leaves(grads), jax.tree.leaves(grads_twin), jax.tree.leaves(grads32), strict=True
    )
    errors = {
        path: (rel_error(g, g_twin), rel_error(g_twin, g32))
        for path, (g, g_twin, g32) in zip(paths, leaves, strict=True)
    }
    apart = {k: v for k, v in errors.items() if v[0] > 0.15 * v[1]}
    assert not apart, (apart, errors)


@pytest.mark.gpu
def test_gpu_kernels_match_twins_in_the_train_step():
    # Full float32 in both paths: XLA:GPU's default runs float32 dots in TF32, while the CUDA
    # grouped GEMM (the kernels' expert FFNs) multiplies float32 in fp32 in every mode.
    with jaxops.precision("fp32"):
        _kernels_vs_twins(jax.devices("gpu")[:1], None, 1e-3)


@pytest.mark.gpu
def test_gpu_fp8_kernels_as_accurate_as_twins_in_the_train_step():
    """FP8 on the GPU: XLA:GPU's float32 division is not correctly rounded, so the twins'
    quantization can put codes one step off the kernels' (which divide exactly, like the CPU),
    and such differences grow through the step. Each FP8 step is therefore compared with the
    float32 step (the kernels'): the kernels' FP8 loss and gradients must be no further from it
    than the twins', within 25%. (Before the twins' encoding was kept FP8 inside the program,
    this failed: the twins were near float32.)"""
    gpu = jax.devices("gpu")[:1]
    loss32, grads32 = _loss_and_grads(gpu, None, "ffi")
    (loss, grads), (loss_twin, grads_twin) = (
        _loss_and_grads(gpu, "block", impl) for impl in ("ffi", "xla")
    )
    errors = {}
    leaves = zip(
        jax.tree.leaves(grads), jax.tree.leaves(grads_twin), jax.tree.leaves(grads32), strict=True
    )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    for path, (g, g_twin, g32) in zip(paths, leaves, strict=True):
        errors[path] = (rel_error(g, g32), rel_error(g_twin, g32))
    errors["loss"] = (rel_error(loss, loss32), rel_error(loss_twin, loss32))
    worse = {k: v for k, v in errors.items() if v[0] > 1.25 * v[1] + 1e-3}
    assert not worse, (worse, errors)


def test_impl_xla_dense_twin_runs_no_custom_call():
    mesh = _mesh((1,), ("expert",))
    tokens, targets = _batch()
    model = models.MoEDecoder(CFG, mesh, impl="xla", moe_impl="dense")
    params = model.init(jax.random.key(0))
    assert _custom_calls(jax.grad(model.loss), params, tokens, targets) == set()


@pytest.mark.parametrize(
    "shape,names,kw",
    [
        ((2, 4), ("data", "expert"), {}),
        ((2, 2, 2), ("pipe", "data", "expert"), {"num_microbatches": 4}),
    ],
    ids=["d2e4", "pipe2-d2e2"],
)
def test_ragged_exchange_train_step_equals_the_gather_one(shape, names, kw, ragged_on_cpu):
    """The GPU's exchange (ragged_all_to_all, here its dense twin) in the decoder and in its
    pipeline stages: the loss and every gradient those of the CPU's all-gather exchange."""
    mesh = _mesh(shape, names)
    tokens, targets = _batch(batch=16)
    out = {}
    for exchange in ("gather", "ragged"):
        model = models.MoEDecoder(CFG, mesh, dtype=jnp.float32, exchange=exchange, **kw)
        params = model.init(jax.random.key(2))
        out[exchange] = jax.jit(model.loss_and_grads)(params, tokens, targets)
    (loss, grads), (loss_r, grads_r) = out["gather"], out["ragged"]
    assert abs(float(loss_r) - float(loss)) <= 1e-6 * abs(float(loss)), (loss_r, loss)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads_r)
    for (path, g), want in zip(flat, jax.tree.leaves(grads), strict=True):
        assert rel_error(g, want) < 1e-5, (jax.tree_util.keystr(path), rel_error(g, want))


def test_pipe_loss_is_a_forward_and_equals_the_training_loss():
    mesh = _mesh((2, 4), ("pipe", "expert"))
    model = models.MoEDecoder(CFG, mesh, num_microbatches=2, dtype=jnp.float32)
    params = model.init(jax.random.key(1))
    tokens, targets = _batch(batch=16)
    loss_fn = jax.jit(model.loss)
    train_fn = jax.jit(model.loss_and_grads)
    loss = float(loss_fn(params, tokens, targets))
    train_loss = float(train_fn(params, tokens, targets)[0])
    assert abs(loss - train_loss) <= 1e-5 * abs(train_loss), (loss, train_loss)
    # No backward: the loss runs no backward kernel; the training step does.
    calls = {
        name: set(_CALL.findall(fn.lower(params, tokens, targets).compile().as_text()))
        for name, fn in (("loss", loss_fn), ("train", train_fn))
    }
    assert "jaxops_rms_norm_fwd" in calls["loss"], calls["loss"]
    assert "jaxops_rms_norm_bwd" in calls["train"], calls["train"]
    assert not any(c.endswith("_bwd") for c in calls["loss"]), calls["loss"]


def test_loss_validates_once(monkeypatch):
    mesh = _mesh((1,), ("expert",))
    model = models.MoEDecoder(CFG, mesh)
    params = model.init(jax.random.key(0))
    tokens, targets = _batch()
    calls = []
    from jaxops.models import _batch as batches  # the check every public method runs once

    original = batches.check_batch

    def counting(op, *args, **kwargs):
        calls.append(op)
        return original(op, *args, **kwargs)

    monkeypatch.setattr(batches, "check_batch", counting)
    jax.jit(model.loss).trace(params, tokens, targets)  # validation runs while tracing
    assert calls == ["jaxops.models.MoEDecoder.loss"]
    calls.clear()
    jax.jit(model.loss_and_grads).trace(params, tokens, targets)
    assert calls == ["jaxops.models.MoEDecoder.loss_and_grads"]


def test_errors_name_the_public_call():
    mesh = _mesh((1,), ("expert",))
    with pytest.raises(jaxops.ConfigError, match=r"^jaxops\.models\.MoEDecoder: schedule must"):
        models.MoEDecoder(CFG, mesh, schedule="interleaved")
    with pytest.raises(jaxops.ConfigError, match=r"^jaxops\.models\.MoEDecoder: impl must"):
        models.MoEDecoder(CFG, mesh, impl="cuda")
    model = models.MoEDecoder(CFG, mesh)
    params = model.init(jax.random.key(0))
    tokens, _ = _batch()
    with pytest.raises(ValueError, match=r"^jaxops\.models\.MoEDecoder\.loss: targets must have"):
        model.loss(params, tokens, tokens[:, :4])
    with pytest.raises(jaxops.ConfigError, match=r"^jaxops\.models\.DecoderConfig\.from_hf: "):
        models.DecoderConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ValueError, match=r"^jaxops\.models\.llama_name_map: rope must"):
        models.llama_name_map({"num_attention_heads": 4, "hidden_size": 32}, rope="neox")
    assert issubclass(checkpoint.CheckpointError, jaxops.JaxopsError)
    assert issubclass(checkpoint.CheckpointError, RuntimeError)
    assert issubclass(models.ConfigError, ValueError) and models.ConfigError is jaxops.ConfigError


def test_deprecated_names_warn_and_still_work():
    mesh = _mesh((1,), ("expert",))
    with pytest.warns(DeprecationWarning, match=r"microbatches= is renamed num_microbatches="):
        model = models.MoEDecoder(CFG, mesh, microbatches=2)
    assert model.num_microbatches == 2
    with pytest.warns(DeprecationWarning, match=r"aux_loss_coef= is renamed router_aux_loss_coef"):
        model = models.MoEDecoder(CFG, mesh, aux_loss_coef=0.5, router_z_loss_coef=0.25)
    with pytest.warns(DeprecationWarning, match=r"z_loss_coef= is renamed router_z_loss_coef"):
        assert models.MoEDecoder(CFG, mesh, z_loss_coef=0.25).router_z_loss_coef == 0.25
    assert (model.router_aux_loss_coef, model.router_z_loss_coef) == (0.5, 0.25)
    assert model.moe.router_aux_loss_coef == 0.5
    with pytest.warns(DeprecationWarning, match=r"MoEDecoder\.microbatches is renamed"):
        assert model.microbatches == 1
    with pytest.raises(TypeError, match="got both num_microbatches= and its deprecated name"):
        models.MoEDecoder(CFG, mesh, microbatches=2, num_microbatches=2)
    with pytest.warns(DeprecationWarning, match="renamed DECODER_SCHEDULES"):
        assert models.SCHEDULES == models.DECODER_SCHEDULES == ("gpipe", "1f1b")
    with pytest.warns(DeprecationWarning, match=r"moved to jaxops\.models\.llama_name_map"):
        old = checkpoint.llama_name_map({"num_attention_heads": 4, "hidden_size": 32})
    assert old == models.llama_name_map({"num_attention_heads": 4, "hidden_size": 32})
    with pytest.warns(DeprecationWarning, match=r"moved to jaxops\.models\.LLAMA_NAME_MAP"):
        assert checkpoint.LLAMA_NAME_MAP is models.LLAMA_NAME_MAP
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names do not warn
        models.MoEDecoder(CFG, mesh, num_microbatches=2, router_aux_loss_coef=0.5)


def _attention_oracle(q, k, v, mask, sinks):
    """float64 softmax attention ``[b, sq, Hq Dv]`` (GQA, sinks); a query without keys: 0."""
    q, k, v, sinks = (np.asarray(a, np.float64) for a in (q, k, v, sinks))
    b, sq, hq, dh = q.shape
    group = hq // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bshd->bhqs", q, k) * dh**-0.5
    scores = np.where(mask[:, None], scores, -np.inf)
    top = np.maximum(scores.max(-1, keepdims=True), sinks[None, :, None, None])
    e = np.exp(scores - top)
    probs = e / (e.sum(-1, keepdims=True) + np.exp(sinks[None, :, None, None] - top))
    return np.einsum("bhqs,bshd->bqhd", probs, v).reshape(b, sq, -1)


@pytest.mark.parametrize("seq", [31, 64, 100])
def test_causal_query_blocks_equal_the_whole_softmax(seq, monkeypatch):
    """Causal self-attention in query blocks (each against the keys up to its last query),
    and blockwise in blocks of 16 (an online softmax, the block pairs the mask empties
    skipped), against float64 numpy and against one block, with a sliding window, two packed
    documents, a padding row (queries that see no key) and sinks; values and gradients."""
    from jaxops.models import _layers, _ops

    rng = np.random.default_rng(seq)
    q = jnp.asarray(rng.standard_normal((3, seq, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((3, seq, 2, 8)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    t = np.arange(seq)
    docs = np.stack([np.ones(seq), 1 + (t >= seq // 3), np.zeros(seq)]).astype(np.int32)
    mask = (t[:, None] >= t[None, :]) & (t[:, None] - t[None, :] < 40)
    mask = mask[None] & (docs[:, :, None] == docs[:, None, :]) & (docs[:, None, :] != 0)
    index = jnp.broadcast_to(jnp.asarray(t, jnp.int32), (3, seq))
    where = _layers.Tokens(index, index, jnp.asarray(docs))
    visible = _layers.Visible(where, where, 40)
    np.testing.assert_array_equal(np.asarray(visible.dense()), mask)
    cot = jnp.asarray(rng.standard_normal((3, seq, 32)), jnp.float32)

    def run(attention="xla"):
        ops = _layers.Ops(jnp.float32, attention=attention, attention_block=16)

        def f(q, k, v, sinks):
            out = _layers.attend(ops, CFG, q, k, v, visible, causal=True, sinks=sinks)
            return jnp.sum(out * cot), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)

    assert _layers.causal_blocks(seq) == (1 if seq < 64 else min(_layers.CAUSAL_BLOCKS, seq // 32))
    (_, out), grads = run()
    want = _attention_oracle(q, k, v, mask, sinks)
    assert rel_error(out, want) < 1e-5
    assert not np.asarray(out)[2].any()  # the padding row: no keys, zeros
    (_, blockwise), blockwise_grads = run("blockwise")
    assert rel_error(blockwise, want) < 1e-5 and not np.asarray(blockwise)[2].any()
    monkeypatch.setattr(_ops, "CAUSAL_BLOCKS", 1)  # where attend reads it
    (_, whole), whole_grads = run()
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole), atol=1e-5)
    for a, b, c in zip(grads, whole_grads, blockwise_grads, strict=True):
        assert rel_error(a, b) < 1e-5 and rel_error(c, b) < 1e-5


def test_dot_product_attention_equals_the_jnp_softmax():
    """attention_impl="dot_product" (jax.nn.dot_product_attention: cuDNN on GPUs) against the
    jnp softmax, with every mask the decoder builds: left padding, packed documents, a sliding
    window; logits, gradients and generated tokens."""
    attention = dataclasses.replace(CFG.attention, qk_norm=False, sliding_window=5)
    cfg = dataclasses.replace(CFG, model_type="mixtral", attention=attention)
    mesh = _mesh((1,), ("expert",))  # (the attention is per token row: any mesh is the same)
    tokens, targets = _batch(seq=12)
    mask = (np.arange(12)[None, :] >= np.arange(8)[:, None] % 4).astype(np.int32)
    segments = np.where(np.arange(12)[None, :] < 7, 1, 2) * (np.arange(8)[:, None] % 2 == 0)
    segments = np.where(segments == 0, mask, segments).astype(np.int32)  # packed or padded rows
    out = {}
    for attention in ("xla", "dot_product"):
        model = models.MoEDecoder(cfg, mesh, attention_impl=attention)
        assert model.layout.ops.attention == attention
        params = model.init(jax.random.key(0))
        kw = dict(segment_ids=model.place_batch(segments))
        logits = jax.jit(functools.partial(model.logits, **kw))(params, model.place_batch(tokens))
        loss, grads = jax.jit(functools.partial(model.loss_and_grads, **kw))(
            params, *model.place_batch(tokens, targets)
        )
        new = models.generate(model, params, tokens[:2] * mask[:2], 6, attention_mask=mask[:2])
        out[attention] = (np.asarray(logits), float(loss), grads, np.asarray(new))
    (l1, v1, g1, n1), (l2, v2, g2, n2) = out["xla"], out["dot_product"]
    valid = (segments != 0)[..., None]
    np.testing.assert_allclose(np.where(valid, l2, 0), np.where(valid, l1, 0), atol=2e-5)
    np.testing.assert_allclose(v2, v1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6)
    np.testing.assert_array_equal(n2, n1)
    # "auto": blockwise on CPU (dot_product is for GPUs in bfloat16 / float16).
    assert models.MoEDecoder(cfg, mesh).layout.ops.attention == "blockwise"
    with pytest.raises(models.ConfigError, match="attention_impl must be one of"):
        models.MoEDecoder(cfg, mesh, attention_impl="flash")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"], ids=["mla", "gqa"])
def test_one_sequence_batch_keeps_its_sharding_through_blockwise_attention(family):
    """A batch of one sequence, longer than an attention block, on an Explicit mesh: loss and
    gradients equal those of the same sequence twice. With one query head per KV head (MLA
    expands its keys so) jax's reshape that groups the query heads dropped the size-1 batch
    axis's sharding, and a one-sequence DeepSeek-V3 step failed to trace (the plan CLI with
    --batch 1 too)."""
    cfg = models.DecoderConfig.from_hf(models.family(family).tiny_config(num_hidden_layers=2))
    model = models.MoEDecoder(cfg, _mesh((1, 1), ("data", "expert")), attention_block=8)
    params = model.init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    step = jax.jit(model.loss_and_grads)
    loss, grads = step(params, *model.place_batch(tokens, targets))
    twice = step(params, *model.place_batch(np.repeat(tokens, 2, 0), np.repeat(targets, 2, 0)))
    np.testing.assert_allclose(float(loss), float(twice[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(twice[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("dense", "period"),
    [
        ((0, 2, 4, 6), (0, ("dense_layers", "layers"))),  # Llama 4 Maverick, ERNIE
        ((0, 3, 6), (2, ("layers", "dense_layers", "layers"))),  # runs of layers 0-1 first
    ],
    ids=["alternating", "runs-then-period-of-three"],
)
def test_repeated_dense_moe_pattern_is_one_scan(dense, period):
    """Layers repeating a dense / MoE pattern run as one scan over the repeats (compile time
    independent of the depth), equal to one scan per run of one kind."""
    cfg = dataclasses.replace(
        CFG, num_layers=8, pattern=models.LayerPattern(dense_layers=dense, dense_ffn=24)
    )
    model = models.MoEDecoder(cfg, _mesh((1,), ("expert",)))
    assert model.layout.period == period
    for other in ((0,), (0, 1, 3, 5, 7)):  # DeepSeek-V3's dense layers first: runs; a prefix
        pattern = models.LayerPattern(dense_layers=other, dense_ffn=24)
        found = models.MoEDecoder(dataclasses.replace(cfg, pattern=pattern), model.mesh)
        assert found.layout.period == (None if other == (0,) else (2, ("layers", "dense_layers")))
    params = model.init(jax.random.key(3))
    tokens, targets = _batch()
    no_period = models.MoEDecoder(cfg, _mesh((1,), ("expert",)))
    object.__setattr__(no_period.layout, "period", None)  # the cached property, forced off
    loss, grads = jax.jit(model.loss_and_grads)(params, tokens, targets)
    want, want_grads = jax.jit(no_period.loss_and_grads)(params, tokens, targets)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    scans = str(jax.make_jaxpr(model.loss)(params, tokens, targets)).count("scan[")
    runs = str(jax.make_jaxpr(no_period.loss)(params, tokens, targets)).count("scan[")
    assert scans < runs, (scans, runs)
