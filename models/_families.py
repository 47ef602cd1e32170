"""Each model type's config.json keys: read into DecoderConfig fields, and written back.

The ``model_type`` s of :data:`MODEL_TYPES`, with transformers' default for every key a file may
leave out (transformers' configuration classes are the specification). :func:`config_fields`
reads a config dict into the keyword arguments of :class:`~jaxops.models.DecoderConfig`;
:func:`hf_keys` writes a config's values back under the model type's keys.
"""

from __future__ import annotations

from typing import Any

from jaxops.models._quant import read_quantization
from jaxops.models._rope import Rope, read_rope, rope_to_hf

from jaxops._errors import ConfigError

__all__ = ["MODEL_TYPES", "config_fields", "hf_keys"]

#: The ``model_type`` values :class:`DecoderConfig` reads (the decoder covers them end to end).
MODEL_TYPES = (
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "ernie4_5_moe",
)

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
}
# transformers' defaults for keys a config.json leaves out: (rms_norm_eps, rope_theta).
_DEFAULTS = {
    "mixtral": (1e-5, 1e6),
    "qwen3_moe": (1e-6, 10000.0),
    "qwen2_moe": (1e-6, 10000.0),
    "olmoe": (1e-5, 10000.0),
    "glm4_moe": (1e-5, 10000.0),
    "deepseek_v3": (1e-6, 10000.0),
    "ernie4_5_moe": (1e-5, 500000.0),
}
# transformers' num_key_value_heads when config.json has none (None: num_attention_heads).
_KV_HEADS = {
    "mixtral": 8,
    "qwen3_moe": 4,
    "qwen2_moe": 16,
    "olmoe": None,
    "glm4_moe": 8,
    "deepseek_v3": None,
    "ernie4_5_moe": 4,
}
# router_aux_loss_coef when config.json has none: transformers' where its model has the loss;
# GLM-4.5 and DeepSeek-V3 balance with the router's correction bias instead (0).
_AUX_COEF = {
    "mixtral": 1e-3,
    "qwen3_moe": 1e-3,
    "qwen2_moe": 1e-3,
    "olmoe": 1e-2,
    "glm4_moe": 0.0,
    "deepseek_v3": 0.0,
    "ernie4_5_moe": 1e-3,
}
# transformers' max_position_embeddings when config.json has none (the "dynamic" RoPE's length,
# and "yarn" / "llama3"'s original length when their parameters have none).
_MAX_POSITIONS = {
    "mixtral": 131072,
    "qwen3_moe": 32768,
    "qwen2_moe": 32768,
    "olmoe": 4096,
    "glm4_moe": 131072,
    "deepseek_v3": 4096,
    "ernie4_5_moe": 131072,
}
# The dense MLP width (intermediate_size) when config.json has none.
_DENSE_FFN = {
    "qwen3_moe": 6144,
    "qwen2_moe": 5632,
    "glm4_moe": 10944,
    "deepseek_v3": 18432,
    "ernie4_5_moe": 12288,
}
# The key of the experts per token.
_TOP_K = {"ernie4_5_moe": "moe_k"}


