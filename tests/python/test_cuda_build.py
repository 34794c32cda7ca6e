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
import re
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
    originals = (torch.cuda.memory_stats_as_nested_dict, torch.cuda.reset_peak_memory_stats)
    yield made
    while galloc._served:  # use_allocator() replaced torch's memory functions: torch's again
        owner, name, fn = galloc._served.pop()
        setattr(owner, name, fn)
    assert (torch.cuda.memory_stats_as_nested_dict, torch.cuda.reset_peak_memory_stats) == originals
    if galloc.installed is not None and galloc.installed.get("oom_error") == "torch.OutOfMemoryError":
        lib = ctypes.CDLL(galloc.installed["library"])  # the library keeps the thrower it was given: cleared
        lib.gact_set_oom_thrower.restype = ctypes.c_void_p
        lib.gact_set_oom_thrower.argtypes = [ctypes.c_void_p]
        lib.gact_set_oom_thrower(None)


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
    try:
        import _gact_torch  # noqa: F401
        oom_error = "torch.OutOfMemoryError"  # the thrower of _gact_torch, built against this torch's c10
    except ImportError:
        oom_error = "RuntimeError"
    assert galloc.installed == {"library": path, "hooks": list(galloc.HOOKS), "oom_error": oom_error,
                                "shared_with_store": True}
    served = {(owner.__name__, name) for owner, name, _ in galloc._served}
    assert served == {(m, f) for m in ("torch.cuda", "torch.cuda.memory")
                      for f in ("memory_stats_as_nested_dict", "reset_peak_memory_stats")}


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


_ALLOCATOR_ALONE = r"""
import ctypes, importlib, os, sys, types
import torch
# gact.allocator alone, with libgact.so over the fake CUDA runtime (the _gact module links the real one)
sys.modules["_gact"] = types.ModuleType("_gact")
pkg = types.ModuleType("gact")
pkg.__path__ = [sys.argv[1]]
sys.modules["gact"] = pkg
galloc = importlib.import_module("gact.allocator")
lib = ctypes.CDLL(os.environ["GACT_LIBRARY"])
"""

_MEMORY_API_SCRIPT = r"""
galloc.serve_torch_memory_api(lib)
lib.gact_alloc.restype = ctypes.c_void_p
lib.gact_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.gact_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
MiB = 1 << 20
seen = {"before": (torch.cuda.memory_allocated(0), torch.cuda.max_memory_allocated(0))}
a = lib.gact_alloc(3 * MiB, 0, None)
b = lib.gact_alloc(5 * MiB, 0, None)
seen["two"] = (torch.cuda.memory_allocated(0), torch.cuda.max_memory_allocated(0),
               torch.cuda.memory_reserved("cuda:0"), torch.cuda.max_memory_reserved(torch.device("cuda", 0)))
lib.gact_free(b, 5 * MiB, 0, None)
seen["freed"] = (torch.cuda.memory_allocated(0), torch.cuda.max_memory_allocated(0))
torch.cuda.reset_peak_memory_stats(0)
seen["reset"] = (torch.cuda.memory_allocated(0), torch.cuda.max_memory_allocated(0))
torch.cuda.reset_max_memory_allocated(0)
stats = torch.cuda.memory_stats(0)
seen["stats"] = (stats["allocation.all.current"], stats["num_ooms"], stats["segment.all.current"] >= 1)
summary = torch.cuda.memory_summary(0)
seen["summary"] = [line for line in summary.splitlines() if line.startswith("|") and "Allocated memory" in line]
lib.gact_free(a, 3 * MiB, 0, None)
print(repr(seen))
"""


