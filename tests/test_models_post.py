"""Post-training (jaxops.models.post): sequence log-probabilities against transformers' on the same
model (packed and one per row, vocabulary chunks), the DPO / IPO losses against formulas written
from the papers and against TRL's own loss code, the reference by disabled adapters against a
separate frozen base, the DPO step's gradient against jax.grad of the reference loss (and the
base untouched), the same step on data x expert as on one device, and refusals.
"""

from __future__ import annotations

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

import _hf_families as fam  # noqa: E402
import jaxops.models.post as post  # noqa: E402

from jaxops import ConfigError, Lora, models  # noqa: E402

IGNORE = models.IGNORE_INDEX


def _pairs(seed: int, n: int, vocab: int = 128):
    """n random (prompt, chosen, rejected) token lists of varied lengths (one empty prompt)."""
    rng = np.random.default_rng(seed)

    def ids(lo, hi):
        return rng.integers(1, vocab, rng.integers(lo, hi)).tolist()

    prompts = [ids(2, 6) for _ in range(n)]
    prompts[-1] = []
    return prompts, [ids(2, 7) for _ in range(n)], [ids(2, 7) for _ in range(n)]


def _hf_sequence_logprobs(torch_model, prompts, chosen, rejected) -> np.ndarray:
    """transformers' summed log-probabilities of each response, each sequence run alone."""
    out = []
    for p, c, r in zip(prompts, chosen, rejected, strict=True):
        for resp in (c, r):
            ids = torch.tensor([p + resp])
            with torch.no_grad():
                logits = torch_model(ids).logits.double()
            logp = torch.log_softmax(logits[0, :-1], -1)
            picked = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
            out.append(float(picked[max(len(p) - 1, 0) :].sum()))
    return np.array(out)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "rows"])
def test_sequence_logprobs_equal_transformers(hf_families, family, pack):
    run = hf_families.load(family, "1dev")
    prompts, chosen, rejected = _pairs(1, 3)
    batch = post.preference_batch(prompts, chosen, rejected, seq_len=24, pack=pack)
    got = jax.jit(post.sequence_logprobs, static_argnums=0)(run.model, run.params, batch)
    want = _hf_sequence_logprobs(run.torch_model, prompts, chosen, rejected)
    err = np.abs(np.asarray(got) - want).max()
    print(f"{family} {pack=}: max |sequence log-prob error| = {err:.2e}")
    assert err <= 1e-5 * max(1.0, np.abs(want).max() / 10), err


def test_token_logprobs_vocab_chunks_and_gradients(hf_families):
    """With vocab_chunk the per-token log-probabilities and their gradients are the whole head's."""
    run = hf_families.load("qwen3_moe", "1dev")
    chunked = models.MoEDecoder(**{**_settings(run.model), "vocab_chunk": 48})
    batch = post.preference_batch(*_pairs(2, 2), seq_len=24)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=batch.tokens.shape), jnp.float32)

    def f(model, params):
        return jnp.sum(post.token_logprobs(model, params, batch) * weights)

    want, g_want = jax.jit(jax.value_and_grad(f, 1), static_argnums=0)(run.model, run.params)
    got, g_got = jax.jit(jax.value_and_grad(f, 1), static_argnums=0)(chunked, run.params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-7 * float(np.abs(b).max()))


def _settings(model) -> dict:
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init}


def _np_dpo(c, r, rc, rr, beta, eps, loss_type):
    """The papers' losses in float64 numpy (DPO / cDPO of Mitchell's note, IPO eq. 17)."""
    h = (c - rc) - (r - rr)
    if loss_type == "ipo":
        return np.mean((h - 1 / (2 * beta)) ** 2)

    def log_sigmoid(x):
        return -np.logaddexp(0.0, -x)

    return np.mean(-(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))


@pytest.mark.parametrize(
    "loss_type,beta,eps",
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0)],
    ids=["dpo", "cdpo", "ipo-0.1", "ipo-1"],
)
def test_dpo_loss_against_the_papers(loss_type, beta, eps):
    rng = np.random.default_rng(3)
    c, r, rc, rr = (rng.normal(-20, 5, 7) for _ in range(4))
    loss, m = post.dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=eps, loss_type=loss_type)
    np.testing.assert_allclose(loss, _np_dpo(c, r, rc, rr, beta, eps, loss_type), rtol=1e-5)
    cw, rw = beta * (c - rc), beta * (r - rr)
    np.testing.assert_allclose(m["rewards/margins"], np.mean(cw - rw), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["rewards/accuracies"], np.mean(cw > rw))

    # and its gradient, against float64 finite differences of the formula
    def of_chosen(c):
        return post.dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=eps, loss_type=loss_type)[0]

    g = jax.grad(of_chosen)(jnp.asarray(c, jnp.float32))
    d = 1e-5
    fd = [
        (_np_dpo(c + d * e, r, rc, rr, beta, eps, loss_type)
         - _np_dpo(c - d * e, r, rc, rr, beta, eps, loss_type)) / (2 * d)
        for e in np.eye(c.size)
    ]  # fmt: skip
    np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-6)


