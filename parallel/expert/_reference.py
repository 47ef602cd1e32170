"""The dense single-device twin of the layer: every expert on every token, masked.

:func:`moe_layer_reference` is the oracle of the tests and the "dense" baseline of the
benchmark; it shares the router, the activations and the shared expert with the layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxops import _checks
from jaxops._errors import ArgumentTypeError, InvalidArgumentError

from ._config import EXPERT_PARAMS, MoEAux, MoEConfig, check_params
from ._ffn import expert_ffn, shared_expert
from ._routing import aux_from_sums, check_token_mask, mask_tokens, route, router_sums

__all__ = ["moe_layer_reference"]


def moe_layer_reference(
    params: dict[str, jax.Array],
    x: jax.Array,
    cfg: MoEConfig,
    *,
    impl: str | None = None,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, MoEAux]:
    """The dense single-device twin of :func:`moe_layer`: every expert on every token, masked.

    Loops over the experts explicitly: ``y += w_e[t] * FFN_e(x[t])`` with ``w_e[t]`` the
    token's routing probability of e if e is among its top-k and the slot is kept (capacity: an
    expert keeps its first C slots in slot order), plus the shared expert if the config has
    one; with cfg.weight_inputs (Llama 4) ``y += FFN_e(w_e[t] * x[t])`` for the tokens whose
    slot of e is kept. ``FFN_e(x) = act(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]`` (biases
    with cfg.expert_bias). With cfg.fp8 each expert's projections are ``jaxops.fp8.linear``
    (the "block" recipe).
    The oracle of the tests and the "dense" baseline of the benchmark (under jit with sharded
    tokens it computes all E experts on every device).

    A `token_mask` has :func:`moe_layer`'s semantics: masked-out tokens are routed to no expert,
    take no capacity (C still comes from the static token count), get a zero output row and no
    gradient, and count in none of the aux values (the losses are means over the unmasked
    tokens; all 0 when there is none).

    Args:
      params: from :func:`init_moe_params`.
      x: ``[..., H]`` float32, bfloat16 or float16 (``H = cfg.hidden_size``).
      cfg: a :class:`MoEConfig` (its mesh axes are ignored).
      impl: with cfg.fp8, "xla" runs ``fp8.linear``'s pure-JAX twin (no jaxops custom call);
        None or "ffi" its default. Without FP8 the twin is plain jnp either way.
      token_mask: None (every token counts) or a bool array of shape ``x.shape[:-1]``, True for
        the tokens that count (an integer array is read as ``!= 0``).

    Returns:
      ``(y, aux)``: y like x, and a :class:`MoEAux`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.parallel.expert import MoEConfig, init_moe_params, moe_layer_reference
      >>> cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=32, expert_ffn=16,
      ...                 dtype=jnp.float32)
      >>> params = init_moe_params(jax.random.key(0), cfg)
      >>> y, aux = moe_layer_reference(params, jnp.ones((3, 32)), cfg)
      >>> y.shape, aux.tokens_per_expert.tolist()
      ((3, 32), [0, 3, 0, 3])
    """
    op = "jaxops.parallel.expert.moe_layer_reference"
    if not isinstance(cfg, MoEConfig):
        raise ArgumentTypeError(f"{op}: cfg must be a MoEConfig, got {type(cfg).__name__}")
    params = check_params(op, params, cfg)
    x = _checks.check_array(op, "x", x, min_rank=1)
    if x.shape[-1] != cfg.hidden_size:
        raise InvalidArgumentError(
            f"{op}: x must have shape (..., H) with H = cfg.hidden_size = {cfg.hidden_size}, "
            f"got {tuple(x.shape)}"
        )
    token_mask = check_token_mask(op, token_mask, x)
    valid = None if token_mask is None else token_mask.reshape(-1)
    tokens = mask_tokens(x.reshape(-1, cfg.hidden_size), valid)
    t, e, k = tokens.shape[0], cfg.num_experts, cfg.top_k
    bias, logit_bias = params.get("router_bias"), params.get("router_logit_bias")
    logits, dist, ids, probs = route(cfg, tokens, params["router"], bias, valid, logit_bias, params)
    slot_expert = ids.reshape(-1)
    onehot = slot_expert[:, None] == jnp.arange(e)[None, :]  # [T*K, E], slot order
    cap = cfg.capacity(t)
    keep = onehot if cap is None else onehot & (jnp.cumsum(onehot, axis=0) <= cap)
    weight = jnp.where(keep, probs.reshape(-1)[:, None], 0.0).reshape(t, k, e).sum(axis=1)
    chosen = jnp.any(keep.reshape(t, k, e), axis=1)  # [T, E]: e holds a kept slot of t
    xs = tokens.astype(cfg.dtype)
    y = jnp.zeros((t, cfg.hidden_size), jnp.float32)
    for i in range(e):
        w_in = params["w_in"][i].astype(cfg.dtype)
        w_out = params["w_out"][i].astype(cfg.dtype)
        biases = (params["b_in"][i], params["b_out"][i]) if cfg.expert_bias else ()
        w = weight[:, i : i + 1]
        if cfg.weight_inputs:
            # The token scaled in float32 and rounded once, as the layer's sent rows are.
            inputs = (xs.astype(jnp.float32) * w).astype(cfg.dtype)
        else:
            inputs = xs
        # Each expert's output is rounded to cfg.dtype, as the layer's grouped GEMM's is.
        adapters = {name: params[name][i] for name in cfg.adapter_names if name in EXPERT_PARAMS}
        out = expert_ffn(cfg, inputs, w_in, w_out, impl, *biases, adapters=adapters)
        out = out.astype(cfg.dtype)
        if cfg.weight_inputs:  # unweighted, where chosen (with biases FFN_e(0) is not 0)
            y = y + jnp.where(chosen[:, i : i + 1], out.astype(jnp.float32), 0.0)
        else:
            y = y + w * out.astype(jnp.float32)
    shared = shared_expert(cfg, params, tokens, impl)
    if shared is not None:
        y = y.astype(cfg.dtype).astype(jnp.float32) + shared
    if valid is not None:
        y = jnp.where(valid[:, None], y, 0)
    counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    dropped = jnp.sum(onehot & ~keep, dtype=jnp.int32)
    num_tokens = t if valid is None else jnp.sum(valid, dtype=jnp.int32)
    aux = aux_from_sums(cfg, counts, *router_sums(logits, dist, valid), dropped, num_tokens)
    return y.astype(x.dtype).reshape(x.shape), aux
