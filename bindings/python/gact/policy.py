"""The adaptive bit policy's Python driver: ``gact.Compressor(model, bits="auto", budget=2, estimator=...)``.

The decisions are made by the C++ controller (``_gact.PolicyController``,
policy/controller.hpp): it keeps one record per tensor key, smooths the
sensitivity estimates C_l and solves min Σ C_l/(2^b_l − 1)² under the stored-byte
budget (metadata counted). This module feeds it:

* ``bits_for(key, numel)`` (the pack hook) → ``controller.on_save``: the current
  width of a known key, ``default_bits`` (the widest code width ≤ budget) for an
  unknown one, so a dynamic graph never fails.
* Every ``adapt_interval`` steps (the ``adapt_interval`` option, GACT_ADAPT_INTERVAL)
  one training step is *sampled* (steps 0, N, 2N, ...): the estimator gathers its
  input during that step, and at the following ``comp.step()`` the estimates are
  (with torch.distributed) averaged over ranks, given to the controller and the
  allocation is re-solved. So default bits hold until the end of step 0.

Estimators (policy/README.md, "Sensitivity estimators"):

``"online"``
    Reuses the sampled training step. At encode time the store reports Σ_g R_g²
    (squared per-group ranges, ``sum_sq_ranges``); a forward hook on the module that
    saved the tensor registers a gradient hook on its output, which records
    ‖∂L/∂y‖². Then C_l = fan_in·‖δ‖²·G·Σ_g R_g² / (6·numel) (policy/estimator.cpp
    ``online_sensitivity``). fan_in is the number of saved elements each output
    reads for a weight gradient: in_features (Linear), C_in/groups·k_h·k_w (ConvNd).
    Tensors saved by other modules (batch norm, activations, pooling) feed an
    input-gradient path whose effect on earlier layers this local model does not
    see (a batch-norm input, for one, is amplified by 1/σ_c² per channel and at
    1 bit blew resnet18's gradient variance up by 10^10): the online estimator
    gives them no estimate, so the controller keeps them at ``default_bits`` with
    their bytes reserved out of the budget; the reference estimator does measure
    them. A tensor saved twice (the store deduplicates, e.g. an in-place ReLU's
    output that the next conv saves again) is one blob, estimated only when every
    saver is a conv/linear (the sum of their C): a ReLU's saved output also gates
    the input gradient (a rounding to 0 flips the mask), an error this model does
    not see and which made resnet18's gradient variance 2.3x worse than uniform
    2 bits when such blobs were estimated from their conv consumer alone.
    Cost: one reduction per module output, on one step in ``adapt_interval``.

``"probe"`` (the default when the Compressor has a model)
    Every tensor's C_l from one double backward: the closure's forward runs with the
    graph cut at each leaf module's inputs, a backward with create_graph gives the
    parameter gradients g as a function of the saved tensors, and for a random sign
    vector v, Ĉ_l = Σ_j var_j·(∂(v·g)/∂h_l,j)², var_j = (x_j − min_g)(max_g − x_j) the
    1-bit rounding variance, is unbiased for E‖J_l ε_l‖² (Hutchinson; policy/README.md,
    "Probe"). Cost: about two ordinary steps per estimate, whatever the tensor count.
    Without a closure it replays the sampled step: a forward hook keeps the first
    ``probe_samples`` (8) rows of the model's positional tensor inputs, and a gradient
    hook the same rows of each output's gradient δ, and the probe's loss is Σ out·δ,
    whose parameter gradients are the step's own on those samples (the noise of a saved
    tensor does not change δ). A closure that returns the loss of one forward pass on a
    few samples can be given instead: ``comp.step(closure)`` or
    ``estimator=gact.policy.Probe(closure)``. Chosen by default, the probe falls back to
    the online estimator, with a RuntimeWarning that says why, when it cannot run (a
    model called with keyword arguments only, an op autograd cannot differentiate
    twice). The estimators' extra forward passes leave batch-norm statistics as they were.

``"reference"``
    GACT's perturbation method with common random numbers, its constants fixed:
    for each key l, three forward+backward passes with every other tensor kept at
    full precision and l at 1 bit (seed s), 1 bit (seed s+1) and 8 bits (seed s+2);
    Ĉ_l = (d01² + d02² + d12²)/(2 + 2·(1 + 1/255²)) with d = gradient differences.
    It replays the sampled step or takes a closure, as the probe does (a closure that
    runs backward itself and returns None also works). Either runs inside ``comp.step()``
    at each adaptation; the model's ``.grad`` are saved before and restored after. Cost:
    3 passes per saved tensor.

Raises ValueError for an unknown estimator name; RuntimeError when an explicitly chosen
probe or reference estimator adapts with neither a closure nor a replayable step;
TypeError when the probe's closure does not return a scalar loss.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any, Callable

import torch

import _gact as _C

from . import _compat

WARMUP_FIRST = 10  # the first early re-estimate (then 20, 40, ... below adapt_interval)
_CODE_WIDTHS = (1, 2, 4, 8)
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


class Reference:
    """``estimator=gact.policy.Reference(closure)``: the reference estimator with its closure."""

    name = "reference"

    def __init__(self, closure: Callable[[], Any]) -> None:
        if not callable(closure):
            raise TypeError(f"gact.policy.{type(self).__name__}: closure must be callable")
        self.closure = closure


class Probe(Reference):
    """``estimator=gact.policy.Probe(closure)``: the probe estimator with its closure, which
    returns the loss of one forward pass on a small batch (gact runs the backward passes)."""

    name = "probe"


_ESTIMATORS = ("online", "probe", "reference")


def online_sensitivity(sum_sq_ranges: float, numel: int, group_size: int, grad_sq_norm: float, fan_in: float) -> float:
    """C_l of the online estimator (the formula of policy/estimator.cpp ``online_sensitivity``)."""
    if numel <= 0 or group_size <= 0:
        raise ValueError("gact.policy.online_sensitivity: numel and group_size must be > 0")
    return fan_in * grad_sq_norm * (group_size * sum_sq_ranges / numel) / 6.0


def reference_sensitivity(d01: float, d02: float, d12: float) -> float:
    """Ĉ_l from the three squared gradient differences (1 bit s, 1 bit s+1, 8 bits s+2)."""
    v1, v8 = 1.0, 1.0 / 255.0**2
    return (d01 + d02 + d12) / ((v1 + v1) + 2.0 * (v1 + v8))


def _fan_in(m: torch.nn.Module) -> float | None:
    """Saved elements read per output row of a weight gradient; None for a module whose saved
    tensors do not feed a local weight gradient (the online model does not cover them)."""
    if isinstance(m, torch.nn.Linear):
        return float(m.in_features)
    if isinstance(m, torch.nn.modules.conv._ConvNd):
        return float(m.in_channels // m.groups * math.prod(m.kernel_size))
    return None


class AutoPolicy:
    """The policy object a Compressor with ``bits="auto"`` asks for bits (see the module doc).

    Attributes:
        controller: the ``_gact.PolicyController`` (its ``stats()`` is the "policy" section).
        adapt_interval: steps between adaptations.
        reference_closure: the reference estimator's closure (None for online).
    """

    def __init__(self, compressor: Any, budget: float, estimator: Any = None, adapt_interval: int | None = None,
                 ema_weight: float = 0.5, probe_vectors: int = 1, probe_samples: int = 8) -> None:
        # The default: the probe, replaying the sampled step when no closure is given, with the
        # online estimator as the fallback when it cannot run (see _probe_or_fallback).
        self._default_estimator = estimator is None
        if estimator is None:
            estimator = "probe" if compressor.model is not None else "online"
        self.closure: Callable[[], Any] | None = None
        if isinstance(estimator, Reference):
            self.closure = estimator.closure
            estimator = estimator.name
        if estimator not in _ESTIMATORS:
            raise ValueError(f"gact.Compressor: estimator={estimator!r} is not supported; "
                             f"use one of {', '.join(repr(e) for e in _ESTIMATORS)}")
        self.estimator = estimator
        self.probe_vectors = probe_vectors
        self.probe_samples = probe_samples
        self._probe_disabled = False
        self._replay: dict | None = None  # the sampled step's first samples and output gradient
        if adapt_interval is None:
            adapt_interval = int(_C.options_current()["adapt_interval"])
        if isinstance(adapt_interval, bool) or not isinstance(adapt_interval, int) or adapt_interval < 1:
            raise ValueError(f"gact.Compressor: adapt_interval={adapt_interval!r} must be an integer >= 1")
        self.adapt_interval = adapt_interval
        self._comp = compressor
        self.default_bits = max(b for b in _CODE_WIDTHS if b <= budget)
        self.controller = _C.PolicyController(budget=float(budget), default_bits=self.default_bits,
                                              ema_weight=ema_weight, group_size=compressor.group_size)
        self.controller.register_stats("policy")
        self.decisions = 0
        self.estimate_seconds = 0.0  # wall time spent estimating and solving (the overhead)
        self._override: dict[str, int] | None = None  # reference probing: key -> bits, others full
        self._sampling = False
        self._saved: dict[str, dict] = {}  # key -> store info, in the sampled step
        self._by_blob: dict[tuple, str] = {}  # blob identity -> first key (dedup)
        self._alias: dict[str, str] = {}  # later key -> first key of the same blob
        self._grad_sq: dict[str, list[float]] = {}  # module name -> ‖dL/dy‖² per call
        self._fan_in: dict[str, float] = {}
        self._hooks: list[Any] = []
        self._sample_next = False  # sample the next step whatever the interval (defer_first_sample)
        self._skip_step = False  # record nothing until the step ends (defer_first_sample)
        self._set_sampling(True)  # the Compressor is built at step 0: sample it
        online_hooks = estimator == "online" or (estimator == "probe" and self._default_estimator)
        if online_hooks and compressor.model is not None:
            for name, m in compressor.model.named_modules():
                hook = _compat.weak_hook(self, AutoPolicy._forward_hook, name or "<root>", m)
                self._hooks.append(m.register_forward_hook(hook))
        if estimator in ("probe", "reference") and compressor.model is not None:
            hook = _compat.weak_hook(self, AutoPolicy._capture_replay)
            self._hooks.append(compressor.model.register_forward_hook(hook))
        # The model holds the hooks, which hold the policy weakly: they go when it does.
        weakref.finalize(self, _compat.remove_handles, self._hooks)

    # ---- the compressor's protocol -------------------------------------------------------

    def bits_for(self, key: str, numel: int) -> int:
        if self._override is not None:
            return self._override.get(key, 32)
        return int(self.controller.bits_for(key))  # an unknown key: default_bits

    def on_stored(self, key: str, info: dict) -> None:
        if self._skip_step or self._override is not None or info["dtype"] not in _FLOAT_DTYPES:
            return  # masks are stored at 1 bit whatever the policy says
        blob = (tuple(info["shape"]), info["bytes_stored"], info["sum_sq_ranges"], info["groups"])
        if info.get("refcount", 1) > 1:
            # deduplicated against a tensor saved earlier in this step: no bytes of its own, so it
            # stays out of the controller (and the budget); its sensitivity goes to the first key
            first = self._by_blob.get(blob)
            if first is not None and self._sampling:
                self._alias[key] = first
                self._saved[key] = dict(info)
            return
        self._by_blob.setdefault(blob, key)
        numel = int(math.prod(info["shape"]))
        self.controller.on_save(key, numel, 32 if info["dtype"] == "float32" else 16)
        if self._sampling:
            self._saved[key] = dict(info)

    def on_step(self, step: int) -> None:
        if self._sampling:
            t0 = _now()
            if self.estimator == "online":
                est = self._online_estimates()
            elif self.estimator == "probe":
                est = self._probe_or_fallback()
            else:
                est = self._reference_estimates()
            est = _allreduce_mean(est)
            for k in sorted(est):
                self.controller.add_estimate(k, est[k])
            self.controller.set_step(step)
            if est:
                self.controller.decide()
                self.decisions += 1
            self.estimate_seconds += _now() - t0
        else:
            self.controller.set_step(step)
        self._by_blob.clear()
        self._set_sampling(self.samples_at(step) or self._sample_next)
        self._sample_next = False
        self._skip_step = False

    def samples_at(self, step: int) -> bool:
        """Whether step ``step`` is sampled (estimated): every ``adapt_interval`` steps, and before the
        first interval at steps 10, 20, 40, 80, ... (sensitivities move fastest early in training:
        measured at initialization alone they misled a character-level transformer, whose attention
        probabilities went to 1 bit while they sharpened; see policy/README.md)."""
        if step % self.adapt_interval == 0:
            return True
        if step < WARMUP_FIRST or step >= self.adapt_interval or step % WARMUP_FIRST:
            return False
        k = step // WARMUP_FIRST
        return k & (k - 1) == 0  # a power of two

    def defer_first_sample(self) -> None:
        """Built in the middle of a step (a model given to a running Compressor): the rest of that step
        is neither recorded (its keys, numbered from the step's start, never recur: they would count
        against the budget) nor sampled; the next step is sampled instead."""
        self._set_sampling(False)
        self._sample_next = True
        self._skip_step = True

    def stats(self) -> dict:
        return self.controller.stats()

    def fit_bytes(self, forward: Callable[[], Any], max_bytes: int) -> float:
        """Re-solve at the largest average-bit budget whose step stores at most ``max_bytes``
        in the store (ReLU masks and raw blobs included, which the budget does not size), found
        by bisection over [1, 8] bits: ``forward()`` runs the model's forward pass (under the
        Compressor, 14 times). For comparisons at equal memory. Returns the budget."""
        comp = self._comp
        pol = self.controller
        lo, hi = 1.0, 8.0
        for _ in range(14):
            mid = 0.5 * (lo + hi)
            pol.set_budget(mid)
            pol.decide()
            with comp:
                out = forward()
            nbytes = _C.store_stored_bytes()
            del out
            comp._discard_step()
            if nbytes <= max_bytes:
                lo = mid
            else:
                hi = mid
        pol.set_budget(lo)
        pol.decide()
        return lo

    @property
    def reference_closure(self) -> Callable[[], Any] | None:
        """The estimator's closure (the name predates the probe estimator, which uses it too)."""
        return self.closure

    @reference_closure.setter
    def reference_closure(self, fn: Callable[[], Any] | None) -> None:
        self.closure = fn

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ---- online estimator ----------------------------------------------------------------

    def _set_sampling(self, on: bool) -> None:
        self._sampling = on
        self._replay = None
        self._saved.clear()
        self._by_blob.clear()
        self._alias.clear()
        self._grad_sq.clear()

    def _forward_hook(self, name: str, m: torch.nn.Module, _m: torch.nn.Module, _inputs: Any, output: Any) -> None:
        if not self._sampling or self._override is not None or self._comp._depth == 0:
            return
        if isinstance(output, torch.Tensor) and output.requires_grad:
            fan_in = _fan_in(m)
            if fan_in is None:
                return
            self._fan_in[name] = fan_in
            slot = self._grad_sq.setdefault(name, [])
            slot.append(0.0)
            i = len(slot) - 1

            def grad_hook(g: torch.Tensor) -> None:
                slot[i] += float(g.detach().double().pow(2).sum())

            output.register_hook(grad_hook)

    def _online_estimates(self) -> dict[str, float]:
        est: dict[str, float] = {}
        uncovered: set[str] = set()  # blobs that some saver uses outside a weight gradient
        for key, info in self._saved.items():
            module = key.rsplit(":", 1)[0]
            target = self._alias.get(key, key)
            calls = self._grad_sq.get(module)
            if not calls or module not in self._fan_in or info.get("gated"):
                uncovered.add(target)
                continue
            if info["codec"] == "raw" or info["groups"] == 0:
                continue
            numel = int(math.prod(info["shape"]))
            c = online_sensitivity(info["sum_sq_ranges"], numel, self._comp.group_size,
                                   sum(calls) / len(calls), self._fan_in[module])
            est[target] = est.get(target, 0.0) + c
        return {k: v for k, v in est.items() if k not in uncovered}

    # ---- reference estimator -------------------------------------------------------------

    def _reference_estimates(self) -> dict[str, float]:
        closure = self.closure or self._replay_closure()
        if closure is None:
            raise RuntimeError(
                "gact.Compressor: estimator='reference' needs a closure: set comp.policy.reference_closure "
                "or pass estimator=gact.policy.Reference(closure)")
        keys = [k for k, i in self._saved.items() if k not in self._alias and i["codec"] != "raw"]
        params = [p for p in self._comp.model.parameters() if p.requires_grad] if self._comp.model is not None else []
        saved_grads = [p.grad for p in params]
        seed0 = self._comp.seed
        est: dict[str, float] = {}
        try:
            for key in keys:
                g = []
                for bits, seed in ((1, seed0), (1, seed0 + 1), (8, seed0 + 2)):
                    g.append(self._probe(params, {key: bits}, seed % 2**64, closure))
                d01 = float((g[0] - g[1]).pow(2).sum())
                d02 = float((g[0] - g[2]).pow(2).sum())
                d12 = float((g[1] - g[2]).pow(2).sum())
                est[key] = reference_sensitivity(d01, d02, d12)
        finally:
            self._comp.seed = seed0
            self._override = None
            for p, gr in zip(params, saved_grads):
                p.grad = gr
        return est

    # ---- probe estimator -----------------------------------------------------------------

    def _probe_or_fallback(self) -> dict[str, float]:
        """The probe with the closure given, else replaying the sampled step. When the probe was
        chosen by default and cannot run (no replayable call, or an op whose backward autograd
        cannot differentiate), a warning names why and the online estimator stands in."""
        if self._probe_disabled:
            return self._online_estimates()
        closure = self.closure or self._replay_closure()
        if closure is None:
            why = ("estimator='probe' needs a closure that returns the loss of one forward pass on a small "
                   "batch (pass it to comp.step(closure) or estimator=gact.policy.Probe(closure)); the sampled "
                   "step could not be replayed: the model was called with keyword arguments only, with no "
                   "tensor input, or no output gradient reached it")
            if not self._default_estimator:
                raise RuntimeError(f"gact.Compressor: {why}")
            return self._fall_back(why)
        try:
            return self._probe_estimates(closure)
        except RuntimeError as e:
            if not self._default_estimator:
                raise
            return self._fall_back(f"the probe failed ({e})")

    def _fall_back(self, why: str) -> dict[str, float]:
        warnings.warn(f"gact policy: {why}; using the online estimator from now on", RuntimeWarning, stacklevel=3)
        self._probe_disabled = True
        return self._online_estimates()

    def _capture_replay(self, _model: torch.nn.Module, args: tuple, output: Any) -> None:
        """The sampled step's first forward call: its first probe_samples samples of every input
        and, in backward, of every output's gradient; the probe's default closure replays them."""
        if not self._sampling or self._replay is not None or self._comp._depth == 0:
            return
        if self._override is not None or self._comp._probe is not None:
            return
        tensors = [a for a in _compat.flatten(args) if isinstance(a, torch.Tensor) and a.dim() >= 1]
        outs = [o for o in _compat.flatten(output) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not tensors or not outs:
            return
        n = tensors[0].shape[0]
        k = n if any(o.dim() == 0 or o.shape[0] != n for o in outs) else min(n, self.probe_samples)
        cut = functools.partial(_first_rows, n=n, k=k)
        rec = {"args": _map_tensors(args, cut), "k": k, "grads": [None] * len(outs), "count": len(outs)}
        for i, o in enumerate(outs):
            def grad_hook(g: torch.Tensor, i: int = i) -> None:
                rec["grads"][i] = g[:k].detach().clone() if g.dim() >= 1 else g.detach().clone()
            o.register_hook(grad_hook)
        self._replay = rec

    def _replay_closure(self) -> Callable[[], Any] | None:
        rec = self._replay
        if rec is None or any(g is None for g in rec["grads"]):
            return None
        model = self._comp.model

        def replay() -> torch.Tensor:
            # Σ out·δ has the sampled step's output gradient δ as its own: the parameter gradients
            # are the step's, on its first k samples (noise in a saved tensor does not change δ).
            outs = [o for o in _compat.flatten(model(*rec["args"])) if isinstance(o, torch.Tensor) and o.requires_grad]
            if len(outs) != rec["count"]:
                raise RuntimeError("the replayed forward returned other outputs than the sampled step")
            return sum((o[: rec["k"]] * g).sum() if o.dim() >= 1 else (o * g).sum()
                       for o, g in zip(outs, rec["grads"]))

        return replay

    def _probe_estimates(self, closure: Callable[[], Any]) -> dict[str, float]:
        comp = self._comp
        params = [p for p in comp.model.parameters() if p.requires_grad] if comp.model is not None else []
        if not params:
            raise RuntimeError("gact.Compressor: estimator='probe' needs a model with parameters that require grad")
        rec = _ProbeRecorder(comp.group_size)
        cuts: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooks = [m.register_forward_pre_hook(functools.partial(_cut_inputs, cuts))
                 for m in comp.model.modules() if next(m.children(), None) is None]
        user_grads = [p.grad for p in params]
        saved_state = comp._key_counts, comp._input_ptrs, comp._step_open
        # the probe keys tensors as a step does, but stores nothing: no store step is opened
        comp._key_counts, comp._input_ptrs, comp._step_open = {}, set(), True
        comp._probe = rec
        try:
            try:
                with torch.enable_grad(), comp, _frozen_norm_stats(comp.model):
                    loss = closure()
            finally:
                comp._probe = None
                comp._key_counts, comp._input_ptrs, comp._step_open = saved_state
                for h in hooks:
                    h.remove()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TypeError("gact.Compressor: the probe closure must return the scalar loss of its forward "
                                f"pass (a tensor that requires grad), not {type(loss).__name__}")
            return self._probe_solve(rec, cuts, params, loss)
        finally:
            for p, g in zip(params, user_grads):
                p.grad = g
            for leaf, _ in cuts:
                leaf.grad = None
            rec.close()

    def _probe_solve(self, rec: "_ProbeRecorder", cuts: list, params: list[torch.Tensor],
                     loss: torch.Tensor) -> dict[str, float]:
        """C_l for every blob of the probe, from one backward with create_graph and
        ``probe_vectors`` double backwards (the method: policy/README.md, "Probe")."""
        for p in params:
            p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # create_graph=True into .grad: the cycle is broken below
            # g(h): the parameter gradients as a function of the saved tensors h. The forward pass
            # was cut at every leaf module's inputs, so that a saved tensor's derivative below is
            # its own (the direct path), not also the forward paths through the activations after
            # it; the cuts are chained here, latest first (a reverse topological order).
            torch.autograd.backward(loss, create_graph=True)
            for leaf, orig in reversed(cuts):
                if leaf.grad is not None and orig.requires_grad:
                    torch.autograd.backward(orig, leaf.grad, create_graph=True)
        g = [p.grad for p in params if p.grad is not None and p.grad.requires_grad]
        comp = self._comp
        alias = self._alias
        want = {k for k in self._saved if k not in alias}
        blob_of = {}  # probe blob -> controller key (a later save of a deduplicated blob: its first key)
        for i, k in enumerate(rec.keys):
            target = alias.get(k, k)
            # Saved outside the model (the loss; "<none>:n" does not name the same tensor in the
            # probe as in the step) or not requiring grad (nothing to differentiate): no estimate,
            # the tensor keeps its bits.
            if target in want and not k.startswith("<none>:") and rec.tensors[i].requires_grad:
                blob_of[i] = target
        c = {k: 0.0 for k in blob_of.values()}
        idx = sorted(blob_of)
        n = self.probe_vectors
        if g and idx:
            gen = torch.Generator().manual_seed((comp.seed * 1_000_003 + self.decisions) % 2**63)
            for r in range(n):
                # Hutchinson: with E[v vᵀ] = I, E_v[(J_lᵀ v)_j²] = ‖J_l[:, j]‖², so
                # Σ_j var_j·(J_lᵀ v)_j² estimates Σ_j var_j‖J_l[:, j]‖² = E‖J_l ε_l‖², the
                # gradient variance tensor l adds at 1 bit, for every tensor from one double backward.
                signs = _random_signs(sum(x.numel() for x in g), gen)
                dot, at = 0, 0
                for x in g:
                    v = signs[at:at + x.numel()].view(x.shape).to(x.device, x.dtype)
                    dot = dot + (x * v).sum()
                    at += x.numel()
                us = torch.autograd.grad(dot, [rec.tensors[i] for i in idx], retain_graph=r + 1 < n,
                                         allow_unused=True)
                per: dict[str, torch.Tensor] = {}  # controller key -> Jᵀv over the blob's elements
                var: dict[str, torch.Tensor] = {}
                for i, u in zip(idx, us):
                    if u is None:
                        continue  # the tensor's noise reaches no parameter gradient (max-pool input)
                    # one blob saved under several keys: the same noise enters each use
                    k = blob_of[i]
                    w = u.detach().float().reshape(-1)
                    per[k] = per[k] + w if k in per else w
                    var.setdefault(k, rec.var1[i])
                for k, w in per.items():
                    c[k] += float((w.double().pow(2) * var[k].double()).sum()) / n
        for p in params:
            p.grad = None
        return c

    def _probe(self, params: list[torch.Tensor], override: dict[str, int], seed: int,
               closure: Callable[[], Any]) -> torch.Tensor:
        comp = self._comp
        self._override = override
        comp.seed = seed
        for p in params:
            p.grad = None
        comp._open_step()
        try:
            with torch.enable_grad(), comp, _frozen_norm_stats(comp.model):
                loss = closure()
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()  # the closure returns its loss (one that ran backward itself returns None)
                del loss
        finally:
            comp._discard_step()
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                          for p in params])


