"""Registering gact as PyTorch's CUDA allocator.

:func:`use_allocator` hands torch gact's C ABI (bindings/gact.h, bindings/c_abi.cpp)
through ``torch.cuda.memory.CUDAPluggableAllocator``:

* ``gact_torch_alloc`` / ``gact_free`` as the alloc and free functions. torch does not
  check the pointer an allocator returns, so ``gact_torch_alloc`` throws when a request
  cannot be served; torch raises that as a ``RuntimeError`` whose text starts
  ``CUDA out of memory. Tried to allocate`` (a pluggable allocator cannot raise
  ``torch.cuda.OutOfMemoryError`` itself, which is a subclass of ``RuntimeError``);
* ``gact_record_stream`` for ``Tensor.record_stream`` (a block used on a side stream is
  not reused before that stream's work is done), ``gact_empty_cache`` for
  ``torch.cuda.empty_cache()``, ``gact_set_memory_fraction`` for
  ``torch.cuda.set_per_process_memory_fraction()``, where this torch has the hooks.

The library is the ``_gact`` module itself when it was built with CUDA kernels: it links
and exports the C ABI over the device allocators its activation store uses, so torch's
tensors and a Compressor's compressed activations share one cache per device. Otherwise
(or with ``GACT_LIBRARY``) it is ``libgact.so``, which has allocators of its own.

Torch accepts a new allocator only before its CUDA state is initialized, so this must run
first thing, before any tensor touches a GPU. Under any pluggable allocator, torch's
``torch.cuda.memory_stats()`` and ``torch.backends.cudnn.benchmark = True`` raise (torch
asks the allocator for ``cacheInfo``, which pluggable allocators do not have):
:func:`use_allocator` turns an enabled cudnn benchmark off with a warning, and makes torch's
memory functions answer with gact's figures (:func:`serve_torch_memory_api`), so that trainers
that log memory the usual way keep running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings
from typing import Dict, Optional

import _gact as _C
import torch

from . import _compat

#: torch's hook setters (on ``CUDAPluggableAllocator.allocator()``) and the gact function for each
HOOKS = {
    "set_record_stream_fn": "gact_record_stream",
    "set_reset_fn": "gact_empty_cache",
    "set_memory_fraction_fn": "gact_set_memory_fraction",
}
ALLOC_FN = "gact_torch_alloc"
FREE_FN = "gact_free"

#: what the last :func:`use_allocator` installed: ``{"library": path, "hooks": [torch setters
#: wired], "oom_error": the error an exhausted device raises (see set_oom_thrower), "shared_with_store":
#: bool}`` (true when the library is the ``_gact`` module, whose activation store uses the same
#: device allocators); None before
installed: Optional[Dict[str, object]] = None


def _exports_c_abi(path: str) -> bool:
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return False
    return all(hasattr(lib, name) for name in (ALLOC_FN, FREE_FN, *HOOKS.values()))


def _find_library() -> str:
    """The shared object whose C ABI torch gets (see the module docstring)."""
    env = os.environ.get("GACT_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(f"gact.use_allocator: GACT_LIBRARY={env!r} is not a file")
        return env
    import _gact

    if getattr(_gact, "have_kernels", False) and _exports_c_abi(_gact.__file__):
        return _gact.__file__
    here = os.path.dirname(os.path.abspath(_gact.__file__))
    candidates = [
        os.path.join(here, "libgact.so"),  # installed beside _gact
        os.path.join(here, "..", "libgact.so"),  # build tree: <build>/bindings/libgact.so
        os.path.join(here, "gact", "libgact.so"),
    ]
    for c in candidates:
        if os.path.isfile(c):
            return os.path.normpath(c)
    found = ctypes.util.find_library("gact")
    if found:
        return found
    raise RuntimeError(
        "gact.use_allocator: this _gact has no CUDA kernels and libgact.so was not found (looked beside _gact "
        "and on the linker path); set GACT_LIBRARY to its path"
    )


def _function_address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def use_allocator() -> str:
    """Make gact's caching allocator PyTorch's CUDA allocator; returns the library path
    (details in :data:`installed`).

    Raises:
        RuntimeError: when torch has no CUDA or no pluggable-allocator support (torch < 2.0),
            when CUDA was already initialized in this process, or when no library is found.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "gact.use_allocator: no CUDA device is available to this torch "
            f"(torch {torch.__version__}); it only applies to CUDA training"
        )
    if not _compat.HAS_PLUGGABLE_ALLOCATOR:
        raise RuntimeError(
            f"gact.use_allocator: torch {torch.__version__} has no CUDAPluggableAllocator (needs torch >= 2.0)"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "gact.use_allocator: CUDA is already initialized in this process; call gact.use_allocator() "
            "before anything touches the GPU (first thing after `import gact`)"
        )
    path = _find_library()
    lib = ctypes.CDLL(path)  # the handle torch's own CDLL of the same file shares
    missing = [n for n in (ALLOC_FN, FREE_FN) if not hasattr(lib, n)]
    if missing:
        raise RuntimeError(f"gact.use_allocator: {path} does not export {', '.join(missing)} (an older gact?)")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_FN, FREE_FN)
    native = alloc.allocator()
    wired = []
    for setter, fn in HOOKS.items():
        if hasattr(native, setter) and hasattr(lib, fn):
            getattr(native, setter)(_function_address(lib, fn))
            wired.append(setter)
    if torch.backends.cudnn.benchmark:
        warnings.warn(
            "gact.use_allocator: torch.backends.cudnn.benchmark=True fails under a pluggable CUDA allocator "
            "(torch asks it for cacheInfo); turned off",
            RuntimeWarning,
            stacklevel=2,
        )
        torch.backends.cudnn.benchmark = False
    torch.cuda.memory.change_current_allocator(alloc)
    serve_torch_memory_api(lib)
    oom_error = set_oom_thrower(lib)
    import _gact

    global installed
    installed = {"library": path, "hooks": wired, "oom_error": oom_error,
                 "shared_with_store": os.path.realpath(path) == os.path.realpath(_gact.__file__)}
    return path