def _trl_loss(loss_type, beta, per_token, ref_per_token, completion):
    """TRL's DPOTrainer._compute_loss (its own code) on given per-token log-probabilities.

    The model is a stand-in returning `per_token` as its log-probabilities; the reference's are
    passed precomputed, as TRL's precompute_ref_log_probs does. Rows: the chosen, then the
    rejected sequences.
    """
    trl = pytest.importorskip("trl")
    n = per_token.shape[0]
    zeros = torch.zeros_like(per_token)
    outputs = types.SimpleNamespace(
        log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
    )
    acc = types.SimpleNamespace(
        device="cpu",
        gather_for_metrics=lambda x: x,
        gather=lambda x: x,
        unwrap_model=lambda m: m,
    )
    ref = ref_per_token.sum(1)
    stub = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=acc,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros((n, per_token.shape[1] + 1), dtype=torch.long),
        "attention_mask": torch.ones((n, per_token.shape[1] + 1), dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": ref[: n // 2],
        "ref_rejected_logps": ref[n // 2 :],
    }
    loss = trl.DPOTrainer._compute_loss(stub, lambda **_: outputs, inputs, False)
    return float(loss), {k: v[-1] for k, v in stub._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_equals_trls(loss_type):
    """The same per-token log-probabilities through TRL's loss code and through ours (IPO's
    per-token mean of the sequence log-probabilities as TRL and dpo_step take it)."""
    rng = np.random.default_rng(5)
    pairs, length, beta = 4, 9, 0.3
    completion = np.zeros((2 * pairs, length + 1), np.int64)
    for k in range(2 * pairs):
        start = rng.integers(1, 4)
        completion[k, start : start + rng.integers(2, length - 3)] = 1
    mask = completion[:, 1:]
    per_token = rng.normal(-3, 1, (2 * pairs, length)) * mask
    ref_per_token = rng.normal(-3, 1, (2 * pairs, length)) * mask
    want, trl_metrics = _trl_loss(
        loss_type,
        beta,
        torch.tensor(per_token, dtype=torch.float64),
        torch.tensor(ref_per_token, dtype=torch.float64),
        torch.tensor(completion),
    )
    seq, ref = per_token.sum(1), ref_per_token.sum(1)
    if loss_type == "ipo":
        seq, ref = seq / mask.sum(1), ref / mask.sum(1)
    got, m = post.dpo_loss(
        seq[:pairs], seq[pairs:], ref[:pairs], ref[pairs:], beta=beta, loss_type=loss_type
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    if loss_type == "sigmoid":  # TRL reports the rewards of the summed log-probabilities
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
            np.testing.assert_allclose(float(m[key]), trl_metrics[key], rtol=1e-5, atol=1e-6)


def _lora_model(run, mesh_name="1dev", **settings):
    lora = Lora(4, 8.0, ("q_proj", "o_proj", "experts.gate_up_proj"))
    model = models.MoEDecoder(
        **{**_settings(run.model), "mesh": fam.mesh(mesh_name), "lora": lora, **settings}
    )
    params = model.add_adapters(run.params, jax.random.key(1))
    rng = np.random.default_rng(7)

    def trained(path, x):  # B not zero: the adapters of a trained model
        if "_lora_b" not in jax.tree_util.keystr(path):
            return x
        return jnp.asarray(rng.normal(size=x.shape) * 0.05, x.dtype)

    params = jax.tree_util.tree_map_with_path(trained, params)
    # copies: the steps donate their parameters, and the loaded ones are shared by the tests
    return model, jax.tree.map(jnp.copy, jax.device_put(params, model.shardings()))


def _with(adapters, params):
    """`params` with the adapter leaves of `adapters` (the others None)."""
    return jax.tree.map(lambda a, b: b if a is None else a, adapters, params,
                        is_leaf=lambda x: x is None)  # fmt: skip


def _check_sgd_update(model, before, new, want, atol):
    """sgd(1)'s update is minus the gradient: ``before - new`` of the trained leaves equals
    `want` (non-zero on every leaf); every other leaf is bit-identical."""
    got = jax.tree.map(lambda b, a: b - a, model.trainable(before), model.trainable(new))
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        scale = float(np.abs(w).max())
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol * scale,
                                   err_msg=jax.tree_util.keystr(path))  # fmt: skip
    for (path, b), a in zip(
        jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(new), strict=True
    ):
        if "_lora_" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _assert_runs_equal(a, b, atol=1e-4):
    """Two runs' ``(metrics per step, trained leaves)`` equal.

    The runs train with adam at lr 1e-2, whose step lr * m / sqrt(v) is about lr per element
    whatever the gradient's size: where a gradient element is near zero, last-bit differences
    between two equal computations move that element's step by a visible fraction of lr (seen:
    3.9e-5 on one element of 4096 on an AMD EPYC; within 3e-5 on an Intel Xeon). The parameters'
    atol is 1% of one step (1e-4): adam's first step is lr * sign(gradient), so a wrong
    microbatch, row or shard moves elements by whole steps, and the next step's metrics move."""
    for x, y in zip(a[0], b[0], strict=True):
        for k in x:
            np.testing.assert_allclose(x[k], y[k], rtol=2e-5, atol=1e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1]), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=atol)


