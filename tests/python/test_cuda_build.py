"""The CUDA build's seams that a CPU can check (issue 14).

- ``gact.use_allocator()`` hands torch ``gact_torch_alloc`` / ``gact_free`` and wires the
  record-stream, empty-cache and memory-fraction hooks, from the ``_gact`` module itself
  when it has kernels (one device allocator per process); cudnn.benchmark is turned off.
  torch's CUDAPluggableAllocator is replaced by a recorder: there is no GPU here.
- ``tests/cuda/check_runpath.py`` fails a binary that needs libcudart.so.13 without a
  RUNPATH to it and passes one with it.
- ``test_codecs_gpu`` reads GACT_GPU_TEST_QUICK and exits 77 without a device.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

import _gact
import gact
import gact.allocator as galloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_LIB = "/usr/local/cuda/lib64"


class _RecordingNative:
    """What torch's ``CUDAPluggableAllocator.allocator()`` offers: the hook setters."""

    def __init__(self):
        self.hooks = {}

    def __getattr__(self, name):
        if name in ("set_record_stream_fn", "set_reset_fn", "set_memory_fraction_fn", "set_init_fn"):
            return lambda address: self.hooks.__setitem__(name, address)
        raise AttributeError(name)


@pytest.fixture
def fake_pluggable(monkeypatch):
    made = {}

    class FakePluggable:
        def __init__(self, path, alloc_fn, free_fn):
            made["args"] = (path, alloc_fn, free_fn)
            self.native = _RecordingNative()
            made["native"] = self.native

        def allocator(self):
            return self.native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(galloc._compat, "HAS_PLUGGABLE_ALLOCATOR", True)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggable, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator",
                        lambda a: made.__setitem__("current", a), raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.delenv("GACT_LIBRARY", raising=False)
    return made


@pytest.mark.skipif(not getattr(_gact, "have_kernels", False), reason="this _gact has no CUDA kernels")
def test_use_allocator_wires_the_module_and_torch_hooks(fake_pluggable):
    with pytest.warns(RuntimeWarning, match="cudnn.benchmark"):
        path = gact.use_allocator()
    assert path == _gact.__file__                      # the store's own allocators, not libgact.so's
    assert fake_pluggable["args"] == (path, "gact_torch_alloc", "gact_free")
    assert isinstance(fake_pluggable["current"], object) and fake_pluggable["current"].native is fake_pluggable["native"]
    lib = ctypes.CDLL(path)
    addr = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
    assert fake_pluggable["native"].hooks == {
        "set_record_stream_fn": addr("gact_record_stream"),
        "set_reset_fn": addr("gact_empty_cache"),
        "set_memory_fraction_fn": addr("gact_set_memory_fraction"),
    }
    assert torch.backends.cudnn.benchmark is False
    assert galloc.installed == {"library": path, "hooks": list(galloc.HOOKS),
                                "shared_with_store": True}


def test_use_allocator_with_gact_library_uses_that_file(fake_pluggable, monkeypatch, tmp_path):
    lib = os.path.join(os.path.dirname(_gact.__file__), "..", "libgact.so")
    if not os.path.isfile(lib):
        pytest.skip("this build has no libgact.so (no CUDA headers)")
    monkeypatch.setenv("GACT_LIBRARY", lib)
    torch.backends.cudnn.benchmark = False
    assert gact.use_allocator() == lib
    assert fake_pluggable["args"] == (lib, "gact_torch_alloc", "gact_free")
    assert galloc.installed["shared_with_store"] is False
    monkeypatch.setenv("GACT_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match="GACT_LIBRARY"):
        gact.use_allocator()


def _cc():
    return shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(not (os.path.exists(os.path.join(CUDA_LIB, "libcudart.so")) and shutil.which("readelf")),
                    reason="needs the CUDA toolkit's libcudart and readelf")
def test_runpath_checker_fails_a_binary_without_runpath(tmp_path):
    if not _cc():
        pytest.skip("no C compiler")
    src = tmp_path / "p.c"
    src.write_text("int cudaGetDeviceCount(int*);\nint main(void) { int n; return cudaGetDeviceCount(&n) ? 0 : 0; }\n")
    checker = os.path.join(ROOT, "tests", "cuda", "check_runpath.py")
    fake = tmp_path / "fake"
    fake.mkdir()
    results = {}
    for name, extra in (("bare", []), ("with_runpath", [f"-Wl,-rpath,{CUDA_LIB}"])):
        exe = tmp_path / name
        subprocess.run([_cc(), str(src), "-o", str(exe), f"-L{CUDA_LIB}", "-lcudart"] + extra, check=True)
        r = subprocess.run([sys.executable, checker, "--toolkit-libdir", CUDA_LIB, "--fake-dir", str(fake),
                            "--real", str(exe)], stdout=subprocess.PIPE, universal_newlines=True)
        results[name] = (r.returncode, r.stdout)
    assert results["bare"][0] == 1 and "no RUNPATH entry holds libcudart.so.13" in results["bare"][1]
    assert results["with_runpath"][0] == 0, results["with_runpath"][1]


@pytest.mark.skipif(not os.environ.get("GACT_TEST_CODECS_GPU"), reason="this build has no CUDA kernels")
def test_codecs_gpu_program_reads_quick_mode_and_skips_without_a_device():
    exe = os.environ["GACT_TEST_CODECS_GPU"]
    r = subprocess.run([exe], env=dict(os.environ, GACT_GPU_TEST_QUICK="1"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True, timeout=600)
    assert "quick mode (GACT_GPU_TEST_QUICK)" in r.stdout
    plain = subprocess.run([exe], env=dict(os.environ, GACT_GPU_TEST_QUICK="0"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True, timeout=600)
    assert "quick mode" not in plain.stdout
    if r.returncode == 77:
        assert "no CUDA device" in r.stdout
    else:
        assert r.returncode == 0, r.stdout[-2000:]
