"""The Compressor: autograd saved-tensor hooks over gact's activation store.

Inside ``with comp:`` every tensor autograd saves for the backward pass goes through
:meth:`Compressor._pack`, which stores it the way its reader needs it (gact/saved.py has the
one table: quantized values, an exact predicate mask, normalized values with the layer's own
statistics, lossless pooling indices, only the shape, or the tensor kept as it is). The op
saving the tensor is known from the ``OpTracker`` (a TorchFunctionMode) the Compressor
activates with its hooks, on the calling thread.

Kept as they are (counted in the store's ``skipped`` stats under a reason; the first rule
that matches names it):

``layout``    not a plain strided CPU/CUDA tensor (sparse, quantized, nested, meta, subclasses)
``parameter`` a parameter or a view of one: a leaf that requires grad, a view whose
              ``_base`` is one, or a tensor sharing storage with the model's parameters
              or buffers (recomputed at the start of every step); or autocast's
              float16/bfloat16 copy of one, which a layer saves to compute with
``excluded``  saved while a module given in ``exclude`` (or one of its submodules)
              runs, or sharing storage with a tensor given in ``exclude``
``stats``     a normalization layer's per-channel mean and 1/std (read exactly)
``exact``     read by an op whose gradient jumps with the value (a sign with a zero, an
              equality with a reduction's result, a divisor): rounding would bias it
``dtype``     an integer tensor that is not a max-pool's indices
``small``     fewer than ``min_bytes`` bytes
``input``     a float tensor passed to the model's forward that does not require grad (the
              input batch): the caller keeps it alive anyway; and autocast's copy of it,
              which the first layer saves for its weight's gradient

A tensor whose reader uses only its shape (a pooling input, a loss's log-probabilities) is
not stored at all (``unstored.shape``).

Reading back: a saved tensor that the program still holds, unchanged (same version counter),
when backward needs it is used as it is and its blob dropped (``unstored.held``); otherwise
the blob is decoded at most once while the decoded tensor is alive, into memory from gact's
own pool handed to torch through DLPack (no copy, no fresh pages in the steady state), and
every reader of the blob shares it. Decoded tensors have the saved tensor's strides
(channels_last stays channels_last).

Lifetime: a :class:`_Packed` releases its handle when it is garbage collected, which happens
when autograd frees the graph (after ``backward()`` without ``retain_graph``, or when the last
reference to the output goes). It is not released at unpack, because ``retain_graph=True`` can
unpack twice.

Keys and noise: each stored tensor gets a stable key, the qualified name of the module that
saved it plus its order among that module's saves in the step
(``"encoder.layers.0.linear1:2"``). The store derives the stochastic-rounding noise from
(seed, step, key), so noise differs per tensor and per step, and a run is reproducible. A
policy keys per-tensor bits on the same string through :meth:`Compressor._bits_for`.

Threads: each thread that enters ``with comp:`` gets its own hooks and tracker (torch's
saved-tensor hooks and function modes are per thread); the step and the statistics are shared.
"""

from __future__ import annotations

import collections
import functools
import operator
import hashlib
import threading
import warnings
import weakref
from typing import Any, Iterable

import torch
import torch.utils.dlpack as _dlpack

import _gact as _C

from . import _compat
from . import allocator as _allocator
from . import saved as _saved
from .options import options as _options

_VALID_BITS = (1, 2, 4, 8)
# A normalization layer's input with fewer than NORM_SMALL_BLOCK elements per statistics block (a batch
# norm late in a network on small images: 1x1 spatial, batch 4) is stored with at least
# NORM_SMALL_MIN_BITS bits, outside an adaptive policy's budget: its backward divides by the block's
# spread, and such tensors carried most of the gradient error at 4 and 2 bits (resnet18, 32 px, batch 4:
# gradient cosine 0.973 -> 0.997 at 4 bits, 0.50 -> 0.89 at 2 bits, for 7 % and 17 % more stored bytes).
# Below NORM_FLOOR_BLOCK elements per block (a layer norm over a transformer's width), NORM_FLOOR_MIN_BITS at least:
# the backward reads x̂·mean(g·x̂) from one rounding, whose i == i term is biased by the rounding's variance over the
# block's size, and in a post-norm stack the bias adds up layer after layer (2 bits, width 256: 1.8 % of the
# gradient at depth 4, 3.1 % at 8; width 64 at depth 4 7.0 %); 4 bits divide it by about 16, for about 8 % more
# stored bytes on a transformer layer at 2 bits. (saved.norm_floor: the same floor for rms_norm, F.normalize and
# cosine_similarity, whose rows the storage table gives it.)
NORM_SMALL_BLOCK = _saved.NORM_SMALL_BLOCK
NORM_SMALL_MIN_BITS = _saved.NORM_SMALL_MIN_BITS
NORM_FLOOR_BLOCK = _saved.NORM_FLOOR_BLOCK
NORM_FLOOR_MIN_BITS = _saved.NORM_FLOOR_MIN_BITS
LOG_SPACE_MIN_BITS = _saved.LOG_MIN_BITS
# a row's largest magnitude that _row_params scales by (beyond: the row as it is, scale 1; 1/m stays a float32 normal);
# from the store's widest value on (codecs' k_store_max_magnitude, a mask's fill) the row keeps its own magnitude, which
# the codec then refuses: the tensor is kept exact, as it is unnormalized
_ROW_SCALE_MIN, _ROW_SCALE_MAX = 2.0 ** -100, float(_C.store_max_magnitude)
_ROW_MIN = _saved.ROW_MIN  # (the fewest values a row normalized per row holds)
#: the scale of a row of zeros or of values at most 2^-100 stored normalized per row (_row_params): exact in the row
#: statistics' bfloat16, its inverse a normal float, the row's normalized values within [-1, 1]; it decodes to its codes'
#: values times 2^-100 at most, zero to any gradient a finite one multiplies
_TINY_ROW_SCALE = 2.0 ** 100
_FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal

# (a capsule straight to torch's converter: the public wrapper first probes it for __dlpack__, once per unpack)
_from_dlpack = getattr(torch._C, "_from_dlpack", None) or _dlpack.from_dlpack
_DTYPE_NAMES = _compat.DTYPE_NAMES
_num_threads = torch.get_num_threads
#: grad_fn types that are neither a dtype copy nor a view (a saved tensor made by one is no cast parameter)
_PLAIN_NODES: set = set()
_HAS_NESTED = hasattr(torch.Tensor, "is_nested")
_HAS_NEG = hasattr(torch.Tensor, "is_neg")
#: dtypes whose saves take a key (the quant codec's and the mask codec's)
_KEYED_DTYPES = frozenset(_compat.FLOAT_DTYPES + _compat.MASK_DTYPES)
#: the predicate a softmax's result is stored as a boundary blob for (Compressor._store): x > 0, code 0 exactly 0
_SIMPLEX_BOUNDARY = ("gt_or_nan", 0.0, 0.0)