def test_reference_by_disabled_adapters_equals_a_frozen_base(hf_families):
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run)
    batch = post.preference_batch(*_pairs(4, 3), seq_len=24)
    got = post.reference_logprobs(model, params, batch)
    want = jax.jit(post.sequence_logprobs, static_argnums=0)(run.model, run.params, batch)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # and the adapted model's differ (the adapters are not zero)
    adapted = jax.jit(post.sequence_logprobs, static_argnums=0)(model, params, batch)
    assert np.abs(np.asarray(adapted) - np.asarray(want)).max() > 1e-3
    # a frozen copy given as ref_params is taken as is
    np.testing.assert_allclose(
        post.reference_logprobs(model, params, batch, ref_params=params), adapted, rtol=1e-6
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_step_gradient_is_the_reference_losss(hf_families, loss_type):
    """With sgd(1) the step's update is minus the gradient: it equals jax.grad of the loss
    written from the public pieces (sequence_logprobs, dpo_loss); the base stays as it was."""
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run)
    batch = post.preference_batch(*_pairs(5, 3), seq_len=24)
    ref = post.reference_logprobs(model, params, batch)
    counts = np.bincount(batch.sequence_ids[batch.sequence_ids >= 0], minlength=6)
    norm = counts if loss_type == "ipo" else np.ones(6)

    def reference(adapters):
        p = _with(adapters, params)
        seq = post.sequence_logprobs(model, p, batch) / norm
        r = ref / norm
        return post.dpo_loss(seq[0::2], seq[1::2], r[0::2], r[1::2], beta=0.2,
                             loss_type=loss_type)[0]  # fmt: skip

    trained = model.trainable(params)
    want_loss, want = jax.jit(jax.value_and_grad(reference))(trained)
    before = jax.tree.map(np.asarray, params)
    opt = optax.sgd(1.0)
    state = model.init_optimizer(opt, params)
    step = post.dpo_step(model, opt, beta=0.2, loss_type=loss_type, aux_weight=0.0)
    new, _, m = step(params, state, batch)
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-6)
    _check_sgd_update(model, before, jax.tree.map(np.asarray, new), want, atol=1e-5)


def test_dpo_step_on_data_x_expert_equals_one_device(hf_families):
    """The metrics of adamw DPO steps (given reference log-probabilities; the MoE aux losses in,
    as the model has them) on data 2 x expert 4 equal one device's; the loss falls."""
    run = hf_families.load("qwen3_moe", "1dev")
    batch = post.preference_batch(*_pairs(6, 8), seq_len=24, row_multiple=8)
    out = {}
    for mesh_name in ("1dev", "d2e4"):
        model, params = _lora_model(run, mesh_name, router_aux_loss_coef=0.01)
        ref = post.reference_logprobs(model, params, batch)
        opt = optax.adamw(3e-3)
        state = model.init_optimizer(opt, params)
        step = post.dpo_step(model, opt, beta=0.5)
        metrics = []
        for _ in range(3):
            params, state, m = step(params, state, batch, ref_logprobs=ref)
            metrics.append({k: float(v) for k, v in m.items()})
        out[mesh_name] = metrics
    for a, b in zip(out["1dev"], out["d2e4"], strict=True):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert out["d2e4"][-1]["loss"] < out["d2e4"][0]["loss"]
    assert out["d2e4"][0]["aux"] > 0


def test_full_weights_dpo_with_a_frozen_copy(hf_families):
    """Without LoRA the reference is a frozen copy: the first step's loss is log 2 and every
    parameter moves."""
    run = hf_families.load("mixtral", "1dev")
    params = jax.tree.map(jnp.array, run.params)
    ref_params = jax.tree.map(jnp.array, run.params)
    batch = post.preference_batch(*_pairs(8, 2), seq_len=24)
    opt = optax.sgd(1e-2)
    state = run.model.init_optimizer(opt, params)
    step = post.dpo_step(run.model, opt, aux_weight=0.0)
    with pytest.raises(ConfigError, match="dpo_step: without lora the reference needs"):
        step(params, state, batch)
    new, _, m = step(params, state, batch, ref_params=ref_params)
    np.testing.assert_allclose(m["loss"], np.log(2), rtol=1e-6)
    moved = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(new), jax.tree.leaves(ref_params), strict=True)]  # fmt: skip
    assert all(moved)


