"""Fine-tuning inputs of jaxops.models against transformers: ignored labels (-100), padding
(attention_mask, left and right) with position ids, packed documents (segment_ids), the global
token mean of the loss with and without a pipeline, gradient accumulation, remat policies, and
the errors a fine-tuning user meets first.

Every weight of the tiny transformers-made models is randomized (norms and biases too, see
test_models._hf_model). Tolerances: loss rel err < 1e-5, logits within 1e-4 of the logit scale.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import FAMILIES, MESHES  # noqa: E402
from _hf_families import hf_model as _hf_model  # noqa: E402
from _hf_families import max_rel_err as _max_rel_err  # noqa: E402

import jaxops  # noqa: E402
from jaxops import models  # noqa: E402

LOSS_TOL = 1e-5
TOL = 1e-4
IGNORE = -100


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """family -> (transformers model, its saved directory)."""
    root = tmp_path_factory.mktemp("hf_finetune")
    out = {}
    for family in FAMILIES:
        model = _hf_model(family, seed=1)
        model.save_pretrained(root / family)
        out[family] = (model, root / family)
    return out


def _mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _load(hf, family, mesh_name, **options):
    options.setdefault("router_aux_loss_coef", 0.0)
    return models.from_pretrained(
        hf[family][1], mesh=_mesh(mesh_name), dtype=jnp.float32, **options
    )


def _sft_batch(vocab, batch, seq, seed=0):
    """tokens, transformers labels (prompt = -100) and our shifted targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    labels = tokens.copy()
    prompt = rng.integers(1, seq - 2, batch)
    for b, p in enumerate(prompt):
        labels[b, :p] = IGNORE
    targets = np.concatenate([labels[:, 1:], np.full((batch, 1), IGNORE, np.int32)], axis=1)
    return tokens, labels, targets


def _hf_loss(model, tokens, labels, **kw):
    with torch.no_grad():
        out = model(
            torch.tensor(tokens, dtype=torch.long),
            labels=torch.tensor(labels, dtype=torch.long),
            **{k: torch.tensor(v, dtype=torch.long) for k, v in kw.items()},
        )
    return float(out.loss)


def _hf_logits(model, tokens, **kw):
    with torch.no_grad():
        out = model(
            torch.tensor(tokens, dtype=torch.long),
            **{k: torch.tensor(v, dtype=torch.long) for k, v in kw.items()},
        )
    return out.logits.float().numpy()


# -------------------------------------------------------------------------------------------------
# Labels: -100 ignored, the mean over the counted targets of the whole global batch.


# Every family on one device, and the pipe mesh with its microbatches with two (the global mean
# over shards and microbatches does not depend on the family; data x expert against transformers'
# loss is tests/test_models_families.py's, for every family).
@pytest.mark.parametrize(
    "family,mesh_name",
    [(f, "1dev") for f in FAMILIES] + [("qwen2_moe", "p2e4"), ("qwen3_moe", "p2e4")],
)
def test_loss_ignores_minus_100_like_transformers(hf, family, mesh_name):
    model, params = _load(hf, family, mesh_name, num_microbatches=2)
    batch = 2 if mesh_name == "1dev" else 16
    tokens, labels, targets = _sft_batch(model.config.vocab_size, batch, 12)
    want = _hf_loss(hf[family][0], tokens, labels)
    tok, tgt = model.place_batch(tokens, targets)
    got = float(jax.jit(model.loss)(params, tok, tgt))
    err = abs(got - want) / abs(want)
    print(f"{family} {mesh_name}: loss {got:.6f} vs transformers {want:.6f}, rel err {err:.1e}")
    assert err < LOSS_TOL, (got, want)
    trained, _ = jax.jit(model.loss_and_grads)(params, tok, tgt)
    assert abs(float(trained) - want) / abs(want) < LOSS_TOL


