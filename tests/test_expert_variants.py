"""gpt-oss and Llama 4 options of the expert-parallel MoE layer: expert biases, clamped SwiGLU,
learned router logit bias, input-weighted experts. The layer on 8 CPU devices vs its dense twin,
and the dense twin vs float64 numpy oracles written from transformers' formulas."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _numerics import rel_error
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert
from jaxops.parallel.expert import (
    MoEConfig,
    init_moe_params,
    moe_layer,
    moe_layer_reference,
    moe_param_specs,
)

from jaxops import ConfigError
from jaxops.testing import assert_allclose

H = 32  # hidden_size

# name: MoEConfig keywords (8 experts; the mesh is data 2 x expert 4: 2 local experts each).
CASES = {
    "expert_bias": dict(expert_bias=True, top_k=2),
    "clamped_swiglu": dict(
        activation="clamped_swiglu", swiglu_alpha=1.5, swiglu_limit=0.8, top_k=2, shared_ffn=8
    ),
    "router_logit_bias": dict(
        router="sigmoid", router_logit_bias=True, router_bias=True, top_k=2, normalize_topk=True
    ),
    "weight_inputs": dict(weight_inputs=True, top_k=2),
    # gpt-oss: biased experts, clamped SwiGLU, softmax over the top-k biased logits.
    "gpt-oss": dict(
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_limit=1.0,
        router_logit_bias=True,
        router="softmax",
        normalize_topk=True,
        top_k=4,
    ),
    # Llama 4: sigmoid of the chosen logits scales the inputs, plus a shared expert.
    "llama4-top1": dict(
        router="sigmoid", normalize_topk=False, weight_inputs=True, top_k=1, shared_ffn=24
    ),
    "llama4-top2": dict(
        router="sigmoid", normalize_topk=False, weight_inputs=True, top_k=2, shared_ffn=24
    ),
}
# The layer vs the reference: (case, capacity_factor, with a token mask, impl). Each case, the
# combinations also with dropped slots and with padding; one with the permute's pure-JAX twin
# (impl="xla": its probs gradient is JAX's, the custom call's is its own rule).
# The layer runs the combinations (each option alone is in the oracle tests below): gpt-oss has
# expert biases, the clamped SwiGLU and the router logit bias; Llama 4 weight_inputs; and the
# logit bias beside the correction bias.
LAYER_CASES = [
    *((case, None, False, None) for case in ("gpt-oss", "llama4-top2", "router_logit_bias")),
    ("gpt-oss", 0.5, True, None),
    ("llama4-top1", 1.0, False, "xla"),
    ("llama4-top2", None, True, None),
]
# Valid tokens per row of the [8, 4] batch (rows 2 and 6 all padding).
LENGTHS = np.array([4, 3, 0, 2, 4, 1, 0, 3])


def _config(case: str, **kw) -> MoEConfig:
    base = dict(num_experts=8, hidden_size=H, expert_ffn=16, dtype=jnp.float32, align=4)
    return MoEConfig(**{**base, **CASES[case], **kw})


def _mesh():
    return jax.make_mesh((2, 4), ("data", "expert"))


def _params(cfg: MoEConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Random float32 params: weights scaled by 1 / sqrt(fan_in), biases large enough to matter."""
    rng = np.random.default_rng(seed)
    scales = {"b_in": 0.5, "b_out": 0.5, "router_bias": 0.2, "router_logit_bias": 1.0}
    out = {}
    for name, shape in cfg.param_shapes.items():
        scale = scales.get(name, shape[-2] ** -0.5 if len(shape) > 1 else 1.0)
        out[name] = jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
    return out


def _x(seed: int = 1, batch: int = 8, seq: int = 4) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, seq, H)), jnp.float32)


def _mask() -> jax.Array:
    return jnp.asarray(np.arange(4)[None, :] < LENGTHS[:, None])


def _weights(shape):
    return jnp.sin(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.37)


def _value_and_grads(layer, params, x, with_aux: bool = True):
    """((y, aux), (d params, d x)) of ``sum(y * weights) (+ aux.loss)``, one compiled call."""

    def loss(p, x):
        y, aux = layer(p, x)
        value = jnp.sum(y.astype(jnp.float32) * _weights(y.shape))
        return value + (aux.loss if with_aux else 0.0), (y, aux)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, grads