def test_preference_batch_layouts():
    prompts, chosen, rejected = [[1, 2], [3]], [[4, 5, 6], [7]], [[8], [9, 10]]
    packed = post.preference_batch(prompts, chosen, rejected, seq_len=8, row_multiple=2)
    rows = post.preference_batch(prompts, chosen, rejected, seq_len=8, pack=False)
    for b in (packed, rows):
        assert b.num_sequences == 4
        ids = b.sequence_ids
        for k, resp in enumerate([(chosen, rejected)[i % 2][i // 2] for i in range(4)]):
            assert (b.targets[ids == k] == np.array(resp)).all(), (k, b)
        assert ((ids >= 0) == (b.targets != IGNORE)).all()
    assert packed.tokens.shape[0] % 2 == 0 and rows.tokens.shape == (4, 8)
    # packed: a pair's two sequences in one row (the longer pair first), positions restart
    assert [sorted({int(r) for r in np.nonzero(packed.sequence_ids == k)[0]}) for k in range(4)] \
        == [[0], [0], [1], [1]]  # fmt: skip
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert packed.segment_ids[0].tolist() == [1] * 5 + [2] * 3
    many = post.preference_batch([[1]] * 5, [[2, 3]] * 5, [[4]] * 5, seq_len=10)
    assert many.tokens.shape == (3, 10) and many.num_sequences == 10  # 5 tokens a pair, 2 a row
    assert rows.attention_mask.tolist()[0] == [1] * 5 + [0] * 3


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda: post.preference_batch([[1]], [[2]], [], 8), "as many"),
        (lambda: post.preference_batch([[1]], [[]], [[2]], 8), r"chosen\[0\] is empty"),
        (lambda: post.preference_batch([[1] * 6], [[2]], [[2, 3, 4]], 8), "more than seq_len"),
        (lambda: post.preference_batch([[]], [[2]], [[3, 4]], 8), "nothing before it"),
        (lambda: post.dpo_loss(np.zeros(2), np.zeros(3), np.zeros(2), np.zeros(2)), "rejected"),
        (lambda: post.dpo_loss(*[np.zeros(2)] * 4, beta=0), "beta must be a number > 0"),
        (lambda: post.dpo_loss(*[np.zeros(2)] * 4, loss_type="hinge"), "loss_type"),
        (lambda: post.dpo_loss(*[np.zeros(2)] * 4, label_smoothing=0.5), "label_smoothing"),
        (lambda: post.dpo_loss(*[np.zeros(2)] * 4, loss_type="ipo", label_smoothing=0.1),
         "sigmoid"),
    ],
    ids=["lengths", "empty", "too-long", "no-context", "shapes", "beta", "loss-type",
         "smoothing", "ipo-smoothing"],
)  # fmt: skip
def test_bad_input_is_refused(call, error):
    with pytest.raises(ValueError, match=error):
        call()


def test_bad_batches_and_meshes_are_refused(hf_families):
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run)
    batch = post.preference_batch(*_pairs(9, 2), seq_len=24)
    opt = optax.sgd(1e-2)
    state = model.init_optimizer(opt, params)
    step = post.dpo_step(model, opt)
    bad_ids = np.where(batch.sequence_ids == 3, 2, batch.sequence_ids)
    odd = post.Scored(batch.tokens, batch.targets, bad_ids, 3, **batch.model_inputs())
    with pytest.raises(ValueError, match="dpo_step: the batch must hold pairs"):
        step(params, state, odd)
    shifted = np.where(batch.targets == IGNORE, 0, -1)
    wrong = post.Scored(batch.tokens, batch.targets, shifted, 4, **batch.model_inputs())
    with pytest.raises(ValueError, match="sequence_ids must be >= 0 exactly where targets"):
        step(params, state, wrong)
    with pytest.raises(ValueError, match=r"ref_logprobs must be float \[4\]"):
        step(params, state, batch, ref_logprobs=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"batch must be a jaxops\.models\.post\.Scored"):
        step(params, state, batch.model_inputs())
    with pytest.raises(ValueError, match="aux_weight"):
        post.dpo_step(model, opt, aux_weight=-1)
    context_mesh = jax.make_mesh((2, 4), ("context", "expert"))
    context = models.MoEDecoder(**{**_settings(run.model), "mesh": context_mesh,
                                   "num_microbatches": 2})  # fmt: skip
    with pytest.raises(ConfigError, match="dpo_step: a context axis together with num_micro"):
        post.dpo_step(context, opt)
    with pytest.raises(ConfigError, match="rollout: generation runs without pipeline stages"):
        post.rollout(dataclasses.replace(context, num_microbatches=1), params, [[1]],
                     group_size=2, max_new_tokens=2, reward_fn=_reward,
                     key=jax.random.key(0))  # fmt: skip
    pipe = models.MoEDecoder(**{**_settings(run.model), "mesh": fam.mesh("p2e4"),
                                "num_microbatches": 2})  # fmt: skip
    with pytest.raises(ConfigError, match="rollout: generation runs without pipeline stages"):
        post.rollout(pipe, params, [[1]], group_size=2, max_new_tokens=2, reward_fn=_reward,
                     key=jax.random.key(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"model must be a jaxops\.models\.MoEDecoder"):
        post.token_logprobs(object(), params, batch)


# ---------------------------------------------------------------------------------------------
# GRPO / GSPO

TRL_LOSS_TYPES = {"sequence": "grpo", "token": "bnpo", "constant": "dr_grpo"}


def _np_grpo(lp, old, adv, mask, ref, beta, low, high, importance, aggregation, max_tokens):
    """GRPO's / GSPO's objective in float64 numpy, from the papers' formulas."""
    log_ratio = (lp - old) * mask
    if importance == "sequence":
        log_ratio = (log_ratio.sum(1) / mask.sum(1))[:, None] * np.ones_like(lp)
    w = np.exp(log_ratio)
    a = adv[:, None]
    per_token = -np.minimum(w * a, np.clip(w, 1 - low, 1 + high) * a)
    if beta:
        d = ref - lp
        per_token = per_token + beta * (np.exp(d) - d - 1)
    per_token = per_token * mask
    if aggregation == "sequence":
        return np.mean(per_token.sum(1) / mask.sum(1))
    if aggregation == "token":
        return per_token.sum() / mask.sum()
    return per_token.sum() / (lp.shape[0] * max_tokens)


def _grpo_inputs(seed, rows=6, length=7):
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, length))
    for k in range(rows):
        mask[k, : rng.integers(2, length + 1)] = 1
    old = rng.normal(-2, 0.5, (rows, length))
    lp = old + rng.normal(0, 0.3, (rows, length))  # some ratios outside the clip range
    ref = old + rng.normal(0, 0.3, (rows, length))
    return lp, old, rng.normal(0, 1, rows), mask, ref


