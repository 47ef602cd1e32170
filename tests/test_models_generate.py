"""jaxops.models.generate: greedy decoding equals transformers' generate token for token with a
sliding window on 8 devices (Mixtral, data x expert; every family's greedy decoding of left-padded
prompts on 1 device is in tests/test_models_families.py), sampling (reproducible, transformers'
top-k / top-p sets), EOS padding, one trace of the decode step, and the argument errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _hf_families import hf_generate, hf_model  # noqa: E402
from jaxops.models import _decoding, _generate, generate  # noqa: E402

from jaxops import models  # noqa: E402

S, N = 8, 10  # prompt length, new tokens


def _hf_model(family: str, **config):
    """hf_model(family) with larger layer weights (varied tokens, not the input repeated) and
    `config` changes (the same weights)."""
    model = hf_model(family)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if ".layers." in key and "norm" not in key and not key.endswith(".bias"):
                p.mul_(5.0)
    if config:
        model.config.update(config)
        weights = model.state_dict()
        model = type(model)(model.config).eval()
        model.load_state_dict(weights)
    model.generation_config.eos_token_id = None  # run max_new_tokens
    return model


def _prompt(batch: int, pads: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded int32 prompts [batch, S] (padding id 0) and their 0/1 attention mask."""
    prompt = np.random.default_rng(seed).integers(1, 128, (batch, S)).astype(np.int32)
    mask = (np.arange(S)[None, :] >= np.asarray(pads)[:, None]).astype(np.int32)
    return prompt * mask, mask


def _hf_generate(model, prompt, mask, n=N) -> np.ndarray:
    return hf_generate(model, prompt, mask, n)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _load(path, shape=(1,), names=("expert",)):
    return models.from_pretrained(path, mesh=_mesh(shape, names), dtype=jnp.float32)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """name -> (transformers model, its directory): Mixtral, and Mixtral with a window."""
    root = tmp_path_factory.mktemp("gen")
    out = {"mixtral": _hf_model("mixtral")}
    out["window"] = _hf_model("mixtral", sliding_window=6)
    for name, model in out.items():
        model.save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


@pytest.fixture(scope="module")
def mixtral(hf):
    return _load(hf["mixtral"][1])


@pytest.fixture(scope="module")
def mixtral_greedy(mixtral):
    """The module's first greedy generation, twice, counting the traces of the decode step."""
    model, params = mixtral
    calls = {"decode": 0}
    layer = _decoding.layer

    def counting(model, key, moe, where, keys, keep, static, h, xs):
        calls["decode"] += xs[1] is not None
        return layer(model, key, moe, where, keys, keep, static, h, xs)

    prompt, mask = _prompt(2, [0, 3])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_decoding, "layer", counting)
        out = generate(model, params, prompt, N, attention_mask=mask)
        traces = calls["decode"]
        again = generate(model, params, (prompt + 1) * mask, N, attention_mask=mask)
    return np.asarray(out), traces, calls["decode"], again


# -------------------------------------------------------------------------------------------------
# Greedy decoding equals transformers' for every family: tests/test_models_families.py.


def test_decode_step_is_traced_once(mixtral_greedy):
    """10 new tokens: one trace of the decode step; the same shapes again: none."""
    _, traces, after_second_call, again = mixtral_greedy
    assert traces == 1 and after_second_call == 1 and again.shape == (2, S + N)


def test_sliding_window_matches_transformers_on_8_devices(hf):
    """Mixtral with window 6 < prompt 8 + 10 new tokens (the prefill's window mask, the ring
    buffer of 6 slots), batch 8 with 0..7 padding tokens, on a data x expert mesh."""
    torch_model, path = hf["window"]
    model, params = _load(path, (2, 4), ("data", "expert"))
    assert model.config.attention.sliding_window == 6
    prompt, mask = _prompt(8, list(range(8)), seed=1)
    got = generate(model, params, prompt, N, attention_mask=mask)
    assert got.sharding.spec[0] == ("data", "expert")
    got = np.asarray(got)
    np.testing.assert_array_equal(got, _hf_generate(torch_model, prompt, mask))
    # The window matters: the same weights without it generate other tokens.
    unwindowed = hf["mixtral"][0]
    assert all(
        torch.equal(a, b)
        for a, b in zip(unwindowed.parameters(), torch_model.parameters(), strict=True)
    )
    assert (got != _hf_generate(unwindowed, prompt, mask)).any()


# -------------------------------------------------------------------------------------------------
# Sampling and EOS.


def test_sampling_is_reproducible_and_top_k_1_is_greedy(mixtral, mixtral_greedy):
    model, params = mixtral
    prompt, mask = _prompt(2, [0, 3])
    greedy = mixtral_greedy[0]

    def sample(seed, **kw):
        kw = {"temperature": 2.0, "top_k": 50, "top_p": 0.95, **kw}
        out = generate(
            model, params, prompt, N, attention_mask=mask, key=jax.random.key(seed), **kw
        )
        return np.asarray(out)

    a = sample(1)
    np.testing.assert_array_equal(a, sample(1))
    assert (a != sample(2)).any() and (a[:, :S] == prompt).all()
    np.testing.assert_array_equal(sample(3, top_k=1), greedy)
    np.testing.assert_array_equal(sample(4, top_p=1e-6), greedy)


