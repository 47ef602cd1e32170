"""Each model type's config.json keys: read into DecoderConfig fields, and written back.

The ``model_type`` s of :data:`MODEL_TYPES`, with transformers' default for every key a file may
leave out (transformers' configuration classes are the specification). :func:`config_fields`
reads a config dict into the keyword arguments of :class:`~jaxops.models.DecoderConfig`;
:func:`jaxops.models._hf_config.hf_keys` writes a config's values back under the model type's
keys.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from ._quant import read_quantization
from ._rope import Rope, read_rope

__all__ = ["LAYER_TYPES", "MODEL_TYPES", "config_fields"]

#: The ``model_type`` values :class:`DecoderConfig` reads (the decoder covers them end to end).
MODEL_TYPES = (
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "ernie4_5_moe",
    "gpt_oss",
    "llama4_text",
    "minimax_m2",
)
#: A layer's attention pattern (transformers' ``layer_types`` values).
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# transformers' defaults for keys a config.json leaves out: (rms_norm_eps, rope_theta).
_DEFAULTS = {
    "mixtral": (1e-5, 1e6),
    "qwen3_moe": (1e-6, 10000.0),
    "qwen2_moe": (1e-6, 10000.0),
    "olmoe": (1e-5, 10000.0),
    "glm4_moe": (1e-5, 10000.0),
    "deepseek_v3": (1e-6, 10000.0),
    "ernie4_5_moe": (1e-5, 500000.0),
    "gpt_oss": (1e-5, 150000.0),
    "llama4_text": (1e-5, 500000.0),
    "minimax_m2": (1e-6, 5000000.0),
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
    "gpt_oss": 8,
    "llama4_text": 8,
    "minimax_m2": 8,
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
    "gpt_oss": 1e-3,
    "llama4_text": 1e-3,
    "minimax_m2": 1e-3,
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
    "gpt_oss": 131072,
    "llama4_text": 131072,
    "minimax_m2": 196608,
}
# head_dim when config.json has none (absent here: hidden_size / num_attention_heads).
_HEAD_DIM = {"gpt_oss": 64, "llama4_text": 128, "minimax_m2": 128}
# gpt-oss's rope_parameters when config.json has none (transformers' GptOssConfig).
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# The dense MLP width (intermediate_size) when config.json has none.
_DENSE_FFN = {
    "qwen3_moe": 6144,
    "qwen2_moe": 5632,
    "glm4_moe": 10944,
    "deepseek_v3": 18432,
    "ernie4_5_moe": 12288,
    "llama4_text": 16384,
}
# The dense MLP width's key (default: intermediate_size).
_DENSE_KEY = {"llama4_text": "intermediate_size_mlp"}
# The key of the experts per token, and its default where transformers has one.
_TOP_K = {"ernie4_5_moe": "moe_k"}
_TOP_K_DEFAULT = {"ernie4_5_moe": 6, "gpt_oss": 4, "llama4_text": 1, "minimax_m2": 8}


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
    if rope.partial_rotary_factor != 1.0 and model_type not in ("glm4_moe", "minimax_m2"):
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
    if model_type == "llama4":  # the published (multimodal) Llama 4: its text model
        read_quantization(hf)
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(
                "config.json: model_type 'llama4' needs a text_config object (the language "
                f"model's keys), got {type(text).__name__}"
            )
        return config_fields({**text, "model_type": "llama4_text"})
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported; supported: "
            f"{', '.join(MODEL_TYPES)} (and llama4, whose text_config is a llama4_text)"
        )
    read_quantization(hf)  # FP8 block checkpoints load; others are refused by name
    act = _get(hf, "hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} is not supported; supported: silu")
    hidden = _positive(hf, "hidden_size")
    heads = _positive(hf, "num_attention_heads")
    layers = _positive(hf, "num_hidden_layers")
    head_dim = _get(hf, "head_dim", int, _HEAD_DIM.get(model_type))
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
    elif model_type == "gpt_oss":
        experts = _read_gpt_oss(hf, layers, kw)
        if not any(isinstance(hf.get(k), dict) for k in ("rope_parameters", "rope_scaling")):
            rope_hf = {**hf, "rope_parameters": {**_GPT_OSS_ROPE, "rope_theta": hf.get(
                "rope_theta", _DEFAULTS[model_type][1])}}  # fmt: skip
    elif model_type == "llama4_text":
        experts = _read_llama4(hf, layers, kw)
    elif model_type == "minimax_m2":
        experts = _positive(hf, _experts_key(hf), 256)
        kw["expert_ffn"] = _positive(hf, "intermediate_size", 1536)
        kw["normalize_topk"], kw["router"], kw["router_bias"] = True, "sigmoid", True
        kw["qk_norm"], kw["qk_norm_width"] = True, "projection"
        _no_jitter(hf)
        rotary = _get(hf, "rotary_dim", int, None)
        if rotary is not None and hf.get("partial_rotary_factor") is None:
            rope_hf = {**hf, "partial_rotary_factor": rotary / head_dim}  # transformers' legacy key
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
        key = _DENSE_KEY.get(model_type, "intermediate_size")
        kw["dense_ffn"] = _positive(hf, key, _DENSE_FFN[model_type])
    interleave = model_type in ("ernie4_5_moe", "llama4_text") or (
        model_type == "deepseek_v3" and _get(hf, "rope_interleave", bool, True)
    )
    kv_default = _KV_HEADS[model_type] or heads
    top_k_key = _TOP_K.get(model_type, "num_experts_per_tok")
    return dict(
        model_type=model_type,
        vocab_size=_positive(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_positive(hf, "num_key_value_heads", kv_default),
        head_dim=head_dim,
        num_experts=experts,
        top_k=_positive(hf, top_k_key, _TOP_K_DEFAULT.get(model_type, ...)),
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
    from ._config import Mla

    # An explicit null q_lora_rank: the queries are projected directly (DeepSeek-V2-Lite).
    q_lora = None if "q_lora_rank" in hf and hf["q_lora_rank"] is None else 1536
    return Mla(
        q_lora_rank=q_lora and _positive(hf, "q_lora_rank", q_lora),
        kv_lora_rank=_positive(hf, "kv_lora_rank", 512),
        qk_nope_head_dim=_positive(hf, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_positive(hf, "qk_rope_head_dim", 64),
        v_head_dim=_positive(hf, "v_head_dim", 128),
    )


def _no_jitter(hf: dict[str, Any]) -> None:
    jitter = _get(hf, "router_jitter_noise", float, 0.0)
    if jitter:
        raise ConfigError(
            f"config.json: router_jitter_noise = {jitter} is not supported (only 0.0)"
        )


def _layer_types(hf: dict[str, Any], layers: int, default: list[str]) -> tuple[str, ...]:
    types = _get(hf, "layer_types", list, None)
    if types is None:
        return tuple(default)
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"config.json: 'layer_types' must hold num_hidden_layers ({layers}) of "
            f"{LAYER_TYPES}, got {types!r}"
        )
    return tuple(types)


def _read_gpt_oss(hf: dict[str, Any], layers: int, kw: dict[str, Any]) -> int:
    """gpt-oss's keys into `kw`; returns the routed experts."""
    kw["expert_ffn"] = _positive(hf, "intermediate_size", 2880)
    kw["normalize_topk"] = True  # transformers: softmax over the top-k logits, the same weights
    kw["qkv_bias"] = kw["o_bias"] = _get(hf, "attention_bias", bool, True)
    kw["attention_sinks"] = kw["expert_bias"] = kw["router_logit_bias"] = True
    kw["activation"] = "clamped_swiglu"
    kw["swiglu_alpha"] = _get(hf, "swiglu_alpha", float, 1.702)
    kw["swiglu_limit"] = _get(hf, "swiglu_limit", float, 7.0)
    window = hf.get("sliding_window", 128)  # an explicit null: no window
    kw["sliding_window"] = None if window is None else _positive(hf, "sliding_window", 128)
    alternate = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    kw["layer_types"] = _layer_types(hf, layers, alternate)
    return _positive(hf, _experts_key(hf), 128)