@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
@pytest.mark.parametrize("beta", [0.0, 0.05], ids=["no-kl", "kl"])
def test_grpo_loss_against_the_formulas_and_trl(importance, aggregation, beta):
    lp, old, adv, mask, ref = _grpo_inputs(11)
    low, high, max_tokens = 0.2, 0.28, 9
    kw = dict(beta=beta, epsilon_low=low, epsilon_high=high, importance=importance,
              aggregation=aggregation, max_tokens=max_tokens)  # fmt: skip
    got, m = post.grpo_loss(lp, old, adv, mask, ref_logprobs=ref if beta else None, **kw)
    want = _np_grpo(lp, old, adv, mask, ref, beta, low, high, importance, aggregation, max_tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    trl_loss, trl_metrics = _trl_grpo(TRL_LOSS_TYPES[aggregation], importance, lp, old, adv, mask,
                                      ref, beta, low, high, max_tokens)  # fmt: skip
    np.testing.assert_allclose(got, trl_loss, rtol=1e-5)
    if beta:
        np.testing.assert_allclose(m["kl"], trl_metrics["kl"], rtol=1e-5)
    if importance == "token":
        np.testing.assert_allclose(m["clip_ratio"], trl_metrics["clip_ratio/region_mean"])

    # the gradient: float64 finite differences of the formula
    def f(x):
        return post.grpo_loss(x, old, adv, mask, ref_logprobs=ref if beta else None, **kw)[0]

    g = np.asarray(jax.grad(f)(jnp.asarray(lp, jnp.float32)))
    d, rng = 1e-6, np.random.default_rng(0)
    for _ in range(4):
        e = rng.normal(size=lp.shape)
        fd = (_np_grpo(lp + d * e, old, adv, mask, ref, beta, low, high, importance, aggregation,
                       max_tokens)
              - _np_grpo(lp - d * e, old, adv, mask, ref, beta, low, high, importance,
                         aggregation, max_tokens)) / (2 * d)  # fmt: skip
        np.testing.assert_allclose(np.sum(g * e), fd, rtol=2e-3, atol=1e-6)


def _trl_grpo(loss_type, importance, lp, old, adv, mask, ref, beta, low, high, max_tokens):
    """TRL's GRPOTrainer._compute_loss (its own code) with a stand-in for the model's pass."""
    trl = pytest.importorskip("trl")
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in
         dict(lp=lp, old=old, adv=adv, ref=ref).items()}  # fmt: skip
    rows, length = lp.shape
    acc = types.SimpleNamespace(
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
        sync_gradients=True,
        num_processes=1,
    )
    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (t["lp"], torch.zeros_like(t["lp"]),
                                                             None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=importance,
        beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=loss_type,
        epsilon_low=low,
        epsilon_high=high,
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_tokens,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        accelerator=acc,
        _metrics={"train": collections.defaultdict(list)},
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros((rows, 2), dtype=torch.long),
        "prompt_mask": torch.ones((rows, 2), dtype=torch.long),
        "completion_ids": torch.zeros((rows, length), dtype=torch.long),
        "completion_mask": torch.tensor(mask, dtype=torch.long),
        "advantages": t["adv"],
        "old_per_token_logps": t["old"],
        "ref_per_token_logps": t["ref"],
    }
    loss = trl.GRPOTrainer._compute_loss(stub, None, inputs)
    return float(loss), {k: v[-1] for k, v in stub._metrics["train"].items()}


def test_group_advantages():
    rewards = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    got = post.group_advantages(rewards, 3)
    g = rewards.reshape(2, 3)
    want = (g - g.mean(1, keepdims=True)) / (torch.tensor(g).std(1, keepdim=True).numpy() + 1e-4)
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-6)
    assert (got[3:] == 0).all()  # a group of equal rewards teaches nothing
    np.testing.assert_allclose(post.group_advantages(rewards, 3, scale=False),
                               (g - g.mean(1, keepdims=True)).reshape(-1), rtol=1e-6)  # fmt: skip


def _reward(prompts, completions):
    """1 for a completion that starts with its prompt's last token, else 0 (a learnable task)."""
    return [float(bool(c) and c[0] == p[-1]) for p, c in zip(prompts, completions, strict=True)]


