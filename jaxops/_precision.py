"""Matmul precision control: one policy for XLA's dots and jaxops' GEMM custom calls.

:func:`precision` sets, inside its scope, both jax's default matmul precision (so every ``jnp.dot``
/ ``lax.dot_general`` / convolution without an explicit precision follows it) and the jaxops mode
that :func:`jaxops.gemm` reads at trace time and passes to its custom call as an attribute: the
choice is part of the compiled program, never a global read at run time. The mode is part of the
jit cache key, so changing it retraces.

Modes, for float32 operands (16-bit operands always multiply natively with fp32 accumulation;
the bf16 modes are algorithm presets, which XLA applies to 16-bit dots as well):

========== ====================================== ==================================
mode       jax's default_matmul_precision          jaxops GEMM (cuBLASLt compute type)
========== ====================================== ==================================
"fp32"     ``"float32"`` (HIGHEST)                 CUBLAS_COMPUTE_32F
"tf32"     ``"tensorfloat32"`` (HIGH)              CUBLAS_COMPUTE_32F_FAST_TF32
"bf16"     ``"BF16_BF16_F32"`` (algorithm)         CUBLAS_COMPUTE_32F_FAST_16BF
"bf16_3x"  ``"BF16_BF16_F32_X3"`` (algorithm)      XLA's dot (cuBLASLt has no 3-pass bf16)
"default"  unset (XLA's default: TF32 on Hopper)   TF32, like XLA's default
========== ====================================== ==================================

jaxops' grouped GEMM (:mod:`jaxops._grouped_gemm`: the expert layer's FFN GEMMs) follows no mode:
it multiplies float32 in fp32 on every platform (its CUDA kernel has fp32 FMAs, no TF32 path), and
16-bit operands natively with fp32 accumulation (also on cuBLASLt's grouped matmul,
``JAXOPS_GPU_GROUPED_GEMM=cublaslt``, which takes 16-bit operands only).

``JAXOPS_MATMUL_PRECISION=<mode>`` sets the process default at import. ``NVIDIA_TF32_OVERRIDE=0``
means "no TF32 anywhere": "tf32" and "default" then act as "fp32", for XLA's dots too. XLA:CPU has
no TF32; there "tf32" computes in float32.

:func:`precision_report` audits a function: every dot, convolution and jaxops GEMM of its compiled
HLO with the precision it runs with, the grouped GEMM's custom calls included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax._src import config as _jax_config

from jaxops._errors import InvalidArgumentError
from jaxops._grouped_gemm import (
    TARGET_GROUPED_GEMM,
    TARGET_GROUPED_GEMM_LT,
    TARGET_WGRAD,
    TARGET_WGRAD_LT,
)

__all__ = [
    "MODES",
    "PrecisionEntry",
    "PrecisionReport",
    "current_precision",
    "dot_precision",
    "precision",
    "precision_report",
]

MODES: tuple[str, ...] = ("fp32", "tf32", "bf16", "bf16_3x", "default")

# jax's default_matmul_precision value of each mode.
_JAX_VALUE: dict[str, str | None] = {
    "fp32": "float32",
    "tf32": "tensorfloat32",
    "bf16": "BF16_BF16_F32",
    "bf16_3x": "BF16_BF16_F32_X3",
    "default": None,
}

# The mode a user-set jax default_matmul_precision value amounts to.
_MODE_OF_JAX_VALUE: dict[str, str] = {
    "float32": "fp32",
    "highest": "fp32",
    "F32_F32_F32": "fp32",
    "tensorfloat32": "tf32",
    "high": "tf32",
    "TF32_TF32_F32": "tf32",
    "bfloat16": "bf16",
    "BF16_BF16_F32": "bf16",
    "bfloat16_3x": "bf16_3x",
    "BF16_BF16_F32_X3": "bf16_3x",
    "default": "default",
}


def _check_mode(mode: Any, name: str = "mode") -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise InvalidArgumentError(f"jaxops.precision: {name} must be one of {MODES}, got {mode!r}")
    return mode


def _no_tf32() -> bool:
    """Whether NVIDIA_TF32_OVERRIDE=0 forbids TF32 in this process."""
    return os.environ.get("NVIDIA_TF32_OVERRIDE", "").strip() == "0"


def _effective(mode: str) -> str:
    return "fp32" if _no_tf32() and mode in ("tf32", "default") else mode


def _env_default() -> str:
    value = os.environ.get("JAXOPS_MATMUL_PRECISION", "").strip().lower() or "default"
    return _check_mode(value, "JAXOPS_MATMUL_PRECISION")


_mode_state = _jax_config.enum_state(
    name="jaxops_matmul_precision",
    enum_values=list(MODES),
    default=_env_default(),
    help="jaxops: matmul precision mode of jaxops GEMMs (see jaxops.precision).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def _apply_process_default() -> None:
    """At import: make jax's process-wide default follow JAXOPS_MATMUL_PRECISION / the override."""
    mode = _effective(_mode_state.value)
    value = _JAX_VALUE[mode]
    if value is not None and (
        "JAXOPS_MATMUL_PRECISION" in os.environ or jax.config.jax_default_matmul_precision is None
    ):
        jax.config.update("jax_default_matmul_precision", value)


