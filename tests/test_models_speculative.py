"""jaxops.models.generate(..., speculative="mtp"): speculative decoding with the MTP modules.

Greedy: the output equals plain greedy decoding token for token (left padding, EOS, one and two
depths, both families that ship MTP modules, one device and data x expert), with a vocabulary small
enough that drafts are often kept, so that rows advance by different counts; the drafts are the
modules' own predictions on the generated text (the trunk steps replayed from them). Sampling: the
joint distribution of the new tokens is the plain one, computed exactly from the model's
logits over every continuation (a chi-square test over thousands of rows).
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
import scipy.stats
from _hf_families import mesh, randomized_adapters
from jaxops.models._adapters import lora_targets

import jaxops
from jaxops import models

VOCAB = 4  # small: random MTP modules' drafts are then often the trunk's tokens


def _model(family: str, depth: int, seed: int, mesh_name: str = "1dev"):
    hf = models.family(family).tiny_config(num_nextn_predict_layers=depth, vocab_size=VOCAB)
    model = models.MoEDecoder(models.DecoderConfig.from_hf(hf), mesh(mesh_name))
    return model, model.init(jax.random.key(seed))


@pytest.mark.parametrize(
    "family,depth,seed,mesh_name",
    [("deepseek_v3", 2, 9, "d2e4"), ("glm4_moe", 1, 3, "1dev")],
    ids=["deepseek_v3-depth2-d2e4", "glm4_moe-depth1-1dev"],
)
def test_greedy_output_is_the_plain_greedy_output(family, depth, seed, mesh_name):
    model, params = _model(family, depth, seed, mesh_name)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, (8, 5)).astype(np.int32)
    mask = np.ones(prompt.shape, np.int32)
    mask[0, :2] = mask[1, :1] = 0
    prompt *= mask
    new = 20
    plain = np.asarray(models.generate(model, params, prompt, new, attention_mask=mask))
    got, stats = models.generate(
        model, params, prompt, new, attention_mask=mask, speculative="mtp", return_stats=True
    )
    np.testing.assert_array_equal(np.asarray(got), plain)
    steps, made = np.asarray(stats["trunk_steps"]), np.asarray(stats["new_tokens"])
    print(f"{family} depth {depth}: trunk steps {steps.tolist()} for {made.tolist()} tokens")
    assert (made == new).all()
    # each trunk step makes 1 to depth + 1 tokens; some rows kept drafts, so rows differ
    assert ((steps <= made) & (steps >= -(-made // (depth + 1)))).all()
    assert steps.min() < new and len(set(steps.tolist())) > 1
    # EOS: a row ends at its first EOS, as in plain decoding, and pads after it
    eos = int(plain[2, 5 + new // 2])
    want = models.generate(model, params, prompt, new, attention_mask=mask, eos_token_id=eos)
    got = models.generate(
        model, params, prompt, new, attention_mask=mask, eos_token_id=eos, speculative="mtp"
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # one new token: the prefill's only (no speculative step runs)
    one = models.generate(model, params, prompt, 1, attention_mask=mask, speculative="mtp")
    np.testing.assert_array_equal(np.asarray(one), plain[:, :6])


def _check_drafts_replay(model, params, prompt: np.ndarray, new: int) -> None:
    """D = 1: each draft is the argmax of ``mtp_logits`` at the position before the last token
    emitted (the module at i reads the trunk at i and token i + 1, predicts i + 2): replaying
    greedy acceptance with those drafts gives every row's trunk steps exactly, so the tokens fed
    to the module and its own KV cache are the ones it was trained on."""
    s = prompt.shape[1]
    out, stats = models.generate(model, params, prompt, new, speculative="mtp", return_stats=True)
    seq = np.asarray(out)
    mtp = np.asarray(jax.jit(model.mtp_logits)(params, model.place_batch(seq)))[:, :, 0]
    draft = mtp.argmax(-1)  # draft[b, i]: the module's token i + 2
    want = []
    for b in range(len(seq)):
        last, steps = s, 1  # the prefill made token s
        while last - s + 1 < new:
            last += 2 if draft[b, last - 1] == seq[b, last + 1] else 1
            steps += 1
        want.append(steps)
    np.testing.assert_array_equal(np.asarray(stats["trunk_steps"]), want)
    assert min(want) < new and len(set(want)) > 1  # drafts were kept, rows differ


def test_drafts_are_the_modules_argmax_on_the_generated_text():
    """:func:`_check_drafts_replay` on data x expert."""
    model, params = _model("deepseek_v3", 1, 8, "d2e4")
    prompt = np.random.default_rng(5).integers(0, VOCAB, (8, 5)).astype(np.int32)
    _check_drafts_replay(model, params, prompt, 16)


def test_drafts_run_the_modules_adapters_on_an_fp8_base():
    """QLoRA with the MTP loss (the modules' layer in FP8 with adapters on every target, B
    random): the drafts are still the modules' own ``mtp_logits`` (:func:`_check_drafts_replay`),
    the greedy output plain greedy's."""
    hf = models.family("deepseek_v3").tiny_config(num_nextn_predict_layers=1, vocab_size=VOCAB)
    config = models.DecoderConfig.from_hf(hf)
    lora = jaxops.Lora(4, 8.0, lora_targets(config))
    model = models.MoEDecoder(config, mesh("1dev"), lora=lora, base="fp8", mtp_loss_weight=0.3)
    params = randomized_adapters(model, model.init(jax.random.key(6)), seed=7)
    assert params["mtp"]["block"]["w_kv_b"].dtype == np.uint8
    assert "kv_b_proj_lora_b" in params["mtp"]["block"]
    prompt = np.random.default_rng(8).integers(0, VOCAB, (8, 5)).astype(np.int32)
    _check_drafts_replay(model, params, prompt, 16)
    plain = models.generate(model, params, prompt, 16)
    got = models.generate(model, params, prompt, 16, speculative="mtp")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