def _integer(v: Any) -> int | None:
    """``v`` as a Python int where it is an integer of any kind (numpy's too: ``np.int64(256)`` once got "group_size=256
    must be a power of two"); None for a bool (numpy's, Python's, a bool tensor) or anything else, which the caller
    refuses naming ``v``."""
    if type(v).__name__ in ("bool", "bool_") or (isinstance(v, torch.Tensor) and v.dtype is torch.bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


@functools.lru_cache(maxsize=1 << 16)
def key64(key: str) -> int:
    """The 64-bit tensor key the codec's noise is derived from (stable across runs and processes).
    Cached: a model's keys recur every step."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


#: the codec keeps a normalization block's shift (its mean) in bfloat16, 8 significant bits: a mean far from zero
#: against the block's spread leaves a residual of up to |mean|·2⁻⁹, different in every block, which a group that
#: spans blocks must cover with its one range (a float64 batch norm input at 1e7 ± 1: the 8-bit gradient 681x its
#: norm from fp32). Past this many of a block's standard deviations, plain values are weighed against it.
NORM_SHIFT_TOLERANCE = 0.125


def _shift_residual_too_large(mean: torch.Tensor, rstd: torch.Tensor) -> bool:
    """Whether plain values (each group with its own range) lose less than the normalized ones would, given each
    block's shift rounded to bfloat16 as the codec stores it: the normalized groups span about 6 + 2·off of a block's
    deviations, off the largest residual in deviations (past NORM_SHIFT_TOLERANCE only); a plain group spans the
    blocks' means and 6 of the largest deviation, which the block with the smallest deviation must resolve. float32
    host tensors of the blocks (a device's would cost a sync on every save: the caller measures _shift_residual_verdict
    there and reads it at step())."""
    return mean.numel() > 0 and bool(_shift_residual_verdict(mean, rstd))


def _shift_residual_verdict(mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """_shift_residual_too_large as a 0-dimensional bool tensor on the statistics' device, with no read back."""
    off = (mean - mean.to(torch.bfloat16).float()).abs_().mul_(rstd).amax()
    plain = ((mean.amax() - mean.amin()) + 6.0 / rstd.amin()) * rstd.amax()
    return (off > NORM_SHIFT_TOLERANCE) & (plain < 6.0 + 2.0 * off)


def _verdict(value: float, limit: float, floor: float) -> int:
    """A measured bound against its limits (Compressor._read_qk, _near_now): 2 keep exact (above ``limit``, NaN too), 1
    store at 8 bits at least (above ``floor``), 0 as the run's bits."""
    return 2 if not value <= limit else 1 if value > floor else 0


def _read_back(values: list) -> list:
    """The 0-dimensional tensors ``values`` as Python floats, in order: one stack and one read per device (a step's
    measurements, read at step(): no sync per save on a GPU)."""
    out = [0.0] * len(values)
    by_device: dict = {}
    for i, v in enumerate(values):
        by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        for i, x in zip(idx, torch.stack([values[i].float() for i in idx]).cpu().tolist()):
            out[i] = x
    return out


#: tests: decide a host tensor's normalization as a device's is decided (from the next step, by _read_qk)
_DEFERRED_CHECKS = False
#: how many policy probes are replaying samples through their models now (gact.probing())
_probing = 0
_probing_lock = threading.Lock()


class _TensorRef(weakref.ref):
    """A weak reference to a stored tensor (to a view's base, which the view holds) whose death tells the store to
    forget its blob's storage address (a later tensor at the same address must not be served by it): one object per
    stored save where a reference and a
    callback closure made three for Python's collector to track (a float64 LSTMCell step saves 9 000 tensors)."""

    __slots__ = ("handle",)


def _forget_ref(r: _TensorRef) -> None:
    try:
        _forget(r.handle)
    except Exception:  # interpreter shutdown
        pass


def _forget(h: int, _store_forget=_C.store_forget) -> None:
    """The store forgets the address blob ``h`` was stored from (no later save is served by it), and so does
    _entry_storage."""
    _entry_storage.pop(h, None)
    _store_forget(h)


#: the storage (held weakly: _gact_torch's SavedRef or StorageRef) of the tensor each blob with an address was stored
#: from, by handle, while that tensor (or a view's base) lives: a dedup hit is served only by a blob of the very storage
#: the save uses. The store knows storages by address, and a tensor that lives can give its memory up (resize_, an out=
#: call that resizes, set_): a tensor made at the old address was served the blob of the old values
_entry_storage: dict = {}


def _release(handle: int, _store_release=_C.store_release) -> None:
    try:
        if _store_release(handle) <= 0:  # (freed, or unknown: its storage's record goes too)
            _entry_storage.pop(handle, None)
    except Exception:  # interpreter shutdown
        pass


def _release_compressor(hooks: list, owner: int, _drop=_C.store_drop_owner) -> None:
    """A Compressor was collected: remove its module hooks and its counters."""
    _compat.remove_handles(hooks)
    _drop(owner)


_compiling = _compat.is_compiling
_is_wrapped = _compat.is_functorch_wrapped
#: a save was made inside a torch.compile'd region (kept as it is there); step() says so once
_compiled_saves = False
_warned_compiled = False
_warned_create_graph = False


def _warn_create_graph(key: str) -> None:
    """Say once per process that a backward with create_graph=True decoded a compressed save (``key``): a loss built
    on that gradient reads the save's rounding through its own backward, squared or twice, and is biased."""
    global _warned_create_graph
    if _warned_create_graph:
        return
    _warned_create_graph = True
    warnings.warn(
        f"gact: a backward with create_graph=True (a gradient penalty, a Hessian-vector product, MAML) read the "
        f"activation '{key}', which gact stored quantized. Where the gradient that loss is built on depends on it (through "
        f"a curve's derivative such as tanh, sigmoid or SiLU, a normalization, a weight gradient), the loss reads its "
        f"rounding squared or twice and its gradient is biased (an R1 penalty through BatchNorm measured 2x its value "
        f"at 2 bits, 1.04x at 4); a penalty on the input gradient of ReLU or LeakyReLU layers reads only exact masks "
        f"and weights and is not. If it does: run that forward outside the Compressor or exclude its modules "
        f"(exclude=). 8 bits shrink a penalty's bias, not that of a loss that matches the gradient itself or uses it "
        f"as a value (an interatomic potential trained on forces, -dE/dx: 4-30 % of the gradient at 8 bits; an "
        f"SDF's normals under a threshold: 2.7 %; README, Known limits). Said once.", RuntimeWarning,
        stacklevel=2)

try:  # a tensor's version counter held without the tensor (bindings/python/torch_cpu.cpp); None without _gact_torch
    from _gact_torch import VersionRef as _VersionRef, version_ref as _version_ref
except ImportError:
    _VersionRef = _version_ref = None
try:  # a tensor's storage held weakly (torch_cpu.cpp): a saved view is made again from its base only where it exists
    from _gact_torch import storage_ref as _storage_ref
except ImportError:
    _storage_ref = None
try:  # both in one object, for a stored tensor (a _gact_torch built before it: the two apart)
    from _gact_torch import SavedRef as _SavedRef, saved_ref as _saved_ref
except ImportError:
    _SavedRef = _saved_ref = None
try:  # autograd nodes by address (torch_graph.cpp; absent without autograd's headers: no _exact_read then)
    from _gact_torch import graph_ancestors as _graph_ancestors, graph_node as _graph_node
except ImportError:
    _graph_ancestors = _graph_node = None
try:
    from _gact_torch import graph_products as _graph_products
except ImportError:
    _graph_products = None
try:  # whether the backward running keeps its graph (torch_graph.cpp); None without it: blobs live to their node's end
    from _gact_torch import graph_keeps as _graph_keeps
except ImportError:
    _graph_keeps = None
try:  # whether a backward is running on this thread (torch_graph.cpp); None without it
    from _gact_torch import in_backward as _in_backward
except ImportError:
    _in_backward = None


_len_modes = getattr(torch._C, "_len_torch_function_stack", None)


def _mode_depth() -> int | None:
    """How many TorchFunctionModes are on this thread's stack (None where torch does not say)."""
    return _len_modes() if _len_modes is not None else None


def _held_storage(t: torch.Tensor) -> Any:
    """``t``'s storage held weakly, for _Packed.sref; None without _gact_torch."""
    return _storage_ref(t._cdata) if _storage_ref is not None else None


_mutation_allowed = _compat.mutation_allowed
#: whether saved-tensor hooks may be pushed now (torch.func's grad-like transforms turn them off for their extent)
_hooks_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
_hooks_disabled_message = getattr(torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", None)


def _in_a_transform() -> bool:
    """Whether saved-tensor hooks are off because a torch.func (functorch) transform turned them off for its extent:
    its message says so ("... don't yet support saved tensor hooks"). Where a program's own
    ``disable_saved_tensors_hooks("why")`` turned them off, raises its message, as pushing torch's own hooks does."""
    if _hooks_enabled is None or _hooks_enabled():
        return False
    msg = _hooks_disabled_message() if _hooks_disabled_message is not None else None
    if msg is None or "support saved tensor hooks" in msg:
        return True
    raise RuntimeError(msg)


def _watch(t: torch.Tensor) -> Any:
    """What tells ``t``'s version at unpack without keeping ``t`` alive (see _check_version): its version counter,
    which its views and aliases share and torch's own check reads, so that an in-place change made through an alias
    (a view, its base, ``detach()``; not ``.data``, which has a counter of its own in torch too) after the program
    dropped ``t`` is still seen; without
    ``_gact_torch``, a weak reference to ``t`` or its base (then a change is seen only while that lives). None (no
    check) under allow_mutation_on_saved_tensors (_mutation_allowed)."""
    if _mutation_allowed():
        return None
    if _version_ref is not None:
        try:
            return _version_ref(t._cdata)
        except (AttributeError, ValueError):  # (a tensor-like without a TensorImpl address)
            pass
    b = t._base
    try:
        return weakref.ref(t if b is None else b)
    except TypeError:
        return None


def _check_version(watch: Any, version: int, saved: Any) -> None:
    """Raise torch's error when the tensor ``watch`` follows (_watch) was changed in place since its pack, when it
    was at ``version``; ``saved`` (shape, dtype, device) names it."""
    if watch is None:
        return
    if watch.__class__ is _SavedRef or watch.__class__ is _VersionRef:
        now = watch.current()
        if now >= 0 and now != version:
            raise _modified_error(saved, version, now)
        return
    v = watch()
    if v is not None and v._version != version:
        raise _modified_error(v, version, v._version)


def _modified_error(t: Any, version: int, now: int) -> RuntimeError:
    """torch's own error for a saved tensor changed in place before backward (torch does not check versions
    while saved-tensor hooks are active, so gact does, with the version recorded at pack). ``t``: the tensor, or
    what was saved of it (shape, dtype, device)."""
    kind = t.type() if isinstance(t, torch.Tensor) else torch.empty(0, dtype=t.dtype, device=t.device).type()
    # (torch names the node that made the tensor as it is now: the saved tensor itself, or the one a _Packed follows)
    src = t if isinstance(t, torch.Tensor) else getattr(t, "ref", None)
    if src is not None and not isinstance(src, torch.Tensor):
        src = src()
    node = src.grad_fn if src is not None else None
    made = f", which is output {src.output_nr} of {type(node).__name__}," if node is not None else ""
    hint = ("Hint: the backtrace further above shows the operation that failed to compute its gradient. The "
            "variable in question was changed in there or anywhere later. Good luck!"
            if torch.is_anomaly_enabled() else
            "Hint: enable anomaly detection to find the operation that failed to compute its gradient, with "
            "torch.autograd.set_detect_anomaly(True).")
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{kind} {list(t.shape)}]{made} is at version {now}; expected version {version} instead. {hint}")


def _predicate_of(t: torch.Tensor, pred: tuple) -> torch.Tensor:
    """The predicate masks encode (codecs/README.md), evaluated by torch on the exact tensor as the codec does
    (mask_math.hpp: eval_predicate): the values as float32 (16-bit ones widened, float64 narrowed), the bounds
    float32 (torch alone would compare a 16-bit tensor with bounds rounded to its dtype)."""
    name, a, b = pred
    if t.dtype != torch.float32:
        t = t.float()
    a, b = torch.tensor(a, dtype=torch.float32).item(), torch.tensor(b, dtype=torch.float32).item()
    if name == "gt_or_nan":
        return ~(t <= a)
    if name == "gt":
        return t > a
    if name == "ge":
        return t >= a
    if name == "lt":
        return t < a
    if name == "le":
        return t <= a
    if name == "open":
        return (t > a) & (t < b)
    if name == "closed":
        return (t >= a) & (t <= b)
    return t != 0


class _Kept:
    """A saved tensor kept as it is (a parameter, a small or exact tensor, ...) and its version at pack: unpack
    raises torch's error if it was changed in place since."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor, version: int) -> None:
        self.t = t
        self.version = version

    def unpack(self) -> torch.Tensor:
        t = self.t
        if t._version != self.version:
            raise _modified_error(t, self.version, t._version)
        return t


#: the most elements _simplex_correct corrects at once (its temporaries: a bool mask and an int64 count of this size)
SIMPLEX_SLICE = 1 << 22


def _simplex_correct(out: torch.Tensor, dim: int) -> None:
    """Make each row of ``out`` along ``dim`` sum to one, in place: the excess taken back in equal shares from the values
    that are not zero (_Packed.unpack). In slices along another dimension, so that the temporaries stay small."""
    n = out.shape[dim]
    d = dim % out.dim() if out.dim() else 0
    parts: Any = (out,)
    if out.dim() >= 2 and out.numel() > SIMPLEX_SLICE:
        other = max((k for k in range(out.dim()) if k != d), key=lambda k: out.shape[k])  # (the longest other dimension)
        parts = out.split(max(1, SIMPLEX_SLICE * out.shape[other] // out.numel()), other)
    for part in parts:
        zero = part == 0
        share = (1.0 - part.sum(d, keepdim=True)) / (n - zero.sum(d, keepdim=True)).clamp_min(1)
        part.add_(share).masked_fill_(zero, 0.0)


class _Packed:
    """What autograd holds instead of a saved tensor: a store handle, how to decode it, and a weak
    reference to the saved tensor (used as it is at unpack if the program still holds it unchanged, in the same
    memory). ``vref`` follows the version counter that tells an in-place change (_watch): the saved tensor's, or
    that of the input an activation's stored derivative came from."""

    __slots__ = ("handle", "shape", "stride", "offset", "dtype", "device", "key", "decode", "ref", "version",
                 "alias", "pending", "owner", "vref", "aborted", "hold", "pred", "ptr", "sref", "logged", "view",
                 "simplex", "dkey", "__weakref__")

    def __init__(self, handle: int, t: torch.Tensor, key: str, decode: tuple | None = None, owner: int = 0,
                 stride: tuple | None = None) -> None:
        self.handle = handle
        self.owner = owner  # the Compressor's store owner id, for its own counters
        # (a plain tuple of ints, which Python's collector stops tracking at its first pass, where a torch.Size stays
        # tracked: every live save's objects are traversed by each full collection, and a float64 LSTMCell's 999 time
        # steps keep 26 000 saves alive through the forward)
        self.shape = tuple(t.shape)
        self.stride = t.stride() if stride is None else stride  # (the decoded image's, when the store gave them)
        self.offset = 0  # element offset of the tensor in its blob's decoded image
        self.dtype = t.dtype
        self.device = t.device
        self.key = key
        self.decode = decode  # a predicate's (true_value, false_value); None: the values
        self.ref: Any = None
        self.ptr = 0  # the data address of the tensor `ref` follows, at pack
        # and its storage, held weakly (None without _gact_torch): `t.data = a` then `t.data = b` can put another
        # storage at the same address, with no version change
        self.sref: Any = None
        self.version = t._version
        self.alias: torch.Tensor | None = None
        self.pending: Any = None  # a normalization input waiting for its layer's statistics
        self.vref: Any = None
        self.aborted = False  # released by Compressor.abort_step()
        # a device blob whose encode has not told yet whether it met NaN/Inf (Compressor._settle): the stored
        # tensor itself (detached), kept until then, and used as it is if it did
        self.hold: torch.Tensor | None = None
        self.pred: Any = None  # the predicate a `decode` reads (to evaluate it on `hold`)
        self.logged = False  # stored as exp(x) (a log-probability): decoded with log
        self.simplex: int | None = None  # a softmax's result: decoded rows along this dimension made to sum to one
        self.dkey: tuple | None = None  # its key for the decisions taken by key (Compressor._next_key)
        # a view's base and the storage the view was saved from, both held weakly, and the view's geometry (base ref,
        # storage ref, size, stride, offset): a frozen matrix used through a view (f @ E.t()) is served from the base
        # while it lives unchanged on that storage
        self.view: tuple | None = None

    def unpack(self) -> torch.Tensor:
        _check_version(self.vref, self.version, self)
        if self.alias is not None:
            return self.alias
        ref = self.ref
        if ref is not None:
            t = ref()
            # (its memory too: `t.data = other` swaps the storage of a tensor the program holds, with no version
            # change, and what was saved is the old one)
            if t is not None and t._version == self.version and t.data_ptr() == self.ptr and (
                    self.sref is None or self.sref.same(t._cdata)):
                # Still held by the program and unchanged: use it, and drop the blob. A detached alias
                # (same storage and version counter) keeps no tensor -> grad_fn -> saved cycle.
                self.alias = t.detach()
                _C.store_note_unstored("held", _compat.held_bytes(t), self.owner)
                self.release()
                return self.alias
        if self.view is not None and self.alias_from_base():
            return self.alias
        if self.hold is not None and self.handle and _C.store_verdict(self.handle) != 0:
            # the device found NaN/Inf in it (or has not run its encode yet): its groups decode to NaN, and
            # the exact tensor is at hand
            kept = self.keep_exact()
            if kept is not None:
                return kept
        self.hold = None
        if self.alias is not None:  # (kept exact by another thread meanwhile)
            return self.alias
        if not _warned_create_graph and torch.is_grad_enabled() and (_in_backward is None or _in_backward()):
            # (grad mode is on in a backward only with create_graph=True; a read through grad_fn._saved_* outside a
            # backward, a graph viewer's, is none)
            _warn_create_graph(self.key)
        if self.handle == 0:
            if self.aborted:
                raise RuntimeError(f"gact: saved tensor '{self.key}' belongs to a step given up with "
                                   "Compressor.abort_step(); run the forward again")
            raise RuntimeError(f"gact: saved tensor '{self.key}' was already released")
        dev = self.device
        stream = _compat.raw_stream(dev.index) if dev.type == "cuda" else 0
        dec = self.decode
        cap = _C.store_get_dlpack(self.handle, self.shape, self.stride, self.offset, stream,
                                  torch.get_num_threads(), dec is not None,
                                  dec[0] if dec is not None else 1.0, dec[1] if dec is not None else 0.0)
        out = _from_dlpack(cap)
        if self.logged:
            # (not in place: the store shares a decoded image with a later reader while an earlier one holds it,
            # a graph built with create_graph=True or a second read of grad_fn._saved_result)
            out = out.log()
        elif self.simplex is not None:
            # each row's excess over one, taken back in equal shares from its values that did not decode to zero: as
            # unbiased as the rows without it at 2 bits in 512 seeds (a row scaled by its sum was not: 3x, 0.15 of the
            # gradient's norm; taken from the row's largest value, 3x too), and a masked entry's exact zero stays zero
            # (shared with it, the excess made it a tiny probability, which p·log p read at the mask's fill); a row
            # with NaN stays NaN. In place, on the decoded image: the correction is idempotent (a row that sums to one
            # gets nothing), so another read of the same image (the matmul given the probabilities, a second
            # backward) gets rows as valid; out of place, and with the count of a whole map's zeros (its sum goes
            # through int64), its temporaries raised a process's peak by 630 MiB over a 512 MiB attention map: in
            # slices of at most SIMPLEX_SLICE elements along another dimension
            _simplex_correct(out, self.simplex)
        elif self.dtype is torch.bool:
            out = out.view(torch.bool)
        if _graph_keeps is not None and not _graph_keeps():
            # A backward that keeps no graph releases this save once its node has run, and no other node reads it:
            # the blob goes now, before the node computes, and the decoded image serves what is left of the node (a
            # second read of its saved tensors). Held to the node's end, a 64 MiB blob of a 512 MiB attention map
            # stood beside the decoded map at the backward's peak, 85 MiB over the run without gact at 4 bits.
            self.alias = out
            self.release()
        return out

    def alias_from_base(self) -> bool:
        """Where the view this save was made from is gone and its base is still held unchanged (the same version
        counter, storage and dtype): make the view again from it, exact, as the alias, drop the blob, and say so."""
        b = self.view[0]()
        if b is None or b._version != self.version or b.dtype != self.dtype or not self.view[1].same(b._cdata):
            return False
        self.alias = b.detach().as_strided(self.view[2], self.view[3], self.view[4])
        _C.store_note_unstored("held", _compat.held_bytes(self.alias), self.owner)
        self.release()
        return True

    def keep_exact(self) -> torch.Tensor | None:
        """Serve the held tensor itself from now on (what a predicate decode reads: evaluated on it) and free
        the blob; None when there is none to serve (taken meanwhile, not kept)."""
        hold = self.hold
        if hold is None:
            return self.alias  # (another thread took it: the Compressor's _settle, or a backward thread)
        dec = self.decode
        if dec is not None:
            hold = torch.full_like(hold, dec[1]).masked_fill_(_predicate_of(hold, self.pred), dec[0])
        elif self.logged:
            hold = hold.log()
        # (the alias before the hold goes and the handle is freed: a thread reading this save between sees one)
        self.alias = hold
        self.release()
        return hold

    def release(self) -> None:
        self.hold = None
        h, self.handle = self.handle, 0
        if h:
            _release(h)

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"_Packed(handle={self.handle}, key={self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


class _ThreadHooks:
    """The hooks install_thread put in a thread's torch state, taken out when that thread's Python
    state is cleared (its thread-local dict goes, with the GIL held, before join() returns). Left in
    place, torch's thread-local destructors would drop them after the OS thread has let go of Python,
    needing the GIL while the interpreter may be finalizing: the process then aborted at exit
    ("terminate called without an active exception", a few runs in a hundred). Only on its own thread: the
    thread-locals of threads Python did not start (torch's, a DataLoader's) are collected on the main thread at
    interpreter exit, where popping took the main thread's hooks, and then an empty stack (torch's INTERNAL ASSERT
    "pack_hook != nullptr", printed at exit)."""

    __slots__ = ("pop", "tracker", "ident", "__weakref__")

    def __init__(self, pop: Any, tracker: Any) -> None:
        self.pop = pop
        self.tracker = tracker
        self.ident = threading.get_ident()

    def __del__(self) -> None:
        if threading.get_ident() != self.ident:
            return  # (another thread's torch state: not this thread's to change)
        try:
            self.tracker.__exit__(None, None, None)
        finally:
            self.pop()


class _Shape:
    """A saved tensor whose reader uses only its shape (and layout): nothing is stored. Changed in place
    before backward it still raises torch's error, as torch would (the gradient would not change, but a
    tool that hooks into autograd never takes away torch's errors)."""

    __slots__ = ("shape", "stride", "dtype", "device", "contiguous", "vref", "version", "swap")

    def __init__(self, t: torch.Tensor, swap: bool = False) -> None:
        self.swap = swap  # the Compressor's: where its unpack's zeros go, when nothing decided the device pool yet
        self.shape = t.shape
        self.stride = t.stride()
        self.dtype = t.dtype
        self.device = t.device
        self.contiguous = t.is_contiguous()
        self.version = t._version
        self.vref = _watch(t)

    def unpack(self) -> torch.Tensor:
        _check_version(self.vref, self.version, self)
        if self.contiguous:
            return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)
        # another layout (channels_last): a zeroed tensor of that layout from gact's pool, so the
        # gradient the reader allocates "like" it keeps the layout
        dev = _compat.device_index_of(self.device)
        if dev >= 0 and _allocator.device_pool is None:
            _allocator._default_device_pool(self.swap, dev)
        stream = _compat.raw_stream(self.device.index) if self.device.type == "cuda" else 0
        cap = _C.empty_dlpack(_compat.DTYPE_NAMES[self.dtype], tuple(self.shape), tuple(self.stride), dev, stream)
        return _from_dlpack(cap).zero_()