def _get(cfg: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ConfigError(
                f"config.json: missing {key!r} (model_type {cfg.get('model_type')!r})"
            )
        return default
    value = cfg[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"config.json: {key!r} must be {kinds[0].__name__}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise ConfigError(f"config.json: {key!r} must be {kinds[0].__name__}, got {value!r}")
    return value


def _positive(cfg: dict[str, Any], key: str, default: Any = ...) -> int:
    value = _get(cfg, key, int, default)
    if value < 1:
        raise ConfigError(f"config.json: {key!r} must be >= 1, got {value}")
    return value


def _experts_key(hf: dict[str, Any]) -> str:
    """The key of the routed expert count: num_experts, or its alias num_local_experts."""
    # transformers 5 writes num_local_experts for Qwen too (num_experts is its alias).
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    return key if hf.get(key) is not None else "num_experts"


def _routed_key(hf: dict[str, Any]) -> str:
    """GLM / DeepSeek: n_routed_experts, or its alias num_local_experts."""
    return "n_routed_experts" if hf.get("n_routed_experts") is not None else "num_local_experts"


def _read_rope(
    hf: dict[str, Any], model_type: str, head_dim: int, *, interleave: bool = False
) -> Rope:
    rope = read_rope(
        hf,
        head_dim,
        _DEFAULTS[model_type][1],
        default_max_positions=_MAX_POSITIONS[model_type],
        interleave=interleave,
    )
    if rope.partial_rotary_factor != 1.0 and model_type != "glm4_moe":
        raise ConfigError(
            f"config.json: partial_rotary_factor = {rope.partial_rotary_factor} is not supported "
            f"for {model_type} (transformers rotates its whole head); only 1.0"
        )
    return rope


def _first_dense(hf: dict[str, Any], layers: int, default: int) -> tuple[int, ...]:
    k = _get(hf, "first_k_dense_replace", int, default)
    if k < 0:
        raise ConfigError(f"config.json: 'first_k_dense_replace' must be >= 0, got {k}")
    return tuple(range(min(k, layers)))


def _ernie_dense(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    """ERNIE-4.5: MoE layers are those in [start, end] with (i + 1) % interval == 0."""
    start = _get(hf, "moe_layer_start_index", int, 1)
    end = _get(hf, "moe_layer_end_index", int, -1)
    end = layers - 1 if end == -1 else end
    interval = _positive(hf, "moe_layer_interval", 1)
    return tuple(i for i in range(layers) if not (start <= i <= end and (i + 1) % interval == 0))


def _ernie_range(moe: tuple[int, ...], layers: int) -> dict[str, int]:
    """moe_layer_start_index / end_index / interval saying the MoE layers `moe` (if any do)."""
    for interval in range(1, layers + 1):
        start, end = moe[0], moe[-1]
        if tuple(i for i in range(start, end + 1) if (i + 1) % interval == 0) == moe:
            return dict(moe_layer_start_index=start, moe_layer_end_index=end,
                        moe_layer_interval=interval)  # fmt: skip
    return dict(moe_layer_start_index=-1)  # no such range: refused when read back


def _qwen_dense(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    step = _get(hf, "decoder_sparse_step", int, 1)
    if step < 1:
        raise ConfigError(f"config.json: 'decoder_sparse_step' must be >= 1, got {step}")
    only = _get(hf, "mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: 'mlp_only_layers' must hold ints, got {only!r}")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~jaxops.models.DecoderConfig` keywords of a config.json dict.

    Raises:
      ConfigError: an unsupported model_type, feature or key value (naming it), a missing or
        mistyped key.
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json must hold an object, got {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(MODEL_TYPES)}"
        )
    read_quantization(hf)  # FP8 block checkpoints load; others are refused by name
    act = _get(hf, "hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported; supported: silu")
    hidden = _positive(hf, "hidden_size")
    heads = _positive(hf, "num_attention_heads")
    layers = _positive(hf, "num_hidden_layers")
    head_dim = _get(hf, "head_dim", int, None)
    if head_dim is None and model_type != "deepseek_v3":
        if hidden % heads:
            raise ConfigError(
                f"config.json: hidden_size ({hidden}) is not a multiple of "
                f"num_attention_heads ({heads}) and no head_dim is given"
            )
        head_dim = hidden // heads
    kw: dict[str, Any] = {}
    rope_hf = hf
    if model_type == "mixtral":
        experts = _positive(hf, "num_local_experts")
        kw["expert_ffn"] = _positive(hf, "intermediate_size")
        kw["normalize_topk"] = True
        jitter = _get(hf, "router_jitter_noise", float, 0.0)
        if jitter:
            raise ConfigError(
                f"config.json: router_jitter_noise = {jitter} is not supported (only 0.0)"
            )
        kw["sliding_window"] = _get(hf, "sliding_window", int, None)
    elif model_type == "olmoe":
        experts = _positive(hf, _experts_key(hf))
        kw["expert_ffn"] = _positive(hf, "intermediate_size")
        kw["normalize_topk"] = _get(hf, "norm_topk_prob", bool, False)
        clip = _get(hf, "clip_qkv", float, None)
        if clip is not None:
            raise ConfigError(
                f"config.json: clip_qkv = {clip} is not supported for olmoe; only null"
            )
        if head_dim * heads != hidden:
            raise ConfigError(
                f"config.json: head_dim = {head_dim} is not supported for olmoe: "
                f"transformers' q/k norms have hidden_size ({hidden}) / "
                f"num_attention_heads ({heads}) per head"
            )
        kw["qk_norm"], kw["qk_norm_width"] = True, "projection"
        kw["qkv_bias"] = kw["o_bias"] = _get(hf, "attention_bias", bool, False)
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        experts = _positive(hf, _experts_key(hf))
        kw["expert_ffn"] = _positive(hf, "moe_intermediate_size")
        kw["normalize_topk"] = _get(hf, "norm_topk_prob", bool, False)
        kw["dense_layers"] = _qwen_dense(hf, layers)
        if _get(hf, "use_sliding_window", bool, False):
            raise ConfigError(
                "config.json: use_sliding_window = true is not supported for "
                f"{model_type} (its per-layer windows); only false"
            )
        if model_type == "qwen3_moe":
            kw["qk_norm"] = True
            bias = _get(hf, "attention_bias", bool, False)
            kw["qkv_bias"] = kw["o_bias"] = bias
        else:
            kw["qkv_bias"] = _get(hf, "qkv_bias", bool, True)
            kw["shared_ffn"] = _get(hf, "shared_expert_intermediate_size", int, 5632)
    elif model_type == "ernie4_5_moe":
        experts = _positive(hf, "moe_num_experts", 64)
        kw["expert_ffn"] = ffn = _positive(hf, "moe_intermediate_size", 1536)
        kw["dense_layers"] = _ernie_dense(hf, layers)
        kw["normalize_topk"], kw["router_bias"], kw["shared_gate"] = True, True, False
        kw["shared_ffn"] = _get(hf, "moe_num_shared_experts", int, 2) * ffn
        if _get(hf, "use_bias", bool, False):
            raise ConfigError(
                "config.json: use_bias = true is not supported for ernie4_5_moe (biases on every "
                "linear layer, lm_head included; no published ERNIE-4.5-MoE has them); only false"
            )
        top_k = _positive(hf, "moe_k", 6)
        norm_min = _get(hf, "moe_norm_min", float, 1e-12)
        if norm_min > top_k / experts:  # the top-k softmax weights sum to at least k / E
            raise ConfigError(
                f"config.json: moe_norm_min = {norm_min} is not supported: above moe_k / "
                f"moe_num_experts ({top_k / experts}) it clamps the weights' sum, which jaxops' "
                "router does not"
            )
    else:  # glm4_moe, deepseek_v3: sigmoid routing with a correction bias, shared experts
        deepseek = model_type == "deepseek_v3"
        experts = _positive(hf, _routed_key(hf), 256 if deepseek else 128)
        kw["expert_ffn"] = ffn = _positive(hf, "moe_intermediate_size", 2048 if deepseek else 1408)
        kw["dense_layers"] = _first_dense(hf, layers, 3 if deepseek else 1)
        kw["normalize_topk"] = _get(hf, "norm_topk_prob", bool, True)
        kw["router"], kw["router_bias"], kw["shared_gate"] = "sigmoid", True, False
        kw["n_group"] = _positive(hf, "n_group", 8 if deepseek else 1)
        kw["topk_group"] = _positive(hf, "topk_group", 4 if deepseek else 1)
        kw["routed_scaling_factor"] = _get(
            hf, "routed_scaling_factor", float, 2.5 if deepseek else 1.0
        )
        shared = _get(hf, "n_shared_experts", int, 1)
        if shared < 0:
            raise ConfigError(f"config.json: 'n_shared_experts' must be >= 0, got {shared}")
        kw["shared_ffn"] = shared * ffn
        scoring = _get(hf, "scoring_func", str, "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(
                f"config.json: scoring_func = {scoring!r} is not supported for {model_type} "
                "(transformers' router is sigmoid); only 'sigmoid'"
            )
        if deepseek:
            kw["mla"] = _read_mla(hf)
            head_dim = kw["mla"].qk_rope_head_dim  # transformers' head_dim: the RoPE width
            if _get(hf, "attention_bias", bool, False):
                raise ConfigError(
                    "config.json: attention_bias = true is not supported for deepseek_v3 (no "
                    "published DeepSeek-V3 has it); only false"
                )
        else:
            kw["qk_norm"] = _get(hf, "use_qk_norm", bool, False)
            kw["qkv_bias"] = _get(hf, "attention_bias", bool, False)
            if hf.get("partial_rotary_factor") is None and not _rope_has_partial(hf):
                rope_hf = {**hf, "partial_rotary_factor": 0.5}  # transformers' default
    dense = kw.get("dense_layers", ())
    if dense:
        kw["dense_ffn"] = _positive(hf, "intermediate_size", _DENSE_FFN[model_type])
    interleave = model_type == "ernie4_5_moe" or (
        model_type == "deepseek_v3" and _get(hf, "rope_interleave", bool, True)
    )
    kv_default = _KV_HEADS[model_type] or heads
    return dict(
        model_type=model_type,
        vocab_size=_positive(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_positive(hf, "num_key_value_heads", kv_default),
        head_dim=head_dim,
        num_experts=experts,
        top_k=_positive(hf, _TOP_K.get(model_type, "num_experts_per_tok"), 6)
        if model_type in _TOP_K
        else _positive(hf, "num_experts_per_tok"),
        rms_norm_eps=_get(hf, "rms_norm_eps", float, _DEFAULTS[model_type][0]),
        rope=_read_rope(rope_hf, model_type, head_dim, interleave=interleave),
        tie_word_embeddings=_get(hf, "tie_word_embeddings", bool, model_type == "ernie4_5_moe"),
        router_aux_loss_coef=_get(hf, "router_aux_loss_coef", float, _AUX_COEF[model_type]),
        hf=dict(hf),
        **kw,
    )


def _rope_has_partial(hf: dict[str, Any]) -> bool:
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(key), dict) and hf[key].get("partial_rotary_factor") is not None:
            return True
    return False


def _read_mla(hf: dict[str, Any]) -> Any:
    from jaxops.models._config import Mla

    # An explicit null q_lora_rank: the queries are projected directly (DeepSeek-V2-Lite).
    q_lora = None if "q_lora_rank" in hf and hf["q_lora_rank"] is None else 1536
    return Mla(
        q_lora_rank=q_lora and _positive(hf, "q_lora_rank", q_lora),
        kv_lora_rank=_positive(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=_positive(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_positive(hf, "qk_rope_head_dim", 64),
        v_head_dim=_positive(hf, "v_head_dim", 128),
    )


def hf_keys(c: Any, out: dict[str, Any]) -> dict[str, Any]:
    """`out` (the config dict read, if any) with the model-type keys of config `c` written."""
    out.pop("quantization_config", None)  # written back by save_pretrained when it quantizes
    out.update(
        model_type=c.model_type,
        architectures=[ARCHITECTURES[c.model_type]],
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        num_experts_per_tok=c.top_k,
        hidden_act="silu",
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        router_aux_loss_coef=c.router_aux_loss_coef,
    )
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        out.pop(key, None)  # all in rope_parameters
    out.update(rope_to_hf(c.rope))
    if c.dense_layers:
        out["intermediate_size"] = c.dense_ffn
    first_k = len(c.dense_layers) if c.dense_layers == tuple(range(len(c.dense_layers))) else -1
    if c.model_type == "mixtral":
        out.update(
            num_local_experts=c.num_experts,
            intermediate_size=c.expert_ffn,
            sliding_window=c.sliding_window,
        )
    elif c.model_type == "olmoe":
        out.update(
            num_experts=c.num_experts,
            intermediate_size=c.expert_ffn,
            norm_topk_prob=c.normalize_topk,
            attention_bias=c.qkv_bias,
            clip_qkv=None,
        )
        out.pop("num_local_experts", None)
        out.pop("head_dim", None)  # transformers' q/k norms assume hidden_size / heads
    elif c.model_type in ("qwen3_moe", "qwen2_moe"):
        out.update(
            num_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn,
            norm_topk_prob=c.normalize_topk,
            decoder_sparse_step=1,
            mlp_only_layers=list(c.dense_layers),
            use_sliding_window=False,
        )
        out.pop("num_local_experts", None)
        if c.model_type == "qwen3_moe":
            out["attention_bias"] = c.qkv_bias
        else:
            out["qkv_bias"] = c.qkv_bias
            out["shared_expert_intermediate_size"] = c.shared_ffn
    elif c.model_type == "ernie4_5_moe":
        out.update(
            moe_num_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn,
            moe_k=c.top_k,
            moe_num_shared_experts=c.shared_ffn // c.expert_ffn,
            use_bias=False,
            **_ernie_range(c.moe_layers, c.num_layers),
        )
        for key in ("num_experts_per_tok", "num_experts", "num_local_experts"):
            out.pop(key, None)  # aliases of moe_k and moe_num_experts
    else:
        out.update(
            n_routed_experts=c.num_experts,
            moe_intermediate_size=c.expert_ffn,
            norm_topk_prob=c.normalize_topk,
            first_k_dense_replace=first_k,
            n_group=c.n_group,
            topk_group=c.topk_group,
            routed_scaling_factor=c.routed_scaling_factor,
            n_shared_experts=c.shared_ffn // c.expert_ffn,
        )
        out.pop("num_local_experts", None)
        if c.model_type == "glm4_moe":
            out.update(use_qk_norm=c.qk_norm, attention_bias=c.qkv_bias)
        elif c.mla is not None:
            out.update(
                q_lora_rank=c.mla.q_lora_rank,
                kv_lora_rank=c.mla.kv_lora_rank,
                qk_nope_head_dim=c.mla.qk_nope_head_dim,
                qk_rope_head_dim=c.mla.qk_rope_head_dim,
                v_head_dim=c.mla.v_head_dim,
                rope_interleave=c.rope.interleave,
                attention_bias=False,
            )
    if len(out.get("layer_types") or []) != c.num_layers:
        out.pop("layer_types", None)  # stale (e.g. after a change of num_layers)
    return out
