"""gact: train with far less memory by compressing the activations autograd saves.

Saved tensors are quantized per group of 256 elements to 1/2/4/8 bits with
unbiased stochastic rounding (the GACT method), stored in gact's own caching
allocator, and decoded when backward needs them::

    import gact
    comp = gact.Compressor(model, bits=4)
    for x, y in loader:
        with comp:
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
        comp.step()
    print(comp.stats())

Also: :func:`stats` / :func:`dump_stats` (the whole statistics document),
:func:`use_allocator` (gact as torch's CUDA allocator), :func:`use_cpu_allocator`
(torch's CPU tensors from gact's host arena: on by default once a Compressor exists), :func:`options` /
:func:`configure` (the settings table), :mod:`gact.codecs` (encode/decode blobs
directly), and the ``gact-run`` command (compress an unmodified script).
"""

from __future__ import annotations

import operator as _operator
import os as _os

try:
    import _gact as _C
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "gact: the extension module _gact is missing or failed to load "
        f"({e}); build gact and run inside `meson devenv -C <builddir>`, or `pip install .`"
    ) from e

from . import codecs
from . import policy
from .allocator import cpu_allocator_installed, use_allocator, use_cpu_allocator
from . import compressor as _compressor
from .compressor import Compressor
from .options import configure, options

__version__ = _C.__version__

GactError = _C.GactError
CorruptBlobError = _C.CorruptBlobError
OutOfMemoryError = _C.OutOfMemoryError  # a MemoryError: gact's arena could not hold a blob

__all__ = [
    "Compressor",
    "stats",
    "dump_stats",
    "install_dump_triggers",
    "trace",
    "use_allocator",
    "use_cpu_allocator",
    "cpu_allocator_installed",
    "empty_cache",
    "probing",
    "options",
    "configure",
    "codecs",
    "GactError",
    "CorruptBlobError",
    "OutOfMemoryError",
    "__version__",
]


def probing() -> bool:
    """Whether a ``bits="auto"`` Compressor is replaying samples through its model to estimate sensitivities (its probe,
    at the steps that re-estimate, inside ``Compressor.step()``), on any thread. The model's own hooks run on those
    replays as on a step: a hook that accumulates state (K-FAC statistics, per-sample gradients, a captured activation)
    returns early when this is true, as it would skip an evaluation pass."""
    return _compressor._probing > 0


def empty_cache() -> None:
    """Return the memory gact caches but does not use to the system: the whole free segments of its host
    arena (torch's CPU tensors, blobs and decoded tensors of CPU training). What is in use stays. A freed
    segment of 256 MiB or more is returned at once anyway. With gact as torch's CUDA allocator,
    ``torch.cuda.empty_cache()`` empties gact's device cache."""
    _C.host_empty_cache()


def stats() -> dict:
    """The whole statistics document (schema_version, allocators, store, codecs, ...) as a dict:
    the same document :func:`dump_stats` writes."""
    return _C.stats_document()


def dump_stats(path: str | _os.PathLike) -> None:
    """Write the statistics document to ``path`` as JSON (atomically: temp file + rename).

    Raises:
        gact.GactError: naming the path when it cannot be written.
    """
    _C.stats_dump(_os.fspath(path))


def install_dump_triggers() -> None:
    """If a stats path is set (GACT_STATS_PATH, or ``configure(stats_path=...)``), dump the
    stats there at exit, on SIGUSR1 and on SIGTERM. Done at import when GACT_STATS_PATH is
    set. A SIGUSR1 handler installed later (``signal.signal(signal.SIGUSR1, f)``) replaces
    gact's: call this again afterwards, and gact's handler comes back and chains to ``f``.

    Raises:
        ValueError: naming GACT_STATS_PATH when that path cannot be written.
    """
    _C.install_dump_triggers()


def trace(capacity: int = 100_000, snapshot_every: int = 1) -> None:
    """Record the last ``capacity`` memory events (allocations, frees, segments, OOMs,
    store put/get/release, swap, step markers) in a ring buffer, and snapshot the per-tag
    and store counters every ``snapshot_every`` steps (``Compressor.step``; 0 = never).
    ``capacity=0`` turns recording off. ``GACT_TRACE=N`` does the same at start-up.

    The events and snapshots appear in :func:`stats` / :func:`dump_stats` as the
    ``"timeline"`` and ``"snapshots"`` sections; ``gact-stats plot|summary|export-torch``
    render a dump.

    Raises:
        TypeError: for a capacity or snapshot_every that is not an integer.
        ValueError: for a negative value or a capacity above 2**26 events.
    """
    capacity = _whole("capacity", capacity)
    snapshot_every = _whole("snapshot_every", snapshot_every)
    if capacity < 0 or snapshot_every < 0:
        raise ValueError(f"gact.trace: capacity ({capacity}) and snapshot_every ({snapshot_every}) "
                         "must be >= 0")
    _C.trace_enable(capacity, snapshot_every)


def _whole(name: str, value) -> int:
    """``value`` as an int when it is an integer (not a bool, not a float). @raises TypeError"""
    if isinstance(value, bool):
        raise TypeError(f"gact.trace: {name} must be an integer, not a bool ({value!r})")
    try:
        return _operator.index(value)
    except TypeError:
        raise TypeError(f"gact.trace: {name} must be an integer, not {type(value).__name__} ({value!r})") from None


# With GACT_STATS_PATH set, the SIGUSR1 and SIGTERM dumps work from here on (not only once
# the first tensor is stored); a path that cannot be written fails the import, naming it.
if _os.environ.get("GACT_STATS_PATH"):
    _C.install_dump_triggers()
