"""The Compressor: autograd saved-tensor hooks over gact's activation store.

Inside ``with comp:`` every tensor autograd saves for the backward pass goes
through :meth:`Compressor._pack`. It either keeps the tensor as it is (counted
in the store's ``skipped`` stats under a reason) or hands it to the C++ store,
which encodes it (quant codec for float32/float16/bfloat16 at any rank, mask
codec for bool and 0/1 uint8 tensors, raw for NaN/Inf) into a blob in gact's
host or CUDA arena, and returns a small :class:`_Packed` object holding the
handle. In backward, :meth:`Compressor._unpack` decodes the handle into a fresh
contiguous tensor allocated under the ``activation`` tag.

Skip rules, in order (the first that matches names the reason):

``layout``    not a plain strided CPU/CUDA tensor (sparse, quantized, nested, meta, subclasses)
``parameter`` a parameter or a view of one: a leaf that requires grad, a view whose
              ``_base`` is one, or a tensor sharing storage with the model's parameters
              or buffers (recomputed at the start of every step, so moving the model
              to another device after building the Compressor is fine)
``excluded``  saved while a module given in ``exclude`` (or one of its submodules)
              runs, or sharing storage with a tensor given in ``exclude``
``dtype``     neither float32/float16/bfloat16 nor bool/uint8
``small``     fewer than ``min_bytes`` bytes
``input``     a float tensor passed to the model's forward that does not require grad (the
              input batch): the caller keeps it alive anyway, so a compressed copy would only
              add memory. (Other leaves that do not require grad, like torch 1.13's float
              dropout masks on the CPU, are op-internal temporaries and are compressed.)
``stats``     a training-mode batch norm's per-channel mean and 1/std (1-D, read exactly)

Tensors stored differently, by what their backward reads:

* a ReLU's own save of its output: an exact 1-bit mask (its backward reads result > 0;
  a small positive output rounded to 0 would drop its gradient). A later save of the
  same tensor (the next layer) stores its values.
* a log-softmax output (cross-entropy's log-probabilities): at least 4 bits, outside an
  adaptive policy's budget (its backward exponentiates it).
* a training-mode batch norm's input: channel-normalized, (x − mean_c)/std_c with the
  per-channel mean and std kept exactly, so that a group spanning channels does not give
  a narrow channel the widest channel's noise.

Lifetime: a :class:`_Packed` releases its handle when it is garbage collected,
which happens when autograd frees the graph (after ``backward()`` without
``retain_graph``, or when the last reference to the output goes). It is not
released at unpack, because ``retain_graph=True`` can unpack twice.

Keys and noise: each stored tensor gets a stable key, the qualified name of the
module that saved it plus its order among that module's saves in the step
(``"encoder.layers.0.linear1:2"``). The store derives the stochastic-rounding
noise from (seed, step, key), so noise differs per tensor and per step, and a
run is reproducible. A policy keys per-tensor bits on the same string through
:meth:`Compressor._bits_for`.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
from typing import Any, Iterable

import torch

import _gact as _C

from . import _compat
from .options import options as _options

_VALID_BITS = (1, 2, 4, 8)

# handle -> weakref to the saved tensor: when the tensor dies the store forgets its
# identity, so a new tensor at the same address can never dedup against the old blob.
_identities: dict[int, Any] = {}


def _forget(handle: int, _ref: Any, _store_forget=_C.store_forget, _pop=_identities.pop) -> None:
    _pop(handle, None)
    try:
        _store_forget(handle)
    except Exception:  # interpreter shutdown
        pass


def _release(handle: int, _store_release=_C.store_release, _pop=_identities.pop) -> None:
    try:
        if _store_release(handle) <= 0:
            _pop(handle, None)
    except Exception:  # interpreter shutdown
        pass


def key64(key: str) -> int:
    """The 64-bit tensor key the codec's noise is derived from (stable across runs and processes)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


_RELU_NODES = frozenset({"ReluBackward0", "ReluBackward1"})  # ReluBackward1: relu_ in older torch
# Log-space outputs whose backward exponentiates them (log_softmax: grad - exp(out)·Σgrad). A
# rounding step of a few nats is a multiplicative error of e^step in the probabilities: at 2 bits
# the char LM lost 0.38 nats/char, at 4 bits 0.02. They are stored with at least this many bits,
# outside the adaptive policy's budget.
_LOG_SPACE_NODES = frozenset({"LogSoftmaxBackward0"})
LOG_SPACE_MIN_BITS = 4