class Compressor:
    """Compress the activations autograd saves inside ``with comp:``.

    Example::

        comp = gact.Compressor(model, bits=4)
        for x, y in loader:
            with comp:
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
            comp.step()
        print(comp.stats())

    Args:
        model: the ``nn.Module`` being trained (used to name tensors by module, to
            recognise its parameters and buffers, and for ``exclude``); ``None``
            compresses whatever is saved, naming tensors by op order.
        bits: 1, 2, 4 or 8 bits per element, or ``"auto"`` (a policy picks bits per
            tensor within ``budget``). Default: the ``bits`` option (GACT_BITS, 4).
        budget: with ``bits="auto"``, the average bits per element, in [1, 8].
            Default: the ``budget`` option (GACT_BUDGET).
        group_size: elements per quantization group, a power of two in [64, 1024].
        min_bytes: saved tensors smaller than this stay uncompressed (default 4096).
        seed: seed of the stochastic-rounding noise.
        exclude: modules (with their submodules) and tensors whose saved tensors stay
            uncompressed. A module is excluded as the model's module of its name: one put in its place
            later (``model.fc1 = nn.Linear(...)``) is excluded too, from the next step. Modules take effect
            with the model (given here or by :meth:`set_model`).
        swap: offload compressed activations to pinned host memory (needs the swap layer).
        estimator: with ``bits="auto"``, how sensitivities are estimated: ``"probe"``
            (the default with a model), ``"online"`` or ``"reference"`` (gact.policy). The
            probe and the reference replay the sampled step's first samples, or call a
            closure given to :meth:`step` or as ``gact.policy.Probe(closure)``.
        adapt_interval: with ``bits="auto"``, steps between re-estimations. Default: the
            ``adapt_interval`` option (GACT_ADAPT_INTERVAL).
        derivatives: store the input of ``silu``, ``gelu``, ``mish``, ``softplus``, ``elu``, ``celu``, ``erf``
            and ``logsigmoid`` as the activation's derivative (their backward is then linear in what
            is stored: an unbiased gradient, less noise); a backward with
            ``create_graph=True`` through them raises. Default: the ``derivatives`` option
            (GACT_DERIVATIVES, true).

    Raises:
        ValueError: for a bad setting, naming it and the accepted values.
        TypeError: for an ``exclude`` entry that is neither a module nor a tensor.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        bits: int | str | None = None,
        *,
        budget: float | None = None,
        group_size: int | None = None,
        min_bytes: int | None = None,
        seed: int | None = None,
        exclude: Iterable[Any] = (),
        swap: bool | None = None,
        estimator: Any = None,
        adapt_interval: int | None = None,
        derivatives: bool | None = None,
        policy: Any = None,
    ) -> None:
        opts = _options()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"gact.Compressor: model must be a torch.nn.Module or None, not {type(model).__name__}")
        model = self.model = _compat.unwrap_ddp(model)  # (DistributedDataParallel's module)

        if bits is None:
            bits = opts["bits"]
        if isinstance(bits, str):
            if bits != "auto":
                if bits.isdigit():
                    bits = int(bits)
                else:
                    raise ValueError(f"gact.Compressor: bits={bits!r} is not supported; use 1, 2, 4, 8 or 'auto'")
        if bits != "auto":
            b = _integer(bits)
            if b not in _VALID_BITS:
                raise ValueError(f"gact.Compressor: bits={bits!r} is not supported; use 1, 2, 4, 8 or 'auto'")
            bits = b
        self.bits = bits

        if budget is None:
            budget = opts["budget"]
        try:
            budget = float(budget)
        except (TypeError, ValueError):
            raise ValueError(f"gact.Compressor: budget={budget!r} is not a number in [1, 8]") from None
        if not (1.0 <= budget <= 8.0):
            raise ValueError(f"gact.Compressor: budget={budget!r} is outside [1, 8] (average bits per element)")
        self.budget = budget

        if group_size is None:
            group_size = opts["group_size"]
        g = _integer(group_size)
        if g is None or not (64 <= g <= 1024) or g & (g - 1):
            raise ValueError(f"gact.Compressor: group_size={group_size!r} must be a power of two in [64, 1024]")
        self.group_size = g

        if min_bytes is None:
            min_bytes = opts["min_bytes"]
        n = _integer(min_bytes)
        if n is None or n < 0:
            raise ValueError(f"gact.Compressor: min_bytes={min_bytes!r} must be an integer >= 0")
        self.min_bytes = n

        if seed is None:
            seed = opts["seed"]
        n = _integer(seed)
        if n is None or not (0 <= n < 2**64):
            raise ValueError(f"gact.Compressor: seed={seed!r} must be an integer in [0, 2**64)")
        self.seed = n

        if swap is None:
            swap = bool(opts["swap"])
        if type(swap).__name__ not in ("bool", "bool_"):  # (a string "false" is truthy: swap on, unasked)
            raise ValueError(f"gact.Compressor: swap={swap!r} must be True or False")
        if swap and not hasattr(_C, "swap_enable"):
            raise NotImplementedError("gact.Compressor: swap=True needs the swap layer, which this build of gact lacks")
        self.swap = bool(swap)
        # GACT_SWAP_BUDGET: device-resident blob bytes kept before offloading (0 = offload all);
        # GACT_PREFETCH: blobs brought back ahead of backward.
        self._swap_budget = int(opts["swap_budget"])
        self._prefetch = int(opts["prefetch"])
        if estimator is not None and self.bits != "auto" and policy is None:
            # An estimator sets nothing with fixed bits: a misspelt bits or estimator would go unnoticed.
            raise ValueError(f"gact.Compressor: estimator={estimator!r} is used only with bits='auto' "
                             f"(bits={self.bits!r})")
        self.estimator = estimator
        if adapt_interval is not None:
            n = _integer(adapt_interval)
            if n is None or n < 1:
                raise ValueError(f"gact.Compressor: adapt_interval={adapt_interval!r} must be an integer >= 1")
            adapt_interval = n
        self.adapt_interval = adapt_interval
        if derivatives is None:
            derivatives = bool(opts["derivatives"])
        if type(derivatives).__name__ not in ("bool", "bool_"):
            raise ValueError(f"gact.Compressor: derivatives={derivatives!r} must be True or False")
        self.derivatives = bool(derivatives)

        self._excluded_modules: set[int] = set()
        self._excluded_tensors: list[torch.Tensor] = []
        if isinstance(exclude, (torch.nn.Module, torch.Tensor)):
            exclude = (exclude,)  # (one module or tensor, given without a list)
        try:
            exclude = list(exclude)
        except TypeError:
            raise TypeError(f"gact.Compressor: exclude must be modules and tensors (a list, or one), not "
                            f"{type(exclude).__name__}") from None
        for e in exclude:
            if isinstance(e, torch.nn.Module):
                self._excluded_modules.update(id(m) for m in e.modules())
            elif isinstance(e, torch.Tensor):
                self._excluded_tensors.append(e)
            else:
                raise TypeError(
                    f"gact.Compressor: exclude entries must be modules or tensors, not {type(e).__name__}"
                )

        self._modules: list = []  # _model_modules()
        self._modules_at: int | None = None
        self._modules_of: Any = None
        self._policy = policy
        self._probe: Any = None  # a policy's probe recorder: saved tensors kept exact (gact.policy)
        self._row_share = 1.0  # an estimator's replay: its rows' share of the step's batch (gact.policy)
        self._own_policy = self.bits == "auto" and self._policy is None  # built here (set_model rebuilds it)
        if self._own_policy:
            self._policy = self._make_auto_policy()

        self._step = 0
        self._step_open = False
        self._global_depth = 0  # install_global: hooks for the whole process
        self._param_ptrs: frozenset[int] = frozenset()
        self._excluded_ptrs: frozenset[int] = frozenset()
        self._key_counts: dict = {}  # module name -> its saves so far; (module, function) -> theirs (_next_key)
        self._input_ptrs: set[int] = set()
        # the tensors this step stored as a call's own result or inner tensor, while they live (saved.correlation_group):
        # a later call that reads one for its own gradient gets a blob of its own
        self._results: dict[tuple, Any] = {}
        # this step's stored saves by the autograd node of the call that stored them (its address: [(weak _Packed,
        # whether it stores the tensor's values)]), for _exact_read
        self._by_node: dict[int, list] = {}
        # per thread (by ident), the last stored tensors of HELD_CALLS, held for HOLD_STORES more stores (_hold)
        self._holds: dict[int, list] = {}
        # keys kept exact by a measurement of their call (attention calls' q and k, and a fused call's v and output; a
        # squared difference's sides), and this step's measurements to read at step() (_measure_qk, _measure_near)
        self._qk_exact: set[str] = set()
        self._qk_floor: set[str] = set()  # ... and those stored at 8 bits at least (_measure_near)
        # keys of saves read (through elementwise calls) by a reader kept exact that divides by them (_exact_read):
        # kept exact from the next step on
        self._divided_exact: set[tuple] = set()  # (their decision keys, _next_key)
        self._spectral_step = -1  # the last step that ran a spectral decomposition (_saved.SPECTRAL_CALLS)
        self._rounded_step = -1  # the last step that rounded a tensor with a graph (_on_round)
        # the last step that factored, inverted or solved with a product of activations (_saved.conditioned_matrix)
        self._conditioned_step = -1
        self._qk_sigmas: list[tuple] = []
        self._qk_next = 0  # the step that measures them next
        # a device's squared-difference keys and the call measured under each (one not measured is measured at once)
        self._near_calls: dict[str, str] = {}
        # a device's normalization inputs whose blocks' shifts would lose too much in bfloat16 (_norm_params): stored as
        # plain values from the step after their measurement; the measurements of this step, (key, verdict tensor)
        self._plain_norm: set[str] = set()
        self._norm_checks: list[tuple] = []
        self._checks_next = 0  # the step that measures those (and _ste_checks) next: ATTENTION_CHECK_EVERY apart
        # a device's straight-through results (_straight_through): the keys found so, and this step's measurements
        self._ste_keys: set[str] = set()
        self._ste_checks: list[tuple] = []
        self._local = threading.local()  # per thread: depth, hooks and tracker, module stack
        self._module_hooks: list[Any] = []
        self._closed = False  # (close(): entered again, it raises)
        self._names: dict[int, str] = {}
        self._hooked: dict[int, Any] = {}  # id -> weak reference of the modules this Compressor hooked (_hook_modules)
        self._excluded_paths: set[str] = set()  # the excluded modules' names in the model (_install_module_hooks)
        # torch's CPU tensors and the blobs: one pool (option cpu_allocator); a model wholly on a GPU has no
        # CPU tensors in play, so a build without the CPU pool is not worth a warning there
        on_gpu = model is not None and any(True for _ in model.parameters()) and \
            all(p.is_cuda for p in model.parameters())
        _allocator._default_cpu_allocator(warn=not on_gpu)
        self._owner = _C.store_new_owner()  # this Compressor's own counters in the store (stats())
        self._warned_memory = False
        self._warned_derivative = False
        self._live: list = []
        # A clamp's output saved for its predicate (a ReLU's x > 0) waits here for the values save of the same
        # tensor that usually follows (the next layer's input): both are then one boundary blob, encoded once,
        # instead of a mask encoded first and encoded again as values. [(weakref to the _Packed, tensor,
        # key, decision)], resolved (the mask stored) at the latest when the forward's `with` block ends,
        # before any unpack, at step() or when MAX_DEFERRED wait.
        self._deferred: list = []
        self._deferred_lock = threading.Lock()
        # Device blobs whose encode has not yet told whether it met NaN/Inf, oldest first: [(_Packed, bytes held)].
        # Each keeps its tensor (hold) until the verdict is read (a few loads of mapped memory, no sync), and serves
        # it exactly if the encode met one (_settle).
        self._verdicts: collections.deque = collections.deque()
        self._verdict_bytes = 0
        self._verdict_lock = threading.Lock()
        # A Compressor dropped without close(): its module hooks (which hold it weakly) and counters go too.
        weakref.finalize(self, _release_compressor, self._module_hooks, self._owner)
        if model is not None:
            self._install_module_hooks(model)

    # ---- policy -------------------------------------------------------------------------

    def _make_auto_policy(self) -> Any:
        try:
            from . import policy as policy_mod  # provided by the policy layer
        except ImportError:
            raise NotImplementedError(
                "gact.Compressor: bits='auto' needs the adaptive policy (gact.policy), which this build lacks; "
                "use bits=1, 2, 4 or 8"
            ) from None
        return policy_mod.make_policy(self, budget=self.budget, estimator=self.estimator)

    def _bits_for(self, key: str, numel: int) -> int:
        """Bits for the tensor saved under ``key`` (``numel`` elements).

        The hook point of the adaptive policy: with a policy set, its ``bits_for(key, numel)``
        answers; otherwise the fixed ``bits``. A policy may also define ``on_stored(key, info)``
        (called after each store of values, ``info`` as ``_gact.store_info``: codec, bits, bytes_in,
        bytes_stored, groups, sum_sq_ranges) and ``on_step(step)`` (called by :meth:`step`).
        """
        if self._policy is not None:
            return int(self._policy.bits_for(key, numel))
        return int(self.bits)

    @property
    def policy(self) -> Any:
        return self._policy

    @policy.setter
    def policy(self, p: Any) -> None:
        self._policy = p

    @property
    def current_step(self) -> int:
        """The number of completed steps."""
        return self._step

    @property
    def _depth(self) -> int:
        """How deep the calling thread is inside ``with comp:`` (plus a global installation)."""
        return getattr(self._local, "depth", 0) + self._global_depth

    def set_model(self, model: torch.nn.Module) -> None:
        """Give a Compressor made without a model its model (gact-run does this with the first module
        a script trains): module names in the keys from now on, and with ``bits="auto"`` a policy that
        estimates on that model, sampling the next step (the current one was saved before it).

        Raises TypeError for a non-module and ValueError when the Compressor has a model already."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"gact.Compressor.set_model: model must be a torch.nn.Module, not {type(model).__name__}")
        if self.model is not None:
            raise ValueError(f"gact.Compressor.set_model: this Compressor has a model already "
                             f"({type(self.model).__name__}); make another Compressor for another model")
        model = self.model = _compat.unwrap_ddp(model)
        self._install_module_hooks(model)
        self._qk_exact.clear()  # (keyed by module names from now on: measured again at once)
        self._qk_floor.clear()
        self._near_calls.clear()
        self._divided_exact.clear()
        self._plain_norm.clear()
        self._ste_keys.clear()
        self._qk_next = self._checks_next = self._step
        if self._own_policy:
            old, self._policy = self._policy, self._make_auto_policy()
            self._policy.defer_first_sample()
            close = getattr(old, "close", None)
            if close is not None:
                close()

    # ---- module tracking ----------------------------------------------------------------

    def _install_module_hooks(self, model: torch.nn.Module) -> None:
        # (the names of the excluded modules in this model: a module put in one's place later is excluded too)
        ids = self._excluded_modules
        self._excluded_paths = {name for name, m in model.named_modules() if id(m) in ids and name}
        self._hook_modules(model)

    def _hook_modules(self, model: torch.nn.Module) -> None:
        """Hook the modules of ``model`` this Compressor has not hooked yet: all of them at first, and at a later
        step's start those added or put in another's place since (``model.head = nn.Linear(...)``), which were named
        after their parent and never excluded before."""
        hooked = self._hooked
        paths = self._excluded_paths
        for name, m in model.named_modules():
            r = hooked.get(id(m))
            if r is not None and r() is m:
                continue
            self._names[id(m)] = name or "<root>"
            if paths and any(name == p or name.startswith(p + ".") for p in paths):
                self._excluded_modules.add(id(m))
            elif r is not None:  # (a module gone whose id this one took: its hooks, keyed by id, serve this one)
                self._excluded_modules.discard(id(m))
            hooked[id(m)] = weakref.ref(m)
            if r is None:
                self._module_hooks.append(
                    _compat.register_forward_pre_hook(m, _compat.weak_hook(self, Compressor._enter_module)))
                self._module_hooks.append(
                    _compat.register_forward_hook(m, _compat.weak_hook(self, Compressor._leave_module)))

    def _stack(self) -> list[tuple[str, bool, int]]:
        s = getattr(self._local, "stack", None)
        if s is None:
            s = self._local.stack = []
        return s

    def _enter_module(self, m: torch.nn.Module, inputs: Any) -> None:
        # (runs for every module call: self._depth and self._stack() inlined)
        local = self._local
        if not self._global_depth and not getattr(local, "depth", 0) or _compiling():
            return
        s = getattr(local, "stack", None)
        if s is None:
            s = local.stack = []
        if not s and self.model is not None:
            self._note_inputs(inputs)
        key = id(m)
        excluded = (bool(s) and s[-1][1]) or key in self._excluded_modules
        s.append((self._names.get(key) or type(m).__name__, excluded, key))

    def _note_inputs(self, inputs: Any) -> None:
        for a in _compat.flatten(inputs):
            if isinstance(a, torch.Tensor) and not a.requires_grad and a.layout == torch.strided and \
                    not _is_wrapped(a):
                self._input_ptrs.add(_compat.storage_base(a))

    def _is_cast_input(self, t: torch.Tensor, frame: Any) -> bool:
        """Whether ``t`` is autocast's float16/bfloat16 copy (or a view of it) of a model input that the call
        saving it was given: the first layer saves it for its weight's gradient."""
        if frame is None or t.grad_fn is not None or t.dtype not in _compat.AUTOCAST_DTYPES:
            return False
        return any(isinstance(a, torch.Tensor) and _compat.storage_base(a) in self._input_ptrs
                   and _saved.cast_copy_of(t, a) for a in list(frame.args) + list(frame.kwargs.values()))

    def _leave_module(self, m: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        local = self._local
        if not self._global_depth and not getattr(local, "depth", 0) or _compiling():
            return
        s = getattr(local, "stack", None)
        if s:
            key = id(m)
            if s[-1][2] == key:
                s.pop()
            else:
                # (entries above it: modules whose forward raised inside its own, caught there, whose forward hook
                # never ran; its forward returning, none of them still runs. Not in the stack at all: nothing to drop)
                for j in range(len(s) - 1, -1, -1):
                    if s[j][2] == key:
                        del s[j:]
                        break

    def close(self) -> None:
        """Remove the module hooks this Compressor (and its policy) installed on the model. A graph alive still reads
        its saves; entering the Compressor again raises (without its hooks it would store ``exclude=`` modules and
        key every tensor by no module)."""
        self._closed = True
        self._settle(drain=True)  # (a graph still alive reads its saves as they should be; no tensor stays kept)
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()
        if self._policy is not None and hasattr(self._policy, "close"):
            self._policy.close()
        _C.host_empty_cache()  # the host arena's free segments back to the system (gact.empty_cache())

    # ---- context manager ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("gact.Compressor: this Compressor was closed (close() took out its module hooks); make "
                               "a new one. To give the arena's cached memory back and go on, call gact.empty_cache()")

    def __enter__(self) -> "Compressor":
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            self._check_open()
        entries = getattr(local, "entries", None)
        if entries is None:
            entries = local.entries = []  # (per `with`, innermost last: whether it stepped aside)
        if _in_a_transform():
            # inside torch.func.grad, vjp, jacrev or hessian, which turn saved-tensor hooks off for their extent (and
            # then save what autograd saves, as gact's own hooks entered outside them do): the block steps aside
            # where torch raised its "saved tensor hooks" error
            entries.append(True)
            return self
        _compat.track_saved_hooks()  # (once: torch.func's transforms then find gact's hooks out of their way)
        _saved.track_function_saves()  # (once: a custom autograd.Function's saves are told apart)
        if depth == 0:
            self._stack().clear()
            if not self._step_open:
                self._open_step()
            if self.swap:
                _C.swap_enable(self._swap_budget, self._prefetch)
            elif hasattr(_C, "swap_disable"):
                _C.swap_disable()
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            entered = None
            before = getattr(local, "tracker", None)
            modes = _mode_depth()
            try:
                tracker = _saved.OpTracker(self._flush, self._on_alias, self._on_result, self._on_round)
                tracker.substitutes = self._substitutes()
                tracker.min_store_bytes = _compat.weak_hook(self, Compressor._min_store_bytes)
                entered = tracker
                tracker.__enter__()
                # (the thread's tracker before it, install_global's, comes back at the end of the block: the policy's
                # probe replays a step inside `with comp:` on gact-run's globally installed Compressor)
                local.ctx = (hooks, tracker, before)
                local.tracker = tracker
                local.depth = depth + 1
                entries.append(False)
            except BaseException:
                # (a Ctrl-C, or an error, before the block is entered: `with` then calls no __exit__, and the hooks and
                # the tracker would stay on this thread for good)
                local.tracker, local.ctx = before, None
                try:
                    # (its mode is on the stack once its __enter__ has pushed it, also if that then raised)
                    if entered is not None and (modes is None or _mode_depth() > modes):
                        entered.__exit__(None, None, None)
                finally:
                    hooks.__exit__(None, None, None)
                raise
            return self
        else:
            # Entered again inside itself: its hooks go on top once more, so that they are the innermost, as torch's
            # hooks are wherever a `with` enters them, over a save_on_cpu, a user's saved_tensors_hooks or a
            # non-reentrant checkpoint entered in between (a checkpointed function with `with comp:` inside: in
            # forward the checkpoint's hooks took its saves, in the recomputation comp's, and backward failed).
            # The op tracker stays the one of the outermost `with`.
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            local.nested = getattr(local, "nested", None) or []
            local.nested.append(hooks)
            entries.append(False)
        local.depth = depth + 1
        return self

    def _min_store_bytes(self) -> float:
        """The size below which a saved tensor is kept as it is ("small"); an estimator's replay scales it by its
        rows' share of the step's batch."""
        return self.min_bytes * self._row_share

    def _substitutes(self) -> dict | None:
        """The op tracker's stand-ins: the activations whose input is stored as their derivative."""
        return _saved.DERIVATIVE_SUBSTITUTES if self.derivatives else None

    def __exit__(self, *exc: Any) -> None:
        local = self._local
        entries = getattr(local, "entries", None)
        if entries and entries.pop():
            return  # (a block that stepped aside: see __enter__)
        depth = getattr(local, "depth", 0)
        if depth == 0:
            raise RuntimeError("gact.Compressor: __exit__ without a matching __enter__ on this thread")
        local.depth = depth - 1
        if depth > 1:
            local.nested.pop().__exit__(*exc)
        if depth == 1:
            self._stack().clear()
            self._holds.pop(threading.get_ident(), None)
            if self._deferred:
                self._resolve_deferred()
            hooks, tracker, before = local.ctx
            local.ctx = None
            local.tracker = before
            try:
                tracker.__exit__(*exc)
            finally:
                hooks.__exit__(*exc)

    # ---- steps --------------------------------------------------------------------------

    def _model_modules(self) -> list:
        """The model's modules, kept between steps while no module in the process registered a submodule
        (walked again at every step on a torch without the registration hook, and every 64th step anyway: a
        submodule deleted from the model drops out). Held weakly: a deleted submodule is not kept alive. A module
        found that this Compressor has not hooked (added to the model since) is hooked now."""
        gen = _compat.module_generation()
        if gen is None or gen != self._modules_at or self._modules_of is not self.model or not self._step & 63:
            mods = list(self.model.modules())
            self._modules = [weakref.ref(m) for m in mods]
            self._modules_at, self._modules_of = gen, self.model
            hooked = self._hooked
            if self._module_hooks and any((r := hooked.get(id(m))) is None or r() is not m for m in mods):
                self._hook_modules(self.model)
        return [m for m in (r() for r in self._modules) if m is not None]

    def _open_step(self) -> None:
        # (read again every step: a parameter replaced, or its .data, since the last one is seen)
        ptrs = _compat.parameter_storages(self._model_modules()) if self.model is not None else ()
        self._param_ptrs = frozenset(ptrs)
        self._excluded_ptrs = frozenset(_compat.storage_base(t) for t in self._excluded_tensors) - {0}
        self._key_counts = {}
        self._input_ptrs = set()
        self._results = {}
        self._by_node = {}
        self._holds = {}
        self._live = []  # weak references to this step's _Packed (abort_step)
        _C.store_begin_step(self._step, self._owner)
        self._step_open = True

    def step(self, closure: Any = None) -> int:
        """End the iteration: count handles still alive as leaks, advance the step (new noise),
        let the policy update. Call after ``optimizer.step()``. Returns the leaked handle count.

        ``closure``: for ``bits="auto"`` with ``estimator="probe"`` or ``"reference"``, a
        function that runs the model's forward pass on a small batch (a few samples) and
        returns the loss; it is called only on the steps that re-estimate. Without one, the
        estimators replay the sampled step's first samples with its output gradient."""
        if closure is not None:
            if not callable(closure):
                raise TypeError(f"gact.Compressor.step: closure must be callable, not {type(closure).__name__}")
            if self._policy is None or not hasattr(self._policy, "closure"):
                raise ValueError("gact.Compressor.step: a closure is used only with bits='auto'")
            self._policy.closure = closure
        if self._deferred:
            self._resolve_deferred()
        if self._verdicts:
            self._settle()
        global _warned_compiled
        if _compiled_saves and not _warned_compiled:
            _warned_compiled = True
            warnings.warn("gact: tensors saved inside a torch.compile'd region are kept as they are (not compressed): "
                          "gact cannot tell which op saved them there. Compress the eager parts, or run the model "
                          "without torch.compile to compress all of it.", RuntimeWarning, stacklevel=2)
        leaks = _C.store_end_step(self._owner)
        if self._qk_sigmas or self._norm_checks or self._ste_checks:
            self._read_qk()
        self._step += 1
        self._step_open = False
        if self._policy is not None and hasattr(self._policy, "on_step"):
            global _probing
            with _probing_lock:
                _probing += 1  # (the policy's estimates replay samples through the model: gact.probing())
            try:
                self._policy.on_step(self._step)
            finally:
                with _probing_lock:
                    _probing -= 1
        return leaks

    def abort_step(self) -> int:
        """Give up the current iteration after an exception in its forward or backward (out of memory,
        a bad batch): release every blob this Compressor stored in it at once, even while the step's
        graph is still alive (a caught exception keeps it, through its traceback, until the exception
        is dropped). A backward through that graph then raises. The step is closed without counting
        as a training step or its handles as leaks; the next forward opens a new one. Returns the
        number of blobs released.

        Example::

            try:
                with comp:
                    loss = model(x).sum()
                loss.backward()
            except torch.cuda.OutOfMemoryError:
                comp.abort_step()   # the failed step's blobs are free for the retry
                ...
        """
        n = 0
        with self._deferred_lock:
            self._deferred.clear()  # (their _Packed are in _live, marked aborted below)
        live, self._live = self._live, []
        for r in live:
            p = r()
            if p is not None and (p.handle or p.pending is not None):
                p.pending = None
                p.aborted = True
                p.release()
                n += 1
        self._drop_verdicts()  # (the released ones: release() let go of their tensors)
        if self._step_open:
            self._discard_step()
        return n

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> dict:
        """The stats document (the schema of the JSON dump) as a dict, with ``store`` counting this
        Compressor's tensors and steps only (its ``owner`` id); the process's totals, every
        Compressor's together, are under ``store_process`` (the dump's ``store``). ``policy`` is this
        Compressor's policy (absent without one; the dump holds the latest policy's)."""
        doc = _C.stats_document()
        doc["store_process"] = doc.get("store")
        doc["store"] = _C.store_stats(self._owner)
        doc.pop("policy", None)
        policy = self._policy
        if policy is not None and hasattr(policy, "stats"):
            doc["policy"] = policy.stats()
        return doc

    # ---- hooks --------------------------------------------------------------------------

    def _is_parameter(self, t: torch.Tensor) -> bool:
        # (a leaf that requires grad is a parameter, except a probe's cut: a module input it made a leaf)
        if t.requires_grad and t.is_leaf:
            return self._probe is None or id(t) not in self._probe.leaves
        b = t._base
        if b is not None and b.requires_grad and b.is_leaf:
            return self._probe is None or id(b) not in self._probe.leaves
        if bool(self._param_ptrs) and _compat.storage_base(t) in self._param_ptrs:
            return True
        return self._is_cast_parameter(t)

    def _is_cast_parameter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is autocast's copy of a parameter in its lower precision (a convolution or linear
        layer saves the copy it computed with): its grad_fn copies a parameter (a view of one). Rounded, it
        would be the weight the input's gradient is computed with. (A copy of a parameter that does not
        require grad has no graph: the storage table's rows for the layers keep the copy of the weight
        they are given exact.)"""
        g = t.grad_fn
        if g is None or type(g) in _PLAIN_NODES:
            return False
        node, cast = _saved.through_copies(g)  # a copy, and views around it
        if node is g:  # (neither a copy nor a view: the next tensor from such a node is looked up in a set)
            _PLAIN_NODES.add(type(g))
        var = getattr(node, "variable", None)  # an AccumulateGrad's leaf
        return cast and var is not None and (self._probe is None or id(var) not in self._probe.leaves)

    def _is_excluded(self, t: torch.Tensor, s: list | None = None) -> bool:
        if s is None:
            s = self._stack()
        if s and s[-1][1]:
            return True
        return bool(self._excluded_ptrs) and _compat.storage_base(t) in self._excluded_ptrs

    def _keep_reason(self, t: torch.Tensor, s: list | None = None) -> str | None:
        """Why a tensor is kept as it is whatever its reader (None: the table decides). ``s``: the calling
        thread's module stack, when the caller has it."""
        # (runs for every saved tensor: cheap properties first, no torch.device object made)
        tt = type(t)
        if (
            (tt is not torch.Tensor and tt is not torch.nn.Parameter)
            or t.layout is not torch.strided
            or t.is_quantized
            or (_HAS_NESTED and t.is_nested)
            or (_HAS_NEG and t.is_neg())  # (a negated view, Z.conj().imag: its memory holds -values)
            or _is_wrapped(t)
        ):
            return "layout"
        if t.is_cuda:
            if not _C.have_kernels:
                return "device"
        elif not t.is_cpu:
            return "layout"
        # _is_parameter(t), inlined
        probe = self._probe
        if t.requires_grad and t.is_leaf:
            if probe is None or id(t) not in probe.leaves:
                return "parameter"
        else:
            b = t._base
            if b is not None and b.requires_grad and b.is_leaf:
                if probe is None or id(b) not in probe.leaves:
                    return "parameter"
            elif (self._param_ptrs and _compat.storage_base(t) in self._param_ptrs) or self._is_cast_parameter(t):
                return "parameter"
        if self._is_excluded(t, s):
            return "excluded"
        return None

    def _live_count(self) -> int:
        """How many of this step's stored tensors are still alive (a graph backward has not yet freed)."""
        return sum(1 for r in self._live if r() is not None)

    def _note_live(self, p: _Packed) -> None:
        """Remember a _Packed of this step for abort_step(); the dead ones are dropped now and then, so that
        a program that never calls step() does not grow the list without end."""
        live = self._live
        live.append(weakref.ref(p))
        if len(live) >= 4096 and (len(live) & 4095) == 0:
            self._live = [r for r in live if r() is not None]

    def _keep(self, t: torch.Tensor, reason: str) -> "_Kept":
        _C.store_note_skip(reason, _compat.held_bytes(t), self._owner)
        # A non-leaf may be the output of the very node saving it: handing autograd the tensor itself
        # would make tensor -> grad_fn -> saved tensor a cycle that Python's GC cannot see, and the
        # graph (with every blob in it) would never be freed if backward never runs. A detached alias
        # breaks the cycle and shares storage and version counter, so in-place checks still work.
        k = t if t.grad_fn is None else t.detach()
        # (a policy's probe replays a step and restores what it changed, batch norm's running statistics
        # included, before its backward: its passes are gact's own, not the program's)
        if self._probe is not None:
            return k
        if _mutation_allowed():  # (the program may change t before backward reads it as saved)
            k = k.detach().clone()
            return _Kept(k, k._version)
        return _Kept(k, t._version)

    def _next_key(self, s: list | None = None, frame: Any = None) -> tuple:
        """The next save's key, "module:n" (n: its order among the module's saves in the step), and its key for the
        decisions taken by key from one step to the next (_divided_exact): (module, function, its order among the
        module's saves by the same function), which a loop of another function before it in the module (a recurrence
        over a batch's own length) does not move."""
        if s is None:
            s = self._stack()
        name = s[-1][0] if s else "<none>"
        counts = self._key_counts
        n = counts.get(name, 0)
        counts[name] = n + 1
        op = (name, frame.name if frame is not None else "")
        m = counts.get(op, 0)
        counts[op] = m + 1
        return f"{name}:{n}", (*op, m)

    def _pack(self, t: Any) -> Any:
        global _compiled_saves
        if not isinstance(t, torch.Tensor):
            return t
        if _compiling():  # (see _compat.is_compiling: kept as it is; said once, at the next step())
            _compiled_saves = True
            return t
        if not self._step_open:
            self._open_step()
        local = self._local
        s = getattr(local, "stack", None)
        if s is None:
            s = local.stack = []
        reason = self._keep_reason(t, s)
        if reason is not None:
            return self._keep(t, reason)
        tracker = getattr(local, "tracker", None)
        frame = (tracker.stack[-1] if tracker.stack else None) if tracker is not None else None
        d = _saved.decide(t, frame)
        kind = d.kind
        if self._by_node and frame is not None and frame.name in _saved.SELECTING_CALLS and not frame.selected:
            frame.selected = True  # (one walk a call: min(dim) and topk save their indices, amin its input and result)
            if _saved.selects_small(frame):
                self._exact_read(_saved._arg(frame.args, frame.kwargs, 0, "input"))
        if kind == _saved.DERIVATIVE and not self.derivatives:
            # another Compressor's tracker ran the stand-in (nested, or gact-run's global one): values here, read
            # through the activation's curve by the stand-in's backward (torch's on them): at >= 4 bits, as the
            # activations' rows store their input where no stand-in ran
            d, kind = _saved._QUADRATIC, _saved.VALUES
        if kind == _saved.SHAPE:
            _C.store_note_unstored("shape", t.numel() * t.element_size(), self._owner)
            return _Shape(t, self.swap)
        if kind == _saved.STATS:
            if frame is not None and frame.pending is not None:
                frame.stats.append(t)
            return self._keep(t, "stats")
        if kind == _saved.EXACT:
            if d is _saved.EXACT_COMPILED:
                _compiled_saves = True
            # keyed as a stored save is: whether a tensor is exact can depend on sizes (an operand broadcast
            # over one with 8x its elements is exact), which a replay of fewer rows changes; the keys of the
            # saves after it must not move with it
            if t.dtype in _KEYED_DTYPES:
                self._next_key(s, frame)
            if self._by_node and _saved.divides_by(t, frame):  # (empty without _gact_torch's graph calls)
                self._exact_read(t)
            if self._by_node and frame is not None and frame.name in _saved.INVERTING_CALLS:
                partner = _saved.inverse_partner(t, frame)
                if partner is not None:
                    # (the divisor computed from t, or t's inverse factor: the saves it was computed through, a sqrt's
                    # result under t / sqrt(1 + t²), read exact too, its rounding amplified as t's)
                    self._exact_read(partner)
            if frame is not None and frame.stored and frame.name in _saved.POINT_DISTANCE_CALLS and \
                    _saved.near_points(t, frame):
                for r, values in frame.stored:  # (the call's points, stored before its distances: its operands)
                    q = r()
                    if q is not None:
                        self._serve_held(q, values)
            if frame is not None and frame.name in _saved.SPECTRAL_CALLS:
                self._spectral_step = self._step  # (the reads of its outputs after it: _saved.near_spectral)
            if self._by_node and frame is not None and frame.name in _saved.CONDITIONED_CALLS and not frame.selected:
                frame.selected = True  # (one walk a call)
                m = _saved.conditioned_matrix(frame)
                if m is not None and self._exact_products(m):
                    self._conditioned_step = self._step  # (the reads beside its results: saved.beside_conditioned)
            return self._keep(t, "exact")
        dtype = t.dtype
        if dtype not in _KEYED_DTYPES and kind != _saved.INDICES:
            return self._keep(t, "dtype")
        # A key for every save from here on, kept or not: keys then follow the order of saves alone, not
        # sizes or identities, so that an estimator's replay of fewer rows (smaller tensors; its cut
        # batch requires grad) keys each tensor as the step did. Such a replay scales min_bytes by its
        # share of the step's rows, so that it also stores what the step stored.
        key, dkey = self._next_key(s, frame)
        n = t.numel()
        if n * t.element_size() < self._min_store_bytes() or n == 0:
            return self._keep(t, "small")
        if dkey in self._divided_exact and t.grad_fn is not None:
            return self._keep(t, "exact")
        if self._spectral_step == self._step and t.grad_fn is not None and _saved.near_spectral(t):
            return self._keep(t, "exact")
        if self._rounded_step == self._step and self._straight_through(t, key):
            # the rounded codes a quantizer's scale is read through, and the saves they were computed through (the
            # dividend x of x / s): _on_round
            self._exact_read(t)
            return self._keep(t, "exact")
        if self._conditioned_step == self._step and _saved.beside_conditioned(t, frame):
            return self._keep(t, "exact")
        if self._input_ptrs and not t.requires_grad and (_compat.storage_base(t) in self._input_ptrs
                                                         or self._is_cast_input(t, frame)):
            return self._keep(t, "input")
        if self._probe is not None:
            return self._probe_pack(t, key, d, frame)
        if kind == _saved.NORMALIZED:
            if frame is None:
                kind = _saved.VALUES
            else:
                # Wait for the layer's statistics (saved after its input, in the same call).
                p = _Packed(0, t, key, owner=self._owner)
                p.dkey = dkey
                self._note_live(p)
                p.pending = t
                p.vref = _watch(t)
                if frame.pending is None:
                    frame.pending, frame.stats = [], []
                frame.pending.append(p)
                return p
        if kind == _saved.DERIVATIVE:
            q = self._store_derivative(t, key, _saved.activation_call(t), dkey)
            if q is not None:
                return q
        if kind == _saved.EXP:
            return self._store_exp(t, key, d, dkey)
        if kind == _saved.DERIVATIVE:  # (f'(x) could not be computed: x, read through the curve, as above)
            d, kind = _saved._QUADRATIC, _saved.VALUES
        elif kind == _saved.NORMALIZED:
            d, kind = _saved._VALUES, _saved.VALUES
        if d.qk == 5 and frame is not None and not (t.is_cuda or _DEFERRED_CHECKS):
            # a squared difference's side on the host: its call decided at once, at every step (reading the measurement
            # costs no sync here), not by key from an earlier step, where a save made before it on some steps only,
            # another task's loss under the same key or a loss that appears later got another call's decision
            near = self._near_now(frame, key, t.numel())
            if near == 2:
                return self._keep(t, "exact")
            if near == 1:
                d = d._replace(min_bits=8)
        elif d.qk:  # (an attention's q or k: kept exact where its rounding would move the scores too far, _measure_qk)
            if d.qk == 4:  # (a fused call's v or output: decided with its q and k)
                if frame is not None and frame.qk_keys is not None:
                    frame.qk_keys.append(key)
            elif frame is not None and len(self._qk_sigmas) < self.QK_MEASURED_MAX and (
                    self._step >= self._qk_next or (d.qk == 5 and self._near_calls.get(key) != frame.name
                                                    and len(self._near_calls) < self.DIVIDED_EXACT_MAX)):
                if d.qk == 5:  # (and a key whose call was not measured yet: from the next step, not the next check)
                    self._near_calls[key] = frame.name
                    self._measure_near(key, t.numel(), frame)
                else:
                    self._measure_qk(t, key, d.qk, frame)  # (kept ones too: a head that calmed down is stored again)
            if key in self._qk_exact:
                return self._keep(t, "exact")
            if key in self._qk_floor:
                d = d._replace(min_bits=8)  # (a squared difference's side: its step at the run's bits was too coarse)
        # (a read multiplied with a gradient computed from another read of the same values: blobs of the call's own)
        group = _saved.correlation_group(t, frame, self._results) if kind == _saved.VALUES or kind == _saved.LOG else 0
        if d.rows:
            norm, held = self._row_params(t, d.rows)  # (held: the statistics' tensors, alive through the encode)
            return self._store(t, key, d, norm, group=group, dkey=dkey)
        return self._store(t, key, d, group=group, dkey=dkey)

    _pack._gact_pack = True  # (a Compressor's pack hook: _compat.track_saved_hooks)

    def _list_stored(self, p: _Packed, t: torch.Tensor | None) -> None:
        """List the stored ``p`` in its call's frame, for _on_result; ``t``: the tensor whose values it stores (None:
        it stores something else, an activation's derivative, a log-probability's exp), which a saturating
        activation's result is held for a while (_hold)."""
        tracker = getattr(self._local, "tracker", None)
        frame = tracker.stack[-1] if tracker is not None and tracker.stack else None
        if frame is None:
            return
        if frame.stored is None:
            frame.stored = []
        frame.stored.append((weakref.ref(p), t is not None))
        held = t is not None and frame.name in self.HELD_CALLS
        if held or self._holds:
            self._hold(t if held else None)

    def _on_result(self, frame: Any, out: Any) -> None:
        """A call that stored saves returned ``out``: its saves are listed under the autograd node that made them
        (out's grad_fn), which _exact_read finds by walking back from a read kept exact."""
        stored, frame.stored = frame.stored, None
        by_node = self._by_node
        if len(by_node) >= _saved.RESULTS_MAX:  # (a program that never ends a step: the record starts again)
            by_node.clear()
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if type(o) is torch.Tensor and o.grad_fn is not None:
                by_node.setdefault(_graph_node(o._cdata), []).extend(stored)
                return  # (a call's outputs share its node)

    def _exact_read(self, t: torch.Tensor) -> None:
        """``t`` is kept exact for a call that divides by it or takes its log (saved.divides_by: log's input,
        binary_cross_entropy's, a divisor): the saves made by the elementwise calls (and sums) ``t`` was computed
        through, up to EXACT_READ_DEPTH nodes back (saved.ELEMENTWISE_NODES), are served exact. The call's gradient
        is 1/t, and theirs multiplies it with their own reads (a sigmoid's p̂(1 − p̂), softmax's p̂, tanh's 1 − â² and
        the power's 2â under log(1 − a² + eps), softplus's stored derivative under log(softplus(s) + eps), a product's
        factors under log(sum(p * q))), whose rounding that division amplifies without bound where t is small: a
        saturated sigmoid under BCE decoded 1.0 as 0.99999994, and BCE's 1/max(p(1 − p), 1e-12) made the gradient
        784x its norm at 8 bits. A save whose tensor is still there (BCE's input is the sigmoid's result; a
        saturating activation's result is held for a few stores, _hold) is served from it at once, and its blob
        released; the key of every such save is kept exact from the next step on (where the tensor was gone, or
        what was stored is a derivative: that step's gradient carries the rounding)."""
        self._serve_exact(_graph_ancestors(t._cdata, self.EXACT_READ_DEPTH, self.EXACT_READ_NODES))

    def _on_round(self, x: Any) -> None:
        """round, floor, ceil or trunc was given ``x``: where it has a graph (a quantizer's x / s, clamped, under a
        straight-through estimator), this step's saves are looked at for a straight-through result (the rounded codes,
        saved by the product with the scale: saved.straight_through), which is kept exact with the saves it was
        computed through (the dividend x of x / s), as _exact_read serves them: the scale's gradient is the small
        difference of the two reads. A rounding whose result feeds no such estimator (a metric of the output) keeps
        nothing exact."""
        if isinstance(x, torch.Tensor) and x.grad_fn is not None and _graph_ancestors is not None:
            self._rounded_step = self._step

    def _straight_through(self, t: torch.Tensor, key: str) -> bool:
        """saved.straight_through for a save of a step that rounded; on a device, where its values are not read back
        per save, from the next step: its whole_numbers verdict is read at step() with the step's other measurements,
        and a key found so is kept exact while its save keeps the estimator's shape (the first step stores it)."""
        if not _saved.straight_through_shape(t):
            return False
        if not (t.is_cuda or _DEFERRED_CHECKS):
            return bool(_saved.whole_numbers(t))
        # (measured at step 0 and every ATTENTION_CHECK_EVERY steps, the keys found so too: one whose save stopped
        # being whole numbers is stored again)
        if self._step >= self._checks_next and len(self._ste_checks) < self.QK_MEASURED_MAX:
            self._ste_checks.append((key, _saved.whole_numbers(t)))
        return key in self._ste_keys

    def _exact_products(self, m: torch.Tensor) -> bool:
        """``m`` is a matrix a conditioned call factors, inverts or solves with (saved.conditioned_matrix): the saves of
        the elementwise calls it is computed through (a GP kernel's exp and squared distances, under a noise term) are
        served exact as _exact_read's are, from the next step on where their tensors are gone, and so are those of a
        Gram product of an activation it is computed from (x @ x.T, einsum's, torch.cov's: a covariance, under a scale
        and a ridge); not a product of two tensors or of parameters. Whether there was such a Gram product (the step
        then keeps exact the reads beside the call's result: saved.beside_conditioned)."""
        if _graph_products is None:
            return False
        nodes, gram = _graph_products(m._cdata, self.EXACT_READ_DEPTH, self.EXACT_READ_NODES)
        self._serve_exact(nodes)  # (the elementwise calls' saves: a GP kernel's exp and squared distance too)
        return gram

    def _serve_exact(self, nodes: list) -> None:
        """Serve exact the stored saves listed under ``nodes`` (_on_result): at once from their tensors where the
        program still holds them unchanged, and by key from the next step on."""
        by_node = self._by_node
        for node in nodes:
            for r, values in by_node.get(node, ()):
                q = r()
                if q is None or not q.handle or q.alias is not None:
                    continue
                if len(self._divided_exact) < self.DIVIDED_EXACT_MAX:
                    self._divided_exact.add(q.dkey)
                self._serve_held(q, values)

    @staticmethod
    def _serve_held(q: _Packed, values: bool) -> None:
        """Serve the stored save ``q`` exact from its tensor where the program still holds it unchanged (``values``:
        q stores that tensor's values, not a function of them), and release its blob."""
        if not q.handle or q.alias is not None:
            return
        # (the tensor stored, still held unchanged on the same storage: `t.data = a` then `t.data = b` can put
        # another storage at its address, as _Packed.unpack checks)
        src = q.ref() if values and q.ref is not None else None
        if src is None or src._version != q.version or src.data_ptr() != q.ptr or \
                (q.sref is not None and not q.sref.same(src._cdata)):
            # (a view gone, its base still held unchanged: the view made again from it, as unpack does; the
            # transposed operand of z.t() @ z, whose z lives on)
            if values and q.view is not None:
                q.alias_from_base()
            return
        q.alias = src.detach()
        _C.store_note_unstored("held", _compat.held_bytes(src), q.owner)
        q.release()

    #: how far back _exact_read looks: elementwise nodes, and nodes in all
    EXACT_READ_DEPTH = 8
    EXACT_READ_NODES = 32
    #: keys _exact_read keeps exact at most (a program whose keys never repeat does not grow the set without end)
    DIVIDED_EXACT_MAX = 4096
    #: how many more stores a saturating activation's result is held for (_hold)
    HOLD_STORES = 4
    #: the calls whose stored tensor is held for a few stores (_hold): a saturating activation's result, which a loss may
    #: divide by where it saturates, and a power's base (a square's, under a root: sqrt((pred - target) ** 2 + eps), a
    #: Charbonnier loss, whose difference is gone when the root reads it exact: one seed 24x the gradient's norm off at
    #: 4 bits on the first step)
    HELD_CALLS = frozenset("sigmoid sigmoid_ expit special_expit softmax _softmax special_softmax tanh tanh_ exp exp_ "
                           "pow pow_ __pow__ square square_".split())

    def _hold(self, t: torch.Tensor | None) -> None:
        """Hold ``t``, a tensor a saturating activation's call or a power (HELD_CALLS) stored, for the next HOLD_STORES
        stores (None: a store that only ages the holds), and let go of the ones held that long: a loss right after
        it that divides by an elementwise function of it (log(softmax(z) + eps), which frees the softmax's result
        once the sum is made) finds it still there (_exact_read), in the step it first runs, not only from the
        next. What plain torch holds anyway (the activation saved its result), with the graph behind it; let go at
        the forward's end (the first unpack, on any thread; the end of the thread's `with` block; the next step).
        Per thread: another thread's stores (DataParallel's replicas) do not age them."""
        tid = threading.get_ident()
        holds = self._holds.get(tid)
        if holds:  # (each entry counts this thread's stores it has left: HOLD_STORES entries at most)
            holds = [(k - 1, x) for k, x in holds if k > 1]
        if t is not None:
            holds = (holds or []) + [(self.HOLD_STORES, t)]
        if holds:
            self._holds[tid] = holds
        else:
            self._holds.pop(tid, None)

    def _measure_qk(self, t: torch.Tensor, key: str, role: int, frame: Any) -> None:
        """Record an attention call's q or k (``role`` 1, 2, or 3 for both) for saved.attention_sigma: once the call
        has both, the bound on its scores' rounding goes to the step's list, read at step() (one read for the step,
        not a sync per call on a GPU); above saved.ATTENTION_SIGMA_MAX the call's q and k keys are kept exact from
        then on, and a fused call's v and output keys with them (saved._ATTENTION_VO)."""
        try:
            with torch.no_grad():
                x = t.detach()
                # (no full-size temporary; float64 too, which vector_norm's float32 dtype= refuses)
                stats = (torch.maximum(x.amax(), x.amin().neg()).float(), torch.linalg.vector_norm(x, dim=-1).amax().float())
        except RuntimeError:  # (no memory for the row norms: not measured)
            return
        seen = frame.qk if frame.qk is not None else {}
        frame.qk = seen
        for r in (1, 2):
            if role & r:
                seen[r] = (key, stats)
        if 1 in seen and 2 in seen:
            (kq, sq), (kk, sk) = seen.pop(1), seen.pop(2)
            sigma = _saved.attention_sigma(sq, sk, _saved.attention_scale(frame, t), shared=role == 3)
            keys = frame.qk_keys = [kq, kk]  # (and a fused call's v and output, saved after them: Decision.qk 4)
            self._qk_sigmas.append((keys, sigma, _saved.ATTENTION_SIGMA_MAX, _saved.ATTENTION_SIGMA_MAX))

    def _near_now(self, frame: Any, key: str, numel: int) -> int:
        """_measure_near's decision for a host call, taken now, once per call: 2 keep its sides exact, 1 store them at 8
        bits at least, 0 as the run's bits."""
        near = frame.near
        if near is None:
            ratio = _saved.near_ratio(frame, 8, self.group_size)
            near = frame.near = _verdict(float(ratio) if ratio is not None else 0.0, *self._near_limits(key, numel))
        return near

    def _near_limits(self, key: str, numel: int) -> tuple:
        """A squared difference's limits on saved.near_ratio (its rounding step at 8 bits over the difference's rms):
        exact above NEAR_STEP_MAX, at least 8 bits above the same for the key's own bits (whose step is 255/(2^b − 1)
        8 bits')."""
        scale = ((1 << max(1, min(8, self._bits_for(key, numel)))) - 1) / 255
        return _saved.NEAR_STEP_MAX, _saved.NEAR_STEP_MAX * scale

    def _measure_near(self, key: str, numel: int, frame: Any) -> None:
        """Record a squared difference's side (mse_loss's input or target, Decision.qk 5): its call is measured once
        (saved.near_ratio, its rounding step at 8 bits over the difference's rms), and from the next step on its sides
        are stored at 8 bits where the step at the key's bits exceeds NEAR_STEP_MAX times the difference's rms, and kept
        exact where even 8 bits' does (read at step(), with the attention calls' bounds)."""
        if frame.qk_keys is not None:
            frame.qk_keys.append(key)
            return
        ratio = _saved.near_ratio(frame, 8, self.group_size)
        if ratio is not None:
            keys = frame.qk_keys = [key]
            self._qk_sigmas.append((keys, ratio, *self._near_limits(key, numel)))

    #: attention calls measured in one step at most (_measure_qk): a program that never calls step() does not grow the
    #: list without end
    QK_MEASURED_MAX = 4096

    def _read_qk(self) -> None:
        """Decide the measured calls' keys (see _measure_qk, _measure_near), each against its limits: exact above the
        first, at least 8 bits above the second; one read per device; the next measurement ATTENTION_CHECK_EVERY steps
        on."""
        entries, self._qk_sigmas = self._qk_sigmas, []
        if entries and self._step >= self._qk_next:  # (a key measured out of turn, _near_calls, moves no schedule)
            self._qk_next = self._step + _saved.ATTENTION_CHECK_EVERY
        if self._norm_checks or self._ste_checks:
            self._checks_next = self._step + _saved.ATTENTION_CHECK_EVERY
        # (a device's normalization inputs: plain values from now on where the shift loses too much; its
        # straight-through results: exact from now on)
        checks = [(self._plain_norm, k, v) for k, v in self._norm_checks] + \
                 [(self._ste_keys, k, v) for k, v in self._ste_checks]
        self._norm_checks, self._ste_checks = [], []
        values = _read_back([v for _, _, v in checks] + [e[1] for e in entries])
        for (keys, key, _), found in zip(checks, values):
            if found:
                keys.add(key)
            else:
                keys.discard(key)
        for (keys, _, limit, floor), value in zip(entries, values[len(checks):]):
            verdict = _verdict(value, limit, floor)
            (self._qk_exact.update if verdict == 2 else self._qk_exact.difference_update)(keys)
            (self._qk_floor.update if verdict == 1 else self._qk_floor.difference_update)(keys)

    def _store_exp(self, t: torch.Tensor, key: str, d: Any, dkey: tuple | None = None) -> Any:
        """Store a log-probability tensor ``t`` as exp(t) (a temporary of t's size, freed once encoded), decoded
        with log; where exp(t) cannot be computed (no memory for it), ``t`` as log-space values."""
        try:
            with torch.no_grad():
                e = t.detach().exp()
                if e.dtype is torch.float64:
                    # (quantized in float32: a probability below its smallest normal, e^-87, is 0 to the
                    # codec, which refuses float64 outside that range and would keep the tensor raw)
                    e.masked_fill_(e < _FLOAT32_TINY, 0.0)
        except RuntimeError:  # out of memory (torch's, or gact's CPU allocator's)
            return self._store(t, key, _saved._LOG, dkey=dkey)
        q = self._store(e, key, d, keep=t, dkey=dkey)
        if isinstance(q, _Packed):
            q.logged = True
            if q.handle and q.ref is not None:
                # the temporary's address must never match a later tensor's; the program's own tensor, if it still
                # holds it unchanged at unpack (a language model's output), is used as it is
                _forget(q.handle)
                q.ref, q.ptr, q.sref = weakref.ref(t), t.data_ptr(), _held_storage(t)
        return q

    def _store_derivative(self, t: torch.Tensor, key: str, call: Any, dkey: tuple | None = None) -> Any:
        """Store the activation's derivative f'(t) for the stand-in ``call`` in place of its input ``t`` (a
        temporary of t's size, freed once encoded); the arena without room for the blob: ``t`` kept as it is.
        None where f'(t) cannot be computed (no memory for the temporary): ``t`` is then stored as values."""
        try:
            dt = call.derivative(t)
        except RuntimeError as e:  # an out-of-memory error (torch's, or gact's CPU allocator's)
            if not self._warned_derivative:
                self._warned_derivative = True
                warnings.warn(f"gact: the derivative of the activation saving '{key}' could not be computed ({e}); "
                              "such inputs are stored as values", RuntimeWarning, stacklevel=4)
            return None
        q = self._store(dt, key, _saved._VALUES, keep=t, dkey=dkey)
        if isinstance(q, _Packed):
            call.stored = True
        return q

    def _store(self, t: torch.Tensor, key: str, d: Any, norm: Any = None, min_bits: int = 0,
               normalized: bool = False, keep: torch.Tensor | None = None, defer: bool = True,
               group: int = 0, dkey: tuple | None = None) -> Any:
        """Store `t` as `d` says; a _Packed, or `t` itself (`keep`, when given) when the arena could not hold
        it. `min_bits`: the fewest bits it is stored with; `normalized`: a normalization layer's input (told to
        the policy); `group`: the store's group of a correlated call's saves (saved.correlation_group), 0 for the
        storage's common blobs; `dkey`: the save's key for the decisions taken by key (_next_key)."""
        kind = d.kind
        min_bits = max(min_bits, d.min_bits)
        role, pred, window, decode = "values", None, None, None
        boundary = False
        floor = 0  # the fewest bits the reader tolerates: an earlier blob of the storage with fewer does not serve it
        if kind == _saved.PREDICATE:
            if t.dtype is not torch.float32 and not _saved.predicate_fits(d, t.dtype):
                # the codec tests in float32 against float32 bounds and decodes in the tensor's dtype: a bound the
                # dtype does not hold (threshold 0.1 in float64 or bfloat16) would move the test's edge from
                # torch's, and a decode value equal to it (threshold's, clamp's, hardtanh's) would land on the
                # wrong side of it
                return self._keep(t if keep is None else keep, "exact")
            # (inside a `with` block, whose end stores what still waits, or installed for the whole process
            # by gact-run, where backward's first unpack and step() do)
            if defer and d.clamped and keep is None and self._probe is None and not _mutation_allowed() and \
                    (self._global_depth > 0 or getattr(self._local, "depth", 0) > 0) and t.is_floating_point():
                return self._defer(t, key, d, dkey)
            role, pred, decode = "predicate", d.pred, d.decode
            bits = self._bits_for(key, t.numel()) if pred[0] == "ne" else 1  # `ne` may fall back to values
        elif kind == _saved.INDICES:
            role, window, bits = "indices", d.window, 32
        elif t.is_floating_point():
            policy = self._policy
            bits = self._bits_for(key, t.numel())
            if kind == _saved.LOG:
                bits, floor = max(bits, LOG_SPACE_MIN_BITS), LOG_SPACE_MIN_BITS
            if policy is None or not getattr(policy, "measuring", False):
                # (a reference probe measures the width it asks for: its replay of a few samples can
                # have small normalization blocks, raised to min_bits, where the whole batch has none)
                bits = max(bits, min_bits)
                floor = max(floor, min_bits)
        else:
            bits = 1
        waiting = None
        # A softmax's result, whose decoded rows are made to sum to one again (_simplex_correct): stored as a boundary
        # blob at 0 (code 0 exactly 0, every positive value decoded positive), so that the values the row's excess is
        # shared among are the ones that are not zero, whatever the rounding. Plain groups holding a masked zero have 0
        # on their grid, and a small probability decoded to 0 or to one step took a share only when it rounded up:
        # a learned temperature of a causal attention was 5.5 % off at 4 bits and 0.19 % at 8, 10x what noise leaves
        # in 64 seeds. A boundary blob spends one code of the grid on the 0 (steps 1.07x wider at 4 bits, 1.5x at 2):
        # on the host only where the result holds a zero (a masked row; the rest keep plain groups, where no value
        # decodes to 0), on a device, where that read would cost a sync, always; at 1 bit it takes 2 (the store's
        # narrowest boundary blob: uncorrected, the rows' sums leak a component every key shares into the query's
        # gradient, which the correction is for).
        # simplex: 0 no correction; 1 plain groups, none holding a zero; 2 a boundary blob asked for
        simplex = 0
        if d.simplex is not None and role == "values" and norm is None:
            # (its values are at least 0: a zero is its minimum, one reduction pass with no temporary)
            if not (t.is_cuda or _saved._DEVICE_RULES_ON_HOST or bool(t.amin() == 0)):
                simplex = 1
            else:
                simplex, pred, boundary = 2, _SIMPLEX_BOUNDARY, True
        if self._deferred and role == "values":
            waiting = self._take_deferred(t) if norm is None and kind == _saved.VALUES else None
            if waiting is not None:
                pred, boundary = waiting[3].pred, True  # one boundary blob for these values and its predicate
                simplex = 0
            else:
                # the stored values save after a clamp reads other data: the waiting masks are stored now (their
                # tensors are not kept alive through the forward)
                self._resolve_deferred()
        src = t
        dense = True
        if t.is_cuda:
            if _allocator.device_pool is None:
                _allocator._default_device_pool(self.swap, t.get_device())  # (once: torch's CUDA pool, or gact's)
            if not _compat.is_dense(t):
                src, dense = torch.empty_like(t).copy_(t), False  # the device stores dense images only
            device = src.get_device()
            stream = _compat.raw_stream(device)
        else:
            stream, device = 0, -1
        # (the storage's address as _compat.storage_base computes it, inlined: this runs for every stored tensor)
        ptr, off = src.data_ptr(), src.storage_offset()
        if not ptr:  # no memory behind it (forward-mode AD's zero tensors): kept as it is
            if waiting is not None:
                self._resolve_one(waiting)
            return self._keep(t if keep is None else keep, "layout")
        try:
            args = (ptr, _DTYPE_NAMES[src.dtype], src.shape, src.stride(), device, src._version,
                    ptr - off * src.element_size() if off else ptr, key64(key), bits, self.group_size, self.seed,
                    stream, role, _num_threads(), norm, pred, d.clamped, window, self._owner, boundary, floor, group)
            h, offset, shared, strides, upgraded = _C.store_put(*args)
            while shared:
                held = _entry_storage.get(h)
                if held is None or held.same(src._cdata):
                    break
                # the blob of a storage given up at this address (its tensor lives on: set_; resize_ and out= calls are
                # seen by the op tracker, which forgets the address first): forgotten, and the save stored afresh
                # (each blob of that address in turn: a plain and a normalized one)
                _forget(h)
                _release(h)
                h, offset, shared, strides, upgraded = _C.store_put(*args)
        except _C.OutOfMemoryError as e:
            if waiting is not None:
                self._resolve_one(waiting)
            return self._out_of_memory(t if keep is None else keep, e)
        # (owned at once: an exception from here on, a Ctrl-C in the middle of a forward, drops p, whose __del__
        # releases the handle; before, one landing before p was made orphaned the blob for good)
        p = _Packed(h, t, key, decode, self._owner, strides)
        p.dkey = dkey
        if simplex == 1 or (simplex == 2 and (upgraded or _C.store_info(h)["variant"] == "boundary")):
            # (a boundary blob refused, a value out of its range, or an earlier plain blob of the memory serving it:
            # uncorrected)
            p.simplex = d.simplex
        if waiting is not None:
            # its predicate save: served by the blob just stored; a ReLU's backward tests result > 0, which the
            # boundary blob's values answer exactly (zeros are exact, the rest positive), so it reads the values
            # image the next layer's backward decodes (kept for it: decoded once), not a mask decoded apart
            self._resolve_one(waiting, values=h if upgraded else 0, group=group)
        self._note_live(p)
        p.offset = offset
        if device >= 0 or self._VERDICTS_ON_HOST:
            self._await_verdict(p, src, pred)
        mutable = _mutation_allowed()
        both = None
        if keep is not None:
            p.version = keep._version
            p.vref = _watch(keep)
        elif dense and not mutable and _saved_ref is not None:
            # (the tensor's version counter and its storage in one object: one call and one object a save)
            both = p.vref = _saved_ref(t._cdata)
        else:
            p.vref = _watch(t)
        if dense and not mutable:
            p.ptr = ptr
            b = t._base if keep is None and _storage_ref is not None else None
            if b is not None:
                # (the base's storage itself, held weakly, not its address: `b.data = x` then `b.data = y` can put
                # another storage at the same address; and t must still use it: `t.data = other` keeps t's _base)
                sref = _storage_ref(b._cdata)
                if sref is None or not sref.same(t._cdata):
                    b = None
            try:
                if b is None:
                    p.ref = r = _TensorRef(t, _forget_ref)
                else:
                    # A view: its storage's address is forgotten when the base dies, not the view (which holds the
                    # base). A view made for one call, k.t() given to q @ k.t(), dies at once, and k's own save by
                    # the next call (q * k) got a blob and a rounding of its own: InfoNCE's backward cancels
                    # P·k̂ against k̂, and two roundings of k made one seed 14x the gradient's norm off at 4 bits.
                    p.ref = weakref.ref(t)
                    r = _TensorRef(b, _forget_ref)
                p.sref = both if both is not None else _held_storage(t)
                r.handle = h
            except TypeError:
                _forget(h)
            else:
                if not shared and p.sref is not None:
                    _entry_storage[h] = p.sref
                if _graph_node is not None:
                    self._list_stored(p, t if keep is None else None)
                if b is not None:
                    p.view = (r, sref, t.shape, t.stride(), off)
        else:
            _forget(h)  # a temporary copy: its address must never match a later tensor's
        policy = self._policy
        if policy is not None and role == "values" and kind not in (_saved.LOG, _saved.EXP) and \
                hasattr(policy, "on_stored"):
            info = _C.store_info(h)
            if info["values"] and info["dtype"] in ("float32", "float16", "bfloat16", "float64"):
                if upgraded and not simplex:
                    # a ReLU's mask turned into values: the blob's bytes are this key's; the ReLU gates
                    # the input gradient with the same codes (the online model does not cover that); a
                    # boundary blob has at least 2 bits
                    info = dict(info, refcount=1, gated=True, min_bits=2)
                elif min_bits:
                    info = dict(info, min_bits=min_bits)  # a small normalization block: stored at >= min_bits
                if normalized:
                    info = dict(info, normalized=True)
                # codec, bits, bytes, groups and sum_sq_ranges (the online estimator's input)
                policy.on_stored(key, info)
        return p

    #: predicate saves that wait for a values save of their tensor at most (the oldest is stored when one more comes)
    MAX_DEFERRED = 4

    #: bytes of device tensors kept until their encode's verdict is read, at most: past it, a save waits for the
    #: oldest encode to run (the host is then this far ahead of the device); and how many such tensors
    VERDICT_WINDOW = 64 << 20
    VERDICT_MAX = 1024
    _VERDICTS_ON_HOST = False  # tests: host tensors wait for a (stand-in) verdict as device tensors do

    def _await_verdict(self, p: "_Packed", src: torch.Tensor, pred: Any) -> None:
        """Keep the device tensor ``src`` stored under ``p`` until its encode has told whether it met NaN/Inf."""
        if _C.store_verdict(p.handle) == 0:
            return  # another codec (a mask, raw), or a blob stored earlier and settled already
        # (the verdicts of the saves before it first: this one's is read at a later save, when _store is done with
        # it, and a save larger than the window never waits for its own encode)
        if self._verdicts:
            self._settle()
        p.hold = src.detach() if not _mutation_allowed() else src.detach().clone()  # (the values as saved)
        p.pred = pred
        n = src.numel() * src.element_size()
        with self._verdict_lock:
            self._verdicts.append((p, n))
            self._verdict_bytes += n

    def _settle(self, drain: bool = False) -> None:
        """Read the verdicts that are in, oldest first: a clean blob drops its tensor, one that met NaN/Inf (its
        groups would decode to NaN) is freed and the tensor served as it is. Waits for the oldest encode only
        while more than VERDICT_WINDOW bytes (or VERDICT_MAX tensors) wait, or for all of them with ``drain``."""
        with self._verdict_lock:
            q = self._verdicts
            while q:
                p, n = q[0]
                if p.hold is not None and p.handle:
                    full = drain or self._verdict_bytes > self.VERDICT_WINDOW or len(q) > self.VERDICT_MAX
                    h = p.handle
                    try:
                        v = _C.store_verdict(h, full)
                    except ValueError:
                        if p.handle == h:
                            raise
                        v = 0  # released meanwhile (a backward thread read it, or kept it exact)
                    if v < 0:
                        return
                    if v > 0:
                        p.keep_exact()
                    else:
                        p.hold = None
                q.popleft()
                self._verdict_bytes -= n

    def _drop_verdicts(self) -> None:
        """Forget the queued saves that no longer keep a tensor (released: abort_step); the others, an earlier
        step's graph still alive, wait for their verdicts as before."""
        with self._verdict_lock:
            keep = [(p, n) for p, n in self._verdicts if p.hold is not None and p.handle]
            self._verdicts = collections.deque(keep)
            self._verdict_bytes = sum(n for _, n in keep)

    def _defer(self, t: torch.Tensor, key: str, d: Any, dkey: tuple | None = None) -> "_Packed":
        """A clamp's output saved for its predicate: wait for a values save of the same tensor (see _deferred)."""
        p = _Packed(0, t, key, d.decode, self._owner)
        p.dkey = dkey
        self._note_live(p)
        p.vref = _watch(t)
        entry = (weakref.ref(p), t, key, d)
        with self._deferred_lock:
            self._deferred.append(entry)
            oldest = self._deferred.pop(0) if len(self._deferred) > self.MAX_DEFERRED else None
        if oldest is not None:
            self._resolve_one(oldest)
        return p

    def _take_deferred(self, t: torch.Tensor) -> tuple | None:
        """The waiting predicate save of this very tensor (same memory, layout and version), taken off the list."""
        ptr, shape, stride, version = t.data_ptr(), t.shape, t.stride(), t._version
        with self._deferred_lock:
            for i, e in enumerate(self._deferred):
                w = e[1]
                if w.data_ptr() == ptr and w._version == version and w.shape == shape and w.stride() == stride \
                        and w.dtype == t.dtype and w.device == t.device:
                    return self._deferred.pop(i)
        return None

    def _resolve_one(self, entry: tuple, values: int = 0, group: int = 0) -> None:
        """Store a waiting predicate save: a dedup hit when its values were just stored as the boundary blob of
        handle ``values``, whose values image a ReLU's save then reads (``group``: the blob's store group; a mask
        read from a boundary blob is exact, so a correlated call's blob serves it as any other)."""
        ref, t, key, d = entry
        p = ref()
        if p is None or p.aborted:
            return  # its graph is gone: nothing reads it
        q = self._store(t, key, d, keep=None, defer=False, group=group, dkey=p.dkey)
        if isinstance(q, _Packed) and self._adopt(p, q):
            # (served by that very blob: a storage whose .data was taken gets blobs of its own, a mask here)
            if values and p.handle == values and d.pred[0] in ("gt", "gt_or_nan") and d.pred[1] == 0.0 \
                    and d.decode == (1.0, 0.0):
                p.decode = None
        else:
            p.alias = q.t if isinstance(q, _Kept) else q  # the arena could not hold it: kept as it is

    def _adopt(self, p: "_Packed", q: "_Packed") -> bool:
        """Give the save ``p`` (made before its blob) what ``_store`` made for it in ``q``: the blob, and the tensor
        kept until its device verdict is read, or that tensor alone when the verdict already said NaN/Inf. True
        when ``p`` got the blob."""
        if q.alias is not None:
            p.alias = q.alias
            return False
        p.handle, p.offset, p.stride, p.ref, p.ptr, p.sref = q.handle, q.offset, q.stride, q.ref, q.ptr, q.sref
        p.view = q.view  # (and a view's reference to its base, whose death forgets the storage's address)
        q.handle, q.ref, q.view = 0, None, None
        if q.hold is not None:  # (q's entry in _verdicts is dropped as released)
            p.hold, p.pred, q.hold = q.hold, q.pred, None
            with self._verdict_lock:
                self._verdicts.append((p, 0))
        return True

    def _resolve_deferred(self) -> None:
        """Store every waiting predicate save (the forward ended, backward began, or the step ends)."""
        while True:
            with self._deferred_lock:
                if not self._deferred:
                    return
                entry = self._deferred.pop(0)
            self._resolve_one(entry)

    def _on_alias(self, t: torch.Tensor) -> None:
        """``t.data`` was taken in the forward: writes through it move no version counter of ``t``'s, so
        until the next step every save of ``t``'s storage gets a blob of what it holds then (never one
        stored before)."""
        try:
            if t.layout is torch.strided and t.device.type != "meta":
                _C.store_forget_storage(_compat.storage_base(t), self._owner)
        except (RuntimeError, TypeError, ValueError):  # a tensor without storage (a functorch wrapper, ...)
            pass

    def _out_of_memory(self, t: torch.Tensor, e: Exception) -> Any:
        """The arena cannot hold the blob: keep the tensor as it is (it exists already, so this costs
        nothing new) and go on; counted as the skip reason `memory`, said once per Compressor."""
        if not self._warned_memory:
            self._warned_memory = True
            warnings.warn(f"{e}; tensors that do not fit are kept uncompressed (counted as skipped: "
                          "memory). Raise gact.configure(memory_limit=...) or free memory.", RuntimeWarning,
                          stacklevel=3)
        return self._keep(t, "memory")

    def _flush(self, frame: Any) -> None:
        """A call with pending normalization inputs returned: store them with its statistics."""
        pending, frame.pending = frame.pending, None
        stats, frame.stats = frame.stats or [], None
        for p in pending:
            t, p.pending = p.pending, None
            src = self._rows_of(frame, t)
            norm, keep = self._norm_params(frame, src, stats, p.key)
            mb = 0
            if len(stats) >= 2 and stats[-1].numel():
                block = t.numel() // stats[-1].numel()
                mb = _saved.norm_floor(block)
            other = t if src is not t else None
            try:
                q = self._store(src, p.key, _saved._VALUES, norm, mb, True, keep=other, dkey=p.dkey)
            except ValueError:
                if norm is None:
                    raise
                # statistics the codec refuses: plain values
                q = self._store(src, p.key, _saved._VALUES, None, 0, True, keep=other, dkey=p.dkey)
            del keep
            if not isinstance(q, _Packed):
                p.alias = q.t if isinstance(q, _Kept) else q  # the arena could not hold it: kept as it is
                continue
            if other is not None and q.handle and q.ref is not None:
                # (the copy's address must never match a later tensor's; the program's own tensor, if it still
                # holds it unchanged at unpack, is used as it is)
                _forget(q.handle)
                q.ref, q.ptr, q.sref = weakref.ref(t), t.data_ptr(), _held_storage(t)
            self._adopt(p, q)

    @staticmethod
    def _rows_of(frame: Any, t: torch.Tensor) -> torch.Tensor:
        """What a layer or group norm's input is stored from: the input in row-major order. Over a view that is
        not (ConvNeXt's LayerNorm over h.permute(0, 2, 3, 1)) a contiguous copy, freed once encoded: in the
        view's own memory order a quantization group spans rows, and one row's values with a small deviation
        shared a range set by others (their rounding variance against that deviation: exp(h).t() under a
        layer norm kept 10x the gradient's norm in the mean of 1 024 seeds at 2 bits). The copy cannot be made
        (no memory for it): the input itself."""
        if frame.name not in ("layer_norm", "group_norm") or t.is_contiguous() or not t.is_floating_point():
            return t
        try:
            return t.contiguous()
        except RuntimeError:  # out of memory (torch's, or gact's CPU allocator's)
            return t

    def _norm_params(self, frame: Any, t: torch.Tensor, stats: list, key: str | None = None) -> tuple:
        """(count, inner, shift pointer, scale pointer) normalizing `t` with its layer's statistics, and the
        float32 tensors behind the pointers; (None, None) when the layout does not allow it or every
        quantization group lies inside one statistics block anyway (normalizing would change nothing)."""
        if len(stats) < 2 or not t.is_floating_point():
            return None, None
        mean, rstd = stats[-2], stats[-1]
        name = frame.name
        strides = _compat.decoded_strides(t)  # the layout of the image the codec encodes
        if name in ("batch_norm", "instance_norm"):
            if t.dim() < 2 or mean.numel() != t.shape[1] or rstd.numel() != t.shape[1]:
                return None, None
            count, inner = t.shape[1], strides[1]  # any dense layout: channel = (e / stride_1) % C
        else:  # layer_norm, group_norm: blocks of consecutive elements in row-major order
            if strides != _compat.contiguous_strides(t.shape) or mean.numel() != rstd.numel() or \
                    mean.numel() == 0 or t.numel() % mean.numel() != 0:
                return None, None
            count, inner = mean.numel(), t.numel() // mean.numel()
        if inner % self.group_size == 0:
            return None, None
        m = mean.detach().reshape(-1).float().contiguous()
        r = rstd.detach().reshape(-1).float().contiguous()
        if m.is_cuda or _DEFERRED_CHECKS:
            # (a device's statistics are not read back per save: measured at step 0 and every ATTENTION_CHECK_EVERY
            # steps, read at step(), and the key stored as plain values from the next step where the shift's bfloat16
            # residual loses more than plain groups would: a batch norm input at offset 1e5 had 0.043 of the gradient
            # off at 8 bits, normalized, at every step)
            if key is not None and self._step >= self._checks_next and len(self._norm_checks) < self.QK_MEASURED_MAX:
                try:  # (a key stored plain is measured again too: an input back near zero is normalized again)
                    with torch.no_grad():
                        self._norm_checks.append((key, _shift_residual_verdict(m, r)))
                except RuntimeError:  # (no memory for the temporaries: not measured)
                    pass
            if key is not None and key in self._plain_norm:
                return None, None
        elif _shift_residual_too_large(m, r):
            return None, None
        return (int(count), int(inner), m.data_ptr(), r.data_ptr()), (m, r)

    def _row_params(self, t: torch.Tensor, inner: int) -> tuple:
        """_norm_params for a save normalized per row (saved.Decision.rows): blocks of ``inner`` consecutive elements,
        each scaled by 1/its largest magnitude (no shift; a row of zeros or of values at most 2^-100, by 2^100; a row of
        NaN/Inf or of 2^15 or more by 1, which the codec then refuses: a mask's fill); (None, None) for rows under
        _ROW_MIN values, where the
        layout does not allow it, or where every quantization group lies inside one row anyway."""
        if inner < _ROW_MIN or not t.is_floating_point() or t.numel() == 0 or t.numel() % inner or \
                inner % self.group_size == 0 or not t.is_contiguous():
            return None, None
        try:
            with torch.no_grad():
                rows = t.detach().reshape(-1, inner)  # (a view: t is contiguous)
                m = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()).float()  # (no full-size temporary)
                ok = torch.isfinite(m) & (m > _ROW_SCALE_MIN) & (m < _ROW_SCALE_MAX)
                # (a row of zeros or tiny values: scaled by _TINY_ROW_SCALE, decoded as its codes times its inverse,
                # 2^-100, where scale 1 gave it the step of the rows it shares a group with; float32 whatever the default
                # dtype: the codec reads the statistics as float32)
                r = torch.where(ok, m.reciprocal(), torch.where(m <= _ROW_SCALE_MIN, torch.full_like(m, _TINY_ROW_SCALE),
                                                                torch.ones_like(m))).contiguous()
                z = torch.zeros_like(r)
        except RuntimeError:  # (out of memory for the statistics: plain values)
            return None, None
        return (int(r.numel()), int(inner), z.data_ptr(), r.data_ptr()), (z, r)

    def _probe_pack(self, t: torch.Tensor, key: str, d: Any, frame: Any) -> Any:
        """A policy's probe keeps the tensors it would quantize as they are (with their rounding variance)."""
        kind = d.kind
        if kind == _saved.DERIVATIVE:
            # the store keeps f'(x) for the activation: the probe keeps it as a leaf of its own, whose
            # derivative is the one through grad * f'(x), with f'(x)'s rounding variance
            call = _saved.activation_call(t)
            with torch.no_grad():
                dt = call.derivative(t)
            call.stored, call.probed = True, dt.requires_grad_()
            return self._probe.pack(dt, key)
        if kind == _saved.PREDICATE and d.clamped and t.is_floating_point():
            # a clamp's output: if a later op reads its values too, the store keeps one boundary blob
            self._probe.note_clamp(t, d.pred[1])
        if kind in (_saved.VALUES, _saved.LOG, _saved.EXP) and t.is_floating_point():
            # (a correlated call's saves are blobs of their own in the store: records of their own here)
            group = _saved.correlation_group(t, frame, self._results) if kind != _saved.EXP else 0
            if d.rows:  # (stored normalized per row: its variance is the rows' own, as _row_params stores them)
                zs = self._probe_rows(t, d.rows)
                if zs is not None:
                    return self._probe.pack(t, key, z=zs[0], std=zs[1], group=group)
            return self._probe.pack(t, key, group=group)
        if kind == _saved.NORMALIZED and t.is_floating_point():
            zs = self._probe_normalized(t, frame)
            return self._probe.pack(t, key) if zs is None else self._probe.pack(t, key, z=zs[0], std=zs[1])
        return t if t.grad_fn is None else t.detach()  # exact: nothing to probe

    def _probe_rows(self, t: torch.Tensor, inner: int) -> tuple | None:
        """(z, std) of a save normalized per row as _row_params stores it; None where it stores plain values."""
        norm, held = self._row_params(t, inner)
        if norm is None:
            return None
        r = held[1].reshape(-1, 1)  # (1 / each row's scale)
        z = (t.detach().reshape(-1, inner).float() * r).to(t.dtype).reshape(t.shape)
        return z, r.reciprocal().expand(-1, inner).reshape(t.shape)

    @staticmethod
    def _probe_normalized(t: torch.Tensor, frame: Any) -> tuple | None:
        """(z, std) of a normalization input as the store normalizes it (see _norm_params): batch norm per
        channel, layer and group norm per block of consecutive elements; ``std`` broadcasts to z. None
        where the store keeps plain values (another layout, instance norm over several samples)."""
        if frame is None:
            return None
        x = t.detach().float()
        if frame.name == "batch_norm" and t.dim() >= 2:
            dims = [i for i in range(t.dim()) if i != 1]
            mean = x.mean(dim=dims)
            std = x.var(dim=dims, unbiased=False).sqrt_()
            view = (1, -1) + (1,) * (t.dim() - 2)
            mean, std = mean.view(view), std.view(view)
        elif frame.name in ("layer_norm", "group_norm") and t.numel():  # (row-major, as _rows_of stores it)
            if frame.name == "layer_norm":
                shape = _saved._arg(frame.args, frame.kwargs, 1, "normalized_shape")
                inner = 1
                for n in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)):
                    inner *= int(n)
            else:
                groups = int(_saved._arg(frame.args, frame.kwargs, 1, "num_groups"))
                inner = t.numel() // (t.shape[0] * groups) if t.dim() >= 2 and groups > 0 else 0
            if inner <= 0 or t.numel() % inner:
                return None
            rows = x.reshape(-1, inner)
            mean = rows.mean(dim=1, keepdim=True)
            std = rows.var(dim=1, unbiased=False, keepdim=True).sqrt_()
            x = rows
        else:
            return None
        std = torch.where(std > 0, std, torch.ones_like(std))
        # (the store decides with the layer's 1/sqrt(var + eps): torch's default eps here)
        if not t.is_cuda and _shift_residual_too_large(mean.reshape(-1), (std.square() + 1e-5).rsqrt().reshape(-1)):
            return None  # (the store keeps plain values there too)
        z = ((x - mean) / std).to(t.dtype)  # in x's layout: grouped as the store groups
        if z.shape != t.shape:  # layer/group norm rows: back to the tensor's shape, std per element
            z = z.reshape(t.shape)
            std = std.expand(x.shape).reshape(t.shape)
        return z, std

    def _discard_step(self) -> None:
        """Close a step opened for an estimator's extra pass: its blobs are gone, nothing advances (it
        is not counted as a step, in its owner's counters or the process's)."""
        _C.store_end_step(self._owner, count_step=False)
        self._step_open = False
        self._norm_checks, self._ste_checks = [], []  # (an extra pass's or a given-up step's tensors decide nothing)

    def _unpack(self, obj: Any) -> Any:
        if _saved.peeking():  # (a look at a saved operand during the forward: saved.peek)
            if type(obj) is _Kept:
                return obj.t
            raise _saved.Unread()
        if self._holds:
            self._holds = {}  # (a backward: the forward's holds go, every thread's)
        if self._deferred:
            self._resolve_deferred()
        unpack = getattr(type(obj), "unpack", None)
        if unpack is not None:
            return unpack(obj)
        probe_unpack = getattr(type(obj), "probe_unpack", None)  # a probe's exact copy (gact.policy)
        return probe_unpack(obj) if probe_unpack is not None else obj

    # ---- global installation (gact-run) -------------------------------------------------

    def install_global(self) -> None:
        """Install this Compressor's hooks for the whole process (every forward, instead of a ``with``
        block), and its op tracker on the calling thread; used by ``gact-run``. Undo with
        :meth:`uninstall_global`."""
        if getattr(self, "_global_pop", None) is not None:
            return
        self._check_open()
        self._global_depth += 1
        _compat.track_saved_hooks()
        _saved.track_function_saves()
        self._global_pop = _compat.push_default_hooks(self._pack, self._unpack)
        tracker = _saved.OpTracker(self._flush, self._on_alias, self._on_result, self._on_round)
        tracker.substitutes = self._substitutes()
        tracker.min_store_bytes = _compat.weak_hook(self, Compressor._min_store_bytes)
        tracker.__enter__()
        self._local.tracker = tracker
        self._global_tracker = tracker
        if self.model is None and _compat.HAS_GLOBAL_MODULE_HOOKS:
            mm = torch.nn.modules.module
            self._module_hooks.append(mm.register_module_forward_pre_hook(self._enter_module))
            self._module_hooks.append(mm.register_module_forward_hook(self._leave_module))

    def uninstall_global(self) -> None:
        """Take out what :meth:`install_global` put in, and close the Compressor (:meth:`close`)."""
        pop = getattr(self, "_global_pop", None)
        if pop is None:
            return
        self._global_pop = None
        tracker, self._global_tracker = self._global_tracker, None
        if getattr(self._local, "tracker", None) is tracker:
            self._local.tracker = None
        tracker.__exit__(None, None, None)
        pop()
        self._global_depth -= 1
        self.close()

    def __repr__(self) -> str:
        return (
            f"gact.Compressor(bits={self.bits!r}, group_size={self.group_size}, min_bytes={self.min_bytes}, "
            f"seed={self.seed}, step={self._step})"
        )

    # ---- gact-run: threads --------------------------------------------------------------

    def install_thread(self) -> None:
        """Install the hooks of :meth:`install_global` in the calling thread too: torch 1.13
        keeps saved-tensor hooks per thread, so a thread started after ``install_global`` saves
        uncompressed without this. ``gact-run`` calls it first thing in every new thread. A
        no-op unless installed globally; the hooks and the thread's op tracker (which tells a
        ReLU's output, stored exactly as a mask, from values) are taken out again when the
        thread's Python state ends (see _ThreadHooks)."""
        if getattr(self, "_global_pop", None) is None or getattr(self._local, "tracker", None) is not None:
            return
        pop = _compat.push_default_hooks(self._pack, self._unpack)
        tracker = _saved.OpTracker(self._flush, self._on_alias, self._on_result, self._on_round)
        tracker.substitutes = self._substitutes()
        tracker.min_store_bytes = _compat.weak_hook(self, Compressor._min_store_bytes)
        tracker.__enter__()
        self._local.tracker = tracker
        self._local.thread_hooks = _ThreadHooks(pop, tracker)
