"""Host memory reuse for XLA:CPU: keep freed memory in the process instead of the kernel's.

XLA:CPU allocates every execution's temporaries (one buffer: a train step's activations and
gradients, hundreds of MiB) and its outputs afresh, from the thread that runs the program. With
glibc's defaults an allocation that large is a fresh ``mmap`` and is unmapped again when freed,
so every step touches new pages and pays a page fault per 4 KiB page: measured here, about
70 ms of a 430-520 ms MoE decoder train step (300 MiB of temporaries), and a jitted program
that fills a 287 MiB temporary took 92-99 ms per execution, 27 ms once its pages are kept
(``tests/test_host.py`` counts the faults). :func:`reuse_host_memory` sets glibc's
``mallopt`` so that large blocks come from the heap and stay there (the same thing a caching
allocator such as TCMalloc or jemalloc, or the GPU runtime's BFC allocator, does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from jaxops._errors import JaxopsError

__all__ = ["reuse_host_memory"]

# glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1


def _backends_initialized() -> bool:
    """Whether jax has made its backends (its CPU client's threads exist then)."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax moved it: assume the worst
        return True
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return True if check is None else bool(check())


def reuse_host_memory() -> bool:
    r"""Keep freed host memory in the process, so XLA:CPU's per-step buffers are not faulted in.

    Sets glibc's ``mallopt``: no ``mmap`` for large blocks (``M_MMAP_MAX = 0``), no returning
    the heap's top to the kernel (``M_TRIM_THRESHOLD`` at its maximum) and one malloc arena for
    every thread (``M_ARENA_MAX = 1``: the buffers XLA's worker threads free are the ones they
    allocate next). The environment variables ``MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_ARENA_MAX=1`` do the same from outside.

    What it costs: the process keeps its peak heap (its resident memory does not shrink when
    big arrays are freed), and threads share one arena's lock. The first executions may still
    fault in fresh pages: a freed block whose neighbours small allocations have taken is too
    small for the next aligned block of the same size, and the heap grows by one (measured:
    up to 4 of 8 executions of a program with a 128 MiB temporary, then none). Where several
    simulated devices allocate at once the heap grows for longer: the MoE decoder's train step
    on 8 simulated devices (2 cores, ``benchmarks/bench_models.py``'s 4x256x16x2x256:16x128 on
    2 x 4) grew its resident memory from 2.3 to 3.5-3.8 GB in bursts over its first 60-100
    steps (440-460 ms each over the first 20), then ran without page faults (385-395 ms);
    without this setting every step faulted in its temporaries (195,000 faults, 600 ms) at a
    flat 1.6 GB. It matters on CPU only: on a GPU, device memory comes from XLA's own caching
    allocator. Nothing numeric changes.

    Huge pages: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment of a new process
    (glibc 2.35 or later, the kernel's transparent huge pages in ``madvise`` or ``always`` mode)
    makes malloc ask for 2 MiB pages, a fault per 2 MiB instead of per 4 KiB. Measured on the
    same step: 429 ms at 1.07 GB without this setting, 374-404 ms with it.

    It must run before jax's first computation (before ``jax.devices()`` or any array is
    made): the arena setting only binds threads that have not allocated yet, and XLA's threads
    start with its CPU client.

    Returns:
      True when the settings were applied; False on a C library without glibc's ``mallopt``
      (macOS, musl): nothing is changed there.

    Raises:
      JaxopsError: jax's backends are already initialized (call it at the top of the program).

    Example:
      At the top of a program, before anything runs on jax (here a fresh, isolated interpreter):

      >>> import subprocess, sys
      >>> code = "import jaxops; print(jaxops.reuse_host_memory())"
      >>> subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True).stdout
      'True\n'
    """
    if _backends_initialized():
        raise JaxopsError(
            "reuse_host_memory: jax's backends are already initialized; call it before the "
            "first JAX computation (before jax.devices() or the first array), or set "
            "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_ARENA_MAX=1 in the "
            "environment"
        )
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only (musl has mallopt as a no-op)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_ARENA_MAX, 1))
    return all(mallopt(param, value) == 1 for param, value in settings)