def _compare(got, want, dtype=jnp.float32, scale=1.0):
    (y, aux), (grads, dx) = got
    (y_ref, aux_ref), (grads_ref, dx_ref) = want
    assert_allclose(y, y_ref, dtype, scale=scale, err_msg="y")
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)
    assert int(aux.dropped) == int(aux_ref.dropped)
    for name in ("loss", "load_balancing_loss", "z_loss"):
        assert_allclose(getattr(aux, name), getattr(aux_ref, name), jnp.float32, err_msg=name)
    assert set(grads) == set(grads_ref)
    for name in grads:
        assert_allclose(grads[name], grads_ref[name], dtype, scale=4 * scale, err_msg=name)
    assert_allclose(dx, dx_ref, dtype, scale=4 * scale, err_msg="dx")


def _sharded(mesh, cfg, params, x, specs=None):
    """params on `specs` (default moe_param_specs) and x on the token axes: shard_map's inputs."""
    specs = moe_param_specs(cfg) if specs is None else specs
    placed = {k: jax.device_put(v, jax.NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return placed, jax.device_put(x, jax.NamedSharding(mesh, P(cfg.token_axes)))


def _layer(cfg, mesh, impl=None, token_mask=None):
    return lambda p, x: moe_layer(p, x, cfg, mesh=mesh, impl=impl, token_mask=token_mask)


def _reference(cfg, token_mask=None):
    return lambda p, x: moe_layer_reference(p, x, cfg, token_mask=token_mask)


# -------------------------------------------------------------------------------------------------
# float64 numpy oracle, from transformers' GptOssMLP / Llama4TextMoe and the Mixtral /
# DeepSeek-V3 routers (a loop over tokens and their experts).


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _np_act(cfg: MoEConfig, h: np.ndarray, stats: dict | None = None) -> np.ndarray:
    if cfg.activation == "clamped_swiglu":  # GptOssExperts._apply_gate
        gate, up = h[..., ::2], h[..., 1::2]
        if stats is not None:
            stats["clamped"] = stats.get("clamped", 0) + int(
                (gate > cfg.swiglu_limit).sum() + (np.abs(up) > cfg.swiglu_limit).sum()
            )
        gate = np.minimum(gate, cfg.swiglu_limit)
        up = np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        glu = gate * _sigmoid(gate * cfg.swiglu_alpha)
        return (up + 1) * glu
    gate, up = np.split(h, 2, axis=-1)
    return gate * _sigmoid(gate) * up


def _np_route(cfg: MoEConfig, p: dict, tokens: np.ndarray):
    """(ids [T, K], weights [T, K]) in float64."""
    logits = tokens @ p["router"]
    if cfg.router_logit_bias:  # GptOssTopKRouter: F.linear(x, weight, bias)
        logits = logits + p["router_logit_bias"]
    k = cfg.top_k
    if cfg.router_bias:  # DeepSeek-V3: the correction bias picks, the raw scores weigh
        if cfg.router == "sigmoid":
            scores = _sigmoid(logits)
        else:
            scores = np.exp(logits - logits.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
        choice = scores + p["router_bias"]
    else:  # gpt-oss and Llama 4: torch.topk of the logits
        choice = logits
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, -1)
    if cfg.router == "softmax" and cfg.normalize_topk:
        # gpt-oss: the softmax over the top-k logits (Mixtral: softmax, then renormalized).
        w = np.exp(top - top.max(-1, keepdims=True))
        return ids, w / w.sum(-1, keepdims=True)
    if cfg.router == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        return ids, np.take_along_axis(z / z.sum(-1, keepdims=True), ids, -1)
    w = _sigmoid(top)  # Llama4Router: sigmoid of the chosen logits
    return ids, w / w.sum(-1, keepdims=True) if cfg.normalize_topk else w


def _np_moe(cfg: MoEConfig, params, x, mask=None, stats: dict | None = None) -> np.ndarray:
    """The layer's y in float64, token by token; masked-out tokens give 0."""
    p = {name: np.asarray(v, np.float64) for name, v in params.items()}
    tokens = np.asarray(x, np.float64).reshape(-1, H)
    valid = np.ones(len(tokens), bool) if mask is None else np.asarray(mask).reshape(-1)
    ids, w = _np_route(cfg, p, tokens)
    y = np.zeros_like(tokens)
    for t in np.flatnonzero(valid):
        for j in range(cfg.top_k):
            e = ids[t, j]
            if cfg.weight_inputs:  # Llama4TextMoe: routed_in = x * router_scores
                h = (tokens[t] * w[t, j]) @ p["w_in"][e]
            else:
                h = tokens[t] @ p["w_in"][e]
            if cfg.expert_bias:  # gate_up_proj_bias
                h = h + p["b_in"][e]
            out = _np_act(cfg, h, stats) @ p["w_out"][e]
            if cfg.expert_bias:  # down_proj_bias
                out = out + p["b_out"][e]
            y[t] += out if cfg.weight_inputs else w[t, j] * out
        if cfg.shared_ffn:  # on the unscaled token
            y[t] += _np_act(cfg, tokens[t] @ p["shared_w_in"]) @ p["shared_w_out"]
    return y.reshape(np.shape(x))


# -------------------------------------------------------------------------------------------------
# The router: gpt-oss's softmax over the top-k logits, the learned logit bias.


def test_softmax_normalized_topk_is_softmax_of_the_topk_logits():
    cfg = _config("gpt-oss")
    params = _params(cfg)
    tokens = np.asarray(_x(3), np.float64).reshape(-1, H)
    _, _, ids, probs = expert._router(
        cfg, jnp.asarray(tokens), params["router"], logit_bias=params["router_logit_bias"]
    )
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    logits = tokens @ p["router"] + p["router_logit_bias"]
    want_ids = np.argsort(-logits, axis=-1, kind="stable")[:, :4]  # torch.topk of the logits
    top = np.take_along_axis(logits, want_ids, -1)
    want = np.exp(top) / np.exp(top).sum(-1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    assert_allclose(probs, want, jnp.float32)
    # The bias decides: without it other experts are chosen.
    free = np.argsort(-(tokens @ p["router"]), axis=-1, kind="stable")[:, :4]
    assert (np.sort(free, -1) != np.sort(want_ids, -1)).any()


def test_router_logit_bias_has_a_gradient_and_the_correction_bias_none():
    cfg = _config("router_logit_bias")
    params = _params(cfg)
    tokens = _x(4).reshape(-1, H)

    def f(logit_bias, bias):
        logits, _, _, top = expert._router(cfg, tokens, params["router"], bias, None, logit_bias)
        return jnp.sum(top * jnp.arange(1.0, 3.0)) + jnp.sum(logits**2) * 1e-3

    g_logit, g_bias = jax.grad(f, argnums=(0, 1))(
        params["router_logit_bias"], params["router_bias"]
    )
    assert np.asarray(g_logit).all() and not np.asarray(g_bias).any()


# -------------------------------------------------------------------------------------------------
# (a) The layer on 8 devices vs the dense reference: values and every gradient.


def _case_id(case) -> str:
    name, capacity, masked, impl = case
    name += f"-capacity{capacity}" if capacity else ""
    return name + ("-masked" if masked else "") + (f"-{impl}" if impl else "")


@pytest.mark.parametrize("case", LAYER_CASES, ids=_case_id)
def test_layer_matches_reference(case):
    """(a) Values and the gradients of every param and x; with weight_inputs the router's
    gradient comes through the scaled rows (the oracle test below checks the reference's)."""
    name, capacity, masked, impl = case
    cfg = _config(name, capacity_factor=capacity)
    params, x = _params(cfg), _x()
    mask = _mask() if masked else None
    if masked:  # (c) padded batches: garbage in the padding must not leak
        x = jnp.where(mask[..., None], x, jnp.nan)
    got = _value_and_grads(_layer(cfg, _mesh(), impl, token_mask=mask), params, x)
    want = _value_and_grads(_reference(cfg, token_mask=mask), params, x)
    _compare(got, want)
    (y, aux), (grads, dx) = got
    for param, g in grads.items():
        if param == "router_bias":
            assert not np.asarray(g).any(), "the correction bias must get no gradient"
        else:
            assert np.isfinite(g).all() and np.asarray(g).any(), param
    if cfg.capacity_factor is not None:
        assert int(aux.dropped) > 0, "the capacity case must drop slots"
    if masked:
        keep = np.asarray(mask)
        np.testing.assert_array_equal(np.asarray(y)[~keep], 0.0)
        np.testing.assert_array_equal(np.asarray(dx)[~keep], 0.0)
        assert int(aux.tokens_per_expert.sum()) == int(LENGTHS.sum()) * cfg.top_k


def test_grouped_ffn_biases_ragged_dot_and_tile_loop_agree():
    """The GPU path (jax.lax.ragged_dot, tile 0) and the CPU tile loop, biases included; the
    padding rows (after each group's used rows) take no bias: their output stays zero and, even
    with a nonzero cotangent there, they add nothing to the biases' gradients."""
    from jaxops.parallel.expert import _ffn

    cfg = _config("gpt-oss")
    params = _params(cfg, 14)
    b_in, b_out = params["b_in"][:2], params["b_out"][:2]
    group_sizes, used = jnp.array([32, 64], jnp.int32), jnp.array([20, 50], jnp.int32)
    r = np.arange(128)
    in_use = (r < 20) | ((r >= 32) & (r < 82))
    rows = jnp.asarray(np.random.default_rng(15).normal(size=(128, H)) * in_use[:, None])
    rows = rows.astype(jnp.float32)

    def run(tile):
        def f(rows, b_in, b_out):
            out = _ffn.grouped_ffn(
                cfg, tile, None, rows, params["w_in"][:2], params["w_out"][:2], group_sizes,
                b_in, b_out, used,
            )  # fmt: skip
            return jnp.sum(out * _weights(out.shape)), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(rows, b_in, b_out)

    (_, out), grads = run(0)
    (_, out32), grads32 = run(32)
    assert_allclose(out, out32, jnp.float32, err_msg="out")
    for g, g32, name in zip(grads, grads32, ("rows", "b_in", "b_out"), strict=True):
        assert_allclose(g, g32, jnp.float32, err_msg=name)
    np.testing.assert_array_equal(np.asarray(out)[~in_use], 0.0)
    # Each expert's b_out gradient is the sum of its used rows' output weights.
    w = np.asarray(_weights(out.shape))
    np.testing.assert_allclose(grads[2][0], w[:20].sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[2][1], w[32:82].sum(0), rtol=1e-5, atol=1e-5)


def test_gpt_oss_layer_inside_shard_map():
    """The pipeline-stage path: params are this device's shards (b_in, b_out: [E / N, ...])."""
    cfg = _config("gpt-oss")
    params, x = _params(cfg), _x()
    mesh, specs, tok = _mesh(), moe_param_specs(cfg), P(cfg.token_axes)
    assert specs["b_in"] == specs["b_out"] == P("expert") and specs["router_logit_bias"] == P()
    aux_specs = expert.MoEAux(P(), P(), P(), P(), P())
    layer = jax.shard_map(
        lambda p, x: moe_layer(p, x, cfg, mesh=mesh),
        mesh=mesh,
        in_specs=(specs, tok),
        out_specs=(tok, aux_specs),
    )
    y, aux = jax.jit(layer)(*_sharded(mesh, cfg, params, x))
    y_ref, aux_ref = jax.jit(_reference(cfg))(params, x)
    assert_allclose(y, y_ref, jnp.float32, err_msg="y")
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_ref.tokens_per_expert)


def test_gpt_oss_fp8_block():
    """Biases after the FP8 GEMMs: the layer's forward and its biases' gradients are the FP8
    reference's; all within FP8's bound of float32. (gpt-oss's limit 7: with a clamp that bites,
    FP8 error moves elements across it and the w_in gradients of both FP8 paths, layer and
    reference alike, drift to ~0.16 of float32's.)"""
    cfg = _config("gpt-oss", hidden_size=256, expert_ffn=128, fp8="block", swiglu_limit=7.0)
    params = _params(cfg, 7)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(8, 4, 256)), jnp.float32)
    (y, _), (grads, _) = _value_and_grads(_layer(cfg, _mesh()), params, x)
    (y8, _), (grads8, _) = _value_and_grads(_reference(cfg), params, x)
    y32, _ = jax.jit(_reference(dataclasses.replace(cfg, fp8=None)))(params, x)

    assert rel_error(y, y8) < 5e-5
    assert 1e-3 < rel_error(y, y32) < 0.1
    for name in ("b_in", "b_out", "router", "router_logit_bias"):
        assert rel_error(grads[name], grads8[name]) < 1e-5, name
    for name in ("w_in", "w_out"):  # the wgrads quantize their operands in other groups
        assert rel_error(grads[name], grads8[name]) < 0.06, name