def test_rollout_is_reproducible_and_scored(hf_families):
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run)
    prompts = [[5, 6, 7], [9], [3, 4]]
    kw = dict(group_size=2, max_new_tokens=5, reward_fn=_reward, temperature=1.0, top_p=0.95,
              eos_token_id=[3, 8], pad_token_id=0, reference="adapters")  # fmt: skip
    a = post.rollout(model, params, prompts, key=jax.random.key(0), **kw)
    b = post.rollout(model, params, prompts, key=jax.random.key(0), **kw)
    c = post.rollout(model, params, prompts, key=jax.random.key(1), **kw)
    np.testing.assert_array_equal(a.completions, b.completions)
    np.testing.assert_array_equal(a.old_logprobs, b.old_logprobs)
    assert not np.array_equal(a.completions, c.completions)
    # the generated tokens are generate's; the mask runs up to and including the first EOS
    ids, mask = _padded(prompts, 2)
    want = models.generate(model, params, ids, 5, attention_mask=mask, temperature=1.0,
                           top_p=0.95, key=jax.random.key(0), eos_token_id=[3, 8],
                           pad_token_id=0)  # fmt: skip
    np.testing.assert_array_equal(a.completions, np.asarray(want)[:, -5:])
    for row, m in zip(a.completions, a.completion_mask, strict=True):
        hits = np.flatnonzero(np.isin(row, [3, 8]))
        end = hits[0] + 1 if hits.size else 5
        assert m.tolist() == [True] * end + [False] * (5 - end)
    np.testing.assert_allclose(a.rewards, _reward(*_lists(prompts, 2, a)))
    np.testing.assert_allclose(a.advantages, post.group_advantages(a.rewards, 2))
    # old log-probabilities: the batch scored by token_logprobs; the reference: the base model
    jitted = jax.jit(post.token_logprobs, static_argnums=0)
    np.testing.assert_allclose(a.old_logprobs, jitted(model, params, a.batch), rtol=1e-6)
    np.testing.assert_allclose(a.ref_logprobs, jitted(run.model, run.params, a.batch), rtol=2e-6,
                               atol=1e-6)  # fmt: skip
    assert ((a.batch.targets != IGNORE).sum(1) == a.completion_mask.sum(1)).all()
    # text rewards through a decode callable
    seen = []
    post.rollout(model, params, prompts, key=jax.random.key(0),
                 decode=lambda ids: " ".join(map(str, ids)),
                 **{**kw, "reward_fn": lambda p, c: seen.extend(p) or [0.0] * len(p)})  # fmt: skip
    assert seen[:2] == ["5 6 7", "5 6 7"]


def _padded(prompts, group):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts) * group, width), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        for g in range(group):
            ids[i * group + g, width - len(p) :] = p
            mask[i * group + g, width - len(p) :] = 1
    return ids, mask


def _lists(prompts, group, r):
    ps = [p for p in prompts for _ in range(group)]
    cs = [row[m & ~np.isin(row, [3, 8])].tolist() for row, m in
          zip(r.completions, r.completion_mask, strict=True)]  # fmt: skip
    return ps, cs


@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_grpo_step_gradient_is_the_reference_losss(hf_families, importance):
    """With sgd(1) the step's update is minus the gradient: jax.grad of grpo_loss on
    token_logprobs, after one step has moved the policy off the rollout's (ratios != 1)."""
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run)
    r = post.rollout(model, params, [[5, 6, 7], [9, 2]], group_size=3, max_new_tokens=4,
                     reward_fn=lambda p, c: [float(len(set(x))) for x in c],
                     key=jax.random.key(2), reference="adapters")  # fmt: skip
    kw = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, importance=importance)
    opt = optax.sgd(1.0)
    state = model.init_optimizer(opt, params)
    step = post.grpo_step(model, optax.sgd(0.05), aux_weight=0.0, **kw)
    params, _, _ = step(params, state, r.batch, **r.step_inputs())  # off-policy now
    mask = r.batch.targets != IGNORE

    def reference(adapters):
        p = _with(adapters, params)
        lp = post.token_logprobs(model, p, r.batch)
        return post.grpo_loss(lp, r.old_logprobs, r.advantages, mask,
                              ref_logprobs=r.ref_logprobs, **kw)  # fmt: skip

    (want_loss, want_m), want = jax.jit(jax.value_and_grad(reference, has_aux=True))(
        model.trainable(params)
    )
    assert float(want_m["ratio"]) != 1.0
    before = jax.tree.map(np.asarray, params)
    step = post.grpo_step(model, opt, aux_weight=0.0, **kw)
    new, _, m = step(params, state, r.batch, **r.step_inputs())
    np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
    _check_sgd_update(model, before, jax.tree.map(np.asarray, new), want, atol=2e-5)


