"""Testing helpers: per-dtype tolerances, collective counting in compiled HLO, multi-process runs.

Used by jaxops' own test suite and useful to check that user code built on jaxops stays local
under sharding. :func:`run_docstring_examples` runs the examples of every module of a package.
:func:`run_processes` runs a script in N local ``jax.distributed`` processes
(gloo on 127.0.0.1) with a hard deadline, for multi-host code on one machine.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxops import testing
  >>> text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
  >>> testing.count_collectives(text)
  {}
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxops._errors import InvalidArgumentError

__all__ = [
    "COLLECTIVES",
    "assert_allclose",
    "child_environ",
    "collective_bytes",
    "collective_shapes",
    "count_collectives",
    "free_port",
    "run_docstring_examples",
    "run_processes",
    "spawn_processes",
    "tolerance",
]

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
    "ragged-all-to-all",
)

# Relative tolerance of one rounding to the dtype plus fp32 accumulation error.
_TOLERANCES = {
    "float64": {"rtol": 1e-12, "atol": 1e-12},
    "float32": {"rtol": 2e-5, "atol": 2e-5},
    "bfloat16": {"rtol": 2**-7, "atol": 2**-7},
    "float16": {"rtol": 2**-10, "atol": 2**-10},
}


def tolerance(dtype: Any) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for comparing a result computed in `dtype` with float64.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.testing import tolerance
      >>> tolerance(jnp.bfloat16)["rtol"]
      0.0078125
    """
    name = np.dtype(dtype).name
    if name not in _TOLERANCES:
        raise InvalidArgumentError(
            f"jaxops.testing.tolerance: no tolerance for dtype {name}; known: {sorted(_TOLERANCES)}"
        )
    return dict(_TOLERANCES[name])


def assert_allclose(
    actual: Any, expected: Any, dtype: Any = None, *, scale: float = 1.0, err_msg: str = ""
) -> None:
    """Asserts closeness with the tolerance of `dtype` (default: `actual`'s dtype) times `scale`.

    NaNs must be in the same places; infinities must match exactly.
    """
    dtype = np.asarray(actual).dtype if dtype is None else dtype
    tol = tolerance(dtype)
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64),
        np.asarray(expected, dtype=np.float64),
        rtol=tol["rtol"] * scale,
        atol=tol["atol"] * scale,
        equal_nan=True,
        err_msg=err_msg,
    )