_draw = jax.jit(jax.vmap(_decoding.choose, in_axes=(None, None, 0)))  # one compile


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.6), (8, 0.5), (None, None)])
def test_sampled_tokens_are_transformers_top_k_top_p_set(top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(1, 32)).astype(np.float32) * 2
    warpers = [transformers.TemperatureLogitsWarper(0.7)]
    if top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    scores = torch.tensor(logits)
    for w in warpers:
        scores = w(None, scores)
    probs = torch.softmax(scores, -1).numpy()[0]
    s = _generate._sampling(32, 0.7, top_k, top_p, jax.random.key(0), None, None)
    got = set(np.unique(_draw(s, logits, jax.random.split(jax.random.key(0), 3000))))
    assert got <= set(np.flatnonzero(probs > 0))  # only the tokens transformers keeps
    assert set(np.flatnonzero(probs > 0.003)) <= got  # and every likely one of them
    # the warped logits (what speculative sampling compares): transformers' kept set exactly
    kept = np.isfinite(np.asarray(_decoding.warped(s, logits)))[0]
    np.testing.assert_array_equal(kept, probs > 0)


def test_eos_pads_finished_rows_and_stops(mixtral, mixtral_greedy):
    model, params = mixtral
    prompt, mask = _prompt(2, [0, 3])
    greedy = mixtral_greedy[0][:, S:]

    def after_eos(eos, pad):  # transformers' rule: the EOS token, then pad_token_id
        want = greedy.copy()
        for row in want:
            hits = np.flatnonzero(np.isin(row, eos))
            if hits.size:
                row[hits[0] + 1 :] = pad
        return want

    eos = int(greedy[0, 2])
    got = generate(model, params, prompt, N, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(got)[:, S:], after_eos([eos], 0))
    assert (np.asarray(got)[0, S + 3 :] == 0).all()
    # Both rows finish (the loop stops early); the pad defaults to the first EOS id.
    eos2 = [eos, int(greedy[1, 1])]
    got = generate(model, params, prompt, N, attention_mask=mask, eos_token_id=eos2)
    np.testing.assert_array_equal(np.asarray(got)[:, S:], after_eos(eos2, eos))


# -------------------------------------------------------------------------------------------------
# Errors.


_BAD = {  # id: (changed arguments, exception, message after "jaxops.models.generate: ")
    "dtype": (dict(prompt=np.zeros((2, 4), np.float32)), TypeError, "prompt must have dtype int32"),
    "rank": (dict(prompt=np.zeros((2,), np.int32)), ValueError, "prompt must have rank >= 2"),
    "ids": (
        dict(prompt=np.full((2, 4), 128)),
        ValueError,
        r"prompt token ids must be in \[0, 128\)",
    ),
    "new-tokens": (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1, got 0"),
    "new-tokens-type": (dict(max_new_tokens=2.0), TypeError, "max_new_tokens must be an int"),
    "temperature": (dict(temperature=-1.0), ValueError, "temperature must be finite and >= 0"),
    "key": (dict(temperature=1.0), ValueError, "key is required when temperature > 0"),
    "top-k": (dict(top_k=0), ValueError, "top_k must be >= 1, got 0"),
    "top-p": (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    "top-p-big": (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    "mask-shape": (
        dict(attention_mask=np.ones((2, 3))),
        ValueError,
        r"attention_mask must have the prompt's shape \(2, 4\), got \(2, 3\)",
    ),
    "mask-values": (
        dict(attention_mask=np.full((2, 4), 2)),
        ValueError,
        "attention_mask must hold 0",
    ),
    "right-padding": (
        dict(attention_mask=np.array([[1, 1, 0, 0]] * 2)),
        ValueError,
        "attention_mask must be left-padded",
    ),
    "empty-row": (dict(attention_mask=np.zeros((2, 4), int)), ValueError, "attention_mask row 0"),
    "eos": (dict(eos_token_id=-2), ValueError, "eos_token_id must be >= 0"),
    "speculative": (
        dict(speculative="eagle"),
        ValueError,
        "speculative must be None or 'mtp', got 'eagle'",
    ),
    "speculative-no-mtp": (
        dict(speculative="mtp"),
        models.ConfigError,
        r"speculative='mtp' needs the model's multi-token prediction modules .*mtp_layers=0",
    ),
}


@pytest.mark.parametrize("change,error,match", list(_BAD.values()), ids=list(_BAD))
def test_bad_arguments_are_named(mixtral, change, error, match):
    model, params = mixtral
    kw = {"prompt": np.ones((2, 4), np.int32), "max_new_tokens": 3, **change}
    with pytest.raises(error, match="^jaxops.models.generate: " + match):
        generate(model, params, kw.pop("prompt"), kw.pop("max_new_tokens"), **kw)


def test_pipeline_mesh_and_batch_layout_are_refused():
    attention = models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8)
    moe = models.MoESpec(num_experts=4, top_k=2, expert_ffn=16)
    cfg = models.DecoderConfig("mixtral", 64, 32, 2, attention, moe)
    piped = models.MoEDecoder(cfg, _mesh((2, 4), ("pipe", "expert")))
    with pytest.raises(models.ConfigError, match="needs a mesh without pipeline stages"):
        generate(piped, None, np.ones((8, 4), np.int32), 2)
    data = models.MoEDecoder(cfg, _mesh((2, 4), ("data", "expert")))
    with pytest.raises(TypeError, match=r"call generate outside jax\.jit"):
        jax.jit(lambda p: generate(data, None, p, 2))(np.ones((8, 4), np.int32))
    with pytest.raises(ValueError, match=r"prompt's batch \(2\) must be a multiple of 8"):
        generate(data, None, np.ones((2, 4), np.int32), 2)