# -------------------------------------------------------------------------------------------------
# (b) The reference vs the float64 oracle: values, and gradients by central differences.


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_float64_oracle(case):
    cfg = _config(case)
    params, x = _params(cfg), _x()
    y, _ = jax.jit(_reference(cfg))(params, x)
    stats = {}
    assert_allclose(y, _np_moe(cfg, params, x, stats=stats), jnp.float32, scale=2)
    if cfg.activation == "clamped_swiglu":  # the clamps must have bitten
        assert stats["clamped"] > 50, stats


# The parameters whose gradients are checked against the oracle's central differences (the
# router's: through the weights, or with weight_inputs through the scaled inputs).
FD_PARAMS = ("b_in", "b_out", "router_logit_bias", "router", "w_in")


@pytest.mark.parametrize("case", ["gpt-oss", "llama4-top2", "router_logit_bias"])
def test_reference_gradients_match_float64_oracle(case):
    """<grad, d> of the reference = the oracle's central difference along a random d."""
    cfg = _config(case)
    params, x = _params(cfg, 9), _x(10)
    weights = np.asarray(_weights(x.shape), np.float64)
    _, (grads, _) = _value_and_grads(_reference(cfg), params, x, with_aux=False)
    rng = np.random.default_rng(11)
    p64 = {name: np.asarray(v, np.float64) for name, v in params.items()}
    eps = 1e-5
    for name in (n for n in FD_PARAMS if n in params):
        d = rng.normal(size=p64[name].shape)

        def loss(sign, name=name, d=d):
            return np.sum(_np_moe(cfg, {**p64, name: p64[name] + sign * eps * d}, x) * weights)

        fd = (loss(1) - loss(-1)) / (2 * eps)
        got = float(np.sum(np.asarray(grads[name], np.float64) * d))
        np.testing.assert_allclose(got, fd, rtol=2e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("case", ["gpt-oss", "llama4-top2"])
def test_masked_reference_matches_float64_oracle(case):
    """(c) The reference with a token mask: the oracle on the valid tokens, 0 elsewhere."""
    cfg = _config(case)
    params, x, mask = _params(cfg, 12), _x(13), _mask()
    y, _ = jax.jit(_reference(cfg, token_mask=mask))(params, jnp.where(mask[..., None], x, jnp.nan))
    assert_allclose(y, _np_moe(cfg, params, x, mask), jnp.float32, scale=2)


# -------------------------------------------------------------------------------------------------
# Parameters and bad input.


def test_params_shapes_specs_and_init():
    cfg = _config("gpt-oss")
    assert cfg.w_in_width == 32 and cfg.swiglu_alpha == 1.702 and cfg.swiglu_limit == 1.0
    assert cfg.param_shapes == {
        "router": (H, 8),
        "w_in": (8, H, 32),
        "w_out": (8, 16, H),
        "b_in": (8, 32),
        "b_out": (8, H),
        "router_logit_bias": (8,),
    }
    params = init_moe_params(jax.random.key(0), cfg)
    for name in ("b_in", "b_out", "router_logit_bias"):
        assert params[name].dtype == jnp.float32 and not np.asarray(params[name]).any(), name
    # The other params are those of the config without the new options.
    plain = init_moe_params(jax.random.key(0), _config("gpt-oss", expert_bias=False))
    np.testing.assert_array_equal(params["w_in"], plain["w_in"])
    llama = _config("llama4-top1")
    assert llama.param_shapes["shared_w_in"] == (H, 48)
    assert "b_in" not in llama.param_shapes and "router_logit_bias" not in llama.param_shapes
    shared = _config("clamped_swiglu")
    assert shared.param_shapes["shared_w_in"] == (H, 16)  # gate and up: 2 * shared_ffn
    # Hashable, equal configs equal: one jit cache entry.
    assert hash(cfg) == hash(_config("gpt-oss")) and cfg != _config("gpt-oss", swiglu_limit=7)
    assert "clamped_swiglu" in expert.FFN_ACTIVATIONS
    defaults = MoEConfig(num_experts=8, top_k=2, hidden_size=H, expert_ffn=16)
    assert not (defaults.expert_bias or defaults.router_logit_bias or defaults.weight_inputs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"swiglu_limit": 0.0}, ConfigError, "swiglu_limit must be finite and > 0, got 0.0"),
        ({"swiglu_limit": -1.0}, ConfigError, "swiglu_limit must be finite and > 0, got -1.0"),
        ({"swiglu_limit": float("inf")}, ConfigError, "swiglu_limit must be finite and > 0"),
        ({"swiglu_alpha": float("nan")}, ConfigError, "swiglu_alpha must be finite and > 0"),
        ({"swiglu_alpha": 0}, ConfigError, "swiglu_alpha must be finite and > 0, got 0"),
        ({"swiglu_alpha": "1.7"}, TypeError, "swiglu_alpha must be a float, got str"),
        ({"expert_bias": 1}, TypeError, "expert_bias must be a bool, got int"),
        ({"router_logit_bias": "yes"}, TypeError, "router_logit_bias must be a bool"),
        ({"weight_inputs": None}, TypeError, "weight_inputs must be a bool"),
        (
            {"weight_inputs": True, "fp8": "block", "dispatch": "fp8"},
            ConfigError,
            "weight_inputs=True .*dispatch='fp8'",
        ),
        ({"activation": "clamped_gelu"}, ConfigError, "activation must be one of"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else "",
)
def test_bad_config(kwargs, error, match):
    with pytest.raises(error, match=f"^jaxops.parallel.expert.MoEConfig: .*{match}"):
        _config("gpt-oss", **kwargs)


