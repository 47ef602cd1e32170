"""Expert-parallel MoE layer in ``shard_map``: router, permute, exchange, grouped FFN, combine.

One jitted layer over a mesh with an expert axis (and optional data axes). The token batch is
sharded over ``(*data_axes, expert_axis)``; expert weights are sharded over the expert axis
(device j of the expert axis holds experts ``j * L .. (j + 1) * L - 1``, ``L = E / N``) and
replicated over the data axes. On every device::

    router (fp32 logits, top-k)          [T, H] -> expert_ids, probs [T, K]
                                         (softmax or sigmoid scores, correction bias,
                                          group-limited choice, scaling: Mixtral,
                                          Qwen-MoE, DeepSeek-V3)
    jaxops.moe.permute                   tokens grouped by expert          [T*K, H]
    exchange along the expert axis       each expert's rows to its device  [R_recv, H]
    grouped FFN (one grouped GEMM)       every local expert at once        [R_recv, H]
    exchange back                        rows to the devices they came from
    jaxops.moe.unpermute(probs)          weighted sum per token            [T, H]
    + shared expert (optional)           dense FFN on every token, gated or not

The exchange needs no host synchronization: one all-gather of the ``[E]`` int32 row counts along
the expert axis gives every device every offset. Each device then sends, per local expert of each
peer, one slice, and the receiver's buffer comes out already grouped by local expert (expert l's
rows from sender 0, then sender 1, ..., zero-padded to a multiple of ``align``): no second sort
before the grouped GEMM. On GPU the exchange is ``jax.lax.ragged_all_to_all``; XLA:CPU has no
ragged all-to-all, so there :func:`_ragged_all_to_all_dense` reproduces its exact semantics with a
dense ``all_to_all`` of per-destination chunks plus a scatter. One function picks by platform.
The grouped GEMM is ``jax.lax.ragged_dot`` on GPU; XLA:CPU's ragged_dot computes every group for
every row (L times the work), so there groups are padded to 32-row tiles (``align`` becomes
``lcm(align, 32)``) and a loop runs one GEMM per tile in use.

Buffer sizes are static and never overflow (``Tl`` tokens per device, N devices on the expert
axis, L local experts; top-k experts of a token are distinct, so a token sends at most
``min(K, L)`` rows to one device)::

    chunk  = Tl * min(K, L)                               rows one device sends another (bound)
    R_recv = N * chunk + L * (align - 1)                  rows one device receives (dropless)
    with a capacity C:  chunk <= L * min(C, Tl),  R_recv <= L * round_up(min(C, N * Tl), align)

Capacity (``capacity_factor``): ``C = ceil(capacity_factor * T * K / E)`` for the global batch of
T tokens, and expert e keeps its first C slots in global slot order ``t * K + k`` -- exactly the
slots a single device (``jaxops.moe.permute(..., capacity=C)``) keeps, whatever the mesh. The
per-device prefix counts come from one more all-gather of ``[E]`` int32 over the token axes.
Dropped slots contribute zero to their token's output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxops import _checks
from jaxops import moe as _moe
from jaxops._fp8 import QuantizedArray, dequantize, quantize, quantize_split_transpose
from jaxops._fp8.scales import GRAD_AMAX_FLOOR
from jaxops._moe import unpermute_rows
from jaxops._rows import round_up, take_rows
from jaxops._sharding import cotangent_like, place, vary_like

__all__ = [
    "ACTIVATIONS",
    "DISPATCHES",
    "EXCHANGES",
    "ROUTERS",
    "STAGES",
    "MoEAux",
    "MoEConfig",
    "exchange_bounds",
    "init_moe_params",
    "moe_layer",
    "moe_layer_reference",
    "moe_param_specs",
    "update_router_bias",
]

ACTIVATIONS = ("swiglu", "gelu", "silu")
ROUTERS = ("softmax", "sigmoid")
EXCHANGES = ("auto", "ragged", "dense")
DISPATCHES = ("dtype", "fp8")
_FP8_RECIPES = (None, "block")
_FP8_BLOCK = 128
_COUNT_DTYPES = tuple(np.dtype(d) for d in ("int32", "int64", "uint32", "float32"))


def _choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"MoEConfig: {name} must be one of {choices}, got {value!r}")
    return value


def _nonneg_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"MoEConfig: {name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"MoEConfig: {name} must be finite and >= 0, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static configuration of :func:`moe_layer` (hashable: use it as a jit static argument).

    Attributes:
      num_experts: E >= 1.
      top_k: K, 1 <= K <= E: experts per token.
      hidden: H, the model width (x's last axis).
      ffn_hidden: F, each expert's inner width.
      activation: "swiglu" (``silu(x W_gate) * (x W_up)``, w_in holds ``[W_gate | W_up]``),
        "gelu" (exact, erf) or "silu".
      router: "softmax" (scores = softmax(logits), Mixtral / Qwen-MoE) or "sigmoid"
        (scores = sigmoid(logits), DeepSeek-V3). The k experts are chosen by their scores (plus
        the correction bias, within the chosen groups, see below) and weighted by their scores.
      normalize_probs: divide each token's k weights by their sum (Mixtral: always; Qwen-MoE:
        ``norm_topk_prob``; DeepSeek-V3: ``norm_topk_prob``).
      router_bias: a per-expert correction bias (params["router_bias"], float32 ``[E]``,
        DeepSeek-V3's ``e_score_correction_bias``) added to the scores for the choice of experts
        only: the weights use the raw scores, and the bias gets no gradient. Update it between
        steps with
        :func:`update_router_bias` (auxiliary-loss-free balancing).
      n_group: group-limited routing: the E experts form `n_group` groups of ``E / n_group``; a
        group's score is the sum of its two best (biased) scores, and each token chooses its k
        experts among the `topk_group` best groups only. 1: no groups.
      topk_group: groups kept per token (1..n_group; None: all of them).
      routed_scaling_factor: the k weights are multiplied by this after the normalization
        (DeepSeek-V3: 2.5).
      shared_ffn_hidden: width of the shared expert applied to every token besides the routed
        ones (0: none). DeepSeek-V3's ``n_shared_experts`` shared experts are one FFN of width
        ``n_shared_experts * moe_intermediate_size``; Qwen2-MoE's
        ``shared_expert_intermediate_size``. Same activation as the routed experts; params
        ``shared_w_in [H, F_s']``, ``shared_w_out [F_s, H]``.
      shared_gate: scale the shared expert's output per token by
        ``sigmoid(x @ params["shared_gate"])`` (Qwen2-MoE; ``shared_gate [H, 1]``).
      capacity_factor: None (dropless) or > 0: ``C = ceil(capacity_factor * T * K / E)`` slots per
        expert over the global batch (see the module docstring).
      aux_loss_coef: weight of the load-balancing loss in ``MoEAux.loss``.
      z_loss_coef: weight of the router z-loss in ``MoEAux.loss``.
      align: each local expert's group of received rows is padded to a multiple of this
        (8 or 16 suit grouped GEMMs; 1 to 4096).
      expert_axis: the mesh axis the experts are sharded over.
      data_axes: mesh axes (a name or a tuple of names) the batch is sharded over besides the
        expert axis; () for none.
      dtype: compute dtype of the experts (float32, bfloat16 or float16). The router runs in
        float32.
      fp8: None or "block": expert GEMMs with DeepSeek-V3 block-scaled FP8 numerics (tokens and
        gradients in 1 x 128 groups, weights in 128 x 128 tiles, wgrad operands in 128-token
        groups per expert, float8_e4m3fn, fp32 accumulation).
      exchange: "auto" (ragged_all_to_all on GPU, the dense all_to_all form elsewhere),
        "ragged" or "dense".
      dispatch: what crosses the dispatch exchange. "dtype": the tokens in cfg.dtype (with
        fp8="block" the receiver quantizes them). "fp8" (needs fp8="block"), as DeepEP does:
        the sender quantizes its tokens once (1 x 128 groups, float8_e4m3fn, float32 scales),
        permutes the FP8 rows with their scales and sends both (half the bytes of bf16, a
        quarter of float32, plus 1/128 of the elements in scales); the receiver feeds them to
        the grouped GEMM as they are. The forward is the same arithmetic as "dtype" (a row's
        1 x 128 groups are the same before and after the exchange). The combine stays in
        cfg.dtype. Backward: the dispatch's gradient crosses back in cfg.dtype -- gradients
        need the range and precision FP8 would cut, and they are quantized only where the
        recipe quantizes them (the grouped GEMMs' dgrad and wgrad); the weight gradient of the
        first expert GEMM requantizes the received FP8 tokens in 128-token groups (the
        sender's original tokens never cross), so it differs from "dtype"'s by FP8 rounding.
    """

    num_experts: int
    top_k: int
    hidden: int
    ffn_hidden: int
    activation: str = "swiglu"
    router: str = "softmax"
    normalize_probs: bool = True
    router_bias: bool = False
    n_group: int = 1
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    shared_ffn_hidden: int = 0
    shared_gate: bool = False
    capacity_factor: float | None = None
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    align: int = 8
    expert_axis: str = "expert"
    data_axes: tuple[str, ...] = ("data",)
    dtype: Any = jnp.bfloat16
    fp8: str | None = None
    exchange: str = "auto"
    dispatch: str = "dtype"

    def __post_init__(self):
        e = _checks.check_int("MoEConfig", "num_experts", self.num_experts, 1)
        k = _checks.check_int("MoEConfig", "top_k", self.top_k, 1)
        if k > e:
            raise ValueError(f"MoEConfig: top_k must be <= num_experts = {e}, got {k}")
        _checks.check_int("MoEConfig", "hidden", self.hidden, 1)
        _checks.check_int("MoEConfig", "ffn_hidden", self.ffn_hidden, 1)
        align = _checks.check_int("MoEConfig", "align", self.align, 1)
        if align > _moe.MAX_ALIGN:
            raise ValueError(f"MoEConfig: align must be <= {_moe.MAX_ALIGN}, got {align}")
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("router", self.router, ROUTERS)
        _choice("fp8", self.fp8, _FP8_RECIPES)
        _choice("exchange", self.exchange, EXCHANGES)
        _choice("dispatch", self.dispatch, DISPATCHES)
        if self.dispatch == "fp8" and self.fp8 != "block":
            raise ValueError(
                f"MoEConfig: dispatch='fp8' quantizes tokens for the block-scaled FP8 expert "
                f"GEMMs and needs fp8='block', got fp8={self.fp8!r}"
            )
        _checks.check_bool("MoEConfig", "normalize_probs", self.normalize_probs)
        _checks.check_bool("MoEConfig", "router_bias", self.router_bias)
        _checks.check_bool("MoEConfig", "shared_gate", self.shared_gate)
        groups = _checks.check_int("MoEConfig", "n_group", self.n_group, 1)
        if e % groups:
            raise ValueError(
                f"MoEConfig: num_experts = {e} must be divisible by n_group, got n_group = {groups}"
            )
        if groups > 1 and e // groups < 2:
            raise ValueError(
                f"MoEConfig: n_group = {groups} leaves {e // groups} expert per group; a group's "
                "score is the sum of its 2 best experts, so groups need at least 2"
            )
        kept = groups if self.topk_group is None else self.topk_group
        kept = _checks.check_int("MoEConfig", "topk_group", kept, 1)
        if kept > groups:
            raise ValueError(f"MoEConfig: topk_group must be <= n_group = {groups}, got {kept}")
        if k > kept * (e // groups):
            raise ValueError(
                f"MoEConfig: top_k = {k} exceeds the {kept * (e // groups)} experts of the "
                f"topk_group = {kept} groups a token may use"
            )
        object.__setattr__(self, "topk_group", kept)
        scale = _nonneg_float("routed_scaling_factor", self.routed_scaling_factor)
        if scale == 0:
            raise ValueError("MoEConfig: routed_scaling_factor must be > 0")
        object.__setattr__(self, "routed_scaling_factor", scale)
        _checks.check_int("MoEConfig", "shared_ffn_hidden", self.shared_ffn_hidden, 0)
        if self.shared_gate and not self.shared_ffn_hidden:
            raise ValueError("MoEConfig: shared_gate needs a shared expert (shared_ffn_hidden > 0)")
        if self.capacity_factor is not None:
            cf = _nonneg_float("capacity_factor", self.capacity_factor)
            if cf == 0:
                raise ValueError("MoEConfig: capacity_factor must be > 0 or None (dropless)")
            object.__setattr__(self, "capacity_factor", cf)
        object.__setattr__(
            self, "aux_loss_coef", _nonneg_float("aux_loss_coef", self.aux_loss_coef)
        )
        object.__setattr__(self, "z_loss_coef", _nonneg_float("z_loss_coef", self.z_loss_coef))
        if not isinstance(self.expert_axis, str):
            raise TypeError(
                f"MoEConfig: expert_axis must be a mesh axis name (str), got {self.expert_axis!r}"
            )
        data_axes = self.data_axes
        data_axes = (
            () if data_axes is None else (data_axes,) if isinstance(data_axes, str) else data_axes
        )
        if not all(isinstance(a, str) for a in data_axes) or self.expert_axis in data_axes:
            raise ValueError(
                "MoEConfig: data_axes must be mesh axis names other than expert_axis "
                f"{self.expert_axis!r}, got {self.data_axes!r}"
            )
        object.__setattr__(self, "data_axes", tuple(data_axes))
        dtype = np.dtype(self.dtype)
        if dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(
                f"MoEConfig: dtype must be float32, bfloat16 or float16, got {dtype.name}"
            )
        object.__setattr__(self, "dtype", dtype)

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes the token batch is sharded over: ``(*data_axes, expert_axis)``."""
        return (*self.data_axes, self.expert_axis)

    def capacity(self, num_tokens: int) -> int | None:
        """C for a global batch of `num_tokens` tokens, or None (dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    @property
    def w_in_width(self) -> int:
        """F': the width of w_in (2F for swiglu's gate and up projections, else F)."""
        return 2 * self.ffn_hidden if self.activation == "swiglu" else self.ffn_hidden

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter :func:`init_moe_params` makes for this config."""
        e, h, f = self.num_experts, self.hidden, self.ffn_hidden
        shapes = {"router": (h, e), "w_in": (e, h, self.w_in_width), "w_out": (e, f, h)}
        if self.router_bias:
            shapes["router_bias"] = (e,)
        if self.shared_ffn_hidden:
            fs = self.shared_ffn_hidden
            shapes["shared_w_in"] = (h, 2 * fs if self.activation == "swiglu" else fs)
            shapes["shared_w_out"] = (fs, h)
            if self.shared_gate:
                shapes["shared_gate"] = (h, 1)
        return shapes


class MoEAux(NamedTuple):
    """What :func:`moe_layer` reports besides its output (global values, replicated).

    Attributes:
      loss: ``aux_loss_coef * load_balancing_loss + z_loss_coef * z_loss`` (float32 scalar): add
        it to the training loss.
      load_balancing_loss: ``E * sum_e f_e * p_e`` with f_e the fraction of the T*K slots routed
        to expert e (before drops) and p_e the mean over tokens of the router's probability of e
        (softmax, or sigmoid scores normalized over the experts).
      z_loss: ``mean_t logsumexp(logits_t) ** 2``.
      tokens_per_expert: int32 ``[E]``, slots routed to each expert (before drops).
      dropped: int32 scalar, slots dropped by the capacity.
    """

    loss: jax.Array
    load_balancing_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array


def init_moe_params(key: jax.Array, cfg: MoEConfig) -> dict[str, jax.Array]:
    """float32 parameters: ``router [H, E]``, ``w_in [E, H, F']``, ``w_out [E, F, H]``.

    ``F' = 2F`` for swiglu (gate and up projections side by side), else F. Scaled normal
    initialization (1 / sqrt(fan_in)). With ``cfg.router_bias`` also ``router_bias [E]`` (zeros);
    with a shared expert ``shared_w_in [H, F_s']``, ``shared_w_out [F_s, H]`` and with
    ``cfg.shared_gate`` ``shared_gate [H, 1]`` (:attr:`MoEConfig.param_shapes`). Place them with
    :func:`moe_param_specs`.

    Example:
      >>> import jax
      >>> from jaxops.parallel.expert import MoEConfig, init_moe_params
      >>> cfg = MoEConfig(num_experts=8, top_k=2, hidden=64, ffn_hidden=128)
      >>> {k: v.shape for k, v in init_moe_params(jax.random.key(0), cfg).items()}
      {'router': (64, 8), 'w_in': (8, 64, 256), 'w_out': (8, 128, 64)}
    """
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"init_moe_params: cfg must be a MoEConfig, got {type(cfg).__name__}")
    shapes = cfg.param_shapes
    kr, ki, ko = jax.random.split(key, 3)
    ks = jax.random.split(jax.random.fold_in(key, 1), 3)
    keys = {"router": kr, "w_in": ki, "w_out": ko, "shared_w_in": ks[0], "shared_w_out": ks[1]}
    keys["shared_gate"] = ks[2]
    params = {}
    for name, shape in shapes.items():
        if name == "router_bias":
            params[name] = jnp.zeros(shape, jnp.float32)
        else:  # [..., in, out]: scaled by 1 / sqrt(in)
            params[name] = jax.random.normal(keys[name], shape, jnp.float32) / math.sqrt(shape[-2])
    return params


def moe_param_specs(cfg: MoEConfig) -> dict[str, P]:
    """PartitionSpecs of the parameters: experts over the expert axis, the rest replicated."""
    return {
        name: P(cfg.expert_axis) if name in ("w_in", "w_out") else P() for name in cfg.param_shapes
    }


def update_router_bias(
    bias: jax.Array, tokens_per_expert: jax.Array, rate: float = 1e-3
) -> jax.Array:
    """Auxiliary-loss-free load balancing (DeepSeek-V3): one update of the correction bias.

    ``bias + rate * sign(mean(load) - load)``: experts that received more than the mean number of
    slots this step become less likely to be chosen, the others more. Jittable; works on stacked
    layers (``[..., E]``, the mean taken over the last axis). Use it with
    ``MoEConfig(router_bias=True)`` and ``MoEAux.tokens_per_expert`` (global counts), outside the
    gradient (the bias has none).

    Args:
      bias: float32 ``[..., E]``, ``params["router_bias"]``.
      tokens_per_expert: int ``[..., E]`` slots routed to each expert (before drops).
      rate: the update speed gamma (DeepSeek-V3 used 1e-3).

    Returns:
      The updated bias, float32 ``[..., E]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.parallel.expert import update_router_bias
      >>> update_router_bias(jnp.zeros(4), jnp.array([10, 2, 2, 2]), rate=0.1).tolist()
      [-0.10000000149011612, 0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    bias = _checks.check_array("update_router_bias", "bias", bias, min_rank=1)
    load = _checks.check_array(
        "update_router_bias",
        "tokens_per_expert",
        tokens_per_expert,
        dtypes=_COUNT_DTYPES,
        min_rank=1,
    )
    if load.shape != bias.shape:
        raise ValueError(
            "update_router_bias: tokens_per_expert must have bias's shape "
            f"{tuple(bias.shape)}, got {tuple(load.shape)}"
        )
    load = load.astype(jnp.float32)
    step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return (bias + rate * step).astype(bias.dtype)


# -------------------------------------------------------------------------------------------------
# Router and expert math, shared by the layer and its dense reference.


def _router(cfg: MoEConfig, tokens: jax.Array, w_router: jax.Array, bias=None):
    """(logits, probabilities over experts, expert_ids [T, K], their weights [T, K]), float32.

    Scores are softmax or sigmoid of the float32 logits. The choice: the scores plus the
    correction bias (no gradient), limited to each token's `topk_group` best groups (a group's
    score: the sum of its two best), then the top k. The weights: the chosen experts' raw scores,
    normalized to sum 1 if asked (sigmoid: the sum plus 1e-20, as DeepSeek-V3), times
    routed_scaling_factor.
    """
    logits = jnp.dot(
        tokens.astype(jnp.float32),
        w_router.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    if cfg.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        dist = scores
    else:
        scores = jax.nn.sigmoid(logits)
        # Every score can underflow to 0 for very negative logits: then dist is 0, not 0 / 0,
        # and so is its gradient (a safe denominator, not a where around the quotient).
        total = jnp.sum(scores, axis=-1, keepdims=True)
        dist = scores / jnp.where(total > 0, total, 1.0)
    choice = scores
    if bias is not None:
        choice = choice + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        t, g = tokens.shape[0], cfg.n_group
        grouped = choice.reshape(t, g, cfg.num_experts // g)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        kept = jnp.any(keep[:, :, None] == jnp.arange(g)[None, None, :], axis=1)  # [T, G]
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(t, cfg.num_experts)
    if bias is None and choice is scores:
        top, ids = jax.lax.top_k(scores, cfg.top_k)
    else:
        _, ids = jax.lax.top_k(jax.lax.stop_gradient(choice), cfg.top_k)
        top = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.normalize_probs:
        total = jnp.sum(top, axis=-1, keepdims=True)
        if cfg.router == "softmax":
            top = top / total
        else:  # DeepSeek-V3's + 1e-20; all-zero scores stay 0 (with a finite gradient)
            top = top / jnp.where(total > 0, total + 1e-20, 1.0)
    if cfg.routed_scaling_factor != 1.0:
        top = top * cfg.routed_scaling_factor
    return logits, dist, ids.astype(jnp.int32), top


def _aux(cfg: MoEConfig, counts, dist_sum, lse_sq_sum, dropped, num_tokens: int) -> MoEAux:
    """MoEAux from global sums: counts [E] int32, dist_sum [E], lse_sq_sum [] (float32)."""
    f = counts.astype(jnp.float32) / (num_tokens * cfg.top_k)
    p = dist_sum / num_tokens
    lb = cfg.num_experts * jnp.sum(f * p)
    z = lse_sq_sum / num_tokens
    loss = cfg.aux_loss_coef * lb + cfg.z_loss_coef * z
    return MoEAux(loss, lb, z, counts, dropped)


def _activate(cfg: MoEConfig, h: jax.Array) -> jax.Array:
    if cfg.activation == "swiglu":
        gate, up = jnp.split(h, 2, axis=-1)
        return jax.nn.silu(gate) * up
    if cfg.activation == "gelu":
        return jax.nn.gelu(h, approximate=False)
    return jax.nn.silu(h)


# Grouped GEMM. Rows arrive grouped by local expert, each group padded to a multiple of the
# plan's alignment. On GPU: jax.lax.ragged_dot. XLA:CPU lowers ragged_dot to one dense dot over
# every group for every row (masked), L times the work; there the groups are padded to multiples
# of a row tile and a loop runs one [tile, K] x [K, N] GEMM per tile in use (a dynamic trip count:
# the work follows the rows actually received, not the buffer's worst-case size).

_CPU_TILE = 32


def _gmm(tile: int, x, w, groups) -> jax.Array:
    """``y[rows of group l] = x[rows] @ w[l]``, float32 ``[R, N]``; padding rows give zeros."""
    group_sizes, tile_group, n_tiles = groups
    if tile == 0:
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)

    def body(i, out):
        rows = jax.lax.dynamic_slice_in_dim(x, i * tile, tile)
        y = jnp.dot(rows, w[tile_group[i]], preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, y, i * tile, 0)

    out = vary_like(jnp.zeros((x.shape[0], w.shape[2]), jnp.float32), x, w, tile_group)
    return jax.lax.fori_loop(0, n_tiles, body, out)


def _gmm_wgrad(tile: int, x, dy, groups, num_groups: int) -> jax.Array:
    """``dw[l] = x[rows of l]^T @ dy[rows of l]``, float32 ``[L, K, N]``."""
    group_sizes, tile_group, n_tiles = groups
    shape = (num_groups, x.shape[1], dy.shape[1])
    if tile == 0:
        _, vjp = jax.vjp(
            lambda w: jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32),
            jnp.zeros(shape, x.dtype),
        )
        return vjp(dy.astype(jnp.float32))[0].astype(jnp.float32)

    def body(i, dw):
        rows = jax.lax.dynamic_slice_in_dim(x, i * tile, tile)
        grad = jax.lax.dynamic_slice_in_dim(dy, i * tile, tile)
        g = tile_group[i]
        return dw.at[g].add(jnp.dot(rows.T, grad, preferred_element_type=jnp.float32))

    dw = vary_like(jnp.zeros(shape, jnp.float32), x, dy, tile_group)
    return jax.lax.fori_loop(0, n_tiles, body, dw)


def _fp8_rows(impl, x, grad: bool = False) -> jax.Array:
    floor = GRAD_AMAX_FLOOR if grad else 1e-4
    q = quantize(x, block=(1, _FP8_BLOCK), amax_floor=floor, impl=impl)
    return dequantize(q, jnp.float32)


def _fp8_split(impl, x, group_sizes, grad: bool = False) -> jax.Array:
    floor = GRAD_AMAX_FLOOR if grad else 1e-4
    q = quantize_split_transpose(x, group_sizes, amax_floor=floor, impl=impl)
    return q.dequantize(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grouped_linear(tile: int, fp8: bool | str, impl, x, w, groups):
    return _grouped_linear_fwd(tile, fp8, impl, x, w, groups)[0]


def _grouped_linear_fwd(tile: int, fp8: bool | str, impl, x, w, groups):
    """fp8: False, True (quantize x's rows 1 x 128) or "given" (x holds dequantized FP8 rows)."""
    like = x[:0]  # x's dtype and varying axes, for its cotangent
    if fp8:
        xq = x if fp8 == "given" else _fp8_rows(impl, x)
        # Given rows are float32 (FP8 values times their scales); the wgrad requantizes them,
        # so they are kept in the compute dtype (the weights'), as other inputs are.
        saved = x.astype(w.dtype) if fp8 == "given" else x
        w = dequantize(quantize(w, block=(_FP8_BLOCK, _FP8_BLOCK), impl=impl), jnp.float32)
        return _gmm(tile, xq, w, groups), ((saved, like), w, groups)
    return _gmm(tile, x, w, groups), ((x, like), w, groups)


def _grouped_linear_bwd(tile: int, fp8: bool | str, impl, saved, dy):
    (x, x_like), w, groups = saved
    if fp8:
        # dgrad from 1 x 128 gradient groups and w's tiles read transposed; wgrad from
        # per-expert transposes quantized in 128-token groups (DeepSeek-V3's recipe).
        dyq = _fp8_rows(impl, dy, grad=True)
        xs = _fp8_split(impl, x, groups[0])
        dys = _fp8_split(impl, dy, groups[0], grad=True)
    else:
        dyq = dys = dy.astype(x.dtype)
        xs = x
    dx = _gmm(tile, dyq, jnp.swapaxes(w, 1, 2), groups)
    dw = _gmm_wgrad(tile, xs, dys, groups, w.shape[0])
    dx = cotangent_like(dx.astype(x_like.dtype), x_like)
    return dx, cotangent_like(dw.astype(w.dtype), w), None


_grouped_linear.defvjp(_grouped_linear_fwd, _grouped_linear_bwd)


def _groups(tile: int, group_sizes: jax.Array, rows: int):
    """(group_sizes, the group of each row tile, tiles in use) for :func:`_gmm`."""
    if tile == 0:
        return group_sizes, jnp.zeros((1,), jnp.int32), jnp.zeros((), jnp.int32)
    ends = jnp.cumsum(group_sizes)
    starts = jnp.arange(rows // tile, dtype=jnp.int32) * tile
    tile_group = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    tile_group = jnp.minimum(tile_group, group_sizes.shape[0] - 1)
    return group_sizes, tile_group, (ends[-1] // tile).astype(jnp.int32)


def _grouped_ffn(cfg: MoEConfig, tile: int, impl, rows, w_in, w_out, group_sizes) -> jax.Array:
    """Each group of rows through its expert's FFN: ``[R, H] -> [R, H]`` in cfg.dtype.

    With ``cfg.dispatch == "fp8"`` the rows are the received FP8 tokens, dequantized (float32).
    """
    groups = _groups(tile, group_sizes, rows.shape[0])
    fp8 = cfg.fp8 == "block"
    first = "given" if cfg.dispatch == "fp8" else fp8
    h = _grouped_linear(tile, first, impl, rows, w_in.astype(cfg.dtype), groups)
    a = _activate(cfg, h).astype(cfg.dtype)
    out = _grouped_linear(tile, fp8, impl, a, w_out.astype(cfg.dtype), groups)
    return out.astype(cfg.dtype)


def _shared_expert(cfg: MoEConfig, params, tokens: jax.Array) -> jax.Array | None:
    """The shared expert on every token, float32 ``[T, H]`` (None without one).

    Its projections are dense GEMMs in cfg.dtype with float32 accumulation (with cfg.fp8 the
    block-scaled ``jaxops.fp8.linear``); the optional sigmoid gate is computed in float32.
    """
    if not cfg.shared_ffn_hidden:
        return None
    from jaxops._gemm import fp8_linear

    xs = tokens.astype(cfg.dtype)
    w_in = params["shared_w_in"].astype(cfg.dtype)
    w_out = params["shared_w_out"].astype(cfg.dtype)
    if cfg.fp8 == "block":
        # Inside shard_map the weights are replicated and the tokens vary: mark the weights
        # varying so fp8.linear's backward (a per-device weight gradient) types check; the
        # cast's transpose sums the gradient over the devices.
        w_in, w_out = vary_like((w_in, w_out), xs)
        hid = fp8_linear(xs, w_in).astype(jnp.float32)
        out = fp8_linear(_activate(cfg, hid).astype(cfg.dtype), w_out).astype(jnp.float32)
    else:
        hid = jnp.dot(xs, w_in, preferred_element_type=jnp.float32)
        act = _activate(cfg, hid).astype(cfg.dtype)
        out = jnp.dot(act, w_out, preferred_element_type=jnp.float32)
    if cfg.shared_gate:
        gate = jnp.dot(
            tokens.astype(jnp.float32),
            params["shared_gate"].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        out = jax.nn.sigmoid(gate) * out
    return out


# -------------------------------------------------------------------------------------------------
# The exchange.


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _slice_of_row(sizes: jax.Array, chunk: int):
    """Which slice each row of a chunk belongs to, for chunks packing slices back to back.

    sizes: ``[n, L]``. Returns (slice index, its start row, row in use), each ``[n, chunk]``.
    """
    ends = jnp.cumsum(sizes, axis=1)
    s = jnp.arange(chunk, dtype=jnp.int32)
    idx = jax.vmap(lambda e: jnp.searchsorted(e, s, side="right"))(ends).astype(jnp.int32)
    valid = idx < sizes.shape[1]
    idx = jnp.minimum(idx, sizes.shape[1] - 1)
    start = jnp.take_along_axis(ends - sizes, idx, axis=1)
    return idx, start, valid


def _ragged_all_to_all_dense(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, chunk
):
    """``jax.lax.ragged_all_to_all``'s semantics from a dense ``all_to_all`` (for XLA:CPU).

    Same arguments (``L = len(input_offsets) / axis size`` slices per peer); `chunk` (static)
    bounds the rows one device sends another. Each device packs the slices for peer j back to back
    into ``[chunk, ...]``, one all_to_all moves the ``[n, chunk, ...]`` blocks and the output
    offsets, and the receiver scatters each row to ``output_offsets + position`` in its slice.
    Rows beyond `chunk` would be lost: callers size it with :func:`exchange_bounds`.
    """
    n = jax.lax.axis_size(axis_name)
    slices = input_offsets.shape[0] // n
    sizes = send_sizes.reshape(n, slices)
    idx, start, valid = _slice_of_row(sizes, chunk)
    s = jnp.arange(chunk, dtype=jnp.int32)
    src = jnp.take_along_axis(input_offsets.reshape(n, slices), idx, axis=1) + s - start
    packed = take_rows(operand, src, valid)
    received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=False)
    their_offsets = jax.lax.all_to_all(
        output_offsets.reshape(n, slices), axis_name, 0, 0, tiled=False
    )
    idx, start, valid = _slice_of_row(recv_sizes.reshape(n, slices), chunk)
    dst = jnp.take_along_axis(their_offsets, idx, axis=1) + s - start
    dst = jnp.where(valid, dst, output.shape[0])  # out of range: dropped by the scatter
    return output.at[dst.reshape(-1)].set(
        received.reshape(n * chunk, *operand.shape[1:]), mode="drop"
    )


def exchange_bounds(
    cfg: MoEConfig,
    tokens_per_device: int,
    expert_axis_size: int,
    num_tokens: int | None = None,
    *,
    align: int | None = None,
) -> tuple[int, int]:
    """``(chunk, recv_rows)``: the static bounds of the exchange (see the module docstring).

    `num_tokens` is the global batch (for the capacity); default ``tokens_per_device`` times the
    expert axis size. `align` is the receiver's group alignment (default cfg.align; off GPU the
    layer uses ``lcm(cfg.align, 32)`` for its row-tiled grouped GEMM).

    Example:
      >>> from jaxops.parallel.expert import MoEConfig, exchange_bounds
      >>> cfg = MoEConfig(num_experts=64, top_k=8, hidden=1024, ffn_hidden=512, align=16)
      >>> exchange_bounds(cfg, tokens_per_device=4096, expert_axis_size=8)
      (32768, 262264)
    """
    n, tl = expert_axis_size, tokens_per_device
    align = cfg.align if align is None else align
    local = cfg.num_experts // n
    num_tokens = tl * n if num_tokens is None else num_tokens
    chunk = tl * min(cfg.top_k, local)
    recv = n * chunk + local * (align - 1)
    c = cfg.capacity(num_tokens)
    if c is not None:
        chunk = min(chunk, local * min(c, tl))
        recv = min(recv, local * round_up(min(c, n * tl), align))
    return max(chunk, 1), max(recv, 1)


@dataclasses.dataclass(frozen=True)
class _Plan:
    n: int  # expert axis size
    local: int  # experts per device
    num_tokens: int  # global T
    capacity: int | None
    chunk: int
    recv_rows: int
    ragged: bool  # ragged_all_to_all, else its dense form
    align: int  # receiver's group alignment
    tile: int  # row tile of the grouped GEMM loop; 0: jax.lax.ragged_dot


def _exchange(plan: _Plan, axis: str, operand, output, offsets):
    """One exchange: ragged_all_to_all on GPU, its dense form elsewhere."""
    if plan.ragged:
        return jax.lax.ragged_all_to_all(operand, output, *offsets, axis_name=axis)
    return _ragged_all_to_all_dense(operand, output, *offsets, axis_name=axis, chunk=plan.chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_dispatch(plan: _Plan, axis: str, impl, tokens, data, scales, row_map, offsets):
    """The FP8 dispatch: permuted FP8 rows and their scales exchanged, dequantized (float32).

    tokens: ``[T, H]`` in the compute dtype, only for the gradient (straight through the
    quantization); data / scales: the sender's permuted FP8 rows ``[R, H]`` and float32 scales
    ``[R, H / 128]``; row_map: the permute's ``[T, K]`` rows; offsets: (forward, backward)
    exchange arguments. Forward: two exchanges (FP8 payload, scale payload). Backward: the
    rows' gradient crosses back in the compute dtype and each token sums its K rows' gradients.
    """
    return _fp8_dispatch_fwd(plan, axis, impl, tokens, data, scales, row_map, offsets)[0]


def _fp8_dispatch_fwd(plan: _Plan, axis: str, impl, tokens, data, scales, row_map, offsets):
    forward, backward = offsets
    h = data.shape[1]
    # The FP8 bytes cross as uint8: XLA:CPU would otherwise widen a float8 collective to f16.
    payload = jax.lax.bitcast_convert_type(data, jnp.uint8)
    rows = _exchange(plan, axis, payload, jnp.zeros((plan.recv_rows, h), jnp.uint8), forward)
    rows = jax.lax.bitcast_convert_type(rows, data.dtype)
    shape = (plan.recv_rows, scales.shape[1])
    row_scales = _exchange(plan, axis, scales, jnp.zeros(shape, jnp.float32), forward)
    out = dequantize(QuantizedArray(rows, row_scales, (1, _FP8_BLOCK)), jnp.float32)
    # The permuted buffer's rows, as the shape of an empty array (residuals are arrays).
    sent = tokens[:0, :1].reshape(0)
    sent = jnp.broadcast_to(sent[:, None], (0, data.shape[0]))
    return out, (row_map, backward, sent, tokens[:0])


def _fp8_dispatch_bwd(plan: _Plan, axis: str, impl, saved, d_rows):
    row_map, backward, sent, like = saved
    d_rows = d_rows.astype(like.dtype)
    back = jnp.zeros((sent.shape[1], d_rows.shape[1]), like.dtype)
    d_sent = _exchange(plan, axis, d_rows, back, backward)
    # The permute's own backward: each token sums the gradients of its K rows.
    d_tokens = unpermute_rows(d_sent, row_map, None, impl)
    return cotangent_like(d_tokens.astype(like.dtype), like), None, None, None, None


_fp8_dispatch.defvjp(_fp8_dispatch_fwd, _fp8_dispatch_bwd)


def _offsets(plan: _Plan, align: int, me, counts_all, kept_all):
    """Forward and backward exchange arguments and the receiver's group sizes.

    counts_all / kept_all: int32 ``[N, E]``, every expert-axis peer's routed and kept slots per
    expert. G[i, j, l] = rows peer i sends to peer j's local expert l.
    """
    n, lx = plan.n, plan.local
    g = kept_all.reshape(n, n, lx)
    # Sender i's permuted buffer (align 1): expert groups in order, dropped slots at group ends.
    send_base = _exclusive_cumsum(counts_all, axis=1).reshape(n, n, lx)
    # Receiver j: local expert l's group starts at base[j, l]; within it, sender i's rows.
    totals = jnp.sum(g, axis=0)  # [j, l]
    padded = (totals + align - 1) // align * align
    base = _exclusive_cumsum(padded, axis=1)
    recv_at = base[None] + _exclusive_cumsum(g, axis=0)  # [i, j, l]
    forward = (
        send_base[me].reshape(-1),
        g[me].reshape(-1),
        recv_at[me].reshape(-1),
        g[:, me].reshape(-1),
    )
    backward = (
        recv_at[:, me].reshape(-1),
        g[:, me].reshape(-1),
        send_base[:, me].reshape(-1),
        g[me].reshape(-1),
    )
    return forward, backward, padded[me]


# -------------------------------------------------------------------------------------------------
# The layer.


#: The layer's stages, in order (the benchmark's time split).
STAGES = ("router", "permute", "exchange", "ffn", "combine")


def _probe(*values) -> jax.Array:
    """One float32 per device that depends on every value (the benchmark's stage cut)."""
    return sum(jnp.sum(v.astype(jnp.float32)) for v in values).reshape(1)


def _local_layer(cfg: MoEConfig, plan: _Plan, impl, params, x, upto: str = "combine"):
    """The per-device body of :func:`moe_layer` (inside shard_map).

    With `upto` before "combine" it stops after that stage and returns :func:`_probe` of the
    stage's results (for the benchmark's time split).
    """
    h = x.shape[-1]
    tokens = x.reshape(-1, h)
    e, axis, token_axes = cfg.num_experts, cfg.expert_axis, cfg.token_axes
    logits, dist, ids, probs = _router(cfg, tokens, params["router"], params.get("router_bias"))
    counts = jnp.zeros((e,), jnp.int32).at[ids.reshape(-1)].add(1)
    if plan.capacity is None:
        kept = counts
    else:
        before = jax.lax.all_gather(counts, token_axes)  # [shards, E], global token order
        me_global = jax.lax.axis_index(token_axes)
        mask = (jnp.arange(before.shape[0]) < me_global)[:, None]
        prefix = jnp.sum(jnp.where(mask, before, 0), axis=0)
        kept = jnp.clip(plan.capacity - prefix, 0, counts)
    stats = jax.lax.psum(
        (
            counts,
            jnp.sum(dist, axis=0),
            jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2),
            jnp.sum(counts - kept),
        ),
        token_axes,
    )
    aux = _aux(cfg, *stats, plan.num_tokens)
    if upto == "router":
        return _probe(probs, aux.loss, kept)

    compute = tokens.astype(cfg.dtype)
    if cfg.dispatch == "fp8":
        # The sender quantizes once; the FP8 rows move with their scales (no gradient here:
        # _fp8_dispatch passes it straight through to the tokens).
        q = quantize(jax.lax.stop_gradient(compute), block=(1, _FP8_BLOCK), impl=impl)
        permuted = _moe.permute(q.data, ids, e, scales=q.scale, impl=impl)
    else:
        permuted = _moe.permute(compute, ids, e, impl=impl)
    if upto == "permute":
        return _probe(probs, aux.loss, kept, permuted.tokens)
    both = jax.lax.all_gather(jnp.stack([counts, kept]), axis)  # [N, 2, E]
    me = jax.lax.axis_index(axis)
    forward, backward, group_sizes = _offsets(plan, plan.align, me, both[:, 0], both[:, 1])
    if cfg.dispatch == "fp8":
        rows = _fp8_dispatch(
            plan,
            axis,
            impl,
            compute,
            permuted.tokens,
            permuted.scales,
            permuted.row_map,
            (forward, backward),
        )
    else:
        recv = jnp.zeros((plan.recv_rows, h), cfg.dtype)
        rows = _exchange(plan, axis, permuted.tokens, recv, forward)
    if upto == "exchange":
        return _probe(probs, aux.loss, rows)
    out = _grouped_ffn(cfg, plan.tile, impl, rows, params["w_in"], params["w_out"], group_sizes)
    if upto == "ffn":
        return _probe(probs, aux.loss, out)
    back = jnp.zeros((permuted.tokens.shape[0], h), cfg.dtype)
    returned = _exchange(plan, axis, out, back, backward)
    y = _moe.unpermute(returned, permuted, probs=probs, impl=impl)
    shared = _shared_expert(cfg, params, tokens)
    if shared is not None:
        y = y.astype(jnp.float32) + shared
    return y.astype(x.dtype).reshape(x.shape), aux


def _check_params(op: str, params: Any, cfg: MoEConfig) -> dict[str, jax.Array]:
    want = cfg.param_shapes
    if not isinstance(params, dict) or set(params) != set(want):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"{op}: params must be a dict with keys {sorted(want)}, got {got}")
    for name, shape in want.items():
        arr = _checks.check_array(op, f"params[{name!r}]", params[name])
        if tuple(arr.shape) != shape:
            raise ValueError(
                f"{op}: params[{name!r}] must have shape {shape} for {cfg}, got {tuple(arr.shape)}"
            )
    return params


def _check_mesh(op: str, mesh: Any, cfg: MoEConfig) -> tuple[int, int]:
    """(expert axis size N, token shards D) after checking that the mesh fits the config."""
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    shape = dict(mesh.shape)
    for name in cfg.token_axes:
        if name not in shape:
            role = "expert_axis" if name == cfg.expert_axis else "data_axes"
            raise ValueError(
                f"{op}: the mesh has no axis {name!r} (cfg.{role}); its axes are "
                f"{tuple(shape)}. Set MoEConfig(expert_axis=..., data_axes=...) to its names."
            )
    n = shape[cfg.expert_axis]
    if cfg.num_experts % n:
        raise ValueError(
            f"{op}: num_experts = {cfg.num_experts} must be divisible by the size {n} of the "
            f"expert axis {cfg.expert_axis!r}"
        )
    return n, math.prod(shape[a] for a in cfg.token_axes)


def _platform(mesh) -> str:
    devices = getattr(mesh, "devices", None)
    if devices is not None and devices.size:
        return devices.flat[0].platform
    return jax.default_backend()


def _plan(cfg: MoEConfig, mesh, n: int, shards: int, num_tokens: int) -> _Plan:
    """Static buffer sizes and kernel choices for `num_tokens` tokens in all."""
    gpu = _platform(mesh) == "gpu"
    ragged = cfg.exchange == "ragged" or (cfg.exchange == "auto" and gpu)
    tile = 0 if gpu else _CPU_TILE
    align = cfg.align if gpu else math.lcm(cfg.align, tile)
    chunk, recv_rows = exchange_bounds(cfg, num_tokens // shards, n, num_tokens, align=align)
    return _Plan(
        n=n,
        local=cfg.num_experts // n,
        num_tokens=num_tokens,
        capacity=cfg.capacity(num_tokens),
        chunk=chunk,
        recv_rows=round_up(recv_rows, max(tile, 1)),
        ragged=ragged,
        align=align,
        tile=tile,
    )


def _check_x(op: str, x, cfg: MoEConfig) -> jax.Array:
    x = _checks.check_array(op, "x", x, min_rank=2)
    if x.shape[-1] != cfg.hidden:
        raise ValueError(
            f"{op}: x must have shape (B, ..., H) with H = cfg.hidden = {cfg.hidden}, "
            f"got {tuple(x.shape)}"
        )
    return x


def _prepare(name: str, params, x, cfg: MoEConfig, mesh):
    """Validates the layer's arguments; (params, x) placed for shard_map, the plan and specs."""
    op = f"jaxops.parallel.expert.{name}"
    if not isinstance(cfg, MoEConfig):
        raise TypeError(f"{op}: cfg must be a MoEConfig, got {type(cfg).__name__}")
    params = _check_params(op, params, cfg)
    x = _check_x(op, x, cfg)
    n, shards = _check_mesh(op, mesh, cfg)
    if x.shape[0] % shards:
        raise ValueError(
            f"{op}: x's leading axis ({x.shape[0]}) must be divisible by the {shards} devices "
            f"of the token axes {cfg.token_axes}"
        )
    plan = _plan(cfg, mesh, n, shards, math.prod(x.shape[:-1]))
    x_spec = P(cfg.token_axes)
    specs = moe_param_specs(cfg)
    return place(params, mesh, specs), place(x, mesh, x_spec), plan, specs, x_spec


def _inside_shard_map(cfg: MoEConfig) -> bool:
    """Whether the layer is called where cfg's token axes are already manual (shard_map)."""
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ()
    inside = [a in manual for a in cfg.token_axes]
    if any(inside) and not all(inside):
        raise ValueError(
            f"jaxops.parallel.expert.moe_layer: inside a shard_map, all of cfg's token axes "
            f"{cfg.token_axes} must be manual, got manual axes {tuple(manual)}"
        )
    return all(inside)


def _local_call(params, x, cfg: MoEConfig, mesh, impl):
    """The layer on this device's shards, inside an enclosing shard_map over cfg's axes."""
    op = "jaxops.parallel.expert.moe_layer"
    n, shards = _check_mesh(op, mesh, cfg)
    local = cfg.num_experts // n
    shapes = dict(cfg.param_shapes)
    shapes["w_in"] = (local, *shapes["w_in"][1:])
    shapes["w_out"] = (local, *shapes["w_out"][1:])
    for name, shape in shapes.items():
        arr = params.get(name) if isinstance(params, dict) else None
        if arr is None or tuple(arr.shape) != shape:
            got = None if arr is None else tuple(arr.shape)
            raise ValueError(
                f"{op}: inside a shard_map over {cfg.token_axes}, params[{name!r}] must be this "
                f"device's shard of shape {shape} (moe_param_specs), got {got}"
            )
    x = _check_x(op, x, cfg)
    plan = _plan(cfg, mesh, n, shards, math.prod(x.shape[:-1]) * shards)
    return _local_layer(cfg, plan, impl, params, x)


def moe_layer(
    params: dict[str, jax.Array],
    x: jax.Array,
    cfg: MoEConfig,
    *,
    mesh: jax.sharding.Mesh,
    impl: str | None = None,
) -> tuple[jax.Array, MoEAux]:
    """The expert-parallel MoE layer: ``y[t] = sum_k probs[t, k] * FFN_{ids[t, k]}(x[t])``.

    Runs as one ``shard_map`` over `mesh` (see the module docstring for the data flow, buffer
    bounds and capacity semantics). Differentiable in params and x (router gradients come through
    the probabilities and the auxiliary losses). Call it under ``jax.jit``.

    Inside an enclosing ``shard_map`` in which cfg's token axes are already manual (a stage of
    :func:`jaxops.parallel.pipeline.pipeline_step`, say), the layer runs directly on this
    device's shards: `params` are then the shards of :func:`moe_param_specs` (``E / N`` local
    experts) and `x` this device's tokens.

    Args:
      params: from :func:`init_moe_params` (float32 or cfg.dtype; any placement, resharded to
        :func:`moe_param_specs`).
      x: ``[B, ..., H]`` float32, bfloat16 or float16; B divisible by the number of devices on
        the token axes ``(*cfg.data_axes, cfg.expert_axis)``, over which B is sharded.
      cfg: a :class:`MoEConfig`.
      mesh: the mesh holding cfg's axes (other axes hold replicas).
      impl: None, "ffi" or "xla": which implementation of jaxops' kernels (permute, unpermute,
        FP8 quantization) to use; "xla" runs their pure-JAX twins.

    Returns:
      ``(y, aux)``: y like x, and a :class:`MoEAux`.

    Raises:
      TypeError / ValueError: bad params, x, mesh or config (named, with what was expected).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.parallel.expert import MoEConfig, init_moe_params, moe_layer
      >>> mesh = jax.make_mesh((len(jax.devices()),), ("expert",))
      >>> cfg = MoEConfig(num_experts=8, top_k=2, hidden=64, ffn_hidden=128, data_axes=())
      >>> params = init_moe_params(jax.random.key(0), cfg)
      >>> x = jax.random.normal(jax.random.key(1), (8, 16, 64), jnp.bfloat16)
      >>> y, aux = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh))(params, x)
      >>> y.shape, y.dtype, int(aux.tokens_per_expert.sum())
      ((8, 16, 64), dtype(bfloat16), 256)
    """
    if isinstance(cfg, MoEConfig) and _inside_shard_map(cfg):
        return _local_call(params, x, cfg, mesh, impl)
    params, x, plan, specs, x_spec = _prepare("moe_layer", params, x, cfg, mesh)
    aux_specs = MoEAux(P(), P(), P(), P(), P())
    body = functools.partial(_local_layer, cfg, plan, impl)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(specs, x_spec), out_specs=(x_spec, aux_specs), check_vma=True
    )(params, x)


def _stage_probe(params, x, cfg: MoEConfig, *, mesh, upto: str, impl: str | None = None):
    """The layer cut after stage `upto` (one of :data:`STAGES`): a float32 per token shard.

    For benchmarks: timing the cuts one after another splits the layer's time into router /
    permute / exchange / FFN / combine (exchange back + unpermute).
    """
    if upto not in STAGES:
        raise ValueError(f"_stage_probe: upto must be one of {STAGES}, got {upto!r}")
    params, x, plan, specs, x_spec = _prepare("_stage_probe", params, x, cfg, mesh)

    def body(p, x):
        out = _local_layer(cfg, plan, impl, p, x, upto=upto)
        return _probe(out[0]) if upto == "combine" else out  # the whole layer, reduced alike

    return jax.shard_map(
        body, mesh=mesh, in_specs=(specs, x_spec), out_specs=P(cfg.token_axes), check_vma=True
    )(params, x)


def moe_layer_reference(
    params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig
) -> tuple[jax.Array, MoEAux]:
    """The dense single-device twin of :func:`moe_layer`: every expert on every token, masked.

    Loops over the experts explicitly: ``y += w_e[t] * FFN_e(x[t])`` with ``w_e[t]`` the
    token's routing probability of e if e is among its top-k and the slot is kept (capacity: an
    expert keeps its first C slots in slot order), plus the shared expert if the config has
    one. With cfg.fp8 each expert's projections are ``jaxops.fp8.linear(recipe="block")``. The
    oracle of the tests and the "dense" baseline of
    the benchmark (under jit with sharded tokens it computes all E experts on every device).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.parallel.expert import MoEConfig, init_moe_params, moe_layer_reference
      >>> cfg = MoEConfig(num_experts=4, top_k=2, hidden=32, ffn_hidden=16, dtype=jnp.float32)
      >>> params = init_moe_params(jax.random.key(0), cfg)
      >>> y, aux = moe_layer_reference(params, jnp.ones((3, 32)), cfg)
      >>> y.shape, aux.tokens_per_expert.tolist()
      ((3, 32), [0, 3, 0, 3])
    """
    from jaxops._gemm import fp8_linear

    op = "jaxops.parallel.expert.moe_layer_reference"
    params = _check_params(op, params, cfg)
    x = _checks.check_array(op, "x", x, min_rank=1)
    tokens = x.reshape(-1, cfg.hidden)
    t, e, k = tokens.shape[0], cfg.num_experts, cfg.top_k
    logits, dist, ids, probs = _router(cfg, tokens, params["router"], params.get("router_bias"))
    slot_expert = ids.reshape(-1)
    onehot = slot_expert[:, None] == jnp.arange(e)[None, :]  # [T*K, E], slot order
    cap = cfg.capacity(t)
    keep = onehot if cap is None else onehot & (jnp.cumsum(onehot, axis=0) <= cap)
    weight = jnp.where(keep, probs.reshape(-1)[:, None], 0.0).reshape(t, k, e).sum(axis=1)
    xs = tokens.astype(cfg.dtype)
    y = jnp.zeros((t, cfg.hidden), jnp.float32)
    for i in range(e):
        w_in = params["w_in"][i].astype(cfg.dtype)
        w_out = params["w_out"][i].astype(cfg.dtype)
        if cfg.fp8 == "block":
            hid = fp8_linear(xs, w_in).astype(jnp.float32)
            out = fp8_linear(_activate(cfg, hid).astype(cfg.dtype), w_out)
        else:
            hid = jnp.dot(xs, w_in, preferred_element_type=jnp.float32)
            out = jnp.dot(
                _activate(cfg, hid).astype(cfg.dtype), w_out, preferred_element_type=jnp.float32
            ).astype(cfg.dtype)
        y = y + weight[:, i : i + 1] * out.astype(jnp.float32)
    shared = _shared_expert(cfg, params, tokens)
    if shared is not None:
        y = y.astype(cfg.dtype).astype(jnp.float32) + shared
    counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    dropped = jnp.sum(onehot & ~keep, dtype=jnp.int32)
    lse_sq = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
    aux = _aux(cfg, counts, jnp.sum(dist, axis=0), lse_sq, dropped, t)
    return y.astype(x.dtype).reshape(x.shape), aux