_apply_process_default()


def current_precision() -> str:
    """The precision mode jaxops GEMMs traced now use.

    The innermost :func:`precision` scope, else jax's own default_matmul_precision setting (if
    set), else ``JAXOPS_MATMUL_PRECISION``; with ``NVIDIA_TF32_OVERRIDE=0``, "tf32" and "default"
    read as "fp32".

    Example:
      >>> import jaxops
      >>> with jaxops.precision("bf16"):
      ...     jaxops.current_precision()
      'bf16'
    """
    mode = _mode_state.value
    if mode == "default":
        jax_value = jax.config.jax_default_matmul_precision
        if jax_value is not None:
            mode = _MODE_OF_JAX_VALUE.get(str(jax_value), "default")
    return _effective(mode)


class precision(contextlib.ContextDecorator):
    """Sets the matmul precision of XLA's dots and of jaxops GEMMs, as a context or decorator.

    Inside the scope, ``jax.default_matmul_precision`` is set to the mode's value (see the module
    table) and :func:`jaxops.gemm` passes the mode to its custom call. Scopes nest; leaving one
    restores the enclosing mode. Both settings are thread-local and part of the jit cache key.

    Args:
      mode: "fp32", "tf32", "bf16", "bf16_3x" or "default".

    Raises:
      ValueError: for any other mode.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> @jaxops.precision("fp32")
      ... def f(x, w):
      ...     return jaxops.gemm(x, w, activation="gelu")
      >>> f(jnp.ones((2, 4)), jnp.ones((4, 3))).shape
      (2, 3)
    """

    def __init__(self, mode: str):
        self.mode = _check_mode(mode)
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> precision:
        stack = contextlib.ExitStack()
        effective = _effective(self.mode)
        stack.enter_context(_mode_state(self.mode))
        stack.enter_context(jax.default_matmul_precision(_JAX_VALUE[effective]))
        self._stack.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.pop().close()

    def __repr__(self) -> str:
        return f"jaxops.precision({self.mode!r})"


def dot_precision(mode: str, dtype: Any) -> Any:
    """The ``precision`` argument of lax.dot_general for `mode` and operand `dtype`.

    float32 operands get the mode's precision or algorithm; 16-bit operands multiply natively
    (None), whatever the mode.
    """
    if np.dtype(dtype) != np.dtype(np.float32):
        return None
    return {
        "fp32": jax.lax.Precision.HIGHEST,
        "tf32": jax.lax.Precision.HIGH,
        "bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
        "bf16_3x": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
        "default": None,
    }[mode]


# -------------------------------------------------------------------------------------------------
# precision_report.


