"""The layer's static configuration: MoESpec, MoEConfig, its choices, MoEAux, the parameters.

:class:`MoESpec` (the layer's architecture: experts, router, shared expert, biases, activation),
:class:`MoEConfig` (a spec plus the width and the runtime settings: validated, hashable, a jit
static argument), the tuples of allowed choices,
:class:`MoEAux` (what the layer reports besides its output), :func:`init_moe_params`,
:func:`moe_param_specs` and the check of a params dict against a config.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxops import _checks
from jaxops import moe as _moe
from jaxops._errors import (
    ArgumentTypeError,
    ConfigError,
    InvalidArgumentError,
    named_errors,
    public_name,
    renamed_fields,
)
from jaxops._lora import Lora, as_lora, lora_init
from jaxops.fp8 import Recipe, as_recipe

__all__ = [
    "DISPATCHES",
    "EXCHANGES",
    "EXPERT_PARAMS",
    "FFN_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "LORA_TARGETS",
    "ROUTERS",
    "MoEAux",
    "MoEConfig",
    "MoESpec",
    "check_params",
    "init_moe_params",
    "moe_param_specs",
]

#: The experts' FFN activations (MoEConfig.activation).
FFN_ACTIVATIONS = ("swiglu", "gelu", "silu", "clamped_swiglu")
#: The gated activations: w_in holds a gate and an up projection (width 2F).
GATED_ACTIVATIONS = ("swiglu", "clamped_swiglu")
#: Router scores (MoEConfig.router).
ROUTERS = ("softmax", "sigmoid")
#: Exchange implementations (MoEConfig.exchange).
EXCHANGES = ("auto", "ragged", "dense", "gather")
#: What crosses the dispatch exchange (MoEConfig.dispatch).
DISPATCHES = ("dtype", "fp8")
#: The weights that take low-rank adapters (MoEConfig.lora.targets): the routed experts' two,
#: the shared expert's projections by transformers' names (its ``shared_w_in`` holds gate and
#: up side by side: each keeps its own adapter), and the router.
LORA_TARGETS = (
    *("w_in", "w_out", "shared_gate_proj", "shared_up_proj", "shared_down_proj"),
    "router",
)
#: FP8 group width (1 x 128 row groups, 128 x 128 weight tiles).
FP8_BLOCK = 128

#: Old -> new MoEConfig field names (the old ones work for one release, with a warning).
RENAMED_FIELDS = {
    "hidden": "hidden_size",
    "ffn_hidden": "expert_ffn",
    "shared_ffn_hidden": "shared_ffn",
    "normalize_probs": "normalize_topk",
    "aux_loss_coef": "router_aux_loss_coef",
    "z_loss_coef": "router_z_loss_coef",
}

_OP = "jaxops.parallel.expert.MoEConfig"
_SPEC_OP = "jaxops.parallel.expert.MoESpec"


def _int(name: str, value: Any, minimum: int, op: str = _OP) -> int:
    try:
        return _checks.check_int(op, name, value, minimum)
    except TypeError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _choice(name: str, value: Any, choices: tuple, op: str = _OP) -> Any:
    if value not in choices:
        raise ConfigError(f"{op}: {name} must be one of {choices}, got {value!r}")
    return value


def _nonneg_float(name: str, value: Any, op: str = _OP) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ArgumentTypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{op}: {name} must be finite and >= 0, got {value}")
    return float(value)


def _pos_float(name: str, value: Any, op: str = _OP) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ArgumentTypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{op}: {name} must be finite and > 0, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The architecture of an MoE layer: its experts, router, shared expert, biases, activation.

    What a checkpoint's config.json says about the layer (``jaxops.models.DecoderConfig.moe`` is
    one); the layer's width and how it runs on a mesh are :class:`MoEConfig`'s. Hashable and
    validated: invalid values raise :class:`jaxops.ConfigError` (a ValueError), or TypeError for
    a wrong type, naming the field.

    Attributes:
      num_experts: E >= 1.
      top_k: K, 1 <= K <= E: experts per token.
      expert_ffn: F, each expert's inner width.
      activation: one of :data:`FFN_ACTIVATIONS`: "swiglu" (``silu(x W_gate) * (x W_up)``, w_in
        holds ``[W_gate | W_up]``), "gelu" (exact, erf), "silu" or "clamped_swiglu" (gpt-oss,
        transformers' ``GptOssExperts._apply_gate``: w_in's columns hold gate and up
        interleaved, ``gate = h[..., 0::2]``, ``up = h[..., 1::2]`` of the first projection's
        output h -- gpt-oss's published layout, so checkpoints map without a permutation --
        then ``gate = min(gate, swiglu_limit)``, ``up = clip(up, -swiglu_limit, swiglu_limit)``
        and ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``). The shared expert uses the
        same activation.
      router: "softmax" (scores = softmax(logits), Mixtral / Qwen-MoE) or "sigmoid"
        (scores = sigmoid(logits), DeepSeek-V3). The k experts are chosen by their scores (plus
        the correction bias, within the chosen groups, see below) and weighted by their scores.
      normalize_topk: divide each token's k weights by their sum (Mixtral: always; Qwen-MoE and
        DeepSeek-V3: ``norm_topk_prob``).
      router_bias: a per-expert correction bias (params["router_bias"], float32 ``[E]``,
        DeepSeek-V3's ``e_score_correction_bias``) added to the scores for the choice of experts
        only: the weights use the raw scores, and the bias gets no gradient. Update it between
        steps with :func:`update_router_bias` (auxiliary-loss-free balancing).
      n_group: group-limited routing: the E experts form `n_group` groups of ``E / n_group``; a
        group's score is the sum of its two best (biased) scores, and each token chooses its k
        experts among the `topk_group` best groups only. 1: no groups.
      topk_group: groups kept per token (1..n_group; None: all of them).
      routed_scaling_factor: the k weights are multiplied by this after the normalization
        (DeepSeek-V3: 2.5).
      shared_ffn: width of the shared expert applied to every token besides the routed
        ones (0: none). DeepSeek-V3's ``n_shared_experts`` shared experts are one FFN of width
        ``n_shared_experts * moe_intermediate_size``; Qwen2-MoE's
        ``shared_expert_intermediate_size``. Same activation as the routed experts; params
        ``shared_w_in [H, F_s']``, ``shared_w_out [F_s, H]``.
      shared_gate: scale the shared expert's output per token by
        ``sigmoid(x @ params["shared_gate"])`` (Qwen2-MoE; ``shared_gate [H, 1]``).
      expert_bias: each routed expert's two projections have biases (gpt-oss's
        ``gate_up_proj_bias`` and ``down_proj_bias``): params ``b_in [E, F']`` and
        ``b_out [E, H]``, sharded over the expert axis like w_in and w_out, and
        ``FFN_e(x) = act(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]``, each bias added in
        float32 to its GEMM's float32 output (with fp8="block", to the FP8 GEMM's output). The
        shared expert has no biases.
      swiglu_alpha: clamped_swiglu's sigmoid scale alpha (finite, > 0; gpt-oss: 1.702).
      swiglu_limit: clamped_swiglu's clamp limit (finite, > 0; gpt-oss: 7.0).
      router_logit_bias: a learned per-expert bias added to the router's float32 logits
        (gpt-oss's ``mlp.router.bias``): param ``router_logit_bias [E]`` (replicated) and
        ``logits = x @ router + router_logit_bias``. It moves the choice, the weights and the
        auxiliary losses, and gets a gradient -- unlike router_bias (a no-gradient correction of
        the choice only), with which it may be combined. gpt-oss's router takes the softmax over
        the top-k logits: that is router="softmax" with normalize_topk=True (the softmax over
        all E experts, then the k chosen renormalized: the partition function cancels).
      weight_inputs: Llama 4's combine (transformers' ``Llama4TextMoe``): each chosen expert
        receives its token scaled by the routing weight and the chosen experts' outputs are
        summed unweighted, ``y[t] = sum_k FFN_{ids[t, k]}(probs[t, k] * x[t])`` (the shared
        expert still sees the unscaled x[t]); the scaled rows are rounded to the compute dtype.
        The router gets its gradient through the scaled rows. Llama 4's router is
        router="sigmoid" with normalize_topk=False. Not with ``MoEConfig.dispatch="fp8"`` (its
        rows are quantized before any weight could apply). False:
        ``y[t] = sum_k probs[t, k] * FFN_{ids[t, k]}(x[t])``.
      router_aux_loss_coef: weight of the load-balancing loss in ``MoEAux.loss`` (the
        config.json key of the same name).

    Example:
      >>> from jaxops.parallel.expert import MoEConfig, MoESpec
      >>> spec = MoESpec(num_experts=8, top_k=2, expert_ffn=128, shared_ffn=64)
      >>> cfg = MoEConfig(spec=spec, hidden_size=64)
      >>> cfg.spec is spec, cfg.num_experts, cfg.param_shapes["shared_w_in"]
      (True, 8, (64, 128))
    """

    num_experts: int
    top_k: int
    expert_ffn: int
    activation: str = "swiglu"
    router: str = "softmax"
    normalize_topk: bool = True
    router_bias: bool = False
    n_group: int = 1
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    shared_ffn: int = 0
    shared_gate: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_logit_bias: bool = False
    weight_inputs: bool = False
    router_aux_loss_coef: float = 1e-2

    def __post_init__(self):
        self._check_sizes()
        self._check_routing()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_sizes(self) -> None:
        op = _SPEC_OP
        e = _int("num_experts", self.num_experts, 1, op)
        k = _int("top_k", self.top_k, 1, op)
        if k > e:
            raise ConfigError(f"{op}: top_k must be <= num_experts = {e}, got {k}")
        _int("expert_ffn", self.expert_ffn, 1, op)
        _choice("activation", self.activation, FFN_ACTIVATIONS, op)
        for name in ("swiglu_alpha", "swiglu_limit"):
            self._set(name, _pos_float(name, getattr(self, name), op))
        _checks.check_bool(op, "expert_bias", self.expert_bias)
        _int("shared_ffn", self.shared_ffn, 0, op)
        _checks.check_bool(op, "shared_gate", self.shared_gate)
        if self.shared_gate and not self.shared_ffn:
            raise ConfigError(f"{op}: shared_gate needs a shared expert (shared_ffn > 0)")

    def _check_routing(self) -> None:
        op = _SPEC_OP
        e, k = self.num_experts, self.top_k
        _choice("router", self.router, ROUTERS, op)
        for name in ("normalize_topk", "router_bias", "router_logit_bias", "weight_inputs"):
            _checks.check_bool(op, name, getattr(self, name))
        groups = _int("n_group", self.n_group, 1, op)
        if e % groups:
            raise ConfigError(
                f"{op}: num_experts = {e} must be divisible by n_group, got n_group = {groups}"
            )
        if groups > 1 and e // groups < 2:
            raise ConfigError(
                f"{op}: n_group = {groups} leaves {e // groups} expert per group; a group's "
                "score is the sum of its 2 best experts, so groups need at least 2"
            )
        kept = groups if self.topk_group is None else self.topk_group
        kept = _int("topk_group", kept, 1, op)
        if kept > groups:
            raise ConfigError(f"{op}: topk_group must be <= n_group = {groups}, got {kept}")
        if k > kept * (e // groups):
            raise ConfigError(
                f"{op}: top_k = {k} exceeds the {kept * (e // groups)} experts of the "
                f"topk_group = {kept} groups a token may use"
            )
        self._set("topk_group", kept)
        scale = _nonneg_float("routed_scaling_factor", self.routed_scaling_factor, op)
        if scale == 0:
            raise ConfigError(f"{op}: routed_scaling_factor must be > 0")
        self._set("routed_scaling_factor", scale)
        name = "router_aux_loss_coef"
        self._set(name, _nonneg_float(name, getattr(self, name), op))

    @property
    def w_in_width(self) -> int:
        """F': the width of w_in (2F for the gated activations' gate and up projections, else F)."""
        return 2 * self.expert_ffn if self.activation in GATED_ACTIVATIONS else self.expert_ffn


#: The fields of a :class:`MoESpec`: :class:`MoEConfig` takes them as keywords and reads them.
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(MoESpec))


