"""Reading config.json keys: typed lookups with transformers' defaults.

And the readers families share (expert counts under their aliases, dense-layer patterns, layer
types). Every reader raises :class:`~jaxops.ConfigError` naming the key, what it needs and what
came.
"""

from __future__ import annotations

from typing import Any

from jaxops._errors import ConfigError

from .._spec import LAYER_TYPES

__all__ = [
    "LAYER_TYPES",
    "experts_key",
    "first_dense",
    "get",
    "layer_types",
    "no_jitter",
    "positive",
    "rope_has_partial",
    "routed_key",
    "sparse_step_dense",
]


def get(cfg: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """``cfg[key]`` of type `kind` (an int is a float where a float is wanted), else `default`.

    A missing or null key without a `default` is refused, as is a value of another type.
    """
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


def positive(cfg: dict[str, Any], key: str, default: Any = ...) -> int:
    """``cfg[key]`` as an int >= 1 (else `default`)."""
    value = get(cfg, key, int, default)
    if value < 1:
        raise ConfigError(f"config.json: {key!r} must be >= 1, got {value}")
    return value


def experts_key(hf: dict[str, Any]) -> str:
    """The key of the routed expert count: num_experts, or its alias num_local_experts."""
    # transformers 5 writes num_local_experts for Qwen too (num_experts is its alias).
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    return key if hf.get(key) is not None else "num_experts"


def routed_key(hf: dict[str, Any]) -> str:
    """GLM / DeepSeek: n_routed_experts, or its alias num_local_experts."""
    return "n_routed_experts" if hf.get("n_routed_experts") is not None else "num_local_experts"


def first_dense(hf: dict[str, Any], layers: int, default: int) -> tuple[int, ...]:
    """The first ``first_k_dense_replace`` layers (GLM, DeepSeek): the dense ones."""
    k = get(hf, "first_k_dense_replace", int, default)
    if k < 0:
        raise ConfigError(f"config.json: 'first_k_dense_replace' must be >= 0, got {k}")
    return tuple(range(min(k, layers)))


def sparse_step_dense(hf: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Qwen's dense layers: ``mlp_only_layers`` and those ``decoder_sparse_step`` skips."""
    step = get(hf, "decoder_sparse_step", int, 1)
    if step < 1:
        raise ConfigError(f"config.json: 'decoder_sparse_step' must be >= 1, got {step}")
    only = get(hf, "mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: 'mlp_only_layers' must hold ints, got {only!r}")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)


def no_jitter(hf: dict[str, Any]) -> None:
    """Refuses a router_jitter_noise other than 0 (training noise jaxops' router does not add)."""
    jitter = get(hf, "router_jitter_noise", float, 0.0)
    if jitter:
        raise ConfigError(
            f"config.json: router_jitter_noise = {jitter} is not supported (only 0.0)"
        )


def layer_types(hf: dict[str, Any], layers: int, default: list[str]) -> tuple[str, ...]:
    """``layer_types`` (one of :data:`LAYER_TYPES` per layer), else `default`."""
    types = get(hf, "layer_types", list, None)
    if types is None:
        return tuple(default)
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"config.json: 'layer_types' must hold num_hidden_layers ({layers}) of "
            f"{LAYER_TYPES}, got {types!r}"
        )
    return tuple(types)


def rope_has_partial(hf: dict[str, Any]) -> bool:
    """Whether the RoPE parameters (old or new key) set a partial_rotary_factor."""
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(key), dict) and hf[key].get("partial_rotary_factor") is not None:
            return True
    return False