@pytest.mark.parametrize("mesh_name", ["1dev", "p2e4"])
def test_no_target_gives_zero_loss_and_zero_grads(hf, mesh_name):
    model, params = _load(hf, "qwen3_moe", mesh_name, num_microbatches=2)
    batch = 2 if mesh_name == "1dev" else 8
    tokens, _, _ = _sft_batch(model.config.vocab_size, batch, 8)
    targets = np.full_like(tokens, IGNORE)
    loss, grads = jax.jit(model.loss_and_grads)(params, *model.place_batch(tokens, targets))
    assert float(loss) == 0.0
    for g in jax.tree.leaves(grads):
        assert np.all(np.asarray(g) == 0)


def test_grad_of_loss_on_a_pipe_mesh_is_the_pipeline_step(hf):
    model, params = _load(hf, "mixtral", "p2e4", num_microbatches=2, router_aux_loss_coef=0.01)
    tokens, _, targets = _sft_batch(model.config.vocab_size, 8, 8, seed=3)
    tok, tgt = model.place_batch(tokens, targets)
    value, grads = jax.jit(jax.value_and_grad(model.loss))(params, tok, tgt)
    want_value, want = jax.jit(model.loss_and_grads)(params, tok, tgt)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_equals_one_pass(hf):
    one, params = _load(hf, "qwen2_moe", "d2e4")
    acc = dataclasses.replace(one, num_microbatches=2)
    tokens, _, targets = _sft_batch(one.config.vocab_size, 16, 8, seed=4)
    tok, tgt = one.place_batch(tokens, targets)
    l1, g1 = jax.jit(one.loss_and_grads)(params, tok, tgt)
    l4, g4 = jax.jit(acc.loss_and_grads)(params, tok, tgt)
    np.testing.assert_allclose(float(l4), float(l1), rtol=1e-6)
    np.testing.assert_allclose(float(jax.jit(acc.loss)(params, tok, tgt)), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


# -------------------------------------------------------------------------------------------------
# Padding and packed documents.


def _padded(vocab, side, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (2, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    if side == "left":
        mask[0, :4] = 0
        mask[1, :1] = 0
    else:
        mask[0, 6:] = 0
        mask[1, 9:] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_logits_match_transformers(hf, family, side):
    model, params = _load(hf, family, "1dev")
    tokens, mask, positions = _padded(model.config.vocab_size, side)
    want = _hf_logits(hf[family][0], tokens, attention_mask=mask, position_ids=positions)
    got = np.asarray(
        jax.jit(model.logits)(params, tokens, attention_mask=mask, positions=positions)
    )
    real = mask.astype(bool)
    err = _max_rel_err(got[real], want[real])
    print(f"{family} {side} padding: logit rel err {err:.1e}")
    assert err <= TOL
    # The default positions are cumsum(mask) - 1: the same logits without passing them.
    default = np.asarray(jax.jit(model.logits)(params, tokens, attention_mask=mask))
    assert _max_rel_err(default[real], want[real]) <= TOL


@pytest.mark.parametrize("mesh_name", ["d2e4", "p2e4"])
def test_padded_loss_on_8_devices_matches_transformers(hf, mesh_name):
    model, params = _load(hf, "qwen2_moe", mesh_name, num_microbatches=2)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, model.config.vocab_size, (16, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    for b, n in enumerate(rng.integers(0, 6, 16)):
        mask[b, :n] = 0  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    labels = np.where(mask == 1, tokens, IGNORE)
    # A target predicted at a padding position (the first real token after left padding) counts
    # for nothing in jaxops; transformers would count it from the padding's logits.
    labels[:, 1:][mask[:, :-1] == 0] = IGNORE
    targets = np.concatenate([labels[:, 1:], np.full((16, 1), IGNORE, np.int32)], axis=1)
    want = _hf_loss(hf["qwen2_moe"][0], tokens, labels, attention_mask=mask, position_ids=positions)
    args = model.place_batch(tokens, targets, mask, positions)
    got = jax.jit(lambda p, t, y, m, pos: model.loss(p, t, y, attention_mask=m, positions=pos))(
        params, *args
    )
    assert abs(float(got) - want) / want < LOSS_TOL, (float(got), want)
    logits = jax.jit(lambda p, t, m: model.logits(p, t, attention_mask=m))(params, args[0], args[2])
    hf_logits = _hf_logits(hf["qwen2_moe"][0], tokens, attention_mask=mask, position_ids=positions)
    real = mask.astype(bool)
    assert _max_rel_err(np.asarray(logits)[real], hf_logits[real]) <= TOL


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_equal_each_document_alone(hf, family):
    model, params = _load(hf, family, "1dev")
    rng = np.random.default_rng(6)
    docs = [rng.integers(0, model.config.vocab_size, n).astype(np.int32) for n in (5, 3, 4)]
    packed = models.pack_sequences(docs, 14, num_rows=2)
    got = np.asarray(
        jax.jit(model.logits)(
            params, packed.tokens, segment_ids=packed.segment_ids, positions=packed.positions
        )
    )
    # Without positions the index within each document is the default.
    default = np.asarray(
        jax.jit(model.logits)(params, packed.tokens, segment_ids=packed.segment_ids)
    )
    seen = 0
    for row in range(packed.tokens.shape[0]):
        for seg in set(packed.segment_ids[row].tolist()) - {0}:
            cols = packed.segment_ids[row] == seg
            alone = _hf_logits(hf[family][0], packed.tokens[row, cols][None])[0]
            assert _max_rel_err(got[row, cols], alone) <= TOL
            assert _max_rel_err(default[row, cols], alone) <= TOL
            seen += 1
    assert seen == len(docs)


def test_padding_never_reaches_the_router(hf):
    model, params = _load(hf, "mixtral", "1dev", router_aux_loss_coef=0.02)
    tokens, mask, _ = _padded(model.config.vocab_size, "right")
    other = np.where(mask == 1, tokens, (tokens + 7) % model.config.vocab_size)
    run = jax.jit(lambda p, t, m: model.forward(p, t, attention_mask=m)[1])
    a, b = run(params, tokens, mask), run(params, other, mask)
    np.testing.assert_array_equal(a.tokens_per_expert, b.tokens_per_expert)
    np.testing.assert_allclose(a.load_balancing_loss, b.load_balancing_loss, rtol=1e-6)
    top_k = model.config.moe.top_k
    assert np.all(np.asarray(a.tokens_per_expert).sum(-1) == mask.sum() * top_k)
    # The padded loss equals the loss of the same real tokens in another padding.
    targets = np.where(mask == 1, np.roll(tokens, -1, axis=1), IGNORE)
    loss = jax.jit(lambda p, t, y, m: model.loss(p, t, y, attention_mask=m))
    np.testing.assert_allclose(
        float(loss(params, tokens, targets, mask)),
        float(loss(params, other, targets, mask)),
        rtol=1e-6,
    )


# -------------------------------------------------------------------------------------------------
# Memory controls and errors.


def test_remat_policies_give_the_same_gradients(hf):
    base, params = _load(hf, "qwen3_moe", "1dev")
    tokens, _, targets = _sft_batch(base.config.vocab_size, 2, 8, seed=7)
    _, want = jax.jit(base.loss_and_grads)(params, tokens, targets)
    for remat in ("full", "matmuls", jax.checkpoint_policies.nothing_saveable, True):
        model = dataclasses.replace(base, remat=remat)
        _, got = jax.jit(model.loss_and_grads)(params, tokens, targets)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    assert dataclasses.replace(base, remat=True).remat == "full"
    assert dataclasses.replace(base, remat=False).remat == "none"
    with pytest.raises(jaxops.ConfigError, match=r"MoEDecoder: remat must be one of"):
        dataclasses.replace(base, remat="dots")


def test_remat_policies_through_the_pipeline(hf):
    """The pipeline step rematerializes each stage's layers (the stash then holds a rotary
    table computed from constants alone, written at a per-stage row): same loss and grads."""
    base, params = _load(hf, "qwen3_moe", "p2e4", num_microbatches=2)
    tokens, _, targets = _sft_batch(base.config.vocab_size, 8, 8, seed=3)
    loss, want = jax.jit(base.loss_and_grads)(params, tokens, targets)
    for remat in ("full", "matmuls"):
        model = dataclasses.replace(base, remat=remat)
        got_loss, got = jax.jit(model.loss_and_grads)(params, tokens, targets)
        np.testing.assert_allclose(float(got_loss), float(loss), rtol=1e-6)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def _scan_loops(compiled) -> int:
    """The compiled program's while loops made from jax loops (op_name ".../while"), not the ones
    XLA makes of scatters (op_name ".../scatter-add"; XLA:CPU's elemental emitters, which the
    suite's conftest selects, expand scatters into loops)."""
    return len(re.findall(r' while\(.*op_name="[^"]*/while"', compiled.as_text()))


@pytest.mark.parametrize("mesh_name", ["1dev", "p2e4"])
def test_scan_unroll_gives_the_same_gradients(hf, mesh_name):
    """Unrolled layer scans (no stacked residuals) compute what the rolled scan does, also
    through the pipeline's stages (one layer each here: the setting passes through). On one
    device it takes effect: the compiled program has no loop over the layers left."""
    options = {"num_microbatches": 2} if mesh_name == "p2e4" else {}
    base, params = _load(hf, "qwen3_moe", mesh_name, **options)
    tokens, _, targets = _sft_batch(base.config.vocab_size, 8, 8, seed=5)
    rolled = jax.jit(base.loss_and_grads).lower(params, tokens, targets).compile()
    loss, want = rolled(params, tokens, targets)
    whiles = {"1": _scan_loops(rolled)}
    for unroll in (2, True) if mesh_name == "1dev" else (True,):
        model = dataclasses.replace(base, scan_unroll=unroll)
        compiled = jax.jit(model.loss_and_grads).lower(params, tokens, targets).compile()
        whiles[str(unroll)] = _scan_loops(compiled)
        got_loss, got = compiled(params, tokens, targets)
        np.testing.assert_allclose(float(got_loss), float(loss), rtol=1e-6)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    if mesh_name == "1dev":
        assert whiles["True"] == 0 < whiles["1"], whiles
    for bad in (0, -1, 1.5, "all"):
        with pytest.raises(jaxops.ConfigError, match=r"MoEDecoder: scan_unroll must be True or"):
            dataclasses.replace(base, scan_unroll=bad)


def test_bad_inputs_are_named(hf):
    model, params = _load(hf, "mixtral", "1dev")
    vocab = model.config.vocab_size
    tokens = np.zeros((2, 6), np.int32)
    tokens[1, 4] = vocab
    with pytest.raises(
        ValueError, match=rf"MoEDecoder\.logits: tokens holds id {vocab} at \(1, 4\)"
    ):
        model.logits(params, tokens)
    tokens[1, 4] = IGNORE
    with pytest.raises(ValueError, match=r"tokens holds id -100"):
        model.loss(params, tokens, tokens)
    good = np.zeros((2, 6), np.int32)
    bad_targets = good.copy()
    bad_targets[0, 0] = -1
    with pytest.raises(ValueError, match=r"MoEDecoder\.loss: targets holds id -1 at \(0, 0\)"):
        model.loss(params, good, bad_targets)
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of tokens"):
        model.logits(params, good, attention_mask=np.ones((2, 5), np.int32))
    with pytest.raises(TypeError, match=r"segment_ids"):
        model.logits(params, good, segment_ids=np.ones((2, 6), np.float32))
    # Padding is not looked at (its id never reaches a real token), on host or device.
    padded = good.copy()
    padded[0, :2] = -1
    mask = (padded >= 0).astype(np.int32)
    want = np.asarray(model.logits(params, good, attention_mask=mask))[0, 2:]
    for arr in (padded, jnp.asarray(padded)):
        got = np.asarray(model.logits(params, arr, attention_mask=mask))[0, 2:]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # On device, an out-of-range id gives NaN logits in its row, never another token's row.
    dev = jnp.asarray(good).at[1, 2].set(vocab + 5)
    logits = np.asarray(jax.jit(model.logits)(params, dev))
    assert np.isnan(logits[1, 2:]).all() and np.isfinite(logits[0]).all()
    with pytest.raises(jaxops.ConfigError, match=r"expert_axis and pipe_axis are both 'expert'"):
        dataclasses.replace(model, pipe_axis="expert")