def test_bad_bias_params():
    cfg = _config("gpt-oss")
    params, x, mesh = _params(cfg), _x(), _mesh()
    layer = r"^jaxops\.parallel\.expert\.moe_layer: "
    ref = r"^jaxops\.parallel\.expert\.moe_layer_reference: "
    bad = {**params, "b_in": params["b_in"][:, :16]}
    with pytest.raises(ValueError, match=layer + r"params\['b_in'\] must have shape \(8, 32\)"):
        moe_layer(bad, x, cfg, mesh=mesh)
    with pytest.raises(ValueError, match=ref + r"params\['b_in'\] must have shape \(8, 32\)"):
        moe_layer_reference(bad, x, cfg)
    missing = {k: v for k, v in params.items() if k != "b_out"}
    with pytest.raises(ValueError, match=layer + r"params must be a dict with keys \['b_in', "):
        moe_layer(missing, x, cfg, mesh=mesh)
    extra = {**params, "router_bias": jnp.zeros(8)}
    with pytest.raises(ValueError, match=ref + r"params must be a dict with keys"):
        moe_layer_reference(extra, x, cfg)
    # Inside a shard_map: this device's shard, 2 of the 8 experts.
    specs, tok = {**moe_param_specs(cfg), "b_in": P()}, P(cfg.token_axes)
    sharded = jax.shard_map(
        lambda p, x: moe_layer(p, x, cfg, mesh=mesh)[0],
        mesh=mesh,
        in_specs=(specs, tok),
        out_specs=tok,
    )
    with pytest.raises(
        ValueError,
        match=layer + r"inside a shard_map .*params\['b_in'\] must be this device's "
        r"shard of shape \(2, 32\) .*got \(8, 32\)",
    ):
        sharded(*_sharded(mesh, cfg, params, x, specs))