_OP = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Counts collective instructions (async pairs counted once) in compiled HLO text."""
    counts: dict[str, int] = {}
    for match in _OP.finditer(hlo_text):
        counts[match.group(2)] = counts.get(match.group(2), 0) + 1
    return counts


def collective_shapes(hlo_text: str, kind: str) -> list[str]:
    """Result shapes (e.g. ``"f32[16]{0}"``) of every `kind` collective in compiled HLO text."""
    return [m.group(1) for m in _OP.finditer(hlo_text) if m.group(2) == kind]


_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4}
_HLO_BYTES.update({"u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8})


def collective_bytes(shape: str) -> int:
    """Bytes of one collective's result shape from :func:`collective_shapes` (tuples summed).

    Example:
      >>> from jaxops.testing import collective_bytes
      >>> collective_bytes("(u8[1,20,256]{2,1,0}, f32[1,20,2]{2,1,0})")
      5280
    """
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * (1 if dtype.startswith("f8") else _HLO_BYTES[dtype])
    return total


# Multi-process runs.

# Prepended to every script: initializes jax.distributed from argv (port, count, id, devices).
_PRELUDE = """
import sys
import jax
_port, NUM_PROCESSES, PROCESS_ID, _devices = map(int, sys.argv[1:5])
ARGS = sys.argv[5:]
jax.config.update("jax_num_cpu_devices", _devices)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    f"127.0.0.1:{_port}", NUM_PROCESSES, PROCESS_ID,
    heartbeat_timeout_seconds=10, initialization_timeout=60, shutdown_timeout_seconds=10,
)
"""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count(=\S*)?")


def child_environ(environ: Mapping[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """An environment for a child jax process: `environ` less its CPU device count.

    Args:
      environ: the environment to start from; ``os.environ`` when None.
      **overrides: variables set on top.

    Returns:
      A new dict: ``JAX_NUM_CPU_DEVICES`` and XLA's ``--xla_force_host_platform_device_count``
      flag are left out (the child sets its own count); the rest of ``XLA_FLAGS`` passes through
      (compiler options, such as the fast-compile flags of jaxops' test suite on CPU machines),
      and ``XLA_FLAGS`` itself is left out when nothing else is in it.

    Example:
      >>> from jaxops.testing import child_environ
      >>> parent = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_ftz=true",
      ...           "JAX_NUM_CPU_DEVICES": "8", "HOME": "/root"}
      >>> child_environ(parent, JAX_PLATFORMS="cpu")
      {'HOME': '/root', 'XLA_FLAGS': '--xla_cpu_ftz=true', 'JAX_PLATFORMS': 'cpu'}
      >>> child_environ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
      {}
    """
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    flags = " ".join(_DEVICE_COUNT_FLAG.sub("", source.get("XLA_FLAGS", "")).split())
    if flags:
        env["XLA_FLAGS"] = flags
    env.update(overrides)
    return env


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def spawn_processes(
    script: str,
    num_processes: int,
    devices_per_process: int,
    *,
    args: tuple[str, ...] = (),
    timeout: float = 240.0,
) -> list[tuple[int | None, str]]:
    """Runs `script` in `num_processes` processes; returns (exit code, output) per process.

    As :func:`run_processes`, but a failing process is not an error: the caller inspects the
    exit codes. A process still running at the deadline is killed and reported with code None.

    Example:
      >>> from jaxops.testing import spawn_processes
      >>> [code for code, _ in spawn_processes("sys.exit(PROCESS_ID)", 2, 1)]
      [0, 1]
    """
    port = free_port()
    env = child_environ(JAX_PLATFORMS="cpu")
    code = _PRELUDE + textwrap.dedent(script)
    argv = [sys.executable, "-c", code, str(port), str(num_processes)]
    procs = [
        subprocess.Popen(
            [*argv, str(i), str(devices_per_process), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd="/",
            start_new_session=True,
        )
        for i in range(num_processes)
    ]
    deadline = time.monotonic() + timeout
    results: list[tuple[int | None, str]] = []
    try:
        for p in procs:
            left = max(deadline - time.monotonic(), 0.1)
            try:
                out, _ = p.communicate(timeout=left)
                results.append((p.returncode, out))
            except subprocess.TimeoutExpired:
                _kill([p])
                results.append((None, p.communicate()[0]))
    finally:
        _kill(procs)
    return results


def run_processes(
    script: str,
    num_processes: int,
    devices_per_process: int,
    *,
    args: tuple[str, ...] = (),
    timeout: float = 240.0,
) -> list[str]:
    """Runs `script` in `num_processes` processes; returns their outputs, or raises.

    The script sees NUM_PROCESSES, PROCESS_ID and ARGS (extra argv strings), with
    jax.distributed already initialized over gloo; the processes run on CPU devices, in
    :func:`child_environ`'s environment. Raises AssertionError if a process fails or
    the deadline passes (every process is then killed), showing all outputs.

    Example:
      >>> from jaxops.testing import run_processes
      >>> outs = run_processes("print(PROCESS_ID, jax.device_count())", 2, 2)
      >>> [o.split() for o in outs]
      [['0', '4'], ['1', '4']]
    """
    results = spawn_processes(
        script, num_processes, devices_per_process, args=args, timeout=timeout
    )
    outputs = [out for _, out in results]
    codes = [code for code, _ in results]
    if None in codes:
        raise AssertionError(
            f"jaxops.testing.run_processes: processes did not finish in {timeout} s:\n"
            + "\n----\n".join(outputs)
        )
    if any(codes):
        raise AssertionError(
            f"jaxops.testing.run_processes: exit codes {codes}:\n" + "\n----\n".join(outputs)
        )
    return outputs


def run_docstring_examples(package: Any, *, skip: Sequence[str] = ()) -> int:
    """Runs the docstring examples of `package` and of every module in it (private ones too).

    Args:
      package: an imported module or package (e.g. ``jaxops.parallel.expert``).
      skip: dotted names of modules or subpackages to leave out, with everything under them
        (e.g. ``("jaxops.parallel", "jaxops.models")`` for the core package alone).

    Returns:
      The number of examples run.

    Raises:
      AssertionError: naming the module whose examples failed (doctest printed which).

    Example:
      >>> from jaxops import _rows, testing
      >>> testing.run_docstring_examples(_rows)
      4
    """
    import doctest
    import importlib
    import pkgutil

    def skipped(name: str) -> bool:
        # An editable install's package path also holds the repository root, where the core's
        # own folder shows up again as "jaxops.jaxops": not a module of the package.
        if "jaxops" in name.split(".")[1:]:
            return True
        return any(name == s or name.startswith(s + ".") for s in skip)

    modules = [package]
    if hasattr(package, "__path__"):
        modules += [
            importlib.import_module(m.name)
            for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
            if not skipped(m.name)
        ]
    attempted = 0
    for module in modules:
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, (module.__name__, result)
        attempted += result.attempted
    return attempted