def test_sampling_keeps_the_plain_distribution():
    """Speculative sampling's joint distribution of 3 new tokens is the exact plain one."""
    model, params = _model("deepseek_v3", 2, 4)
    rows, new, prompt = 4096, 3, np.array([1, 3, 0, 2, 1], np.int32)
    temperature, top_k = 1.3, 3
    # The exact distribution: the model's logits over every continuation of the prompt.
    tails = np.array(list(itertools.product(range(VOCAB), repeat=new - 1)), np.int32)
    ids = np.concatenate([np.broadcast_to(prompt, (len(tails), len(prompt))), tails], 1)
    logits = np.asarray(jax.jit(model.logits)(params, ids), np.float64)[:, len(prompt) - 1 :]
    logits = logits / temperature
    kth = np.sort(logits, -1)[..., -top_k][..., None]
    p = np.exp(np.where(logits < kth, -np.inf, logits - logits.max(-1, keepdims=True)))
    p /= p.sum(-1, keepdims=True)  # [tails, new, V]: token j's distribution after tail[:j]
    exact = np.zeros((VOCAB,) * new)
    for t, tail in enumerate(tails):
        for last in range(VOCAB):
            seq = (*tail, last)
            exact[seq] = np.prod([p[t, j, seq[j]] for j in range(new)])
    assert np.isclose(exact.sum(), 1.0)

    def counts(**options):
        out = models.generate(
            model,
            params,
            np.broadcast_to(prompt, (rows, len(prompt))),
            new,
            temperature=temperature,
            top_k=top_k,
            key=jax.random.key(11),
            **options,
        )
        got = np.asarray(out)[:, len(prompt) :]
        return np.bincount(np.ravel_multi_index(got.T, (VOCAB,) * new), minlength=VOCAB**new)

    expected = exact.ravel() * rows
    seen = expected > 0
    for options in ({}, {"speculative": "mtp"}):
        observed = counts(**options)
        assert observed[~seen].sum() == 0, options  # nothing top-k removed
        chi2 = np.sum((observed[seen] - expected[seen]) ** 2 / expected[seen])
        dof = seen.sum() - 1
        print(f"{options or 'plain'}: chi-square {chi2:.1f} over {dof} degrees of freedom")
        assert scipy.stats.chi2.sf(chi2, dof) > 1e-4, (options, chi2, dof)
