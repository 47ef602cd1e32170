"""What an installed jaxops says about itself: build_info's op paths, the missing-CUDA warning.

A GPU backend is faked on this CPU machine by monkeypatching the detection jaxops uses
(``jaxops._ffi._gpu_backend_present`` and the signs it reads); nothing here starts a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import pytest

import jaxops
from jaxops import _ffi

FAMILIES = {"rms_norm", "fp8", "moe", "gemm", "grouped_gemm"}


class _FakeCudaModule:
    def __init__(self, cublaslt):
        self._cublaslt = cublaslt

    def build_info(self):
        return {"platform": "CUDA", "cublaslt": self._cublaslt}


@pytest.fixture
def no_cuda_module(monkeypatch):
    """This install as a CPU-only build: no CUDA module, none that failed, no warning yet."""
    monkeypatch.delitem(_ffi._modules, "CUDA", raising=False)
    monkeypatch.delitem(_ffi._load_errors, "_jaxops_cuda", raising=False)
    monkeypatch.setattr(_ffi, "_warned_cuda_missing", False)


def _missing_warnings(calls=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            _ffi._warn_if_cuda_module_missing()
    return [w for w in caught if issubclass(w.category, jaxops.CudaModuleMissingWarning)]


def test_warning_category_is_public():
    assert "CudaModuleMissingWarning" in jaxops.__all__
    assert issubclass(jaxops.CudaModuleMissingWarning, UserWarning)


def test_warns_once_on_a_gpu_without_the_cuda_module(monkeypatch, no_cuda_module):
    monkeypatch.setattr(_ffi, "_gpu_backend_present", lambda: True)
    caught = _missing_warnings(calls=3)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "no CUDA module in this install" in message
    assert "jax's CUDA GPU backend is present" in message
    assert "pip install 'jaxops[cuda13]'" in message
    assert "nvcc on PATH" in message and "JAXOPS_CUDA=ON" in message


def test_no_warning_without_a_gpu(monkeypatch, no_cuda_module):
    monkeypatch.setattr(_ffi, "_gpu_backend_present", lambda: False)
    assert _missing_warnings() == []


def test_no_warning_with_the_cuda_module(monkeypatch, no_cuda_module):
    monkeypatch.setattr(_ffi, "_gpu_backend_present", lambda: True)
    monkeypatch.setitem(_ffi._modules, "CUDA", _FakeCudaModule("wheel"))
    assert _missing_warnings() == []


def test_gpu_detection_before_backends_start(monkeypatch, tmp_path):
    # The import-time path: jax's backends not started, judged from plugin, driver and env.
    if jax.config.jax_platforms:
        pytest.skip("jax_platforms is configured in this environment")
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    for name in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(_ffi, "_CUDA_PLUGIN_MODULES", ("json",))  # stands in for the plugin
    monkeypatch.setattr(_ffi, "_NVIDIA_GPU_PATHS", (str(tmp_path / "nvidia[0-9]*"),))
    assert _ffi._gpu_backend_present()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not _ffi._gpu_backend_present()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert _ffi._gpu_backend_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not _ffi._gpu_backend_present()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(_ffi, "_CUDA_PLUGIN_MODULES", ("jaxops_no_such_plugin",))
    assert not _ffi._gpu_backend_present()
    monkeypatch.setattr(_ffi, "_CUDA_PLUGIN_MODULES", ("json",))
    monkeypatch.setattr(_ffi, "_NVIDIA_GPU_PATHS", (str(tmp_path / "none[0-9]*"),))
    assert not _ffi._gpu_backend_present()


def test_import_warns_only_on_a_gpu_without_the_cuda_module(tmp_path):
    # A fresh interpreter, from outside the source tree: import jaxops, then list the warnings.
    code = textwrap.dedent(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import jaxops
        print(sum(w.category is jaxops.CudaModuleMissingWarning for w in caught))
        print(jaxops._ffi._gpu_backend_present() and not jaxops.cuda_available())
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    count, expected = out.stdout.split()
    assert count == ("1" if expected == "True" else "0")


def test_build_info_paths_on_cpu():
    info = jaxops.build_info()
    assert info["cpu"]["platform"] == "cpu"
    paths = info["paths"]
    assert set(paths) == FAMILIES
    if jax.default_backend() == "cpu":
        for family in ("rms_norm", "fp8", "moe", "grouped_gemm"):
            assert paths[family] == "custom call (CPU module)"
        assert paths["gemm"].startswith("pure-JAX twin: no CPU GEMM kernel")
    with jaxops.default_impl("xla"):
        forced = jaxops.build_info()["paths"]
    assert all(p.startswith("pure-JAX twin: forced") for p in forced.values()), forced


def test_op_paths_on_gpu(monkeypatch, no_cuda_module):
    paths = _ffi.op_paths("gpu")
    assert set(paths) == FAMILIES
    assert all(
        p == "pure-JAX twin: no CUDA module in this install (jaxops was built without nvcc)"
        for p in paths.values()
    ), paths
    monkeypatch.setitem(_ffi._load_errors, "_jaxops_cuda", "libcublasLt.so.13: not found")
    assert "failed to load (libcublasLt.so.13: not found)" in _ffi.op_paths("gpu")["fp8"]
    monkeypatch.delitem(_ffi._load_errors, "_jaxops_cuda")

    monkeypatch.setattr(_ffi, "kernel_available", lambda backend: True)
    monkeypatch.setitem(_ffi._modules, "CUDA", _FakeCudaModule("wheel"))
    assert _ffi.op_paths("gpu") == dict.fromkeys(FAMILIES, "custom call (CUDA module)")
    monkeypatch.setitem(_ffi._modules, "CUDA", _FakeCudaModule(None))
    paths = _ffi.op_paths("gpu")
    assert paths["rms_norm"] == "custom call (CUDA module)"
    assert paths["gemm"] == "pure-JAX twin: the CUDA module was built without cuBLASLt"
    assert _ffi.op_paths("tpu")["moe"] == "pure-JAX twin: no jaxops kernels for the tpu backend"