def _read_llama4(hf: dict[str, Any], layers: int, kw: dict[str, Any]) -> int:
    """Llama 4's text keys into `kw`; returns the routed experts."""
    kw["expert_ffn"] = ffn = _positive(hf, "intermediate_size", 8192)
    kw["shared_ffn"], kw["shared_gate"] = ffn, False  # its shared expert: intermediate_size wide
    kw["normalize_topk"], kw["router"], kw["weight_inputs"] = False, "sigmoid", True
    kw["qkv_bias"] = kw["o_bias"] = _get(hf, "attention_bias", bool, False)
    _no_jitter(hf)
    step = _positive(hf, "interleave_moe_layer_step", 1)
    moe = _get(hf, "moe_layers", list, list(range(step - 1, layers, step)))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in moe):
        raise ConfigError(f"config.json: 'moe_layers' must hold layer indices, got {moe!r}")
    kw["dense_layers"] = tuple(i for i in range(layers) if i not in set(moe))
    rope = _get(hf, "no_rope_layers", list, None) or [
        int((i + 1) % _positive(hf, "no_rope_layer_interval", 4) != 0) for i in range(layers)
    ]
    if len(rope) != layers or any(r not in (0, 1) or isinstance(r, float) for r in rope):
        raise ConfigError(
            f"config.json: 'no_rope_layers' must hold num_hidden_layers ({layers}) of 0 (no "
            f"RoPE) or 1, got {rope!r}"
        )
    kw["nope_layers"] = tuple(i for i, r in enumerate(rope) if not r)
    chunk = hf["attention_chunk_size"] if "attention_chunk_size" in hf else 8192
    if chunk is not None:
        chunk = _positive(hf, "attention_chunk_size", 8192)
    kw["attention_chunk_size"] = chunk
    kw["layer_types"] = _layer_types(
        hf,
        layers,
        ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope],
    )
    kw["qk_l2_norm"] = _get(hf, "use_qk_norm", bool, True)
    kw["attn_temperature_tuning"] = _get(hf, "attn_temperature_tuning", bool, True)
    kw["floor_scale"] = _get(hf, "floor_scale", float, 8192.0)
    kw["attn_scale"] = _get(hf, "attn_scale", float, 0.1)
    return _positive(hf, "num_local_experts", 16)