def set_oom_thrower(lib: ctypes.CDLL) -> str:
    """Make ``lib``'s gact_torch_alloc fail with torch's own out-of-memory error (``torch.OutOfMemoryError``,
    which cuDNN's workspace fallback and users' retry loops catch) by giving it the thrower of ``_gact_torch``,
    which is built against this torch's c10. Returns the name of the error an exhausted device raises: without
    ``_gact_torch`` (no c10 headers where gact was built) or an older library it stays a RuntimeError."""
    if not hasattr(lib, "gact_set_oom_thrower"):
        return "RuntimeError"
    try:
        import _gact_torch
        addr = _gact_torch.oom_thrower()
    except (ImportError, AttributeError):
        return "RuntimeError"
    lib.gact_set_oom_thrower.restype = ctypes.c_void_p
    lib.gact_set_oom_thrower.argtypes = [ctypes.c_void_p]
    lib.gact_set_oom_thrower(ctypes.c_void_p(addr))
    return "torch.OutOfMemoryError"


# ---- torch's memory API under use_allocator ------------------------------------------------------

#: the families of torch's ``memory_stats()`` keys that ``memory_summary()`` reads: "<family>.<pool>.<stat>"
_TORCH_FAMILIES = ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
                   "allocation", "active", "segment", "inactive_split")
_TORCH_POOLS = ("all", "large_pool", "small_pool")
_TORCH_STATS = ("current", "peak", "allocated", "freed")
#: keys of torch's that gact's allocator has no counterpart of, with torch's value for "none"
_TORCH_OTHER = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0, "num_device_alloc": 0,
                "num_device_free": 0, "max_split_size": -1,
                **{f"oversize_{k}.{s}": 0 for k in ("allocations", "segments") for s in _TORCH_STATS}}

#: torch.cuda's functions replaced by serve_torch_memory_api: [(module, name, original)]
_served: list = []