def _spec_keywords(cls: type) -> type:
    """`cls`'s constructor also takes the :class:`MoESpec` fields as keywords (see MoEConfig)."""
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = {k: kwargs.pop(k) for k in SPEC_FIELDS if k in kwargs}
        spec = args[0] if args else kwargs.pop("spec", None)
        if spec is not None and not isinstance(spec, MoESpec):
            raise ArgumentTypeError(f"{_OP}: spec must be a MoESpec, got {type(spec).__name__}")
        if spec is None:
            missing = [k for k in ("num_experts", "top_k", "expert_ffn") if k not in given]
            if missing:
                raise ArgumentTypeError(
                    f"{_OP}: give spec= (a MoESpec) or the keywords {', '.join(missing)}"
                )
            spec = MoESpec(**given)
        elif given:
            spec = dataclasses.replace(spec, **given)
        init(self, spec, *args[1:], **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)  # type: ignore[attr-defined]
    cls.__init__ = named_errors(_OP)(__init__)  # type: ignore[method-assign]
    for name in SPEC_FIELDS:
        doc = f"The spec's :attr:`MoESpec.{name}` (``cfg.spec.{name}``)."
        setattr(cls, name, property(lambda self, _n=name: getattr(self.spec, _n), doc=doc))
    return cls


@renamed_fields(RENAMED_FIELDS)
@_spec_keywords
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static configuration of :func:`moe_layer` (hashable: use it as a jit static argument).

    A :class:`MoESpec` (the layer's architecture), the model width and the settings of how the
    layer runs. The spec's fields may be given as keywords instead of `spec` (``MoEConfig(
    num_experts=8, top_k=2, hidden_size=64, expert_ffn=128)`` builds the spec; with `spec`
    they replace its fields, as ``dataclasses.replace(cfg, top_k=1)`` does), and read through
    the config (``cfg.num_experts`` is ``cfg.spec.num_experts``). Invalid values raise
    :class:`jaxops.ConfigError` (a ValueError), or TypeError for a wrong type, naming the
    field. The fields ``hidden``, ``ffn_hidden``, ``shared_ffn_hidden``, ``normalize_probs``,
    ``aux_loss_coef`` and ``z_loss_coef`` were renamed (``hidden_size``, ``expert_ffn``,
    ``shared_ffn``, ``normalize_topk``, ``router_aux_loss_coef``, ``router_z_loss_coef``); their
    old names still work, as keywords and attributes, with a DeprecationWarning.

    Attributes:
      spec: the layer's architecture (:class:`MoESpec`: experts, router, shared expert, biases,
        activation, the load-balancing loss's weight).
      hidden_size: H, the model width (x's last axis). Formerly ``hidden``.
      capacity_factor: None (dropless) or > 0: ``C = ceil(capacity_factor * T * K / E)`` slots per
        expert over the global batch (see the package docstring).
      router_z_loss_coef: weight of the router z-loss in ``MoEAux.loss``. Formerly
        ``z_loss_coef``.
      align: each local expert's group of received rows is padded to a multiple of this
        (8 or 16 suit grouped GEMMs; 1 to 4096).
      expert_axis: the mesh axis the experts are sharded over.
      data_axes: mesh axes (a name or a tuple of names) the batch is sharded over besides the
        expert axis; () for none.
      dtype: compute dtype of the experts (float32, bfloat16 or float16). The router runs in
        float32.
      fp8: None, or the block :class:`jaxops.fp8.Recipe` (``jaxops.fp8.BLOCK``, or its name
        "block"; kept as the Recipe, equal to "block"): expert GEMMs with DeepSeek-V3
        block-scaled FP8 numerics (tokens and gradients in 1 x 128 groups, weights in 128 x 128
        tiles, wgrad operands in 128-token groups per expert, float8_e4m3fn, fp32
        accumulation). The tensor and delayed recipes are refused.
      exchange: how tokens reach their experts' devices. "ragged": ``ragged_all_to_all``
        (GPU; XLA:CPU cannot compile it). "dense": its exact twin from rounds of a dense
        all_to_all of ``[N, block]`` rows and a scatter (``block`` about 1.25x the mean rows
        per peer; more rounds under skewed routing, never more memory). "gather": every device
        all-gathers the expert axis's tokens, runs its experts on the slots routed to them and
        one float32 reduce-scatter sums each token's outputs back (no worst-case blocks; the
        collectives move ``N * Tl`` token rows). "auto": "ragged" on GPU, elsewhere "gather"
        unless a capacity makes the dense form's bound of one peer's rows smaller than ``Tl``.
      dispatch: what crosses the dispatch exchange. "dtype": the tokens in cfg.dtype (with
        fp8="block" the receiver quantizes them). "fp8" (needs fp8="block"), as DeepEP does:
        the sender quantizes its tokens once (1 x 128 groups, float8_e4m3fn, float32 scales),
        permutes the FP8 rows with their scales and sends both (the gather exchange
        all-gathers the FP8 tokens and their scales; half the bytes of bf16, a quarter of
        float32, plus 1/128 of the elements in scales); the receiver feeds them to the grouped
        GEMM as they are. The forward is the same arithmetic as "dtype" (a row's 1 x 128
        groups are the same before and after the exchange). The combine stays in cfg.dtype
        (float32 in the gather exchange's reduce-scatter). Backward: the dispatch's gradient
        crosses back in cfg.dtype -- gradients need the range and precision FP8 would cut, and
        they are quantized only where the recipe quantizes them (the grouped GEMMs' dgrad and
        wgrad); the weight gradient of the first expert GEMM requantizes the received FP8
        tokens in 128-token groups (the sender's original tokens never cross), so it differs
        from "dtype"'s by FP8 rounding. Not with the spec's ``weight_inputs``.
      lora: None, or low-rank adapters (:class:`jaxops.Lora`) on the routed experts' weights
        its ``targets`` name (of :data:`LORA_TARGETS`): each expert e gets its own
        ``A_e [in, r]`` and ``B_e [r, out]`` (params ``<target>_lora_a [E, in, r]`` and
        ``<target>_lora_b [E, r, out]``, sharded over the expert axis like the weights), and
        its GEMM ``x @ W_e`` becomes ``x @ W_e + scaling * (x @ A_e) @ B_e``: two grouped GEMMs
        of rank r on the same permuted rows as the expert GEMM, in cfg.dtype with float32
        accumulation (with fp8="block" the base GEMM stays FP8 and the adapter does not). PEFT's
        ``target_parameters`` LoRA on the fused ``gate_up_proj`` / ``down_proj`` is this
        (:attr:`adapter_names` are the parameters to train; the rest stay frozen by the caller).
        The shared expert's ``shared_gate_proj``, ``shared_up_proj`` and ``shared_down_proj``
        (swiglu only) get one replicated pair each (``shared_gate_proj_lora_a [H, r]``, ...),
        added to the gate's and the up projection's halves of ``shared_w_in`` and to
        ``shared_w_out``'s output. ``router`` adapts the router (``router_lora_a [H, r]``,
        ``router_lora_b [r, E]``, replicated; float32 logits): it moves the choice of experts,
        so it trains only when asked.

    Example:
      >>> from jaxops.parallel.expert import MoEConfig
      >>> cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, expert_ffn=128)
      >>> cfg.w_in_width, cfg.token_axes, cfg.capacity(1024)
      (256, ('data', 'expert'), None)
    """

    spec: MoESpec
    hidden_size: int
    capacity_factor: float | None = None
    router_z_loss_coef: float = 1e-3
    align: int = 8
    expert_axis: str = "expert"
    data_axes: tuple[str, ...] = ("data",)
    dtype: Any = jnp.bfloat16
    fp8: Recipe | str | None = None
    exchange: str = "auto"
    dispatch: str = "dtype"
    lora: Lora | None = None

    def __post_init__(self):
        _int("hidden_size", self.hidden_size, 1)
        lora = as_lora(_OP, self.lora)
        if lora is not None:
            lora.check_targets(_OP, LORA_TARGETS)
            shared = [t for t in lora.targets if t.startswith("shared_")]
            if shared and (not self.shared_ffn or self.activation != "swiglu"):
                raise ConfigError(
                    f"{_OP}: lora targets {shared} need a shared expert with the swiglu "
                    f"activation; shared_ffn = {self.shared_ffn}, activation = "
                    f"{self.activation!r}"
                )
        align = _int("align", self.align, 1)
        if align > _moe.MAX_ALIGN:
            raise ConfigError(f"{_OP}: align must be <= {_moe.MAX_ALIGN}, got {align}")
        if self.capacity_factor is not None:
            cf = _nonneg_float("capacity_factor", self.capacity_factor)
            if cf == 0:
                raise ConfigError(f"{_OP}: capacity_factor must be > 0 or None (dropless)")
            self._set("capacity_factor", cf)
        name = "router_z_loss_coef"
        self._set(name, _nonneg_float(name, getattr(self, name)))
        self._check_layout()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_layout(self) -> None:
        try:  # one FP8 recipe type for every tier; the expert GEMMs run block scaling
            self._set("fp8", as_recipe(self.fp8, _OP, allowed=("block",)))
        except InvalidArgumentError as err:
            raise ConfigError(str(err)) from None
        _choice("exchange", self.exchange, EXCHANGES)
        _choice("dispatch", self.dispatch, DISPATCHES)
        if self.dispatch == "fp8" and self.fp8 != "block":
            raise ConfigError(
                f"{_OP}: dispatch='fp8' quantizes tokens for the block-scaled FP8 expert "
                f"GEMMs and needs fp8='block', got fp8={self.fp8!r}"
            )
        if self.weight_inputs and self.dispatch == "fp8":
            raise ConfigError(
                f"{_OP}: weight_inputs=True scales each expert's input rows by its routing "
                "weight, but dispatch='fp8' quantizes the rows before they are weighted; use "
                "dispatch='dtype' with weight_inputs"
            )
        if not isinstance(self.expert_axis, str):
            raise ArgumentTypeError(
                f"{_OP}: expert_axis must be a mesh axis name (str), got {self.expert_axis!r}"
            )
        data_axes = self.data_axes
        data_axes = (
            () if data_axes is None else (data_axes,) if isinstance(data_axes, str) else data_axes
        )
        if not all(isinstance(a, str) for a in data_axes) or self.expert_axis in data_axes:
            raise ConfigError(
                f"{_OP}: data_axes must be mesh axis names other than expert_axis "
                f"{self.expert_axis!r}, got {self.data_axes!r}"
            )
        self._set("data_axes", tuple(data_axes))
        dtype = np.dtype(self.dtype)
        if dtype not in _checks.FLOAT_DTYPES:
            raise ArgumentTypeError(
                f"{_OP}: dtype must be float32, bfloat16 or float16, got {dtype.name}"
            )
        self._set("dtype", dtype)

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
        """F': the spec's :attr:`MoESpec.w_in_width`."""
        return self.spec.w_in_width

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every parameter :func:`init_moe_params` makes for this config."""
        e, h, f = self.num_experts, self.hidden_size, self.expert_ffn
        shapes = {"router": (h, e), "w_in": (e, h, self.w_in_width), "w_out": (e, f, h)}
        if self.expert_bias:
            shapes["b_in"] = (e, self.w_in_width)
            shapes["b_out"] = (e, h)
        if self.router_bias:
            shapes["router_bias"] = (e,)
        if self.router_logit_bias:
            shapes["router_logit_bias"] = (e,)
        if self.shared_ffn:
            fs = self.shared_ffn
            shapes["shared_w_in"] = (h, 2 * fs if self.activation in GATED_ACTIVATIONS else fs)
            shapes["shared_w_out"] = (fs, h)
            if self.shared_gate:
                shapes["shared_gate"] = (h, 1)
        if self.lora is not None:
            r, fs = self.lora.rank, self.shared_ffn
            widths = {"w_in": ((e,), h, self.w_in_width), "w_out": ((e,), f, h)}
            widths.update(shared_gate_proj=((), h, fs), shared_up_proj=((), h, fs))
            widths["shared_down_proj"] = ((), fs, h)
            widths["router"] = ((), h, e)
            for target in self.lora.targets:
                lead, n_in, n_out = widths[target]
                shapes[f"{target}_lora_a"] = (*lead, n_in, r)
                shapes[f"{target}_lora_b"] = (*lead, r, n_out)
        return shapes

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The adapter parameters (``<target>_lora_a``, ``<target>_lora_b``; () without lora)."""
        if self.lora is None:
            return ()
        return tuple(f"{t}_lora_{ab}" for t in self.lora.targets for ab in "ab")


class MoEAux(NamedTuple):
    """What :func:`moe_layer` reports besides its output (global values, replicated).

    Attributes:
      loss: ``router_aux_loss_coef * load_balancing_loss + router_z_loss_coef * z_loss``
        (float32 scalar): add it to the training loss.
      load_balancing_loss: ``E * sum_e f_e * p_e`` with f_e the fraction of the T*K slots routed
        to expert e (before drops) and p_e the mean over tokens of the router's probability of e
        (softmax, or sigmoid scores normalized over the experts). With a ``token_mask``, T
        counts the unmasked tokens of the whole batch only.
      z_loss: ``mean_t logsumexp(logits_t) ** 2`` (over the unmasked tokens).
      tokens_per_expert: int32 ``[E]``, slots routed to each expert (before drops; unmasked
        tokens only).
      dropped: int32 scalar, slots dropped by the capacity.
    """

    loss: jax.Array
    load_balancing_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array


#: The parameters init_moe_params starts at zero (the biases).
_ZERO_INIT = ("b_in", "b_out", "router_bias", "router_logit_bias")
#: The parameters sharded over the expert axis (their leading axis is E).
EXPERT_PARAMS = (
    *("w_in", "w_out", "b_in", "b_out"),
    *(f"{t}_lora_{ab}" for t in ("w_in", "w_out") for ab in "ab"),
)


def init_moe_params(key: jax.Array, cfg: MoEConfig) -> dict[str, jax.Array]:
    """float32 parameters: ``router [H, E]``, ``w_in [E, H, F']``, ``w_out [E, F, H]``.

    ``F' = 2F`` for swiglu (gate and up projections side by side) and clamped_swiglu (gate and
    up interleaved), else F. Scaled normal initialization (1 / sqrt(fan_in)). With
    ``cfg.expert_bias`` also ``b_in [E, F']`` and ``b_out [E, H]`` (zeros); with
    ``cfg.router_bias`` ``router_bias [E]`` (zeros); with ``cfg.router_logit_bias``
    ``router_logit_bias [E]`` (zeros); with a shared expert ``shared_w_in [H, F_s']``,
    ``shared_w_out [F_s, H]`` and with ``cfg.shared_gate`` ``shared_gate [H, 1]``
    (:attr:`MoEConfig.param_shapes`). The biases start at zero, so a fresh layer computes what
    the same layer without them would. With ``cfg.lora`` each target's adapters as PEFT
    initializes them (:func:`jaxops._lora.lora_init`: ``<target>_lora_a`` uniform in
    ``+-1 / sqrt(in)``, ``<target>_lora_b`` zeros, so the adapters add nothing yet). Place
    them with :func:`moe_param_specs`.

    Example:
      >>> import jax
      >>> from jaxops.parallel.expert import MoEConfig, init_moe_params
      >>> cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, expert_ffn=128)
      >>> {k: v.shape for k, v in init_moe_params(jax.random.key(0), cfg).items()}
      {'router': (64, 8), 'w_in': (8, 64, 256), 'w_out': (8, 128, 64)}
    """
    if not isinstance(cfg, MoEConfig):
        raise ArgumentTypeError(
            f"{public_name(init_moe_params)}: cfg must be a MoEConfig, got {type(cfg).__name__}"
        )
    shapes = cfg.param_shapes
    kr, ki, ko = jax.random.split(key, 3)
    ks = jax.random.split(jax.random.fold_in(key, 1), 3)
    keys = {"router": kr, "w_in": ki, "w_out": ko, "shared_w_in": ks[0], "shared_w_out": ks[1]}
    keys["shared_gate"] = ks[2]
    params = {}
    for name, shape in shapes.items():
        if name in _ZERO_INIT:
            params[name] = jnp.zeros(shape, jnp.float32)
        elif name in cfg.adapter_names:
            continue
        else:  # [..., in, out]: scaled by 1 / sqrt(in)
            params[name] = jax.random.normal(keys[name], shape, jnp.float32) / math.sqrt(shape[-2])
    for i, target in enumerate(cfg.lora.targets if cfg.lora is not None else ()):
        a, b = f"{target}_lora_a", f"{target}_lora_b"
        params[a], params[b] = lora_init(jax.random.fold_in(key, 2 + i), shapes[a], shapes[b])
    return {name: params[name] for name in shapes}


def moe_param_specs(cfg: MoEConfig) -> dict[str, P]:
    """PartitionSpecs of the parameters: experts over the expert axis, the rest replicated.

    w_in, w_out and (with ``cfg.expert_bias``) b_in, b_out are sharded over ``cfg.expert_axis``
    along their leading (expert) axis.

    Example:
      >>> from jaxops.parallel.expert import MoEConfig, moe_param_specs
      >>> cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, expert_ffn=128)
      >>> {name: tuple(spec) for name, spec in moe_param_specs(cfg).items()}
      {'router': (), 'w_in': ('expert',), 'w_out': ('expert',)}
    """
    return {name: P(cfg.expert_axis) if name in EXPERT_PARAMS else P() for name in cfg.param_shapes}


def check_params(op: str, params: Any, cfg: MoEConfig) -> dict[str, jax.Array]:
    """`params` after checking it has exactly the arrays of ``cfg.param_shapes`` (ValueError)."""
    want = cfg.param_shapes
    if not isinstance(params, dict) or set(params) != set(want):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise InvalidArgumentError(
            f"{op}: params must be a dict with keys {sorted(want)}, got {got}"
        )
    for name, shape in want.items():
        arr = _checks.check_array(op, f"params[{name!r}]", params[name])
        if tuple(arr.shape) != shape:
            raise InvalidArgumentError(
                f"{op}: params[{name!r}] must have shape {shape} for {cfg}, got {tuple(arr.shape)}"
            )
    return params
