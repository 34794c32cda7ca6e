"""What differs between the torch versions gact supports (1.13 CPU to 2.x CUDA).

Everything version-dependent is detected here once, by feature rather than by
version number, so the rest of the package reads the same on every torch:

* storage identity: ``Tensor.untyped_storage()`` (2.x) or ``Tensor.storage()``
  (1.13, a TypedStorage; calling it on 2.x warns, so it is only the fallback);
* global saved-tensor hooks: ``torch._C._autograd._push_saved_tensors_default_hooks``
  (1.11+), else an entered ``torch.autograd.graph.saved_tensors_hooks``;
* the optimizer step hook: ``torch.optim.optimizer.register_optimizer_step_post_hook``
  (2.0+), else a wrapper installed on each optimizer class;
* the pluggable CUDA allocator: ``torch.cuda.memory.CUDAPluggableAllocator`` (2.0+).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from typing import Any

import torch
import torch.optim.optimizer as _optim_mod

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())

HAS_UNTYPED_STORAGE = hasattr(torch.Tensor, "untyped_storage")
HAS_DEFAULT_HOOKS = hasattr(torch._C._autograd, "_push_saved_tensors_default_hooks")
HAS_OPTIMIZER_POST_HOOK = hasattr(_optim_mod, "register_optimizer_step_post_hook")
HAS_PLUGGABLE_ALLOCATOR = hasattr(torch.cuda, "memory") and hasattr(torch.cuda.memory, "CUDAPluggableAllocator")
HAS_GLOBAL_MODULE_HOOKS = hasattr(torch.nn.modules.module, "register_module_forward_pre_hook") and hasattr(
    torch.nn.modules.module, "register_module_forward_hook"
)
#: whether a forward hook can be given the call's keyword arguments (torch 2.x's with_kwargs)
HAS_HOOK_KWARGS = HAS_GLOBAL_MODULE_HOOKS and "with_kwargs" in inspect.signature(
    torch.nn.modules.module.register_module_forward_hook).parameters


def _never_compiling() -> bool:
    return False


#: True while torch.compile (dynamo) traces the calling code, where torch 2.x also traces the saved-tensor hooks
#: and the op tracker's mode; a constant there. gact's hooks are the identity inside a compiled region: the graph's
#: saves are not the eager ops' (nothing tells which op saved what), so nothing there is compressed, and the
#: tracker passes every call through (its stand-ins are not traceable).
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or \
    getattr(getattr(torch, "_dynamo", None), "is_compiling", None) or _never_compiling

_functorch = getattr(torch._C, "_functorch", None)
#: torch.func's wrapper tensors (vmap's batched tensors, jvp's and grad's levels): they have no storage of their
#: own, so gact keeps them as they are
is_functorch_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None) or (lambda t: False)

try:
    import torch.autograd.forward_ad as _forward_ad
except ImportError:  # pragma: no cover
    _forward_ad = None


_graph = getattr(torch.autograd, "graph", None)


def mutation_allowed() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is active: the program may then change a
    saved tensor in place before backward, and backward must read it as it was when saved (torch clones it on its
    first change; gact's hooks, the innermost, keep torch's from seeing the saves). A blob holds the values of its
    save already: it is decoded without the version check, never served by the program's (changed) tensor; a tensor
    gact would keep as it is is kept as a copy; nothing waits to be encoded later."""
    return _graph is not None and getattr(_graph, "_allow_mutation_on_saved_tensors_enabled", False) is True


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (dual tensors may flow through the ops)."""
    return _forward_ad is not None and getattr(_forward_ad, "_current_level", -1) >= 0


# torch dtype -> the name the C++ core parses; dtypes missing here are never stored.
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float64: "float64",
}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}

# dtypes the quant codec encodes; bool and uint8 go to the mask codec (uint8 only when 0/1).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MASK_DTYPES = (torch.bool, torch.uint8)


def storage_ptr(t: torch.Tensor) -> int:
    """Address of the storage behind ``t`` (shared by all views of one tensor)."""
    if HAS_UNTYPED_STORAGE:
        return t.untyped_storage().data_ptr()
    return t.storage().data_ptr()


def storage_base(t: torch.Tensor) -> int:
    """Address of the storage behind ``t``, from the tensor itself (no storage object is made)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


#: the lower precisions autocast computes in
AUTOCAST_DTYPES = frozenset({torch.float16, torch.bfloat16})