def _run_with_libgact(script: str) -> dict:
    """Run `script` (gact.allocator alone, with libgact.so over the fake CUDA runtime) in its own process; the
    dict it printed last (its repr)."""
    lib = os.path.normpath(os.path.join(os.path.dirname(_gact.__file__), "..", "libgact.so"))
    fake = os.path.normpath(os.path.join(os.path.dirname(lib), "..", "tests", "fake_cudart"))
    if not os.path.isfile(os.path.join(fake, "libcudart.so.13")):
        pytest.skip("this build has no fake CUDA runtime")
    env = dict(os.environ, GACT_LIBRARY=lib, LD_LIBRARY_PATH=fake + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    pkg = os.path.dirname(os.path.abspath(galloc.__file__))
    r = subprocess.run([sys.executable, "-c", _ALLOCATOR_ALONE + script, pkg], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 (the script's own repr)


@pytest.mark.skipif(not os.path.isfile(os.path.join(os.path.dirname(_gact.__file__), "..", "libgact.so")),
                    reason="this build has no libgact.so (no CUDA headers)")
def test_torch_memory_api_answers_with_gacts_figures_under_use_allocator():
    """Under a pluggable allocator torch's memory_stats() raises (it asks the allocator for statistics
    pluggable allocators do not have), so a trainer that logs memory the usual way crashed under
    use_allocator(). gact answers instead: memory_allocated, max_memory_allocated, memory_reserved,
    max_memory_reserved, reset_peak_memory_stats, memory_stats and memory_summary follow gact's allocator,
    here libgact.so over the fake CUDA runtime (a separate process: torch's functions are replaced)."""
    seen = _run_with_libgact(_MEMORY_API_SCRIPT)
    MiB = 1 << 20
    assert seen["before"] == (0, 0)
    allocated, peak, reserved, max_reserved = seen["two"]
    assert allocated == peak == 8 * MiB and reserved >= 8 * MiB and max_reserved >= reserved
    assert seen["freed"] == (3 * MiB, 8 * MiB)
    assert seen["reset"] == (3 * MiB, 3 * MiB)  # the peak starts again from what is allocated now
    assert seen["stats"] == (1, 0, True)
    # memory_summary's row: current, peak (since the reset), allocated in all, freed in all (KiB)
    (row,) = seen["summary"]
    assert [int(n) for n in re.findall(r"(\d+) Ki?B", row)] == [3072, 3072, 8192, 5120], row


_OOM_THROWER_SCRIPT = r"""
import _gact_torch
seen = {"error": galloc.set_oom_thrower(lib)}
lib.gact_set_oom_thrower.restype = ctypes.c_void_p
lib.gact_set_oom_thrower.argtypes = [ctypes.c_void_p]
seen["wired"] = lib.gact_set_oom_thrower(None) == _gact_torch.oom_thrower()  # (and cleared again)
seen["throws"] = _gact_torch.check_oom_thrower("CUDA out of memory. Tried to allocate 2.00 GiB on GPU 0")
print(repr(seen))
"""


@pytest.mark.skipif(not os.path.isfile(os.path.join(os.path.dirname(_gact.__file__), "..", "libgact.so")),
                    reason="this build has no libgact.so (no CUDA headers)")
def test_use_allocator_gives_the_library_torchs_out_of_memory_thrower():
    """Under use_allocator() an exhausted device raised gact's own error, a RuntimeError to torch, which
    cuDNN's workspace fallback and users' `except torch.OutOfMemoryError` do not catch. use_allocator() now
    gives gact_torch_alloc the thrower of _gact_torch (built against this torch's c10): the library holds
    its address, and it throws c10::OutOfMemoryError, the type torch raises as torch.OutOfMemoryError.
    (That an exhausted pool reaches it is tests/cuda/test_c_abi.cpp's; torch's translation of the type is
    torch's own, and gpu-check sees it on a device.)"""
    try:
        import _gact_torch  # noqa: F401
    except ImportError:
        pytest.skip("no _gact_torch in this build (no c10 headers)")
    seen = _run_with_libgact(_OOM_THROWER_SCRIPT)
    assert seen == {"error": "torch.OutOfMemoryError", "wired": True,
                    "throws": "CUDA out of memory. Tried to allocate 2.00 GiB on GPU 0"}


# ---- the store's device blobs in torch's CUDA caching allocator (issue 31: one pool on the GPU) ----------

_TORCH_POOL_PROLOGUE = r"""
import json, sys, warnings
import _gact, _gact_torch
import gact.allocator as galloc
out = {}
"""


def _run_torch_pool(script: str, env: dict | None = None) -> dict:
    """Run ``script`` in a fresh process (it may register an allocator for CUDA in torch's c10); its ``out``."""
    code = _TORCH_POOL_PROLOGUE + script + "\nprint('OUT ' + json.dumps(out))\n"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("OUT ")][-1]
    return __import__("json").loads(line[4:])


def _need_gact_torch():
    try:
        import _gact_torch
    except ImportError:
        pytest.skip("this build has no _gact_torch (torch's c10 headers were not found)")
    return _gact_torch


def test_device_blocks_come_from_torchs_cuda_allocator_through_c10():
    """``_gact_torch.device_blocks()`` allocates from whatever c10 has registered for CUDA (torch's caching
    allocator on a GPU machine; a counting stand-in here), holds each block's DataPtr until gact frees it, and
    reports torch's own out-of-memory text as the reason."""
    _need_gact_torch()
    out = _run_torch_pool(r"""
before = _gact_torch._install_fake_cuda_allocator()
cap = _gact_torch.device_blocks()
out["ok"] = _gact._device_blocks_roundtrip(cap, 4096)
out["counts"] = [a - b for a, b in zip(_gact_torch._fake_cuda_counts(), before)]
out["held"] = _gact_torch.device_blocks_held()
out["oom"] = _gact._device_blocks_roundtrip(cap, 2 << 30)
out["held_after_oom"] = _gact_torch.device_blocks_held()
# a free by a thread without the GIL (an autograd device thread freeing a decoded tensor) is deferred (torch's
# deleter may take the GIL) to the interpreter's main thread, which gives the block back between two bytecodes,
# with no allocation needed
_gact._device_blocks_roundtrip(cap, 4096, 0, True)
for _ in range(10000):
    pass
out["drained"] = [a - b for a, b in zip(_gact_torch._fake_cuda_counts(), before)]
out["held_at_end"] = _gact_torch.device_blocks_held()
""")
    assert out["ok"] == ""  # allocated and freed
    assert out["counts"] == [1, 1]  # one block of the CUDA allocator, given back to it
    assert out["held"] == 0 and out["held_after_oom"] == 0
    assert "CUDA out of memory" in out["oom"]
    assert out["drained"] == [2, 2] and out["held_at_end"] == 0  # (the oversized request never got a block)


def test_the_first_cuda_store_puts_the_blobs_in_torchs_pool():
    """Decided once per process: torch's pool when c10 reaches a CUDA allocator; gact's own under
    use_allocator() (one pool already), with the option off, or without a CUDA allocator (then with a
    warning naming why)."""
    _need_gact_torch()
    out = _run_torch_pool(r"""
_gact_torch._install_fake_cuda_allocator()
out["choice"] = galloc._default_device_pool()
out["again"] = galloc._default_device_pool()
out["counts"] = list(_gact_torch._fake_cuda_counts())  # the probe: one block, given back
""")
    assert out == {"choice": "torch", "again": "torch", "counts": [1, 1]}

    out = _run_torch_pool(r"""
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out["choice"] = galloc._default_device_pool()
out["warnings"] = [str(x.message) for x in w]
out["why"] = galloc._device_pool_reason
""", env={"GACT_TORCH_POOL": "0"})
    assert out == {"choice": "gact", "warnings": [], "why": "the torch_pool option is off"}  # (the user's choice)

    out = _run_torch_pool(r"""
galloc.installed = {"library": "x"}  # as use_allocator() leaves it
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out["choice"] = galloc._default_device_pool()
out["warnings"] = [str(x.message) for x in w]
out["why"] = galloc._device_pool_reason
""")
    assert out == {"choice": "gact", "warnings": [], "why": "gact is torch's CUDA allocator (use_allocator)"}

    out = _run_torch_pool(r"""
_gact_torch._install_fake_cuda_allocator()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out["choice"] = galloc._default_device_pool(swap=True)
out["warnings"] = [str(x.message) for x in w]
out["counts"] = list(_gact_torch._fake_cuda_counts())
""")
    assert out == {"choice": "gact", "warnings": [], "counts": [0, 0]}  # swap: gact's pool, no probe

    # a swap Compressor whose first CUDA save only needed its shape (a channels_last one): its unpack decides, for
    # swap too (a later store of that Compressor could not swap out of torch's pool)
    out = _run_torch_pool(r"""
import torch
from gact.compressor import _Shape
_gact_torch._install_fake_cuda_allocator()
s = _Shape(torch.empty(2, 3, 4, 4, device="meta").to(memory_format=torch.channels_last), swap=True)
s.device = torch.device("cuda", 0)  # (no GPU here: the zeros' allocation fails after the choice)
try:
    s.unpack()
except Exception:
    pass
out["choice"] = galloc.device_pool
out["counts"] = list(_gact_torch._fake_cuda_counts())
""")
    assert out == {"choice": "gact", "counts": [0, 0]}

    if torch.cuda.is_available():
        return  # (a CUDA torch has a caching allocator to find: the case below is a CPU torch's)
    out = _run_torch_pool(r"""
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out["choice"] = galloc._default_device_pool()
out["warnings"] = [str(x.message) for x in w]
""")
    assert out["choice"] == "gact"
    assert any("not reachable through c10" in m for m in out["warnings"]), out["warnings"]


def test_torch_pool_set_after_the_choice_raises_naming_it():
    _need_gact_torch()
    out = _run_torch_pool(r"""
import gact
_gact_torch._install_fake_cuda_allocator()
galloc._default_device_pool()
gact.configure(torch_pool=True)  # what is in force: accepted
try:
    gact.configure(torch_pool=False)
    out["error"] = None
except ValueError as e:
    out["error"] = str(e)
""")
    assert "torch_pool=False comes too late" in out["error"] and "torch's pool" in out["error"]

    # gact's own pool for another reason (no CUDA allocator, a swap Compressor): either value is accepted; a
    # bad value is the option parser's error
    out = _run_torch_pool(r"""
import gact
galloc._default_device_pool(swap=True)
gact.configure(torch_pool=True)
gact.configure(torch_pool=False)
try:
    gact.configure(torch_pool="maybe")
    out["error"] = None
except ValueError as e:
    out["error"] = str(e)
""")
    assert out["error"] is not None and "comes too late" not in out["error"] and "torch_pool" in out["error"]


def test_the_cuda_allocator_is_found_in_a_library_torch_loaded_locally(tmp_path):
    """Where torch does not register its caching allocator with c10 (pytorch#106533), _gact_torch finds it by its
    exported symbol in libc10_cuda.so, which torch loads RTLD_LOCAL: a lookup in the process's global scope
    misses it; one through the loaded library finds it."""
    mod = _need_gact_torch()
    src = tmp_path / "lib.c"
    src.write_text("int gact_test_symbol = 7;\n")
    lib = tmp_path / "libgact_local_test.so"
    subprocess.run([_cc(), "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    handle = ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
    addr = mod._loaded_symbol(str(lib), "gact_test_symbol")
    assert addr != 0 and ctypes.c_int.from_address(addr).value == 7
    assert addr == ctypes.addressof(ctypes.c_int.in_dll(handle, "gact_test_symbol"))
    assert mod._loaded_symbol(str(tmp_path / "libnot_loaded.so"), "gact_test_symbol") == 0  # (not in the global scope)