def _is_log_space(t: torch.Tensor) -> bool:
    fn = t.grad_fn
    return fn is not None and type(fn).__name__ in _LOG_SPACE_NODES


def _is_relu_own_save(t: torch.Tensor) -> bool:
    """True when relu/relu_'s backward node is saving its own output: the first save of a tensor
    whose grad_fn is that node (the node saves it while the op runs, before any consumer can);
    the node is marked in its ``metadata`` so that later saves (a conv's input) are values."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ not in _RELU_NODES:
        return False
    if fn.metadata.get("gact_relu_mask"):
        return False
    fn.metadata["gact_relu_mask"] = True
    return True


class _Packed:
    """What autograd holds instead of a saved tensor: a store handle and the tensor's metadata."""

    __slots__ = ("handle", "shape", "dtype", "device", "key", "mask_of", "affine")

    def __init__(self, handle: int, shape: torch.Size, dtype: torch.dtype, device: torch.device, key: str,
                 mask_of: torch.dtype | None = None, affine: tuple | None = None):
        self.handle = handle
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.key = key
        self.mask_of = mask_of  # a ReLU output stored as its mask: decode to 0/1 in this dtype
        self.affine = affine  # a batch-norm input stored channel-normalized: (mean, std) per channel

    def unpack(self) -> torch.Tensor:
        if self.handle == 0:
            raise RuntimeError(f"gact: saved tensor '{self.key}' was already released")
        _C.push_tag("activation")
        try:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        finally:
            _C.pop_tag()
        stream = _compat.current_stream(out)
        _C.store_get(self.handle, out.data_ptr(), out.numel() * out.element_size(), stream)
        if self.mask_of is not None:
            return out.to(self.mask_of)
        if self.affine is not None:
            mean, std = self.affine
            view = (1, -1) + (1,) * (out.dim() - 2)
            out = (out.float() * std.view(view) + mean.view(view)).to(self.dtype)
        return out

    def release(self) -> None:
        h, self.handle = self.handle, 0
        if h:
            _release(h)

    def __del__(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"_Packed(handle={self.handle}, key={self.key!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


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
            uncompressed.
        swap: offload compressed activations to pinned host memory (needs the swap layer).
        estimator: with ``bits="auto"``, how sensitivities are estimated: ``"probe"``
            (the default with a model), ``"online"`` or ``"reference"`` (gact.policy). The
            probe and the reference replay the sampled step's first samples, or call a
            closure given to :meth:`step` or as ``gact.policy.Probe(closure)``.
        adapt_interval: with ``bits="auto"``, steps between re-estimations. Default: the
            ``adapt_interval`` option (GACT_ADAPT_INTERVAL).

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
        policy: Any = None,
    ) -> None:
        opts = _options()
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"gact.Compressor: model must be a torch.nn.Module or None, not {type(model).__name__}")
        self.model = model

        if bits is None:
            bits = opts["bits"]
        if isinstance(bits, str):
            if bits != "auto":
                if bits.isdigit():
                    bits = int(bits)
                else:
                    raise ValueError(f"gact.Compressor: bits={bits!r} is not supported; use 1, 2, 4, 8 or 'auto'")
        if isinstance(bits, bool) or (bits != "auto" and bits not in _VALID_BITS):
            raise ValueError(f"gact.Compressor: bits={bits!r} is not supported; use 1, 2, 4, 8 or 'auto'")
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
        if (
            isinstance(group_size, bool)
            or not isinstance(group_size, int)
            or not (64 <= group_size <= 1024)
            or group_size & (group_size - 1)
        ):
            raise ValueError(f"gact.Compressor: group_size={group_size!r} must be a power of two in [64, 1024]")
        self.group_size = group_size

        if min_bytes is None:
            min_bytes = opts["min_bytes"]
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"gact.Compressor: min_bytes={min_bytes!r} must be an integer >= 0")
        self.min_bytes = min_bytes

        if seed is None:
            seed = opts["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**64):
            raise ValueError(f"gact.Compressor: seed={seed!r} must be an integer in [0, 2**64)")
        self.seed = seed

        if swap is None:
            swap = bool(opts["swap"])
        if swap and not hasattr(_C, "swap_enable"):
            raise NotImplementedError("gact.Compressor: swap=True needs the swap layer, which this build of gact lacks")
        self.swap = bool(swap)
        # GACT_SWAP_BUDGET: device-resident blob bytes kept before offloading (0 = offload all);
        # GACT_PREFETCH: blobs brought back ahead of backward.
        self._swap_budget = int(opts["swap_budget"])
        self._prefetch = int(opts["prefetch"])
        self.estimator = estimator
        if adapt_interval is not None and (
            isinstance(adapt_interval, bool) or not isinstance(adapt_interval, int) or adapt_interval < 1
        ):
            raise ValueError(f"gact.Compressor: adapt_interval={adapt_interval!r} must be an integer >= 1")
        self.adapt_interval = adapt_interval

        self._excluded_modules: set[int] = set()
        self._excluded_tensors: list[torch.Tensor] = []
        for e in exclude:
            if isinstance(e, torch.nn.Module):
                self._excluded_modules.update(id(m) for m in e.modules())
            elif isinstance(e, torch.Tensor):
                self._excluded_tensors.append(e)
            else:
                raise TypeError(
                    f"gact.Compressor: exclude entries must be modules or tensors, not {type(e).__name__}"
                )

        self._policy = policy
        self._probe: Any = None  # a policy's probe recorder: saved tensors kept exact (gact.policy)
        if self.bits == "auto" and self._policy is None:
            self._policy = self._make_auto_policy()

        self._step = 0
        self._step_open = False
        self._depth = 0
        self._hook_ctx: list[Any] = []
        self._param_ptrs: frozenset[int] = frozenset()
        self._excluded_ptrs: frozenset[int] = frozenset()
        self._key_counts: dict[str, int] = {}
        self._input_ptrs: set[int] = set()
        self._local = threading.local()
        self._module_hooks: list[Any] = []
        self._names: dict[int, str] = {}
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
        (called after each store, ``info`` as ``_gact.store_info``: codec, bits, bytes_in,
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

    # ---- module tracking ----------------------------------------------------------------

    def _install_module_hooks(self, model: torch.nn.Module) -> None:
        for name, m in model.named_modules():
            self._names.setdefault(id(m), name or "<root>")
            self._module_hooks.append(m.register_forward_pre_hook(self._enter_module))
            self._module_hooks.append(m.register_forward_hook(self._leave_module))

    def _stack(self) -> list[tuple[str, bool]]:
        s = getattr(self._local, "stack", None)
        if s is None:
            s = self._local.stack = []
        return s

    def _enter_module(self, m: torch.nn.Module, inputs: Any) -> None:
        if self._depth == 0:
            return
        s = self._stack()
        if not s and self.model is not None:
            self._note_inputs(inputs)
        excluded = (bool(s) and s[-1][1]) or id(m) in self._excluded_modules
        norm = isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training
        s.append((self._names.get(id(m)) or type(m).__name__, excluded, norm))

    def _note_inputs(self, inputs: Any) -> None:
        for a in _compat.flatten(inputs):
            if isinstance(a, torch.Tensor) and not a.requires_grad and a.layout == torch.strided:
                self._input_ptrs.add(_compat.storage_ptr(a))

    def _leave_module(self, m: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        if self._depth == 0:
            return
        s = self._stack()
        if s:
            s.pop()

    def close(self) -> None:
        """Remove the module hooks this Compressor (and its policy) installed on the model."""
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()
        if self._policy is not None and hasattr(self._policy, "close"):
            self._policy.close()

    # ---- context manager ----------------------------------------------------------------

    def __enter__(self) -> "Compressor":
        if self._depth == 0:
            self._stack().clear()
            if not self._step_open:
                self._open_step()
            if self.swap:
                _C.swap_enable(self._swap_budget, self._prefetch)
            elif hasattr(_C, "swap_disable"):
                _C.swap_disable()
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            self._hook_ctx.append(ctx)
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._stack().clear()
            ctx = self._hook_ctx.pop()
            ctx.__exit__(*exc)

    # ---- steps --------------------------------------------------------------------------

    def _open_step(self) -> None:
        ptrs = set()
        if self.model is not None:
            for p in self.model.parameters():
                ptrs.add(_compat.storage_ptr(p))
            for b in self.model.buffers():
                ptrs.add(_compat.storage_ptr(b))
        ptrs.discard(0)
        self._param_ptrs = frozenset(ptrs)
        self._excluded_ptrs = frozenset(_compat.storage_ptr(t) for t in self._excluded_tensors) - {0}
        self._key_counts = {}
        self._input_ptrs = set()
        _C.store_begin_step(self._step)
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
        leaks = _C.store_end_step()
        self._step += 1
        self._step_open = False
        if self._policy is not None and hasattr(self._policy, "on_step"):
            self._policy.on_step(self._step)
        return leaks

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> dict:
        """The whole stats document (the schema of the JSON dump), as a dict."""
        return _C.stats_document()

    # ---- hooks --------------------------------------------------------------------------

    def _is_parameter(self, t: torch.Tensor) -> bool:
        if t.requires_grad and t.is_leaf:
            return True
        b = t._base
        if b is not None and b.requires_grad and b.is_leaf:
            return True
        return bool(self._param_ptrs) and _compat.storage_ptr(t) in self._param_ptrs

    def _is_excluded(self, t: torch.Tensor) -> bool:
        s = self._stack()
        if s and s[-1][1]:
            return True
        return bool(self._excluded_ptrs) and _compat.storage_ptr(t) in self._excluded_ptrs

    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if (
            t.layout != torch.strided
            or t.is_quantized
            or getattr(t, "is_nested", False)
            or t.device.type not in ("cpu", "cuda")
            or type(t) not in (torch.Tensor, torch.nn.Parameter)
        ):
            return "layout"
        if t.device.type == "cuda" and not _C.have_kernels:
            return "device"
        if t.numel() == 0:
            return "small"
        if self._is_parameter(t):
            return "parameter"
        if self._is_excluded(t):
            return "excluded"
        if t.dtype not in _compat.FLOAT_DTYPES and t.dtype not in _compat.MASK_DTYPES:
            return "dtype"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        if self._input_ptrs and not t.requires_grad and _compat.storage_ptr(t) in self._input_ptrs:
            return "input"
        return None

    def _next_key(self) -> str:
        s = self._stack()
        name = s[-1][0] if s else "<none>"
        n = self._key_counts.get(name, 0)
        self._key_counts[name] = n + 1
        return f"{name}:{n}"

    def _pack(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not self._step_open:
            self._open_step()
        relu_own = t.dtype in _compat.FLOAT_DTYPES and _is_relu_own_save(t)
        stack = self._stack()
        in_norm = bool(stack) and stack[-1][2] and t.dtype in _compat.FLOAT_DTYPES
        if in_norm and t.dim() == 1 and not self._is_parameter(t):
            # batch norm's save_mean / save_invstd: per-channel, read exactly by its backward
            _C.store_note_skip("stats", t.numel() * t.element_size())
            return t if t.grad_fn is None else t.detach()
        reason = self._skip_reason(t)
        if reason is not None:
            _C.store_note_skip(reason, t.numel() * t.element_size())
            # A non-leaf may be the output of the very node saving it: handing autograd
            # the tensor itself would make tensor -> grad_fn -> saved tensor a cycle that
            # Python's GC cannot see, and the graph (with every blob in it) would never be
            # freed if backward never runs. A detached alias breaks the cycle and shares
            # storage and version counter, so in-place checks still work. (Double backward
            # through a kept non-leaf tensor is not supported, as for compressed ones.)
            return t if t.grad_fn is None else t.detach()
        if t.device.type == "cuda" and not t.is_contiguous():
            t = t.contiguous()  # the device gathers faster than a host round trip
        key = self._next_key()
        if relu_own:
            # ReLU's backward reads only result > 0. Rounding a small positive output to the
            # group's min 0 would drop its gradient (a bias no rounding noise averages out), so
            # the ReLU keeps an exact 1-bit mask; a consumer that saves the same tensor for its
            # values (the next conv) stores it quantized under its own key.
            return self._pack_relu_mask(t, key)
        normalize = in_norm and t.dim() >= 2  # a batch-norm input
        if self._probe is not None:
            return self._pack_channel_normalized(t, key, 0) if normalize else self._probe.pack(t, key)
        bits = self._bits_for(key, t.numel()) if t.dtype in _compat.FLOAT_DTYPES else 1
        log_space = t.dtype in _compat.FLOAT_DTYPES and _is_log_space(t)
        if log_space:
            bits = max(bits, LOG_SPACE_MIN_BITS)
        if normalize and bits in _VALID_BITS:  # kept at full precision: stored as it is
            return self._pack_channel_normalized(t, key, bits)
        h = _C.store_put(
            t.data_ptr(),
            _compat.DTYPE_NAMES[t.dtype],
            tuple(t.shape),
            tuple(t.stride()),
            _compat.device_index(t),
            t._version,
            key64(key),
            bits,
            self.group_size,
            self.seed,
            _compat.current_stream(t),
        )
        if self._policy is not None and hasattr(self._policy, "on_stored") and not log_space:
            # codec, bits, bytes, groups and sum_sq_ranges (the online estimator's input)
            self._policy.on_stored(key, _C.store_info(h))
        if h not in _identities:
            try:
                _identities[h] = weakref.ref(t, functools.partial(_forget, h))
            except TypeError:
                _C.store_forget(h)
        return _Packed(h, t.shape, t.dtype, t.device, key)

    def _pack_channel_normalized(self, t: torch.Tensor, key: str, bits: int) -> Any:
        """A batch-norm input, stored as (t − mean_c)/std_c with its per-channel mean and std kept
        exactly. Where a group of consecutive elements spans channels (small images: H·W < group
        size), the group's range is set by its widest channel, and a narrow channel's noise,
        which batch norm's backward scales by 1/std_c², swamps it; normalized, every channel's
        noise is in proportion to its own spread. (Within one channel the transform is affine
        and changes nothing.)"""
        dims = [d for d in range(t.dim()) if d != 1]
        x = t.detach().float()
        mean = x.mean(dim=dims)
        std = x.var(dim=dims, unbiased=False).sqrt_()
        std = torch.where(std > 0, std, torch.ones_like(std))
        view = (1, -1) + (1,) * (t.dim() - 2)
        z = ((x - mean.view(view)) / std.view(view)).to(t.dtype).contiguous()
        if self._probe is not None:
            return self._probe.pack(t, key, z=z, std=std)
        h = self._put_temporary(z, key, bits)
        if self._policy is not None and hasattr(self._policy, "on_stored"):
            self._policy.on_stored(key, _C.store_info(h))
        return _Packed(h, t.shape, t.dtype, t.device, key, affine=(mean, std))

    def _put_temporary(self, z: torch.Tensor, key: str, bits: int) -> int:
        """Store a contiguous tensor made for the store (a mask, a normalized copy). Its identity
        is forgotten at once: a temporary's address must never match a later tensor's."""
        h = _C.store_put(z.data_ptr(), _compat.DTYPE_NAMES[z.dtype], tuple(z.shape), tuple(z.stride()),
                         _compat.device_index(z), 0, key64(key), bits, self.group_size, self.seed,
                         _compat.current_stream(z))
        _C.store_forget(h)
        return h

    def _discard_step(self) -> None:
        """Close a step opened for an estimator's extra pass: its blobs are gone, nothing advances."""
        _C.store_end_step()
        self._step_open = False

    def _pack_relu_mask(self, t: torch.Tensor, key: str) -> Any:
        mask = t > 0
        if self._probe is not None:
            return mask.to(t.dtype)  # exact: nothing to probe
        h = self._put_temporary(mask, key, 1)
        return _Packed(h, mask.shape, mask.dtype, mask.device, key, mask_of=t.dtype)

    def _unpack(self, obj: Any) -> Any:
        if isinstance(obj, _Packed):
            return obj.unpack()
        probe_unpack = getattr(type(obj), "probe_unpack", None)  # a probe's exact copy (gact.policy)
        return probe_unpack(obj) if probe_unpack is not None else obj

    # ---- global installation (gact-run) -------------------------------------------------

    def install_global(self) -> None:
        """Install this Compressor's hooks for the whole process (every thread, every
        forward), instead of a ``with`` block; used by ``gact-run``. Undo with :meth:`uninstall_global`."""
        if getattr(self, "_global_pop", None) is not None:
            return
        self._depth += 1
        self._global_pop = _compat.push_default_hooks(self._pack, self._unpack)
        if self.model is None and _compat.HAS_GLOBAL_MODULE_HOOKS:
            mm = torch.nn.modules.module
            self._module_hooks.append(mm.register_module_forward_pre_hook(self._enter_module))
            self._module_hooks.append(mm.register_module_forward_hook(self._leave_module))

    def uninstall_global(self) -> None:
        pop = getattr(self, "_global_pop", None)
        if pop is None:
            return
        self._global_pop = None
        pop()
        self._depth -= 1
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
        no-op unless installed globally; the hooks go with the thread."""
        if getattr(self, "_global_pop", None) is None:
            return
        _compat.push_default_hooks(self._pack, self._unpack)