class _ProbeSaved:
    """What autograd holds for a saved tensor during a probe: the tensor itself (uncompressed),
    so that a double backward reaches it through the saved-variable edge."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def probe_unpack(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("gact: a probe's saved tensor was used after the probe ended")
        return self.tensor


class _ProbeRecorder:
    """The Compressor's probe mode. Every float tensor it would store is kept as is, once per
    blob (the store's dedup: same storage, offset, shape, strides and version) under the key of
    its first save, with its 1-bit rounding variance computed at save time."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.index: dict[tuple, int] = {}
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.var1: list[torch.Tensor] = []
        self.holders: list[_ProbeSaved] = []

    def pack(self, t: torch.Tensor, key: str, z: torch.Tensor | None = None, std: torch.Tensor | None = None) -> Any:
        """``z``, ``std``: a tensor the store keeps channel-normalized (batch-norm inputs): its
        rounding variance is z's, scaled back by std_c² per channel."""
        if not t.is_floating_point():
            return t if t.grad_fn is None else t.detach()  # masks: stored losslessly, nothing to probe
        ident = (_compat.storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version, t.dtype)
        if ident not in self.index:  # the tensor stays referenced, so its address is not reused
            self.index[ident] = len(self.tensors)
            self.keys.append(key)
            self.tensors.append(t)
            if z is None:
                self.var1.append(rounding_variance_1bit(t, self.group_size))
            else:
                view = (1, -1) + (1,) * (t.dim() - 2)
                var = rounding_variance_1bit(z, self.group_size).view(z.shape) * std.view(view).pow(2)
                self.var1.append(var.reshape(-1))
        h = _ProbeSaved(t)
        self.holders.append(h)
        return h

    def close(self) -> None:
        for h in self.holders:  # break tensor -> grad_fn -> saved holder -> tensor
            h.tensor = None
        self.holders.clear()
        self.tensors.clear()
        self.var1.clear()


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """obj with every tensor in its nested tuples, lists and dicts replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        out = [_map_tensors(o, fn) for o in obj]
        return out if isinstance(obj, list) else tuple(out)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _first_rows(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A detached copy of t's first k rows when its first dimension is the batch (n), else of t."""
    t = t.detach()
    return (t[:k] if t.dim() >= 1 and t.shape[0] == n else t).clone()


class _frozen_norm_stats:
    """Restores every batch-norm running statistic of ``model`` on exit: an estimator's extra
    forward passes must not move them."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.saved = []
        if model is not None:
            for m in model.modules():
                if isinstance(m, torch.nn.modules.batchnorm._NormBase):
                    self.saved += [(b, b.detach().clone()) for b in m.buffers()]

    def __enter__(self) -> "_frozen_norm_stats":
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, v in self.saved:
                b.copy_(v)


def _cut_inputs(cuts: list, _module: torch.nn.Module, inputs: tuple) -> tuple:
    """A probe's forward pre-hook on a leaf module: each float input is replaced by a copy of a
    fresh leaf that requires grad, cutting the graph there (``cuts`` gets (leaf, original);
    an input that did not require grad, like the batch, now does, so that what the module
    saves of it can be differentiated too)."""
    out = []
    for a in inputs:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            leaf = a.detach().requires_grad_()
            cuts.append((leaf, a))
            a = leaf.clone()
        out.append(a)
    return tuple(out)


def _random_signs(n: int, gen: torch.Generator) -> torch.Tensor:
    """n independent ±1 (float32) from 64 random bits per word: much faster than one draw per element."""
    words = torch.randint(-2**63, 2**63 - 1, ((n + 63) // 64, 1), generator=gen, dtype=torch.int64)
    bits = (words >> torch.arange(64, dtype=torch.int64)) & 1
    return bits.reshape(-1)[:n].to(torch.float32).mul_(2.0).sub_(1.0)


def variance_factor(bits: int) -> float:
    return 1.0 / float(2**bits - 1) ** 2


def rounding_variance_1bit(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per element, the variance of 1-bit stochastic rounding within its group of ``group_size``
    consecutive elements (row-major): (x − min_g)(max_g − x). At b bits it is at most this
    times 1/(2^b − 1)², and equal to it in expectation over uniform fractions (policy/README.md)."""
    v = x.detach().reshape(-1).float()
    out = torch.empty_like(v)
    full = v.numel() // group_size * group_size
    for lo, hi, g in ((0, full, group_size), (full, v.numel(), v.numel() - full)):
        if hi > lo:
            blk = v[lo:hi].view(-1, g)
            mn = blk.min(dim=1, keepdim=True).values
            mx = blk.max(dim=1, keepdim=True).values
            out[lo:hi] = ((blk - mn) * (mx - blk)).reshape(-1)
    return out


def _now() -> float:
    import time

    return time.perf_counter()


def _allreduce_mean(est: dict[str, float]) -> dict[str, float]:
    """With torch.distributed initialized: the per-key mean over the ranks that saw the key,
    identical on every rank (keys sorted), so that every rank solves the same problem."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return est
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, est)
    sums: dict[str, list[float]] = {}
    for d in gathered:
        for k, v in d.items():
            sums.setdefault(k, []).append(float(v))
    return {k: math.fsum(v) / len(v) for k, v in sorted(sums.items())}


def make_policy(compressor: Any, budget: float, estimator: Any = None) -> AutoPolicy:
    """The policy a ``Compressor(bits="auto")`` uses (see the module doc). ``adapt_interval``
    comes from the compressor's ``adapt_interval`` attribute when set, else the option."""
    return AutoPolicy(compressor, budget, estimator, adapt_interval=getattr(compressor, "adapt_interval", None))