def _device_stats(lib: ctypes.CDLL, device: int) -> Dict[str, float]:
    """The flat statistics of gact's allocator for ``device`` in torch's keys (every key torch's
    ``memory_summary()`` reads; zeros before the device's first allocation)."""
    import json

    lib.gact_stats_json.restype = ctypes.c_void_p
    lib.gact_free_string.argtypes = [ctypes.c_void_p]
    text = lib.gact_stats_json()
    if not text:
        raise RuntimeError("gact: the allocator's statistics could not be read (gact_stats_json failed)")
    try:
        doc = json.loads(ctypes.string_at(text).decode())
    finally:
        lib.gact_free_string(text)
    mine = doc.get("allocators", {}).get(f"cuda:{device}", {})
    out: Dict[str, float] = {f"{f}.{p}.{s}": 0 for f in _TORCH_FAMILIES for p in _TORCH_POOLS for s in _TORCH_STATS}
    out.update(_TORCH_OTHER)
    out.update({k: v for k, v in mine.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def _nested(flat: Dict[str, float]) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        *path, leaf = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def serve_torch_memory_api(lib: ctypes.CDLL) -> None:
    """Make ``torch.cuda.memory_stats`` (and what reads it: ``memory_allocated``,
    ``max_memory_allocated``, ``memory_reserved``, ``max_memory_reserved``, ``memory_summary``)
    answer with the statistics of gact's allocator in ``lib``, and ``reset_peak_memory_stats``
    (with ``reset_max_memory_allocated``/``_cached``) reset its peaks (those of every device).
    Under a pluggable allocator torch's own raise. :func:`use_allocator` calls it; a library without
    the statistics entry points (an older libgact.so) leaves torch's functions as they are."""
    if not all(hasattr(lib, n) for n in ("gact_stats_json", "gact_free_string", "gact_reset_peak_stats")):
        return
    mem = torch.cuda.memory

    def memory_stats_as_nested_dict(device=None):
        index = torch.cuda._utils._get_device_index(device, optional=True)
        return _nested(_device_stats(lib, index))

    def reset_peak_memory_stats(device=None):
        lib.gact_reset_peak_stats()

    memory_stats_as_nested_dict.__doc__ = mem.memory_stats_as_nested_dict.__doc__
    reset_peak_memory_stats.__doc__ = mem.reset_peak_memory_stats.__doc__
    for name, fn in (("memory_stats_as_nested_dict", memory_stats_as_nested_dict),
                     ("reset_peak_memory_stats", reset_peak_memory_stats)):
        for owner in (mem, torch.cuda):
            if getattr(owner, name, None) is not None:
                _served.append((owner, name, getattr(owner, name)))
                setattr(owner, name, fn)


# ---- torch's CPU tensors from gact's host arena ---------------------------------------------------

#: None until decided; True/False after :func:`use_cpu_allocator` or the first Compressor
_cpu_choice: Optional[bool] = None
_cpu_missing_reason: Optional[str] = None


def _gact_torch():
    global _cpu_missing_reason
    try:
        import _gact_torch  # built beside _gact when torch's c10 headers were found (bindings/python/torch_cpu.cpp)
    except ImportError as e:
        _cpu_missing_reason = f"_gact_torch is not available ({e}); build gact with torch's c10 headers (libtorch-dev)"
        return None
    return _gact_torch


def use_cpu_allocator(enable: bool = True) -> bool:
    """Serve torch's CPU tensors from gact's host arena (``enable=True``), or give torch its own
    allocator back (``False``). Returns whether gact's is installed now.

    One pool for torch's tensors, gact's compressed activations and its decoded tensors: memory
    that compressing frees in forward, and that the blobs free in backward, serves torch's next
    tensors, and the arena's segments stay warm from step to step. Without it, glibc's heap
    fragments under a compressed forward and keeps much of the saving from the process's peak.
    A Compressor turns it on when the ``cpu_allocator`` option is on (the default) and this
    function was not called. Tensors already allocated keep their own allocator's memory, so
    switching at any time is safe. ``gact.configure(memory_limit=...)`` then caps torch's CPU
    tensors too; a request over it raises a RuntimeError naming gact.

    Raises:
        gact.GactError: ``enable=True`` in a build without ``_gact_torch`` (no torch headers).
    """
    global _cpu_choice
    if isinstance(enable, str) or not (isinstance(enable, bool) or enable in (0, 1)):
        raise TypeError(f"gact.use_cpu_allocator: enable must be True or False, not {enable!r}")
    mod = _gact_torch()
    if mod is None:
        if enable:
            raise _C.GactError(f"gact.use_cpu_allocator: {_cpu_missing_reason}")
        _cpu_choice = False
        return False
    if enable:
        mod.install(_C._host_allocator())
    else:
        mod.uninstall()
        _C.host_empty_cache()  # what the arena cached for torch's tensors goes back to the system
    _cpu_choice = bool(enable)
    return bool(mod.installed())


def cpu_allocator_installed() -> bool:
    """Whether torch's CPU tensors come from gact's host arena now."""
    mod = _gact_torch()
    return bool(mod is not None and mod.installed())


def _default_cpu_allocator(warn: bool = True) -> None:
    """A Compressor was made: install gact's CPU allocator unless the user chose, or the option is off.
    ``warn``: say so when this build has no CPU allocator (not for a model that lives on a GPU)."""
    global _cpu_choice
    if _cpu_choice is not None:
        return
    if not _C.options_current().get("cpu_allocator", True):
        _cpu_choice = False
        return
    try:
        use_cpu_allocator(True)
    except _C.GactError as e:  # no _gact_torch in this build
        _cpu_choice = False
        if warn:
            warnings.warn(f"gact: torch's CPU tensors stay with torch's allocator: {e}", RuntimeWarning, stacklevel=3)


# ---- the store's device blobs from torch's CUDA caching allocator ---------------------------------

#: whose memory the store's device blobs live in, decided at the first CUDA tensor a Compressor stores:
#: "torch", "gact", or None (not decided yet)
device_pool: Optional[str] = None
_device_pool_reason = ""


def _default_device_pool(swap: bool = False, device: int = 0) -> str:
    """Decide, once per process, where the store's device blobs and decoded tensors live (called before the
    first CUDA tensor is stored):

    * ``"gact"`` under :func:`use_allocator` (torch's tensors are in gact's pool already: one pool);
    * ``"torch"`` otherwise: torch's own CUDA caching allocator, one block per blob or decoded image, given
      back to torch's cache when freed. Two caching pools side by side cannot reuse each other's free
      memory (blob bytes freed in backward sat in gact's pool while torch's grew for the gradients), and
      ``torch.cuda.max_memory_allocated()`` then counts the blobs;
    * ``"gact"`` for a Compressor with ``swap=True`` (its mover allocates on its own copy stream, while torch
      ties a block to the allocating thread's current stream);
    * ``"gact"`` when the ``torch_pool`` option is off (``GACT_TORCH_POOL=0``), or this build or torch has no
      way to it (no ``_gact_torch``, or no CUDA caching allocator found), with a warning.

    ``device``: the CUDA device of the tensor about to be stored (the probe allocates there). Returns the
    choice."""
    global device_pool, _device_pool_reason
    if device_pool is not None:
        return device_pool
    choice, why = "gact", ""
    if installed is not None:
        why = "gact is torch's CUDA allocator (use_allocator)"
    elif not _C.options_current().get("torch_pool", True):
        why = "the torch_pool option is off"
    elif swap:
        why = "swap=True (its copies need gact's stream-ordered pool)"
    else:
        mod = _gact_torch()
        blocks = getattr(mod, "device_blocks", None) if mod is not None else None
        if blocks is None:
            why = _cpu_missing_reason or "this _gact_torch cannot reach torch's CUDA allocator"
        else:
            cap = blocks()
            failed = _C._device_blocks_roundtrip(cap, 512, device)
            if failed:
                why = f"torch's CUDA allocator is not reachable through c10 ({failed})"
            else:
                _C.set_device_blocks(cap)
                choice, why = "torch", "torch's CUDA caching allocator"
        if choice == "gact":
            warnings.warn(f"gact: compressed activations on the GPU live in gact's own device pool beside torch's: "
                          f"{why}", RuntimeWarning, stacklevel=4)
    device_pool, _device_pool_reason = choice, why
    return choice