@dataclasses.dataclass(frozen=True)
class PrecisionEntry:
    """One matmul of a compiled program.

    Attributes:
      name: the HLO instruction name.
      kind: "dot", "convolution", "jaxops_gemm", "jaxops_gemm_fp8", "jaxops_grouped_gemm",
        "jaxops_grouped_gemm_wgrad" (their cuBLASLt twins "jaxops_grouped_gemm_lt",
        "jaxops_grouped_gemm_wgrad_lt") or XLA's GPU GEMM custom call ("cublas", "cublasLt").
      operands: the operand types, e.g. "f32[128,256] x f32[256,64]".
      precision: what the HLO says: operand precisions, an algorithm, or the jaxops attribute.
      runs_as: how the multiplication is carried out on `platform`: "fp32", "tf32", "bf16",
        "bf16_3x", "native 16-bit", "fp8", or "fp32 (no TF32 on CPU)".
    """

    name: str
    kind: str
    operands: str
    precision: str
    runs_as: str


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """The matmuls of a compiled function (:func:`precision_report`); ``str()`` is a table."""

    platform: str
    entries: tuple[PrecisionEntry, ...]

    def __iter__(self) -> Iterator[PrecisionEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __str__(self) -> str:
        header = ("op", "kind", "operands", "precision (HLO)", f"runs as ({self.platform})")
        rows = [header] + [
            (e.name, e.kind, e.operands, e.precision, e.runs_as) for e in self.entries
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(line.rstrip() for line in lines)


_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+(dot|convolution|custom-call)\((.*)$"
)
_OPERAND_TYPES = re.compile(r"((?:f8e4m3fn|f8e5m2|bf16|f16|f32|f64|s8|s32|u8)\[[\d,]*\])")
_GEMM_TARGETS = {
    "jaxops_gemm": "jaxops_gemm",
    "jaxops_gemm_fp8": "jaxops_gemm_fp8",
    TARGET_GROUPED_GEMM: TARGET_GROUPED_GEMM,
    TARGET_WGRAD: TARGET_WGRAD,
    TARGET_GROUPED_GEMM_LT: TARGET_GROUPED_GEMM_LT,
    TARGET_WGRAD_LT: TARGET_WGRAD_LT,
    "__cublas$gemm": "cublas",
    "__cublas$lt$matmul": "cublasLt",
    "__cublas$lt$matmul$f8": "cublasLt fp8",
}
_GROUPED_KINDS = (TARGET_GROUPED_GEMM, TARGET_WGRAD, TARGET_GROUPED_GEMM_LT, TARGET_WGRAD_LT)
_JAXOPS_PRECISION_NAMES = {0: "fp32", 1: "tf32", 2: "bf16"}


def _operands(text: str, dtypes_of: dict[str, str]) -> list[str]:
    inner = text.split(")", 1)[0]
    types = _OPERAND_TYPES.findall(inner)
    if types:
        return types
    # Compiled HLO names operands without types: look them up.
    return [dtypes_of.get(name.strip().lstrip("%"), "?") for name in inner.split(",") if name]


def _runs_as(kind: str, operand_types: list[str], precision: str, platform: str) -> str:
    dtype = operand_types[0].split("[")[0] if operand_types else "?"
    if dtype.startswith("f8") or "fp8" in kind:
        return "fp8"
    if dtype in ("bf16", "f16") and "x3" not in precision.lower():
        return "native 16-bit"
    low = precision.lower()
    if "bf16_bf16_f32_x3" in low or "bf16_3x" in low:
        return "bf16_3x"
    if "bf16_bf16_f32" in low or low == "bf16":
        return "bf16"
    if "highest" in low or "f32_f32_f32" in low or low == "fp32":
        return "fp32"
    tf32 = "tf32" in low or "high" in low or low in ("default", "")
    if tf32:
        if platform == "cpu":
            return "fp32 (no TF32 on CPU)"
        return "fp32" if _no_tf32() else "tf32"
    return low


def _precision_of(kind: str, rest: str) -> str:
    if kind == "jaxops_gemm":
        match = re.search(r"precision\s*=\s*(\d+)", rest)
        return _JAXOPS_PRECISION_NAMES.get(int(match.group(1)), "?") if match else "?"
    if kind == "jaxops_gemm_fp8":
        return "fp8"
    if kind in _GROUPED_KINDS:
        return "fp32"  # no mode: fp32 products of float32, native products of 16-bit operands
    algorithm = re.search(r"algorithm=(\w+)", rest)
    if algorithm:
        return algorithm.group(1)
    operand_precision = re.search(r"operand_precision=\{([^}]*)\}", rest)
    if operand_precision:
        return operand_precision.group(1)
    # XLA:GPU GEMM custom calls carry a JSON backend_config.
    alg = re.search(r'"algorithm":"(\w+)"', rest)
    if alg and alg.group(1) not in ("ALG_UNSET",):
        return alg.group(1)
    ops = re.search(r'"operand_precision":\[([^\]]*)\]', rest)
    if ops:
        return ops.group(1).replace('"', "").lower()
    return "default"


def precision_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PrecisionReport:
    """Compiles ``fn(*args, **kwargs)`` and lists every matmul with the precision it runs with.

    Reads the compiled (optimized) HLO of ``jax.jit(fn)`` for the default backend, fusions
    included: XLA dots and convolutions with their operand precision or algorithm, XLA:GPU's own
    cuBLAS GEMM custom calls, jaxops' GEMM custom calls with the mode they were traced with, and
    jaxops' grouped GEMM custom calls (float32 always in fp32).
    Use it to check that nothing silently runs in TF32 (or in bf16).

    Args:
      fn: the function to compile (jit-able).
      *args: its arguments (arrays or jax.ShapeDtypeStruct).
      **kwargs: its keyword arguments.

    Returns:
      A :class:`PrecisionReport`; ``print(report)`` shows a table.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> report = jaxops.precision_report(lambda x: x @ x, jnp.ones((8, 8)))
      >>> [e.kind for e in report]
      ['dot']
    """
    compiled = jax.jit(fn).lower(*args, **kwargs).compile()
    platform = jax.default_backend()
    text = compiled.as_text()
    dtypes_of: dict[str, str] = {}
    entries = []
    for line in text.splitlines():
        head = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s", line)
        if head:
            dtypes_of[head.group(1)] = head.group(2)
        match = _INSTR.match(line)
        if not match:
            continue
        name, _, op, rest = match.groups()
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            if not target or target.group(1) not in _GEMM_TARGETS:
                continue
            kind = _GEMM_TARGETS[target.group(1)]
        else:
            kind = op
        operand_types = _operands(rest, dtypes_of)
        precision_text = _precision_of(kind, rest)
        entries.append(
            PrecisionEntry(
                name=name,
                kind=kind,
                operands=" x ".join(re.sub(r"\{[^}]*\}", "", t) for t in operand_types[:2]),
                precision=precision_text,
                runs_as=_runs_as(kind, operand_types, precision_text, platform),
            )
        )
    return PrecisionReport(platform=platform, entries=tuple(entries))