def test_grpo_on_data_x_expert_equals_one_device(hf_families):
    """The rollout (generate on data 2 x expert 4) and two steps on it equal one device's."""
    run = hf_families.load("qwen3_moe", "1dev")
    prompts = [[5, 6, 7], [9, 2], [1], [4, 4, 4]]
    out = {}
    for mesh_name in ("1dev", "d2e4"):
        model, params = _lora_model(run, mesh_name)
        r = post.rollout(model, params, prompts, group_size=2, max_new_tokens=4,
                         reward_fn=_reward, key=jax.random.key(3), temperature=1.0)  # fmt: skip
        opt = optax.adam(1e-2)
        state = model.init_optimizer(opt, params)
        step = post.grpo_step(model, opt, aggregation="token")
        ms = []
        for _ in range(2):
            params, state, m = step(params, state, r.batch, **r.step_inputs())
            ms.append({k: float(v) for k, v in m.items()})
        out[mesh_name] = (r, ms)
    (a, ma), (b, mb) = out["1dev"], out["d2e4"]
    np.testing.assert_array_equal(a.completions, b.completions)
    np.testing.assert_allclose(a.old_logprobs, b.old_logprobs, rtol=1e-5, atol=1e-6)
    for x, y in zip(ma, mb, strict=True):
        for k in x:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_grpo_refusals(hf_families):
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run)
    kw = dict(max_new_tokens=2, reward_fn=_reward, key=jax.random.key(0))
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        post.rollout(model, params, [[1]], group_size=1, **kw)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty"):
        post.rollout(model, params, [[1], []], group_size=2, **kw)
    with pytest.raises(ValueError, match="reward_fn must return 2 numbers"):
        post.rollout(model, params, [[1]], group_size=2, **{**kw, "reward_fn": lambda p, c: [1.0]})
    with pytest.raises(ValueError, match="reward_fn returned nan for completion 1"):
        post.rollout(model, params, [[1]], group_size=2,
                     **{**kw, "reward_fn": lambda p, c: [1.0, float("nan")]})  # fmt: skip
    with pytest.raises(ValueError, match="rollout: max_new_tokens must be an int >= 1"):
        post.rollout(model, params, [[1]], group_size=2, **{**kw, "max_new_tokens": 0})
    with pytest.raises(ValueError, match="rollout: key is required"):
        post.rollout(model, params, [[1]], group_size=2, **{**kw, "key": None})
    base = models.MoEDecoder(**_settings(run.model))
    with pytest.raises(ConfigError, match="reference must be None, 'adapters'"):
        post.rollout(base, run.params, [[1]], group_size=2, reference="adapters", **kw)
    lp, old, adv, mask, _ = _grpo_inputs(1)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        post.grpo_loss(lp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match=r"advantages must be float \[6\]"):
        post.grpo_loss(lp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="importance must be one of"):
        post.grpo_loss(lp, old, adv, mask, importance="seq")
    with pytest.raises(ValueError, match="epsilon_low must be"):
        post.grpo_step(model, optax.sgd(1.0), epsilon_low=0)
    with pytest.raises(ValueError, match=r"rewards\[1\] is inf"):
        post.group_advantages([0.0, np.inf], 2)


@pytest.mark.parametrize("mesh_name", ["1dev", "d2e4"])
def test_gradient_accumulation_equals_one_pass(hf_families, mesh_name):
    """num_microbatches=2: the DPO step (its in-step reference per microbatch) and the GRPO
    step give the one-pass metrics and parameters (the aux losses left out: per microbatch they
    differ, as the model's own loss's do)."""
    run = hf_families.load("qwen3_moe", "1dev")
    batch = post.preference_batch(*_pairs(12, 8), seq_len=24, row_multiple=16)
    model, params = _lora_model(run, mesh_name)
    r = post.rollout(model, params, [[5, 6, 7], [9, 2], [1], [4, 4, 4]], group_size=4,
                     max_new_tokens=4, reward_fn=_reward, key=jax.random.key(5),
                     reference="adapters")  # fmt: skip
    out = {}
    for m in (1, 2):
        model, params = _lora_model(run, mesh_name, num_microbatches=m)
        opt = optax.adam(1e-2)
        state = model.init_optimizer(opt, params)
        dpo = post.dpo_step(model, opt, beta=0.3, aux_weight=0.0)
        grpo = post.grpo_step(model, opt, beta=0.05, importance="sequence", aux_weight=0.0)
        metrics = []
        for _ in range(2):
            params, state, md = dpo(params, state, batch)
            params, state, mg = grpo(params, state, r.batch, **r.step_inputs())
            metrics.append({**{f"dpo/{k}": float(v) for k, v in md.items()},
                            **{f"grpo/{k}": float(v) for k, v in mg.items()}})  # fmt: skip
        out[m] = metrics, jax.tree.map(np.asarray, model.trainable(params))
    _assert_runs_equal(out[1], out[2])


def test_pairs_straddling_microbatches_are_refused(hf_families):
    run = hf_families.load("qwen3_moe", "1dev")
    model, params = _lora_model(run, num_microbatches=2)
    batch = post.preference_batch(*_pairs(13, 3), seq_len=24, pack=False)  # rows 0-2 | 3-5
    opt = optax.sgd(1e-2)
    step = post.dpo_step(model, opt)
    with pytest.raises(ValueError, match=r"pair 1's chosen and rejected sequences fall in"):
        step(params, model.init_optimizer(opt, params), batch)


def test_grpo_rollout_on_data_x_expert_update_through_the_pipeline(hf_families):
    """Rollout on data 2 x expert 4, updates on pipe 2 x expert 4 (2 microbatches, the 1F1B
    schedule): the metrics and the trained adapters equal the data x expert steps'."""
    run = hf_families.load("qwen3_moe", "1dev")
    flat, params = _lora_model(run, "d2e4")
    r = post.rollout(flat, params, [[5, 6, 7], [9, 2], [1], [4, 4, 4]], group_size=4,
                     max_new_tokens=4, reward_fn=_reward, key=jax.random.key(6),
                     reference="adapters")  # fmt: skip
    out = {}
    for mesh_name, micro in (("d2e4", 1), ("p2e4", 2)):
        model, params = _lora_model(run, mesh_name, num_microbatches=micro)
        opt = optax.adam(1e-2)
        state = model.init_optimizer(opt, params)
        step = post.grpo_step(model, opt, beta=0.05, epsilon_high=0.28)
        metrics = []
        for _ in range(2):
            params, state, m = step(params, state, r.batch, **r.step_inputs())
            metrics.append({k: float(v) for k, v in m.items()})
        out[mesh_name] = metrics, jax.tree.map(np.asarray, model.trainable(params))
    _assert_runs_equal(out["d2e4"], out["p2e4"])
    pipe, _ = _lora_model(run, "p2e4", num_microbatches=2)
    with pytest.raises(ConfigError, match="aux_weight must be 1"):
        post.grpo_step(pipe, optax.sgd(1.0), aux_weight=0.0)


