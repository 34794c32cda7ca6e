"""Registering gact as PyTorch's CUDA allocator.

:func:`use_allocator` hands torch the C ABI of ``libgact.so``
(``gact_alloc``/``gact_free``, bindings/c_abi.cpp) through
``torch.cuda.memory.CUDAPluggableAllocator``. Torch accepts a new allocator only
before its CUDA state is initialized, so this must run first thing, before any
tensor touches a GPU.
"""

from __future__ import annotations

import ctypes.util
import os

import torch

from . import _compat


def _find_library() -> str:
    env = os.environ.get("GACT_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(f"gact.use_allocator: GACT_LIBRARY={env!r} is not a file")
        return env
    import _gact

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
        "gact.use_allocator: libgact.so not found (looked beside _gact and on the linker path); "
        "set GACT_LIBRARY to its path"
    )


def use_allocator() -> str:
    """Make gact's caching allocator PyTorch's CUDA allocator; returns the library path.

    Raises:
        RuntimeError: when torch has no CUDA or no pluggable-allocator support (torch < 2.0),
            when CUDA was already initialized in this process, or when libgact.so is missing.
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
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gact_alloc", "gact_free")
    torch.cuda.memory.change_current_allocator(alloc)
    return path
