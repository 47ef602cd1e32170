"""jaxops.reuse_host_memory: XLA:CPU's per-execution temporaries stop page-faulting.

Each check runs in a fresh interpreter (the setting must come before jax's backends exist) and
counts the minor page faults (``getrusage``) of executions of a jitted function whose
temporaries are 128 MiB, after a first execution: with the default allocator every execution
maps fresh pages (one fault per 4 KiB page, 32768 here); with the setting they are pages an
earlier execution freed. Not every time: the temporary is an aligned block, and when small
allocations have taken the freed block's neighbours it no longer fits there, so the heap grows by
another block (here 0-4 of 8 executions did, mostly the first ones, until the heap held enough
free blocks). The fewest faults of 8 executions is the measure (of 3, one probe in about six
saw none reused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

import jaxops

_PROBE = r"""
import json, resource, sys
import jaxops
applied = jaxops.reuse_host_memory() if sys.argv[1] == "reuse" else None
import jax, jax.numpy as jnp
from jax import lax

def f(x):  # a [64, 512, 1024] float32 stack (128 MiB) filled row by row: a temporary
    z = jnp.zeros((64, 512, 1024), jnp.float32)
    z = lax.fori_loop(0, 64, lambda i, z: lax.dynamic_update_slice(z, x[None] * i, (i, 0, 0)), z)
    return z.sum(axis=(0, 1))

x = jnp.ones((512, 1024), jnp.float32)
c = jax.jit(f).lower(x).compile()
temp = c.memory_analysis().temp_size_in_bytes
jax.block_until_ready(c(x))
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = jax.block_until_ready(c(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
assert float(out[0]) == 512 * sum(range(64)), out[0]
print(json.dumps({"applied": applied, "temp": temp, "faults": min(faults)}))
"""


def _probe(mode: str, cwd) -> dict:
    skip = ("XLA_FLAGS", "JAX_", "MALLOC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-I", "-c", _PROBE, mode],  # -I: the installed jaxops, not ./jaxops
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_reuse_host_memory_stops_the_temporaries_page_faults(tmp_path):
    default, reused = _probe("default", tmp_path), _probe("reuse", tmp_path)
    pages = default["temp"] // 4096
    assert default["temp"] >= 128 * 2**20, default
    assert reused["applied"] is True, reused
    # Default glibc: the 128 MiB temporary is a fresh mmap each execution, faulted page by page.
    assert default["faults"] >= pages // 2, (default, pages)
    # Reused: its pages stay mapped (a few hundred faults of other allocations remain).
    assert reused["faults"] <= pages // 20, (reused, default)


def test_reuse_host_memory_after_jax_started_is_an_error():
    jax.devices()  # the test process's backends exist
    with pytest.raises(jaxops.JaxopsError, match=r"reuse_host_memory: jax's backends are already"):
        jaxops.reuse_host_memory()