@pytest.mark.parametrize("reference", ["adapters", "given"])
def test_dpo_through_the_pipeline_equals_data_x_expert(hf_families, reference):
    """DPO steps on pipe 2 x expert 4 (2 microbatches, the 1F1B schedule) equal data 2 x
    expert 4's: the reference in the step (adapters disabled) or precomputed."""
    run = hf_families.load("qwen3_moe", "1dev")
    batch = post.preference_batch(*_pairs(14, 8), seq_len=24, row_multiple=16)
    out = {}
    for mesh_name, micro in (("d2e4", 1), ("p2e4", 2)):
        model, params = _lora_model(run, mesh_name, num_microbatches=micro)
        refs = {}
        if reference == "given":
            refs["ref_logprobs"] = post.reference_logprobs(model, params, batch)
        opt = optax.adam(1e-2)
        state = model.init_optimizer(opt, params)
        step = post.dpo_step(model, opt, beta=0.3, loss_type="ipo")
        metrics = []
        for _ in range(2):
            params, state, m = step(params, state, batch, **refs)
            metrics.append({k: float(v) for k, v in m.items()})
        out[mesh_name] = metrics, jax.tree.map(np.asarray, model.trainable(params))
    _assert_runs_equal(out["d2e4"], out["p2e4"])
    if reference == "given":
        pipe, params = _lora_model(run, "p2e4", num_microbatches=2)
        rows = post.preference_batch(*_pairs(14, 8), seq_len=24, pack=False)
        opt = optax.sgd(1.0)
        with pytest.raises(ValueError, match="each pair must lie in one row"):
            post.dpo_step(pipe, opt)(params, pipe.init_optimizer(opt, params), rows)


def test_updates_on_a_context_axis_equal_data_x_expert(hf_families):
    """A rollout on data 2 x expert 4, then GRPO and DPO steps on context 2 x expert 4 (each
    sequence split over 2 devices, ring attention): the metrics and the trained adapters equal
    data 2 x expert 4's."""
    run = hf_families.load("qwen3_moe", "1dev")
    flat, params = _lora_model(run, "d2e4")
    r = post.rollout(flat, params, [[5, 6, 7, 8], [9, 2], [1], [4, 4, 4]], group_size=4,
                     max_new_tokens=5, reward_fn=_reward, key=jax.random.key(7),
                     reference="adapters")  # fmt: skip
    assert r.batch.tokens.shape[1] % 4 == 0
    pairs = post.preference_batch(*_pairs(15, 8), seq_len=24, row_multiple=8)
    out = {}
    for name, mesh in (("flat", fam.mesh("d2e4")),
                       ("context", jax.make_mesh((2, 4), ("context", "expert")))):  # fmt: skip
        model, params = _lora_model(run, "d2e4", mesh=mesh, attention_block=8)
        opt = optax.adam(1e-2)
        state = model.init_optimizer(opt, params)
        grpo = post.grpo_step(model, opt, beta=0.05)
        dpo = post.dpo_step(model, opt, beta=0.3)
        params, state, mg = grpo(params, state, r.batch, **r.step_inputs())
        params, state, md = dpo(params, state, pairs)
        out[name] = ({**{f"grpo/{k}": float(v) for k, v in mg.items()},
                      **{f"dpo/{k}": float(v) for k, v in md.items()}},
                     jax.tree.map(np.asarray, model.trainable(params)))  # fmt: skip
    _assert_runs_equal(([out["flat"][0]], out["flat"][1]), ([out["context"][0]], out["context"][1]))


def test_zero_sharding_equals_zero_0(hf_families):
    """A DPO and a GRPO step with ZeRO-1 and with ZeRO-3 (the base and the adapters sharded
    over the batch axes, gathered per layer) equal ZeRO-0's on data 2 x expert 4."""
    run = hf_families.load("qwen3_moe", "1dev")
    flat, params = _lora_model(run, "d2e4")
    r = post.rollout(flat, params, [[5, 6, 7], [9, 2], [1], [4, 4, 4]], group_size=4,
                     max_new_tokens=4, reward_fn=_reward, key=jax.random.key(8))  # fmt: skip
    pairs = post.preference_batch(*_pairs(16, 8), seq_len=24, row_multiple=8)
    out = {}
    for z in (0, 1, 3):
        model, params = _lora_model(run, "d2e4", zero=z)
        opt = optax.adam(1e-2)
        state = model.init_optimizer(opt, params)
        params, state, mg = post.grpo_step(model, opt)(params, state, r.batch, **r.step_inputs())
        params, state, md = post.dpo_step(model, opt)(params, state, pairs)
        out[z] = ({**{f"grpo/{k}": float(v) for k, v in mg.items()},
                   **{f"dpo/{k}": float(v) for k, v in md.items()}},
                  jax.tree.map(np.asarray, model.trainable(params)))  # fmt: skip
    for zero in (1, 3):
        _assert_runs_equal(([out[0][0]], out[0][1]), ([out[zero][0]], out[zero][1]))