def held_bytes(t: torch.Tensor) -> int:
    """The bytes of memory ``t``'s elements occupy: ``numel * element_size``, less for a view that reaches
    some element more than once (an expanded tensor: its stride-0 dimensions take no memory); a sparse tensor's,
    the sum of its indices and values (sparse CSR, CSC and BSR tensors have no is_contiguous)."""
    if t.layout is not torch.strided:
        return _component_bytes(t)
    n = t.numel()
    if t.is_nested:  # (a strided nested tensor, which a jagged one's attention makes inside: it has no sizes)
        return n * t.element_size()
    if n == 0 or t.is_contiguous():
        return n * t.element_size()
    distinct = 1  # elements along the dimensions that move (a stride-0 dimension repeats them)
    span = 1  # the elements between the first and the last one reached
    for d, s in zip(t.shape, t.stride()):
        if s != 0:
            distinct *= d
            span += (d - 1) * abs(s)
    return min(distinct, span) * t.element_size()


def _component_bytes(t: torch.Tensor) -> int:
    """held_bytes of a tensor of another layout: a sparse one's indices and values, otherwise its elements'."""
    names = ("_indices", "_values") if t.layout is torch.sparse_coo else \
        ("crow_indices", "ccol_indices", "col_indices", "row_indices", "values")
    total, found = 0, False
    for name in names:
        try:
            part = getattr(t, name)()
        except (AttributeError, RuntimeError, TypeError):  # (each compressed layout has two of the four index arrays)
            continue
        found = True
        total += part.numel() * part.element_size()
    if found:
        return total
    try:
        return t.numel() * t.element_size()
    except RuntimeError:
        return 0


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is non-overlapping and dense (its elements fill its span): contiguous,
    channels-last, transposed, ..."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def decoded_strides(t: torch.Tensor) -> tuple:
    """The strides a saved tensor decodes to: its own when it is dense, otherwise dense strides in the
    order of its own, as torch's empty_like gives them (the store's dense_strides, written again here)."""
    if is_dense(t):
        return t.stride()
    shape, strides = t.shape, t.stride()
    nd = len(shape)
    perm = list(range(nd - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        s0, s1 = strides[d0], strides[d1]
        if s0 == 0 or s1 == 0:
            return 0
        if s0 != s1:
            return -1 if s0 < s1 else 1
        return 1 if shape[d0] > shape[d1] else 0

    for i in range(1, nd):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    out = [0] * nd
    acc = 1
    for i in perm:
        out[i] = acc
        acc *= max(shape[i], 1)
    return tuple(out)


def contiguous_strides(shape) -> tuple:
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def device_index_of(device: torch.device) -> int:
    """-1 for the CPU, the CUDA device index otherwise."""
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def flatten(obj) -> list:
    """The leaves of nested tuples, lists and dicts (dict values in insertion order), in order."""
    if isinstance(obj, (tuple, list)):
        return [x for o in obj for x in flatten(o)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in flatten(v)]
    return [obj]


def device_index(t: torch.Tensor) -> int:
    """-1 for a CPU tensor, the CUDA device index otherwise."""
    if not t.is_cuda:
        return -1
    return t.get_device()


#: torch's current CUDA stream of a device index as an integer, read with no Stream object made (the call
#: torch's generated kernels use); None on a torch without CUDA
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as an integer handle (runs for every saved CUDA tensor)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def current_stream(t: torch.Tensor) -> int:
    """The current CUDA stream on ``t``'s device as an integer handle (0 on the CPU)."""
    if not t.is_cuda:
        return 0
    return raw_stream(t.get_device())


def push_default_hooks(pack, unpack):
    """Install process-wide saved-tensor hooks; returns a callable that removes them."""
    if HAS_DEFAULT_HOOKS:
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        return torch._C._autograd._pop_saved_tensors_default_hooks
    ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    ctx.__enter__()
    return lambda: ctx.__exit__(None, None, None)


#: per thread, the default saved-tensor hooks pushed since track_saved_hooks() wrapped torch's push and pop, oldest
#: first: [(pack, unpack)]
_pushed = threading.local()
_torch_push = _torch_pop = _torch_disable = None


def _pushed_stack() -> list:
    s = getattr(_pushed, "stack", None)
    if s is None:
        s = _pushed.stack = []
    return s


def is_gact_pack(pack: Any) -> bool:
    """Whether a pack hook is a Compressor's (its function carries ``_gact_pack``)."""
    return getattr(getattr(pack, "__func__", pack), "_gact_pack", False)


def gact_hooks_on_top() -> bool:
    """Whether the calling thread's innermost saved-tensor hooks are a Compressor's, as far as track_saved_hooks has
    seen the stack: a derivative stand-in saves for them alone (under a non-reentrant checkpoint's hooks, whose
    recomputation runs torch's own op, or save_on_cpu's, the call must save what torch's own op saves)."""
    s = getattr(_pushed, "stack", None)
    return bool(s) and is_gact_pack(s[-1][0])


#: whether a torch.func / functorch transform is running on this thread (an autograd.Function without setup_context
#: is refused inside any, whatever its inputs)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def functorch_active() -> bool:
    return _transforms_active is not None and bool(_transforms_active())


def track_saved_hooks() -> None:
    """Let gact's saved-tensor hooks make way for the transforms that refuse any (``torch.func.grad``, ``vjp``,
    ``jacrev``, ``hessian``, functorch's): they enter ``torch.autograd.graph.disable_saved_tensors_hooks``, which
    raises while hooks are on the thread's stack, and under ``gact-run`` gact's cover the whole process (a script that
    logs per-sample gradient norms with ``vmap(grad(...))`` failed where it ran without gact). Wraps torch's push and
    pop of default hooks (once) to know what is on the stack; where every entry on it is gact's, they are taken off for
    the transform's extent and put back after (the transform's saves are then autograd's own, uncompressed); with any
    other hooks on it, torch raises its error as it does without gact. Hooks pushed before this ran are not known:
    they stay, and torch raises."""
    global _torch_push, _torch_pop, _torch_disable
    graph = getattr(torch.autograd, "graph", None)
    if _torch_push is not None or not HAS_DEFAULT_HOOKS or not hasattr(graph, "disable_saved_tensors_hooks"):
        return
    with _track_lock:  # (two threads entering their first Compressor at once: one wraps, and only once)
        if _torch_push is not None:
            return
        ag = torch._C._autograd
        torch_push, torch_pop = ag._push_saved_tensors_default_hooks, ag._pop_saved_tensors_default_hooks
        torch_disable = graph.disable_saved_tensors_hooks
        _wrap_saved_hooks(ag, graph, torch_push, torch_pop, torch_disable)
        _torch_push, _torch_pop, _torch_disable = torch_push, torch_pop, torch_disable


_track_lock = threading.Lock()


def _wrap_saved_hooks(ag: Any, graph: Any, torch_push: Any, torch_pop: Any, torch_disable: Any) -> None:
    def push(pack: Any, unpack: Any) -> None:
        torch_push(pack, unpack)
        _pushed_stack().append((pack, unpack))

    def pop() -> None:
        torch_pop()
        s = _pushed_stack()
        if s:
            s.pop()

    @contextlib.contextmanager
    def disable_saved_tensors_hooks(error_message: str):
        s = _pushed_stack()
        aside = list(s) if s and all(is_gact_pack(p) for p, _ in s) else []
        for _ in aside:
            pop()
        try:
            with torch_disable(error_message):
                yield
        finally:
            for pack, unpack in aside:
                push(pack, unpack)

    disable_saved_tensors_hooks.__doc__ = torch_disable.__doc__
    ag._push_saved_tensors_default_hooks = push
    ag._pop_saved_tensors_default_hooks = pop
    # (torch 1.13 re-exports the two in torch.autograd: a push there would pass the stack gact keeps)
    for name, orig, wrapper in (("_push_saved_tensors_default_hooks", torch_push, push),
                                ("_pop_saved_tensors_default_hooks", torch_pop, pop)):
        if getattr(torch.autograd, name, None) is orig:
            setattr(torch.autograd, name, wrapper)
    graph.disable_saved_tensors_hooks = disable_saved_tensors_hooks


def unwrap_ddp(model: Any) -> Any:
    """The module inside a DistributedDataParallel wrapper (``model`` itself otherwise): what a Compressor keys, hooks
    and probes. Through the wrapper, the policy's probe replayed DDP's forward, which prepares a gradient reduction
    that the probe's double backward never finished: the next forward raised DDP's "Expected to have finished
    reduction in the prior iteration" on every rank. (Not DataParallel's: on several GPUs it runs replicas of its
    module, whose hooks are not the module's; its own forward replays fine.)"""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def weak_hook(obj: Any, func: Any, *bound: Any) -> Any:
    """A hook calling ``func(obj, *bound, *args)`` while ``obj`` lives and doing nothing after: a
    model's hooks then do not keep a Compressor (or its policy) alive."""
    ref = weakref.ref(obj)

    def hook(*args: Any) -> Any:
        o = ref()
        return None if o is None else func(o, *bound, *args)

    return hook


class _ModuleHooks:
    """gact's module hooks, kept out of the modules themselves. A hook registered on a module lives in its
    ``_forward_hooks`` dict, so ``torch.save(model)``, ``copy.deepcopy`` and ``pickle`` tried to pickle
    gact's closures ("Can't pickle local object 'weak_hook.<locals>.hook'"), a loaded model carried
    them, and ``torch.jit.script`` met Python hooks. Instead, one global forward pre-hook and one forward
    hook (torch's ``register_module_forward_*_hook``) run the hooks registered here for the module being
    called, looked up by the module's id (a dead module's hooks go with it, through a weak reference's
    callback, before its id can name another object).

    They run for every module call in the process (torch's module call takes its slow path while any
    global hook is installed), so they cost little: one dictionary lookup for a module without hooks,
    tuples run as they are; and they are installed only while some module has a hook here (a closed
    Compressor leaves the process's module calls as they were)."""

    def __init__(self) -> None:
        self.pre: dict[int, tuple] = {}
        self.post: dict[int, tuple] = {}
        self.post_kw: dict[int, tuple] = {}  # forward hooks given the call's keyword arguments too (HAS_HOOK_KWARGS)
        self._refs: dict[int, Any] = {}  # id -> weak reference to the module, whose callback drops its hooks
        self._handles: list = []  # what takes the two global hooks out again, while they are installed
        # the keys torch gave the two hooks when first installed, and the hook objects themselves: installed again under
        # the same keys, a torch.compile'd model's guards on the global hooks still hold (new keys recompiled the model
        # for every new Compressor, and past dynamo's cache limit, 8, it ran uncompiled)
        self._keys: tuple | None = None
        self._fns = (self._run_pre, self._run_post)
        # changes (from any thread, and from a weak reference's callback that a collection runs in the middle
        # of one) are made under this lock; the hooks read the tables without it (a dict lookup and a tuple
        # are each read whole)
        self._lock = threading.RLock()

    def add(self, module: Any, fn: Any, pre: bool, with_kwargs: bool = False) -> Any:
        """``fn(module, inputs)`` before ``module``'s calls (pre), or ``fn(module, inputs, output)`` after them,
        ``fn(module, inputs, output, kwargs)`` with ``with_kwargs`` (kwargs None where torch cannot give them)."""
        if not HAS_GLOBAL_MODULE_HOOKS:  # (an old torch: the module's own hooks)
            if pre:
                return module.register_forward_pre_hook(fn)
            return module.register_forward_hook((lambda m, i, o: fn(m, i, o, None)) if with_kwargs else fn)
        key = id(module)
        table = self.pre if pre else self.post_kw if with_kwargs else self.post
        with self._lock:
            if key not in self._refs:
                self._refs[key] = weakref.ref(module, lambda _r, key=key: self._drop(key))
            table[key] = table.get(key, ()) + (fn,)
            if not self._handles:
                self._install()
        return _HookHandle(self, table, key, fn)

    def _install(self) -> None:
        from torch.nn.modules import module as _m
        dicts = (getattr(_m, "_global_forward_pre_hooks", None), getattr(_m, "_global_forward_hooks", None))
        keys = self._keys
        kw = getattr(_m, "_global_forward_hooks_with_kwargs", None) if HAS_HOOK_KWARGS else None
        if keys is not None and all(isinstance(d, dict) for d in dicts) and keys[0] not in dicts[0] and \
                keys[1] not in dicts[1] and (not HAS_HOOK_KWARGS or isinstance(kw, dict)):
            for d, k, fn in zip(dicts, keys, self._fns):
                d[k] = fn
            self._handles = [functools.partial(d.pop, k, None) for d, k in zip(dicts, keys)]
            if kw is not None:
                kw[keys[1]] = True
                self._handles.append(functools.partial(kw.pop, keys[1], None))
            return
        post = _m.register_module_forward_hook(self._fns[1], with_kwargs=True) if HAS_HOOK_KWARGS else \
            _m.register_module_forward_hook(self._fns[1])
        handles = [_m.register_module_forward_pre_hook(self._fns[0]), post]
        self._keys = tuple(h.id for h in handles)
        self._handles = [h.remove for h in handles]
        if kw is not None:  # (torch's handle leaves its with_kwargs entry)
            self._handles.append(functools.partial(kw.pop, post.id, None))

    def remove(self, table: dict, key: int, fn: Any) -> None:
        with self._lock:
            fns = table.get(key)
            if fns is None or fn not in fns or key not in self._refs:
                return
            i = fns.index(fn)
            fns = fns[:i] + fns[i + 1:]
            if key not in self._refs:  # (the module died while the tuple was made: _drop took its entries)
                return
            if fns:
                table[key] = fns
            else:
                del table[key]
                if key not in self.pre and key not in self.post and key not in self.post_kw:
                    self._refs.pop(key, None)
            self._uninstall_if_empty()

    def _drop(self, key: int) -> None:
        with self._lock:
            self.pre.pop(key, None)
            self.post.pop(key, None)
            self.post_kw.pop(key, None)
            self._refs.pop(key, None)
            self._uninstall_if_empty()

    def _uninstall_if_empty(self) -> None:
        if not self.pre and not self.post and not self.post_kw and self._handles:
            handles, self._handles = self._handles, []
            for remove in handles:
                remove()

    def _run_pre(self, module: Any, inputs: Any) -> None:
        fns = self.pre.get(id(module))
        if fns is not None:
            for fn in fns:
                fn(module, inputs)

    def _run_post(self, module: Any, inputs: Any, *rest: Any) -> None:
        kwargs, output = rest if len(rest) == 2 else (None, rest[0])  # (installed with_kwargs: kwargs first)
        fns = self.post.get(id(module))
        if fns is not None:
            for fn in fns:
                fn(module, inputs, output)
        fns = self.post_kw.get(id(module))
        if fns is not None:
            for fn in fns:
                fn(module, inputs, output, kwargs)


class _HookHandle:
    """Removes one hook registered with _ModuleHooks (as torch's RemovableHandle)."""

    __slots__ = ("hooks", "table", "key", "fn")

    def __init__(self, hooks: _ModuleHooks, table: dict, key: int, fn: Any) -> None:
        self.hooks = hooks
        self.table = table
        self.key = key
        self.fn = fn

    def remove(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            self.hooks.remove(self.table, self.key, fn)


_MODULE_HOOKS = _ModuleHooks()


_MODULE_GENERATION = [0]  # bumped when any module registers a submodule (while the hook below is installed)
_GENERATION_HOOK: list = []


def module_generation() -> int | None:
    """A number that changes whenever any module in the process registers a submodule (torch 2.x's global
    module registration hook, installed at the first call; it costs nothing on module calls), so that a list
    of a model's modules can be kept between steps; None on a torch without that hook (1.13): walk again."""
    if not _GENERATION_HOOK:
        reg = getattr(torch.nn.modules.module, "register_module_module_registration_hook", None)
        if reg is None:
            return None

        def bump(_module: Any, _name: str, _submodule: Any) -> None:
            _MODULE_GENERATION[0] += 1  # (returns None: the submodule is registered as it is)

        _GENERATION_HOOK.append(reg(bump))
    return _MODULE_GENERATION[0]


def parameter_storages(modules: Any) -> set:
    """The storage addresses (storage_base) of the parameters and buffers of ``modules``, read from each
    module's own dictionaries (no generator per module, no deduplication pass: the set does it)."""
    ptrs = set()
    add = ptrs.add
    for m in modules:
        for t in m._parameters.values():
            if t is not None:
                add(t.data_ptr() - t.storage_offset() * t.element_size())
        for t in m._buffers.values():
            if t is not None:
                add(t.data_ptr() - t.storage_offset() * t.element_size())
    ptrs.discard(0)
    return ptrs


def register_forward_pre_hook(module: Any, fn: Any) -> _HookHandle:
    """``module.register_forward_pre_hook(fn)`` without touching the module (see _ModuleHooks); fn's
    return value is ignored."""
    return _MODULE_HOOKS.add(module, fn, True)


def register_forward_hook(module: Any, fn: Any, with_kwargs: bool = False) -> _HookHandle:
    """``module.register_forward_hook(fn)`` without touching the module (see _ModuleHooks); fn's return
    value is ignored. ``with_kwargs``: fn(module, inputs, output, kwargs), kwargs the call's keyword arguments (None
    where this torch cannot give them: 1.13)."""
    return _MODULE_HOOKS.add(module, fn, False, with_kwargs)


def remove_handles(handles: list) -> None:
    """Remove hook handles (a finalizer: the owner of ``handles`` is gone or closed)."""
    for h in handles:
        h.remove()
    handles.clear()
