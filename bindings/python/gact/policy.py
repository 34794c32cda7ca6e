"""The adaptive bit policy's Python driver: ``gact.Compressor(model, bits="auto", budget=2, estimator=...)``.

The decisions are made by the C++ controller (``_gact.PolicyController``,
policy/controller.hpp): it keeps one record per tensor key, smooths the
sensitivity estimates C_l and solves min Σ C_l/(2^b_l − 1)² under the stored-byte
budget (metadata counted). This module feeds it:

* ``bits_for(key, numel)`` (the pack hook) → ``controller.on_save``: the current
  width of a known key, ``default_bits`` (the widest code width ≤ budget) for an
  unknown one, so a dynamic graph never fails.
* Every ``adapt_interval`` steps (the ``adapt_interval`` option, GACT_ADAPT_INTERVAL)
  one training step is *sampled* (steps 0, N, 2N, ..., and 10, 20, 40, ... below N): the
  estimator gathers its input during that step, and at the following ``comp.step()`` the
  estimates are (with torch.distributed) averaged over ranks, given to the controller and
  the allocation is re-solved. So default bits hold until the end of step 0. With the
  default interval the policy also spaces its regular estimates so that each costs at most
  ``max_overhead`` (1 %) of the training time since the previous estimate (``samples_at``;
  the early ones keep their steps).

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
    tensor does not change δ). Where the model computes each row on its own (a test in
    eval mode) and no batch norm trains, the rows are replayed one per pass
    (``probe_pass_rows``) and the estimates added up, so the probe holds one row's
    activations at a time; under batch norm in training mode, as many rows as fit, at
    about 3x their saved bytes, in what compression saved in the sampled step
    (``probe_memory``, 1.0); where the model mixes rows otherwise, all kept rows.
    While the policy estimates, the host arena returns its whole free segments before it
    reserves new ones. A closure that returns the loss of one forward pass on a
    few samples can be given instead: ``comp.step(closure)`` or
    ``estimator=gact.policy.Probe(closure)``. Chosen by default, the probe falls back to
    the online estimator, with a RuntimeWarning that says why, when it cannot run (a
    model given no tensor among its arguments, or under torch 1.13 called with keyword
    arguments only, an op autograd cannot differentiate twice). Outputs no gradient
    reached (a recurrent model's last hidden state, returned beside its output and
    detached for the next batch) take no part in the replay. The
    estimators' extra forward passes leave batch-norm statistics as they were.

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

import contextlib
import functools
import math
import threading
import warnings
import weakref
from typing import Any, Callable

import torch

import _gact as _C

from . import _compat
from . import saved as _saved

WARMUP_FIRST = 10  # the first early re-estimate (then 20, 40, ... below adapt_interval)
_CODE_WIDTHS = (1, 2, 4, 8)
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# What the probe holds at its peak, in saved bytes of the rows it replays: the rows' saved tensors
# uncompressed, the create-graph backward's graph and the double backward's transients (measured
# with the host arena: 2.6x on mobilenet_v2, 3.6x on resnet50, 8 rows at 96 px)
_PROBE_HOLDS = 3.0
# The fewest values a batch norm's channel is normalized over in a replay that keeps fewer rows than
# the step (a channel's statistics from fewer are too far from the batch's: a 2-row replay of a
# mobilenet_v2 at 1x1 decided widths 1.3x worse than uniform's)
_NORM_VALUES = 16


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


class FixedWidths:
    """``policy=gact.policy.FixedWidths({key: bits, ...}, default=...)``: each listed tensor at its
    width, every other one at ``default`` (32: kept exact). Keys are the Compressor's (module name
    and save index, as in ``stats()["policy"]`` or the stats dump). For measuring what one tensor's
    width does (``gact-bench policy --oracle``, the policy tests) or pinning widths by hand."""

    def __init__(self, widths: dict[str, int], default: int = 32) -> None:
        for k, b in list(widths.items()) + [("default", default)]:
            if isinstance(b, bool) or b not in (1, 2, 4, 8, 32):
                raise ValueError(f"gact.policy.FixedWidths: {k}={b!r} is not one of 1, 2, 4, 8, 32")
        self.widths, self.default = dict(widths), default

    def bits_for(self, key: str, numel: int) -> int:
        return self.widths.get(key, self.default)


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
        adapt_interval: steps between adaptations (the fewest, when ``max_overhead`` is set).
        max_overhead: with the default ``adapt_interval`` (not given, the option at its default value): the
            largest share of training time a re-estimate may take, 0.01; a re-estimate then also
            waits until its predicted cost is at most that share of the training time since the
            previous estimate (see :meth:`samples_at`). None: every ``adapt_interval`` steps.
        reference_closure: the reference estimator's closure (None for online).
    """

    def __init__(self, compressor: Any, budget: float, estimator: Any = None, adapt_interval: int | None = None,
                 ema_weight: float = 0.5, probe_vectors: int = 1, probe_samples: int = 8,
                 max_overhead: float | None = 0.01, probe_pass_rows: int | None = None,
                 probe_memory: float | None = 1.0) -> None:
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
        self.probe_pass_rows = probe_pass_rows  # rows per replayed pass (None: see _replay_passes)
        # the most the probe may hold, as a share of the bytes compression saved in the sampled step
        # (None: no bound); see _rows_that_fit
        self.probe_memory = probe_memory
        self._rows_independent: bool | None = None  # the model's rows apart in eval mode, tested once (_rows_apart)
        self._splittable = True  # no tensor the kept rows share was found in a pass (_scales_with_rows)
        self._probe_numels: dict[str, int] = {}  # key -> elements of the tensor the last probe pass estimated
        self._signs: dict | None = None  # (parameter, vector) -> the probe's signs, while a closure's passes run
        self._norm_values = math.inf  # the fewest values a batch norm's channel had in one row (_norm_hook)
        self._probe_disabled = False
        self._compiled = False  # (a sampled step's forward was seen only while torch.compile traced it)
        self._probe_stage = ""  # how far the last probe got (a failed one: whether its closure ran backward)
        self._fallback_checks = False  # the online estimator standing in for the probe is checked against uniform
        self._probe_closure: Callable[[], Any] | None = None  # the closure the last probe ran (verification)
        self._replay: dict | None = None  # the sampled step's first samples and output gradient
        default_interval = adapt_interval is None and _option_is_default("adapt_interval")
        if adapt_interval is None:
            adapt_interval = int(_C.options_current()["adapt_interval"])
        if isinstance(adapt_interval, bool) or not isinstance(adapt_interval, int) or adapt_interval < 1:
            raise ValueError(f"gact.Compressor: adapt_interval={adapt_interval!r} must be an integer >= 1")
        if max_overhead is not None and not (isinstance(max_overhead, (int, float)) and 0 < max_overhead < 1):
            raise ValueError(f"gact.Compressor: max_overhead={max_overhead!r} must be a share of training time "
                             "in (0, 1), or None")
        self.adapt_interval = adapt_interval
        # An interval the user chose is kept as it is; the default one is also held to max_overhead.
        self.max_overhead = float(max_overhead) if max_overhead is not None and default_interval else None
        self.train_seconds = 0.0  # time between comp.step() calls, estimates left out (the overhead's base)
        self._step_seconds: list[float] = []  # the latest ordinary step times (the estimate's cost in steps)
        self._next_regular = adapt_interval  # the next step a regular (not early) estimate may sample
        self._t_mark = _now()  # the end of the last comp.step() (or the policy's start)
        self._after_estimate: tuple[int, float] | None = None  # (step, cost) of an estimate the last step made
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
        self._normalized: set[str] = set()  # keys of normalization layers' inputs (verified at 1 bit)
        self._min_bits: dict[str, int] = {}  # key -> the narrowest width the store uses for it
        self._uniform = False  # the last decision measured worse than uniform: every key at default_bits
        self.last_check: dict | None = None  # the last decision against uniform, measured
        self._checked_widths: dict[str, int] | None = None  # the widths last_check measured
        self._scratch_owner = 0  # the store owner the estimators' passes count under (_scratch_counters)
        self.verified = 0  # 1-bit widths checked by direct measurement (see _verify_one_bit)
        self.nonfinite_estimates = 0  # estimates and 1-bit measurements left out for not being finite
        self._warned_nonfinite = False
        self._warned_float64 = False
        self._sample_next = False  # sample the next step whatever the interval (defer_first_sample)
        self._skip_step = False  # record nothing until the step ends (defer_first_sample)
        self._set_sampling(True)  # the Compressor is built at step 0: sample it
        online_hooks = estimator == "online" or (estimator == "probe" and self._default_estimator)
        if online_hooks and compressor.model is not None:
            for name, m in compressor.model.named_modules():
                hook = _compat.weak_hook(self, AutoPolicy._forward_hook, name or "<root>", m)
                self._hooks.append(_compat.register_forward_hook(m, hook))
        if estimator in ("probe", "reference") and compressor.model is not None:
            hook = _compat.weak_hook(self, AutoPolicy._capture_replay)
            self._hooks.append(_compat.register_forward_hook(compressor.model, hook, with_kwargs=True))
            for m in compressor.model.modules():
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    self._hooks.append(_compat.register_forward_hook(m, _compat.weak_hook(self, AutoPolicy._norm_hook)))
        # The model holds the hooks, which hold the policy weakly: they go when it does.
        weakref.finalize(self, _compat.remove_handles, self._hooks)

    # ---- the compressor's protocol -------------------------------------------------------

    def bits_for(self, key: str, numel: int) -> int:
        if self._override is not None:
            return self._override.get(key, 32)
        if self._uniform:
            return self.default_bits  # the decision measured worse than uniform (see _check_against_uniform)
        return int(self.controller.bits_for(key))  # an unknown key: default_bits

    @property
    def measuring(self) -> bool:
        """Whether an estimator is measuring the widths it sets (the reference estimator, the checks): the
        Compressor then stores each tensor at exactly the width asked, without its narrowest-width rules."""
        return self._override is not None

    def on_stored(self, key: str, info: dict) -> None:
        if info["dtype"] == "float64" and not self._warned_float64 and self._override is None and \
                math.prod(info["shape"]) > 1:  # (not a Python number torch wrapped: x.mul_(2.0) saves one)
            self._warned_float64 = True
            warnings.warn(f"gact policy: bits='auto' decides for float32, float16 and bfloat16 activations; the float64 "
                          f"ones ('{key}' the first) are stored at the default {self.default_bits} bits, unbiased but "
                          f"not adapted", RuntimeWarning, stacklevel=4)
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
        self.controller.on_save(key, numel, 32 if info["dtype"] == "float32" else 16, int(info.get("min_bits", 1)))
        if info.get("normalized"):
            self._normalized.add(key)
        self._min_bits[key] = int(info.get("min_bits", 1))
        if self._sampling:
            self._saved[key] = dict(info)

    def on_step(self, step: int) -> None:
        t0 = _now()
        took = t0 - self._t_mark  # the user's step since the last comp.step() (no estimate in it)
        self.train_seconds += took
        over = max(0.0, took - _median(self._step_seconds)) if self._step_seconds else 0.0  # over an ordinary step
        # what sampling added to the step itself (the estimators' hooks) counts as the estimate's
        extra = over if self._sampling else 0.0
        if self._after_estimate is not None and not self._sampling and self._step_seconds:
            # the step after an estimate reserves its memory afresh (_lean_host_arena): the estimate's too
            after = over
            self.estimate_seconds += after
            self.train_seconds -= after
            at, cost = self._after_estimate
            if self.max_overhead is not None:
                self._next_regular = max(self._next_regular, at + self.spacing(cost + after))
        elif not self._sampling:
            self._step_seconds = self._step_seconds[-31:] + [took]
        self._after_estimate = None
        if self._sampling:
            with _lean_host_arena() as emptied:
                self._estimate(step)
            self._probe_closure = None
            cost = _now() - t0 + extra
            self.estimate_seconds += cost
            self.train_seconds -= extra
            if self.max_overhead is not None:
                self._next_regular = max(self._next_regular, step + self.spacing(cost))
            self._after_estimate = (step, cost) if emptied else None
        else:
            self.controller.set_step(step)
        self._by_blob.clear()
        sample = self.samples_at(step) or self._sample_next
        if sample and self.max_overhead is not None and step >= self._next_regular:
            self._next_regular = step + self.adapt_interval  # the next regular one, unless spacing pushes it
        self._set_sampling(sample)
        self._sample_next = False
        self._skip_step = False
        self._t_mark = _now()

    def _estimate(self, step: int) -> None:
        """The sampled step's estimates, the decision and its checks."""
        if self.estimator == "online":
            est = self._online_estimates()
        elif self.estimator == "probe":
            est = self._probe_or_fallback()
        else:
            est = self._reference_estimates()
        gathered = _allreduce_mean(est)
        if gathered is not est:
            # (keys another rank saw and this one did not, a block that stochastic depth skipped here, an expert that got
            # no tokens: this rank's decision covers its own tensors, with every rank's mean for them)
            known = self.controller.stats()["tensors"]
            gathered = {k: v for k, v in gathered.items() if k in known}
        est = self._finite(gathered)
        for k in sorted(est):
            if isinstance(est[k], (list, tuple)):  # the probe: the variance at 1, 2, 4, 8 bits
                self.controller.add_estimate_widths(k, list(est[k]))
            else:
                self.controller.add_estimate(k, est[k])
        self.controller.set_step(step)
        if est:
            self.controller.decide()
            self._uniform = False
            if self.estimator == "probe" and self._probe_closure is not None:
                self._checks(self._probe_closure)
            self.decisions += 1

    def _finite(self, est: dict[str, Any]) -> dict[str, Any]:
        """The estimates that are finite. A tensor whose estimate is not (a derivative that is infinite or
        undefined there: the probe's second derivative through a norm of a zero vector, a gradient that
        overflowed) gets none this time: it keeps its earlier estimates, or with none ``default_bits``, as
        the tensors no estimator reaches do (counted as ``unestimated`` in the decision); said once per
        policy."""
        bad = sorted(k for k, v in est.items()
                     if not all(math.isfinite(x) for x in (v if isinstance(v, (list, tuple)) else (v,))))
        if not bad:
            return est
        self.nonfinite_estimates += len(bad)
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(f"gact policy: the {self.estimator} estimate of {len(bad)} tensor(s) is not finite (the first: "
                          f"{bad[0]!r}); they keep their earlier estimates, or {self.default_bits} bits",
                          RuntimeWarning, stacklevel=5)
        return {k: v for k, v in est.items() if k not in bad}

    def spacing(self, cost: float) -> int:
        """The fewest steps after an estimate that cost ``cost`` seconds before the next regular one
        (:func:`spacing_steps` with the median of the latest ordinary steps' times; the largest over
        the ranks with torch.distributed, so that every rank samples the same steps)."""
        if self.max_overhead is None or not self._step_seconds:
            return 0
        return _allreduce_max(spacing_steps(cost, _median(self._step_seconds), self.max_overhead))

    def samples_at(self, step: int) -> bool:
        """Whether step ``step`` is sampled (estimated): every ``adapt_interval`` steps, and before the
        first interval at steps 10, 20, 40, 80, ... (sensitivities move fastest early in training:
        measured at initialization alone they misled a character-level transformer, whose attention
        probabilities went to 1 bit while they sharpened; see policy/README.md). With ``max_overhead``
        (the default interval), a regular estimate comes ``adapt_interval`` steps after the previous
        regular one, or later: not before :meth:`spacing` steps after the last estimate of any kind
        (its cost repaid at ``max_overhead`` of the steps since); the early ones keep their steps."""
        if self.max_overhead is not None:
            if step == 0 or (step >= self._next_regular and (step - self._next_regular) % self.adapt_interval == 0):
                return True
        elif step % self.adapt_interval == 0:
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
        doc = self.controller.stats()
        if self.last_check is not None:
            doc["last_check"] = dict(self.last_check)
        doc["nonfinite_estimates"] = self.nonfinite_estimates
        doc["schedule"] = {"adapt_interval": self.adapt_interval, "max_overhead": self.max_overhead,
                           "next_regular_step": self._next_regular if self.max_overhead is not None else None,
                           "estimate_seconds": self.estimate_seconds, "train_seconds": self.train_seconds,
                           "overhead": self.estimate_seconds / self.train_seconds if self.train_seconds > 0 else None}
        return doc

    @property
    def probe_pass_rows(self) -> int | None:
        """Rows per pass when the probe and its checks replay the sampled step: None (the default) for one
        row per pass where the model's rows are independent of each other and all kept rows in one pass
        otherwise (:meth:`_replay_passes`); a number for that many rows per pass whatever the model (with
        batch norm in training mode, each pass then normalizes over its own rows: an approximation)."""
        return self._probe_pass_rows

    @probe_pass_rows.setter
    def probe_pass_rows(self, rows: int | None) -> None:
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"gact.Compressor: probe_pass_rows={rows!r} must be an integer >= 1, or None")
        self._probe_pass_rows = rows

    @property
    def probe_memory(self) -> float | None:
        """The most the probe may hold when it replays rows that cannot run apart (under batch norm), as a
        share of the bytes compression saved in the sampled step: 1.0 (the default) keeps an estimate's
        peak near the uncompressed step's; None replays ``probe_samples`` rows whatever they hold
        (:meth:`_rows_that_fit`)."""
        return self._probe_memory

    @probe_memory.setter
    def probe_memory(self, share: float | None) -> None:
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share < math.inf):
            raise ValueError(f"gact.Compressor: probe_memory={share!r} must be a positive number, or None")
        self._probe_memory = share

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
        if not self._sampling or self._override is not None or self._comp._depth == 0 or self._comp._probe is not None:
            return  # the user's sampled step only, not the estimators' own passes
        if isinstance(output, torch.Tensor) and output.requires_grad:
            fan_in = _fan_in(m)
            if fan_in is None:
                return
            self._fan_in[name] = fan_in
            slot = self._grad_sq.setdefault(name, [])
            slot.append(0.0)
            i = len(slot) - 1

            def grad_hook(g: torch.Tensor) -> None:
                # no float64 copy of g (twice the size of the layer's output, on the user's step); a
                # float16 gradient (scaled by AMP's loss scale) is summed in float32, where it cannot overflow
                # (float64 as it is: vector_norm refuses to narrow it)
                g = g.detach()
                slot[i] += float(torch.linalg.vector_norm(g, dtype=None if g.dtype == torch.float64 else
                                                          torch.float32)) ** 2

            output.register_hook(grad_hook)

    def _norm_hook(self, m: torch.nn.Module, _inputs: Any, output: Any) -> None:
        """A batch norm's call in the user's sampled step: the values a channel has in one row (see
        _rows_that_fit)."""
        if self._sampling and m.training and self._comp._probe is None and self._override is None \
                and isinstance(output, torch.Tensor) and output.dim() >= 2:
            self._norm_values = min(self._norm_values, math.prod(output.shape[2:]))

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

    # ---- verification of 1-bit normalization inputs ----------------------------------------

    def _checks(self, closure: Callable[[], Any]) -> None:
        """The 1-bit verification and the check against uniform. Standing in for a failed probe, a check
        that fails says so once and the online estimator's decisions go unchecked from then on."""
        try:
            self._verify_one_bit(closure)
            self._check_against_uniform(closure)
        except RuntimeError as e:
            if not self._probe_disabled:
                raise
            self._fallback_checks = False
            self._uniform = False
            warnings.warn(f"gact policy: the online estimator's decision cannot be measured against uniform ({e}); "
                          "using it unchecked from now on", RuntimeWarning, stacklevel=5)

    def _verify_one_bit(self, closure: Callable[[], Any], rounds: int = 3) -> None:
        """Measure, rather than trust, the variance of each normalization input the solver put at 1 bit.

        A normalization's backward is quadratic in its saved input (x̂·mean(δ·x̂)); the probe's
        derivatives are its first-order part, exact at 2 bits and more but not at 1 bit, where the
        second-order term can dominate (resnet18 at batch 8: a batch-norm input's 1-bit variance 3.5x
        the probe's). So each such tensor at 1 bit gets a direct measurement (two runs of the closure
        with only it quantized); a variance above the probe's replaces it, and the solve is redone,
        for up to ``rounds`` rounds."""
        checked: set[str] = set()
        params = [p for p in self._comp.model.parameters() if p.requires_grad] if self._comp.model is not None else []
        for _ in range(rounds):
            todo = [k for k in sorted(self._normalized) if k not in checked and self.controller.bits_for(k) == 1]
            if not todo or not params:
                return
            raised = False
            measured = {}
            for key in todo:
                checked.add(key)
                measured[key] = self._measure(params, key, closure)
                self.verified += 1
            measured = _allreduce_mean(measured)  # with several ranks: the same records on every rank
            tensors = self.stats()["tensors"]
            for key in todo:
                record = tensors.get(key) or {}
                predicted = (record.get("variance") or [record.get("C") or 0.0])[0]
                if not math.isfinite(measured[key]):
                    # (no finite variance to raise it to: the check against uniform measures the decision)
                    self.nonfinite_estimates += 1
                    continue
                if measured[key] > predicted:
                    self.controller.raise_variance(key, 1, measured[key])
                    raised = True
            if not raised:
                return
            self.controller.decide()

    def _check_against_uniform(self, closure: Callable[[], Any], pairs: int = 1) -> None:
        """Measure the decision against uniform ``default_bits`` before using it: the closure's gradient
        variance with the policy's tensors at the decided widths, and at uniform's (every other tensor
        exact in both), from ``pairs`` pairs of runs with fresh rounding noise each (the squared
        difference of a pair's gradients is twice the variance in expectation). A decision that measures worse is not used until the next one:
        every tensor then gets ``default_bits``, as with uniform storage. Whatever the estimators got wrong
        (a term their model lacks), the policy is then not worse than uniform on the sampled batch. The
        squared error of a whole gradient is a sum over many parameters and varies little from run to run
        (resnet18: 1 % between seeds), so one pair per arm is enough. A decision with the same widths as
        the last one measured keeps that verdict without measuring again."""
        params = [p for p in self._comp.model.parameters() if p.requires_grad] if self._comp.model is not None else []
        tensors = self.controller.stats()["tensors"]
        keys = [k for k, r in tensors.items() if r["active"] and r["decided"]]
        if not params or not keys:
            return
        auto = {k: int(tensors[k]["bits"]) for k in keys}
        uniform = {k: max(self.default_bits, self._min_bits.get(k, 1)) for k in keys}
        if auto == uniform:
            self.last_check = {"step": self.controller.step(), "same_as_uniform": True}
            self._uniform = False
            return
        if self.last_check is not None and self._checked_widths == auto:
            self._uniform = self.last_check.get("used") == "uniform"
            return
        var = {}
        with self._extra_runs(params) as seed0:
            for name, widths in (("auto", auto), ("uniform", uniform)):
                var[name] = sum(self._pair_variance(params, widths, (seed0 + 211 + 2 * i, seed0 + 212 + 2 * i), closure)
                                for i in range(pairs)) / pairs
        var = _allreduce_mean(var)  # with several ranks: one verdict for all
        # (a measurement that is not finite loses: NaN compares false)
        self._uniform = not (var["auto"] <= var["uniform"] or
                             (math.isfinite(var["auto"]) and not math.isfinite(var["uniform"])))
        self._checked_widths = auto
        self.last_check = {"step": self.controller.step(), "variance_auto": var["auto"],
                           "variance_uniform": var["uniform"], "used": "uniform" if self._uniform else "auto"}
        if self._uniform:
            warnings.warn(f"gact policy: the decision at step {self.controller.step()} measured a gradient variance "
                          f"{var['auto']:.4g} against uniform {self.default_bits} bits' {var['uniform']:.4g} on the "
                          f"sampled batch; using uniform {self.default_bits} bits until the next estimate",
                          RuntimeWarning, stacklevel=6)

    def _measure(self, params: list[torch.Tensor], key: str, closure: Callable[[], Any]) -> float:
        """One tensor's 1-bit gradient variance, measured: two runs with only it quantized."""
        with self._extra_runs(params) as seed0:
            return self._pair_variance(params, {key: 1}, (seed0 + 101, seed0 + 102), closure)

    @contextlib.contextmanager
    def _scratch_counters(self) -> Any:
        """The estimators' own passes count in a store owner of their own, not in the Compressor's
        statistics (``comp.stats()["store"]``: what the user's steps saved). The process totals
        (``store_process``, the dump's ``store``) include them."""
        comp = self._comp
        if self._scratch_owner == 0:
            self._scratch_owner = _C.store_new_owner()
            weakref.finalize(self, _C.store_drop_owner, self._scratch_owner)
        owner, comp._owner = comp._owner, self._scratch_owner
        try:
            yield
        finally:
            comp._owner = owner

    @contextlib.contextmanager
    def _extra_runs(self, params: list[torch.Tensor]) -> Any:
        """Around an estimator's extra runs of the closure: yields the Compressor's seed, and restores it,
        the parameters' gradients and the Compressor's widths (no override) afterwards."""
        seed0 = self._comp.seed
        saved_grads = [p.grad for p in params]
        try:
            yield seed0
        finally:
            self._comp.seed = seed0
            self._override = None
            for p, gr in zip(params, saved_grads):
                p.grad = gr

    # ---- reference estimator -------------------------------------------------------------

    def _reference_estimates(self) -> dict[str, float]:
        closure = self.closure or self._replay_closure()
        if closure is None:
            raise RuntimeError(
                "gact.Compressor: estimator='reference' needs a closure: set comp.policy.reference_closure "
                "or pass estimator=gact.policy.Reference(closure)")
        keys = [k for k, i in self._saved.items() if k not in self._alias and i["codec"] != "raw"]
        params = [p for p in self._comp.model.parameters() if p.requires_grad] if self._comp.model is not None else []
        est: dict[str, float] = {}
        with self._extra_runs(params) as seed0:
            for key in keys:
                g = []
                for bits, seed in ((1, seed0), (1, seed0 + 1), (8, seed0 + 2)):
                    g.append(self._probe(params, {key: bits}, seed % 2**64, closure))
                d01 = float((g[0] - g[1]).pow(2).sum())
                d02 = float((g[0] - g[2]).pow(2).sum())
                d12 = float((g[1] - g[2]).pow(2).sum())
                est[key] = reference_sensitivity(d01, d02, d12)
        return est

    # ---- probe estimator -----------------------------------------------------------------

    def _probe_or_fallback(self) -> dict[str, Any]:
        """The probe with the closure given, else replaying the sampled step. When the probe was
        chosen by default and cannot run (no replayable call, or an op whose backward autograd
        cannot differentiate), a warning names why and the online estimator stands in; its decisions
        are then measured against uniform as the probe's are, by the same closure's first-order runs,
        whenever it can be replayed and ran forward and backward in the failed probe (it failed in the
        double backward)."""
        if self._probe_disabled:
            # the checks replay the kept rows together: no pass of this probe showed that they may run apart
            self._probe_closure = (self.closure or self._replay_closure()) if self._fallback_checks else None
            return self._online_estimates()
        closure = self.closure or self._replay_passes()
        if closure is None and self._compiled:
            why = ("the model runs under torch.compile, whose compiled forward the probe cannot replay (each replay "
                   "would recompile it); pass comp.step(closure) with a closure over an uncompiled forward for "
                   "the probe")
            if not self._default_estimator:
                raise RuntimeError(f"gact.Compressor: {why}")
            return self._fall_back(why)
        if closure is None:
            why = ("estimator='probe' needs a closure that returns the loss of one forward pass on a small "
                   "batch (pass it to comp.step(closure) or estimator=gact.policy.Probe(closure)); the sampled "
                   "step could not be replayed: no tensor was among the model's arguments (keyword arguments "
                   "count only under torch 2.x), or no output gradient reached it")
            if not self._default_estimator:
                raise RuntimeError(f"gact.Compressor: {why}")
            return self._fall_back(why)
        try:
            est = self._probe_estimates(closure)
            if est is None:  # found in its first pass: a tensor the rows share; together, then
                closure = self._replay_passes()
                est = self._probe_estimates(closure)
            self._probe_closure = closure
            return est
        except Exception as e:
            # (gact's replay of the sampled step may meet anything in the user's forward: training goes on without
            # it; the user's own closure raises as it would without gact)
            if not self._default_estimator or (self.closure is not None and not isinstance(e, RuntimeError)):
                raise
            est = self._fall_back(f"the probe failed ({type(e).__name__}: {e})")
            # an op with no double backward: the closure itself ran forward and backward, so the checks can run
            self._fallback_checks = self._probe_stage == "double backward"
            self._probe_closure = closure if self._fallback_checks else None
            return est

    def _fall_back(self, why: str) -> dict[str, Any]:
        warnings.warn(f"gact policy: {why}; using the online estimator from now on", RuntimeWarning, stacklevel=6)
        self._probe_disabled = True
        return self._online_estimates()

    def _capture_replay(self, _model: torch.nn.Module, args: tuple, output: Any, kwargs: dict | None = None) -> None:
        """The sampled step's first forward call: its first probe_samples samples of every input, positional and
        keyword (``kwargs``; None on torch 1.13, whose hooks are not given them: README), and, in backward, of every
        output's gradient; the probe's default closure replays them."""
        if not self._sampling or self._replay is not None or self._comp._depth == 0:
            return
        if self._override is not None or self._comp._probe is not None:
            return
        if _compat.is_compiling():
            # (torch.compile traces the model, its hooks included: the call seen here is the trace's, not the step's;
            # the probe cannot replay a compiled model without recompiling it for every pass)
            self._compiled = True
            return
        call = (tuple(args), dict(kwargs or {}))  # (replayed as model(*call[0], **call[1]))
        tensors = [a for a in _compat.flatten(call) if isinstance(a, torch.Tensor) and a.dim() >= 1]
        outs = [o for o in _compat.flatten(output) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not tensors or not outs:
            return
        n = tensors[0].shape[0]
        # every output has the batch's rows; and no input is a structure whose tensors' rows are not the batch's
        # alone (a PackedSequence's data and its batch sizes: replayed whole)
        rows = not any(o.dim() == 0 or o.shape[0] != n for o in outs) and not _has_packed_sequence(call)
        k = min(n, self.probe_samples) if rows else n
        sliced: set[int] = set()  # id() of the kept tensors that are rows of the batch (cut again per pass)

        def cut(t: torch.Tensor) -> torch.Tensor:
            c = _first_rows(t, n, k)
            if t.dim() >= 1 and t.shape[0] == n:
                sliced.add(id(c))
            return c

        rec = {"args": _map_tensors(call, cut), "n": n, "k": k, "rows": rows, "sliced": sliced,
               "grads": [None] * len(outs), "count": len(outs)}
        for i, o in enumerate(outs):
            def grad_hook(g: torch.Tensor | None, i: int = i) -> None:
                if g is None:  # (an output of a node whose other outputs the loss reads: chunk's, split's)
                    return
                rec["grads"][i] = g[:k].detach().clone() if g.dim() >= 1 else g.detach().clone()
            o.register_hook(grad_hook)
        self._replay = rec

    def _replay_closure(self, lo: int = 0, hi: int | None = None) -> Callable[[], Any] | None:
        """The sampled step replayed on its kept rows ``lo:hi`` (all by default), or None when nothing
        was kept (or no output's gradient came)."""
        rec = self._replay
        if rec is None or all(g is None for g in rec["grads"]):
            return None
        model = self._comp.model
        k = rec["k"]
        hi = k if hi is None else hi
        whole = lo == 0 and hi == k
        args = rec["args"] if whole else _kept_rows(rec, lo, hi)
        # (an output whose gradient never came, once another's did, took no part in the loss: an RNN's last hidden
        # state, returned beside its output and detached for the next batch; its δ is zero)
        grads = [g if whole or g is None or g.dim() == 0 else g[lo:hi] for g in rec["grads"]]

        def replay() -> torch.Tensor:
            # Σ out·δ has the sampled step's output gradient δ as its own: the parameter gradients
            # are the step's, on its kept samples (noise in a saved tensor does not change δ).
            outs = [o for o in _compat.flatten(model(*args[0], **args[1])) if isinstance(o, torch.Tensor) and
                    o.requires_grad]
            if len(outs) != rec["count"]:
                raise RuntimeError("the replayed forward returned other outputs than the sampled step")
            return sum((o[: hi - lo] * g).sum() if o.dim() >= 1 else (o * g).sum()
                       for o, g in zip(outs, grads) if g is not None)

        replay.row_share = (hi - lo) / rec["n"] if rec["rows"] else 1.0  # type: ignore[attr-defined]
        return replay

    def _replay_passes(self) -> Callable[[], Any] | "_Passes" | None:
        """The replay, in passes of ``probe_pass_rows`` rows each. By default: where the model computes
        each kept row on its own in eval mode (:meth:`_rows_apart`), one row per pass when no batch norm
        trains (the probe and its checks then hold one row's activations at a time, and its estimates
        are the sum over rows), and under batch norm, which joins the rows through its statistics, the
        rows that fit (:meth:`_rows_that_fit`) in one pass; all kept rows in one pass otherwise (a model
        that mixes rows, whose first dimension is time, or whose attention groups several rows together:
        :func:`_groups_span_rows`)."""
        rec = self._replay
        if rec is None or all(g is None for g in rec["grads"]):
            return None
        k = rec["k"]
        per = self.probe_pass_rows
        if per is None:
            if not rec["rows"] or k == 1 or not self._rows_apart():
                return self._replay_closure()
            if _training_norm(self._comp.model):
                return self._replay_closure(0, self._rows_that_fit(k))
            if _groups_span_rows(self._comp.model, self._comp.group_size):
                return self._replay_closure()
            per = 1
        if not rec["rows"] or per >= k or not self._splittable:
            return self._replay_closure()
        return _Passes(self._replay_closure(lo, min(lo + per, k)) for lo in range(0, k, per))

    def _rows_that_fit(self, k: int) -> int:
        """How many of the ``k`` kept rows one pass replays under batch norm in training mode: all of them,
        or as many as fit, at about ``_PROBE_HOLDS`` times their saved bytes, in what compression saved
        in the sampled step (``probe_memory`` times it), so that an estimate does not raise the peak past
        the uncompressed step's; at least enough rows that every batch-norm channel normalizes over
        ``_NORM_VALUES`` values (resnet50 at 96 px, 3x3 at its last: 2 rows). ``probe_memory=None``:
        all ``k``."""
        if self.probe_memory is None or not self._saved:
            return k
        n = self._replay["n"]
        raw = stored = 0
        for key, info in self._saved.items():
            if key in self._alias:
                continue  # deduplicated: its bytes are its first key's
            raw += math.prod(info["shape"]) * (4 if info["dtype"] == "float32" else 2)
            stored += int(info["bytes_stored"])
        if raw <= 0:
            return k
        fit = int(self.probe_memory * max(raw - stored, 0) / (_PROBE_HOLDS * raw / n))
        least = 1 if self._norm_values == math.inf else -(-_NORM_VALUES // max(int(self._norm_values), 1))
        return max(min(k, least), min(k, fit))

    def _rows_apart(self) -> bool:
        """Whether the model, in eval mode (batch norm on its running statistics) and without autograd,
        gives the first and the last kept row alone the outputs they have among all kept rows: each row
        is computed on its own but for batch norm's statistics in training (a model that mixes rows, or
        whose first dimension is time, fails it). Tested once, with every module's mode set directly
        and put back (no ``train()`` override runs)."""
        if self._rows_independent is None:
            model, rec = self._comp.model, self._replay
            k = rec["k"]
            modes = [(m, m.training) for m in model.modules()]
            ok = True
            try:
                for m, _ in modes:
                    m.training = False
                # (gact's own test runs, not the program's: a reentrant checkpoint under no_grad warned that none of
                # its inputs required grad, a warning the program never gave; under -W error the raise failed the
                # test and changed the policy's replay)
                with torch.no_grad(), _frozen_state(model), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    a, kw = rec["args"]
                    full = [o for o in _compat.flatten(model(*a, **kw)) if isinstance(o, torch.Tensor)]
                    for lo in (0, k - 1):
                        a, kw = _kept_rows(rec, lo, lo + 1)
                        alone = [o for o in _compat.flatten(model(*a, **kw)) if isinstance(o, torch.Tensor)]
                        ok = ok and len(full) == len(alone) and all(
                            a.dim() >= 1 and a.shape[0] == k and a[lo:lo + 1].shape == b.shape
                            and torch.allclose(a[lo:lo + 1].float(), b.float(), rtol=1e-3,
                                               atol=1e-4 * float(a.abs().max()) if a.numel() else 0.0)
                            for a, b in zip(full, alone))
            except Exception:  # noqa: BLE001 (a model that cannot run so is not split)
                ok = False
            finally:
                for m, t in modes:
                    m.training = t
            self._rows_independent = ok
        return self._rows_independent

    def _probe_estimates(self, closure: Callable[[], Any], copy_inputs: bool = False) -> dict[str, list[float]]:
        """The probe's estimates, summed over the closure's passes (:class:`_Passes`; the same sign
        vector in each); ``copy_inputs``: every cut gives its module a copy of its leaf, as it does
        again when a module wrote its input in place without saying so by ``inplace=True``."""
        passes = closure if isinstance(closure, _Passes) else [closure]
        self._signs = {} if len(passes) > 1 else None  # each pass's v is the same: drawn once
        try:
            for copies in (copy_inputs, True):
                total: dict[str, list[float]] = {}
                for pc in passes:
                    est = self._probe_once(pc, copies)
                    if est is None:
                        break
                    if len(passes) > 1 and not self._scales_with_rows(pc):
                        self._splittable = False  # the caller replays the rows together (_replay_passes)
                        return None
                    for key, v in est.items():
                        total[key] = [a + b for a, b in zip(total[key], v)] if key in total else list(v)
                else:
                    return total
        finally:
            self._signs = None
        raise AssertionError("unreachable: a probe with copies is not run again")

    def _scales_with_rows(self, closure: Callable[[], Any]) -> bool:
        """Whether every tensor the last probe pass estimated has its rows' share of the step's elements.
        One that does not (made from parameters alone, such as a weight scaled in forward) collects the
        derivatives of all rows: the sum over passes of its squares is not the square of its sum."""
        rows = getattr(closure, "row_share", 1.0) * self._replay["n"]
        for key, numel in self._probe_numels.items():
            info = self._saved.get(key)
            if info is not None and numel * self._replay["n"] != math.prod(info["shape"]) * rows:
                return False
        return True

    def _probe_once(self, closure: Callable[[], Any], copy_inputs: bool) -> dict[str, list[float]] | None:
        self._probe_stage = "forward"
        comp = self._comp
        params = [p for p in comp.model.parameters() if p.requires_grad] if comp.model is not None else []
        if not params:
            raise RuntimeError("gact.Compressor: estimator='probe' needs a model with parameters that require grad")
        rec = _ProbeRecorder(comp.group_size)
        cuts: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooks: list = []
        try:
            for m in comp.model.modules():
                if _cut_here(m):
                    hooks.append(m.register_forward_pre_hook(functools.partial(_cut_inputs, cuts, rec, copy_inputs)))
        except BaseException:
            # (one that could not be hooked: those hooked so far would cut the program's own graph from now on)
            for h in hooks:
                h.remove()
            raise
        user_grads = [p.grad for p in params]
        saved_state = comp._key_counts, comp._input_ptrs, comp._step_open, comp._results
        # the probe keys tensors as a step does, but stores nothing: no store step is opened
        comp._key_counts, comp._input_ptrs, comp._step_open, comp._results = {}, set(), True, {}
        comp._probe = rec
        comp._row_share = getattr(closure, "row_share", 1.0)
        retry = False
        try:
            try:
                with torch.enable_grad(), self._scratch_counters(), comp, _double_backward_ops(comp), \
                        _frozen_state(comp.model), _InnerCuts(cuts, rec, comp.model, copy_inputs):
                    loss = closure()
            except RuntimeError as e:
                if copy_inputs or "leaf Variable that requires grad" not in str(e):
                    raise
                retry = True  # a module wrote its input in place: the caller runs again, with copies
            finally:
                comp._probe = None
                comp._row_share = 1.0
                comp._key_counts, comp._input_ptrs, comp._step_open, comp._results = saved_state
                for h in hooks:
                    h.remove()
            if retry:
                return None
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TypeError("gact.Compressor: the probe closure must return the scalar loss of its forward "
                                f"pass (a tensor that requires grad), not {type(loss).__name__}")
            try:
                return self._probe_solve(rec, cuts, params, loss)
            except RuntimeError as e:
                # a cut's leaf shares its original's version counter: a later in-place write to the
                # original (which a copy would not see) is refused at unpack; again, with copies
                if copy_inputs or "saved for backward was modified by an in-place" not in str(e):
                    raise
                return None
        finally:
            for p, g in zip(params, user_grads):
                p.grad = g
            for leaf, _ in cuts:
                leaf.grad = None
            rec.close()

    def _probe_solve(self, rec: "_ProbeRecorder", cuts: list, params: list[torch.Tensor],
                     loss: torch.Tensor) -> dict[str, list[float]]:
        """For every blob of the probe, the gradient variance it adds at 1, 2, 4 and 8 bits in the
        form the store keeps it in, from one backward with create_graph and ``probe_vectors``
        double backwards (the method: policy/README.md, "Probe")."""
        for p in params:
            p.grad = None
        comp = self._comp
        n = self.probe_vectors
        base = (comp.seed * 1_000_003 + self.decisions) % 2**63
        # Hutchinson: with E[v vᵀ] = I, E_v[(J_lᵀ v)_j²] = ‖J_l[:, j]‖², so
        # Σ_j var_j(b)·(J_lᵀ v)_j² estimates Σ_j var_j(b)‖J_l[:, j]‖² = E‖J_l ε_l(b)‖², the
        # gradient variance tensor l adds at b bits, for every tensor from one double backward.
        # Each v·g is formed as backward hands over a parameter's gradient (v's part for that
        # parameter drawn from a generator of its own, the same for every part of its gradient),
        # and the gradient is dropped at the next one: no parameter-sized set of gradients is ever
        # held, and the double backward meets each parameter's signs just before it uses them.
        dots: list[Any] = [None] * n
        signs = self._signs  # kept across a closure's passes (None: one pass)
        reached: list[torch.Tensor] = []  # the parameter whose gradient backward is storing now

        def on_grad(i: int, p: torch.Tensor, g: torch.Tensor) -> None:
            for q in reached:
                q.grad = None
            reached.clear()
            if g.requires_grad:  # g(h) reaches this parameter
                for r in range(n):
                    s = signs.get((i, r)) if signs is not None else None
                    if s is None:
                        s = _random_signs(g.numel(), _sign_generator(base, i, r)).view(g.shape).to(g.device)
                        if signs is not None:
                            signs[(i, r)] = s
                    t = (g * s).sum()
                    dots[r] = t if dots[r] is None else dots[r] + t
            reached.append(p)

        hooks = [p.register_hook(functools.partial(on_grad, i, p)) for i, p in enumerate(params)]
        self._probe_stage = "backward"
        try:
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
                    leaf.grad = None  # complete and passed on (the graph keeps what its derivative needs)
        finally:
            for h in hooks:
                h.remove()
            for p in params:
                p.grad = None
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
        # the tensors of one key have one size (a later save deduplicated into a first one's blob): one that
        # does not (the step's dedup merged two saves that the replay keeps apart) has no estimate
        size_of: dict[str, int] = {}
        for i in sorted(blob_of):
            if size_of.setdefault(blob_of[i], rec.tensors[i].numel()) != rec.tensors[i].numel() or \
                    any(u.numel() != rec.tensors[i].numel() for u in rec.uses.get(i, ())):
                del blob_of[i]
        c = {k: [0.0] * len(_CODE_WIDTHS) for k in blob_of.values()}
        self._probe_numels = {blob_of[i]: rec.tensors[i].numel() for i in sorted(blob_of, reverse=True)}
        idx = sorted(blob_of)
        if dots[0] is not None and idx:
            self._probe_stage = "double backward"
            # the tensors to differentiate by: each blob's, and the others saved as it (rec.uses), by key
            inputs = [(blob_of[i], i, t) for i in idx for t in [rec.tensors[i], *rec.uses.get(i, ())]]
            expected: dict[str, int] = {}
            first: dict[str, int] = {}  # key -> its first blob (whose stored form the variances use)
            for k, i, _ in inputs:
                expected[k] = expected.get(k, 0) + 1
                first.setdefault(k, i)
            for r in range(n):
                # Each Jᵀv is used as backward computes it (a hook on its tensor) and dropped: they are the
                # size of the activations, and they were all held until the double backward returned.
                partial: dict[str, list] = {}  # key -> [Σ of its tensors' Jᵀv so far, how many]
                stored: list[torch.Tensor] = []  # the tensor whose .grad backward is storing now

                def use(k: str) -> None:
                    w = partial.pop(k)[0]
                    for j, v in enumerate(rec.weighted_variances(first[k], w)):
                        c[k][j] += v / n

                def on_w(k: str, t: torch.Tensor, g: torch.Tensor) -> None:
                    for q in stored:
                        q.grad = None
                    stored.clear()
                    stored.append(t)
                    if g is None:
                        # (torch 2.x calls the hook with no gradient where none reaches the tensor: a recurrent
                        # layer's last step, whose hidden state the loss does not read) a zero Jᵀv adds nothing
                        return
                    # one blob saved under several keys: the same noise enters each use
                    w = g.detach().float().reshape(-1)
                    slot = partial.get(k)
                    if slot is None:
                        partial[k] = [w, 1]
                    else:
                        slot[0] = slot[0] + w
                        slot[1] += 1
                    if partial[k][1] == expected[k]:
                        use(k)

                hooks = [t.register_hook(functools.partial(on_w, k, t)) for k, _, t in inputs]
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # .grad of a non-leaf: set by backward, cleared here
                        torch.autograd.backward(dots[r], inputs=[t for _, _, t in inputs], retain_graph=r + 1 < n)
                        dots[r] = None
                        # a tensor whose noise reaches no parameter gradient (a max-pool input) gets no Jᵀv
                        for k in list(partial):
                            use(k)
                finally:
                    for h in hooks:
                        h.remove()
                    for _, _, t in inputs:
                        t.grad = None
            del inputs
        for p in params:
            p.grad = None
        return c

    def _probe(self, params: list[torch.Tensor], override: dict[str, int], seed: int,
               closure: Callable[[], Any]) -> torch.Tensor:
        return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                          for p, g in zip(params, self._grads(params, override, seed, closure))])

    def _grads(self, params: list[torch.Tensor], override: dict[str, int], seed: int,
               closure: Callable[[], Any], start: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
        """The closure's parameter gradients with the tensors in ``override`` at those widths and every other
        one kept exact, under rounding seed ``seed``: the tensors backward made (no copies). ``start``: gradients
        to add this run's to (in place, by backward's accumulation: they are set as the .grad only once the
        closure has returned, so a closure that zeroes gradients cannot clear them), None for none."""
        comp = self._comp
        self._override = override
        for p in params:
            p.grad = None
        added = False
        passes = closure if isinstance(closure, _Passes) else [closure]
        for i, pc in enumerate(passes):
            # each pass rounds with noise of its own (its tensors have the same keys as the others')
            comp.seed = (seed + 0x9E3779B97F4A7C15 * i) % 2**64
            with self._scratch_counters():
                comp._open_step()
                comp._row_share = getattr(pc, "row_share", 1.0)
                try:
                    with torch.enable_grad(), comp, _frozen_state(comp.model):
                        loss = pc()
                    if isinstance(loss, torch.Tensor) and loss.requires_grad:
                        if start is not None and not added:
                            for p, g in zip(params, start):
                                p.grad = g
                            added = True
                        loss.backward()  # the closure returns its loss (one that ran backward itself returns None)
                        del loss
                finally:
                    comp._row_share = 1.0
                    comp._discard_step()
        grads = [None if p.grad is None else p.grad.detach() for p in params]
        for p in params:
            p.grad = None
        if start is not None and not added:  # the closure ran backward itself: add them now
            grads = [s if g is None else (g if s is None else g + s) for g, s in zip(grads, start)]
        return grads

    def _pair_variance(self, params: list[torch.Tensor], widths: dict[str, int], seeds: tuple[int, int],
                       closure: Callable[[], Any]) -> float:
        """The gradient variance of the closure with ``widths`` (every other tensor exact), from two runs of
        independent rounding noise: E‖g_a − g_b‖² = 2·Var. The second run accumulates into the first's
        gradients negated, in place: one set of parameter-sized gradients is held, not two (two when the
        closure runs backward itself)."""
        a = self._grads(params, widths, seeds[0] % 2**64, closure)
        neg = [None if x is None else x.neg_() for x in a]
        del a
        diff = self._grads(params, widths, seeds[1] % 2**64, closure, start=neg)
        del neg
        d = 0.0
        for x in diff:
            if x is not None:
                d += sum(float(c.double().pow(2).sum()) for c in x.reshape(-1).split(1 << 20))
        return d / 2.0


class _Passes(list):
    """A closure in passes: the replay of the kept rows, a few rows per pass (see
    ``AutoPolicy._replay_passes``). The estimators run every pass and add up what each gives."""


class _ProbeSaved:
    """What autograd holds for a saved tensor during a probe: the tensor itself (uncompressed),
    so that a double backward reaches it through the saved-variable edge."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def probe_unpack(self) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError("gact: a probe's saved tensor was used after the probe ended")
        if self.tensor._version != self.version:
            # what autograd says of a saved tensor changed after it was saved (the probe keeps no copy)
            raise RuntimeError(f"a tensor of shape {list(self.tensor.shape)} saved for backward was modified by an "
                               f"in-place operation (version {self.tensor._version}, saved at {self.version})")
        return self.tensor


class _ProbeRecorder:
    """The Compressor's probe mode. Every float tensor it would store is kept as is, once per
    blob (the store's dedup: same storage, offset, shape, strides and version) under the key of
    its first save, with the form the store would keep it in: plain values, channel-normalized
    (batch-norm inputs: ``z`` and ``std``), or a boundary blob (a clamp's output, such as a ReLU's,
    whose values a later op reads: the store keeps one blob with the clamp's bound exact). From
    the form, :meth:`variances` gives each element's rounding variance at every width exactly."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.index: dict[tuple, int] = {}
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.forms: list[tuple] = []  # per tensor: (z, std, boundary bound or None)
        self.holders: list[_ProbeSaved] = []
        # identity of a clamp's output -> (the bound it clamps to, the tensor): the tensor is held so
        # that its storage is not freed and handed to another tensor of that shape (a dropout's output
        # after an in-place ReLU's copy was taken for the ReLU's output and given a boundary form)
        self.clamps: dict[tuple, tuple[float, torch.Tensor]] = {}
        self.leaves: set[int] = set()  # id() of the cuts' leaves (alive in the cut list while the probe runs)
        self.uses: dict[int, list[torch.Tensor]] = {}  # tensor i -> other tensors saved as the same blob

    @staticmethod
    def _ident(t: torch.Tensor) -> tuple:
        return (_compat.storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t._version, t.dtype)

    def note_clamp(self, t: torch.Tensor, lo: float) -> None:
        """``t`` is the output of a clamp to [lo, ∞) saved for its mask (a ReLU's)."""
        self.clamps[self._ident(t)] = (float(lo), t)

    def copy_clamp(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` is a copy of ``src`` the probe made (a cut): the same clamp's output, if ``src`` is one."""
        noted = self.clamps.get(self._ident(src))
        if noted is not None:
            self.clamps[self._ident(dst)] = (noted[0], dst)

    def pack(self, t: torch.Tensor, key: str, z: torch.Tensor | None = None, std: torch.Tensor | None = None,
             group: int = 0) -> Any:
        """``z``, ``std``: a tensor the store keeps normalized (a normalization layer's input): its
        rounding variance is z's, scaled back by std² (``std`` broadcasts to z's shape). ``group``: the
        store's group of a correlated call's saves (gact.saved.correlation_group), a blob apart from the
        tensor's other saves."""
        if not t.is_floating_point():
            return t if t.grad_fn is None else t.detach()  # masks: stored losslessly, nothing to probe
        ident = self._ident(t) if not group else self._ident(t) + (group,)
        i = self.index.get(ident)
        if i is None:  # the tensor stays referenced, so its address is not reused
            i = self.index[ident] = len(self.tensors)
            self.keys.append(key)
            self.tensors.append(t)
            noted = self.clamps.get(ident) if z is None else None
            self.forms.append((z, std, noted[0] if noted is not None else None))
        elif t is not self.tensors[i] and id(t) in self.leaves and not any(u is t for u in self.uses.get(i, ())):
            # another cut of the blob's tensor (two cuts of one tensor are two leaves sharing its
            # storage): autograd routes the derivative of this save to it, not to the first. (A view
            # with the same identity is not added: the first's derivative already passes through it.)
            self.uses.setdefault(i, []).append(t)
        h = _ProbeSaved(t)
        self.holders.append(h)
        return h

    def weighted_variances(self, i: int, w: torch.Tensor) -> list[float]:
        """Σ_j w_j²·var_j(b) over tensor i's elements at 1, 2, 4 and 8 bits, var_j(b) element j's
        rounding variance in its stored form (``w``: tensor i's shape, or its elements in row-major order)."""
        z, std, lo = self.forms[i]
        x = self.tensors[i] if z is None else z
        w2 = w.detach().double().reshape(x.shape).pow(2)
        if z is None:
            return weighted_rounding_variances(x, w2, self.group_size, boundary=lo)
        # z's rounding variance, scaled back by std² (std broadcasts to z's shape)
        return weighted_rounding_variances(z, w2.mul_(std.double().pow(2)), self.group_size)

    def close(self) -> None:
        for h in self.holders:  # break tensor -> grad_fn -> saved holder -> tensor
            h.tensor = None
        self.holders.clear()
        self.tensors.clear()
        self.forms.clear()
        self.clamps.clear()
        self.leaves.clear()
        self.uses.clear()


@contextlib.contextmanager
def _double_backward_ops(comp: Any) -> Any:
    """Inside ``with comp`` on this thread: its op tracker runs the stand-ins of
    gact.saved.double_backward_substitutes() for functions whose backward autograd cannot differentiate
    (hardsigmoid in torch 1.13: the probe of the mobilenet_v3 family fell back to the online estimator;
    torchvision's roi_align: detection models'), with the same values and saved tensors."""
    tracker = getattr(comp._local, "tracker", None)
    if tracker is None:
        yield
        return
    was = tracker.substitutes
    tracker.substitutes = {**(was or {}), **_saved.double_backward_substitutes()}
    try:
        yield
    finally:
        tracker.substitutes = was


@contextlib.contextmanager
def _lean_host_arena() -> Any:
    """Around an estimate: the host arena (where torch's CPU tensors live by default) returns its whole
    free segments before it reserves a new one, and all of them at the end. The estimators' passes
    request other sizes than the training step's, and each new size took a segment of its own while
    the others sat cached: on resnet50 the probe's double backward reserved 377 MiB for 249 in use.
    What the estimate leaves behind is returned too: the next step's requests, served from the
    leftovers of both patterns, reserved 538 MiB for 397 in use on the word LM (477 from a clean
    arena, 394 for 354 on its first step); it reserves afresh, once per estimate."""
    was = _C.host_release_on_miss(True)
    try:
        yield not was  # whether the arena is emptied at the end (the next step then reserves afresh)
    finally:
        _C.host_release_on_miss(was)
        if not was:
            _C.host_empty_cache()


def _groups_span_rows(model: torch.nn.Module, group_size: int) -> bool:
    """Whether a multi-head attention of ``model`` lays several rows into one quantization group: it computes
    time first inside ((L, B, E), (B·H, L, E/H) with L outermost in memory), so where its width E is not a
    multiple of ``group_size`` a group holds parts of several rows, and a pass over fewer rows groups
    its tensors otherwise than the step (the output projection's input, width 32: 0.56-0.77 of its
    measured variance in one-row passes, 0.98-1.03 with the rows together)."""
    return any(isinstance(m, torch.nn.MultiheadAttention) and m.embed_dim % group_size for m in model.modules())


def _training_norm(model: torch.nn.Module) -> bool:
    """Whether a batch norm of ``model`` is in training mode (its statistics join the batch's rows)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """obj with every tensor in its nested tuples, lists and dicts replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        out = [_map_tensors(o, fn) for o in obj]
        if isinstance(obj, list):
            return out
        if type(obj) is tuple:
            return tuple(out)
        if hasattr(obj, "_fields"):  # a named tuple (a PackedSequence): rebuilt as its own type
            return type(obj)(*out)
        try:
            return type(obj)(out)
        except Exception:
            return tuple(out)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _has_packed_sequence(obj: Any) -> bool:
    """Whether a PackedSequence (whose tensors' rows are not the batch's) lies in obj's nested tuples, lists and
    dicts."""
    if isinstance(obj, torch.nn.utils.rnn.PackedSequence):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_packed_sequence(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_packed_sequence(v) for v in obj.values())
    return False


def _kept_rows(rec: dict, lo: int, hi: int) -> Any:
    """The replay's arguments, (positional, keyword), with rows ``lo:hi`` of each tensor kept as rows of the batch (the
    others whole)."""
    return _map_tensors(rec["args"], lambda t: t[lo:hi] if id(t) in rec["sliced"] else t)


def _first_rows(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A detached copy of t's first k rows when its first dimension is the batch (n), else of t; a leaf that
    requires grad if t did (a reentrant checkpoint of the model's input builds no graph from one that does not)."""
    c = t.detach()
    c = (c[:k] if c.dim() >= 1 and c.shape[0] == n else c).clone()
    return c.requires_grad_() if t.requires_grad and c.is_floating_point() else c


class _frozen_state:
    """Restores, on exit, every buffer of ``model`` (batch norm's running statistics, spectral norm's power
    iteration vectors, a counter a module keeps) and the random number generators (CPU, and each CUDA device
    in use): an estimator's extra forward passes must not move the training run's state, so that its dropout
    masks, shuffles and buffers are the ones it would have without the estimate. (What no state holds, a
    Python attribute a forward changes or a hook's side effect, it cannot undo.)"""

    def __init__(self, model: torch.nn.Module | None) -> None:
        # (module, name, the buffer, its values): a forward may change a buffer in place (`+=`) or replace it
        # (`self.n = self.n + 1`, which Module.__setattr__ puts in _buffers): the buffer itself goes back, with its
        # values
        self.saved = []
        if model is not None:
            self.saved = [(m, n, b, b.detach().clone()) for m in model.modules()
                          for n, b in m._buffers.items() if b is not None]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and \
            torch.cuda.is_initialized() else None

    def __enter__(self) -> "_frozen_state":
        return self

    def __exit__(self, *exc: Any) -> None:
        # through .data: the restore must not bump the buffers' version counters, which the passes'
        # graphs (batch norm saves its running statistics) check before their backward
        with torch.no_grad():
            for m, n, b, v in self.saved:
                if m._buffers.get(n) is not b:
                    m._buffers[n] = b
                b.data.copy_(v)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


# Modules the probe does not cut at: they save nothing a derivative passes through (a mask, indices, a
# shape), so no later saved tensor's derivative can leak through them into an earlier one's, and the cut
# would only hold their input twice (an in-place ReLU's input was copied: one activation per ReLU).
_NO_CUT = tuple(getattr(torch.nn, n) for n in (
    "ReLU", "ReLU6", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "MaxPool1d", "MaxPool2d",
    "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "AvgPool1d", "AvgPool2d",
    "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "Identity", "Flatten", "Unflatten")
    if hasattr(torch.nn, n))


def _cut_here(m: torch.nn.Module) -> bool:
    """Whether the probe cuts the graph at a module's inputs: a leaf module, or one that uses parameters of
    its own directly (multi-head attention applies its projections functionally, without calling its
    children): without the cut, the tensors it saves would collect the derivatives of every later
    tensor through the forward graph (a layer's attention leaked into the previous layer's norm input).
    Not at the modules of ``_NO_CUT``, whose saves carry no derivative, nor inside a scripted module (torch.jit.script:
    it takes no hooks; its saves are kept exact, and the probe measures nothing there)."""
    if isinstance(m, _NO_CUT) or isinstance(m, torch.jit.ScriptModule):
        return False
    return next(m.children(), None) is None or next(m.parameters(recurse=False), None) is not None


def _cut_inputs(cuts: list, rec: "_ProbeRecorder", copy: bool, module: torch.nn.Module, inputs: tuple) -> tuple:
    """A probe's forward pre-hook on a leaf module: each float input is replaced by a fresh leaf
    that requires grad and shares its storage, cutting the graph there (``cuts`` gets (leaf,
    original); an input that did not require grad, like the batch, now does, so that what the
    module saves of it can be differentiated too). No copy: the leaf has the original's identity,
    so a tensor saved both before the cut and after it (a clamp's output read by the next
    convolution) is one record in the probe, as it is one blob in the store (its other saves are
    its uses, ``_ProbeRecorder.uses``), and the replayed rows' activations are not held twice.
    A module that writes its input in place (``inplace=True``), and every module when ``copy``
    is set (the retry after a module wrote its input in place without saying so), gets a copy of
    the leaf instead, marked as a clamp's output if the original is one. A tensor passed several
    times gets one leaf (self-attention passes its input as query, key and value, and tests them
    for identity)."""
    out = []
    copies: dict[int, torch.Tensor] = {}  # one leaf per tensor: a module may test its inputs for identity
    copy = copy or getattr(module, "inplace", False) is True
    for a in inputs:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            c = copies.get(id(a))
            if c is None:
                leaf = a.detach().requires_grad_()
                cuts.append((leaf, _Anchor.apply(a) if a.requires_grad else a))  # (its edge now: see _Anchor)
                rec.leaves.add(id(leaf))
                c = leaf
                if copy:  # a module that writes its input (ReLU(inplace=True)) writes a copy: a leaf refuses it
                    c = leaf.clone()
                    rec.copy_clamp(a, c)
                copies[id(a)] = c
            a = c
        out.append(a)
    return tuple(out)


# Inside torch.nn.MultiheadAttention the probe also cuts at the inputs of these functions (looked up by
# the attention's code at call time): its projections, products and softmax run as functional calls
# within one module, so that without these cuts a saved q, k, v or attention matrix collected the
# derivatives of the tensors saved after it through the forward graph (measured on a 3-layer encoder:
# v 30-60x its variance, q and k 2-4x, the projection's input 3x). Only there: cut everywhere, a 3-d
# matmul's saved view of its cut input, an in-place write after a cut, or a batch that requires grad
# each misdirected derivatives (measured 0.05-8.8x), and attention blocks written by hand with @ and
# softmax stay attributed jointly (see policy/README.md).
_INNER_CUT_FUNCS = ((torch, "bmm"), (torch, "baddbmm"), (torch, "matmul"), (torch.nn.functional, "linear"),
                    (torch.nn.functional, "softmax"), (torch.nn.functional, "scaled_dot_product_attention"))
_inner = threading.local()  # per thread: the stack of _InnerCuts active in it
_inner_lock = threading.Lock()
_inner_installed: list = []  # [(owner, name, original)] while any thread runs a probe's forward
_inner_users = [0]


def _inner_cut_wrapper(orig: Callable) -> Callable:
    # inside the attention the op tracker sees only multi_head_attention_forward, so the stand-in that a
    # double backward needs for torch 2.x's fused attention is applied here
    # (its output saved as a leaf of the probe's: every other tensor it saves is a cut)
    inner = _saved.DOUBLE_BACKWARD.get(orig)

    @functools.wraps(orig)
    def cutting(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_inner, "stack", None)
        if not stack or not stack[-1].depth:
            return orig(*args, **kwargs)
        ic = stack[-1]
        args, kwargs = [ic.cut(a) for a in args], {k: ic.cut(v) for k, v in kwargs.items()}
        if inner is None:
            return orig(*args, **kwargs)
        return inner(*args, **kwargs, leaf_output=ic.output_leaf)
    return cutting


class _Anchor(torch.autograd.Function):
    """An alias of a tensor with the tensor's graph edge as it is now: a cut chained back through it is
    unaffected by a later in-place write to the tensor, and an in-place write to the alias is allowed."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return a.detach()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class _InnerCuts:
    """While a probe's forward runs: inside each ``torch.nn.MultiheadAttention`` call (``depth`` > 0, counted
    by the module's hooks in the probing thread only), every plain float tensor argument with a forward
    graph that a function of ``_INNER_CUT_FUNCS`` receives (not a parameter's view) is replaced by a
    fresh leaf sharing its storage (a copy of it with ``copy``: the probe's retry after an in-place
    write), appended to ``cuts`` with an anchor of the original; and the attention's outputs are cut too
    (the weights it returns are its softmax's saved output: read by code outside any module, that code's
    saves leaked into its estimate, 2.5x), returned as aliases that accept in-place writes. The
    functions are wrapped only while some thread runs a probe's forward, and act only in that thread;
    others pass straight through. (Meanwhile ``torch.matmul`` and the others are Python functions: a
    TorchScript compilation started then, or a mode comparing ``func is torch.matmul``, sees the
    wrapper. An exception inside the attention that the model catches leaves the depth raised for the
    rest of this forward, as it leaves the Compressor's module stack.)"""

    def __init__(self, cuts: list, rec: "_ProbeRecorder", model: torch.nn.Module, copy: bool = False) -> None:
        self.cuts, self.rec, self.copy, self.depth = cuts, rec, copy, 0
        self.made: dict[int, tuple] = {}  # original's id -> (original, its version, its cut)
        self.leaves: list[torch.Tensor] = []  # output_leaf's (alive while the probe runs: rec.leaves holds ids)
        self.mods = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
        # a parameter's views (cross-attention splits its packed projection weight) are not activations:
        # cut, they would be saved and keyed as one, and every later key of the module would move
        self.params = {_compat.storage_base(p) for p in model.parameters()} if self.mods else set()
        self.hooks: list = []
        self.thread = threading.get_ident()

    def cut(self, a: Any) -> Any:
        if type(a) is not torch.Tensor or not a.is_floating_point() or not a.requires_grad or a.grad_fn is None \
                or _compat.storage_base(a) in self.params \
                or (a._base is not None and a._base.is_leaf and a._base.requires_grad
                    and id(a._base) not in self.rec.leaves):
            # a parameter or a view of one (or of a batch that requires grad, which the Compressor keeps
            # as it keeps parameters), a cut already, a tensor subclass, or nothing to differentiate
            return a
        hit = self.made.get(id(a))
        if hit is not None and hit[0] is a and hit[1] == a._version:
            return hit[2]
        leaf = a.detach().requires_grad_()
        self.cuts.append((leaf, _Anchor.apply(a)))
        self.rec.leaves.add(id(leaf))
        c = leaf.clone() if self.copy else leaf
        self.rec.copy_clamp(a, c)
        self.made[id(a)] = (a, a._version, c)
        return c

    def output_leaf(self, t: torch.Tensor) -> torch.Tensor:
        """A leaf sharing ``t``'s storage, for a stand-in to save in place of its own output ``t``."""
        leaf = t.detach().requires_grad_()
        self.rec.leaves.add(id(leaf))
        self.leaves.append(leaf)
        return leaf

    def _enter_call(self, *_: Any) -> None:
        if threading.get_ident() == self.thread:
            self.depth += 1

    def _leave_call(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if threading.get_ident() != self.thread or not self.depth:
            return None
        self.depth -= 1
        if self.depth:
            return None

        def out(t: Any) -> Any:
            c = self.cut(t)
            if c is t or self.copy:
                return c
            alias = _Anchor.apply(c)  # not the leaf itself: the caller may write it in place
            self.rec.leaves.add(id(alias))
            self.made[id(t)] = (t, t._version, alias)
            return alias

        return _map_tensors(output, out)

    def __enter__(self) -> "_InnerCuts":
        if not self.mods:
            return self
        for m in self.mods:
            self.hooks.append(m.register_forward_pre_hook(self._enter_call))
            self.hooks.append(m.register_forward_hook(self._leave_call))
        with _inner_lock:
            if not _inner_users[0]:
                for owner, name in _INNER_CUT_FUNCS:
                    orig = getattr(owner, name, None)
                    if orig is not None:
                        _inner_installed.append((owner, name, orig))
                        setattr(owner, name, _inner_cut_wrapper(orig))
            _inner_users[0] += 1
        if not hasattr(_inner, "stack"):
            _inner.stack = []
        _inner.stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.mods:
            return
        _inner.stack.remove(self)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.made.clear()
        with _inner_lock:
            _inner_users[0] -= 1
            if not _inner_users[0]:
                for owner, name, orig in reversed(_inner_installed):
                    setattr(owner, name, orig)
                _inner_installed.clear()


def _sign_generator(base: int, i: int, r: int) -> torch.Generator:
    """The generator of the probe's vector ``r``'s signs for parameter ``i`` (``base``: the estimate's seed)."""
    return torch.Generator().manual_seed((base + 0x9E3779B97F4A7C15 * (i + 1) + 0xBF58476D1CE4E5B9 * (r + 1)) % 2**63)


def _random_signs(n: int, gen: torch.Generator) -> torch.Tensor:
    """n independent ±1 (int8) from 8 random bits per byte drawn: a byte per sign, so that the
    probe's signs cost a quarter of the parameters they multiply (they stay referenced by the
    graph of v·g until its double backward)."""
    drawn = torch.randint(0, 256, ((n + 7) // 8, 1), generator=gen, dtype=torch.uint8)
    bits = (drawn >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1)[:n].to(torch.int8).mul_(2).sub_(1)


def _memory_order(t: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """A dense tensor's elements in memory order (the order the store groups them in) and the
    permutation that lays them out so; None when that is the row-major order."""
    if t.dim() < 2 or t.is_contiguous() or not _compat.is_dense(t):
        return t.reshape(-1), None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return t.permute(order).reshape(-1), order


def weighted_rounding_variances(x: torch.Tensor, w2: torch.Tensor, group_size: int, boundary: float | None = None,
                                chunk: int = 1 << 18) -> list[float]:
    """Σ_j w2_j·var_j(b) at b = 1, 2, 4 and 8 bits, var_j(b) the variance of the store's stochastic
    rounding of element j of ``x`` (``w2``: x's shape). In each group of ``group_size`` elements
    (consecutive in memory), step = (max_g − min_g)/(2^b − 1) and var = step²·f(1 − f), f the
    element's fractional position in its step. ``boundary``: the tensor is a boundary blob beside a
    clamp to [boundary, ∞) (a ReLU's output also read as values): elements at the bound are exact,
    the others are quantized between their own min and max on 2^b − 2 steps, with at least 2 bits.
    Whole groups of about ``chunk`` elements at a time: the float64 temporaries stay that small
    whatever the tensor's size."""
    flat, order = _memory_order(x.detach())
    wflat = w2.reshape(-1) if order is None else w2.permute(order).reshape(-1)
    n = flat.numel()
    step_elems = max(group_size, chunk // group_size * group_size)
    sums = [0.0] * len(_CODE_WIDTHS)
    inf = float("inf")
    for a in range(0, n, step_elems):
        b = min(n, a + step_elems)
        full = a + (b - a) // group_size * group_size
        for a2, b2, g in ((a, full, group_size), (full, b, b - full)):
            if b2 <= a2:
                continue
            blk = flat[a2:b2].double().view(-1, g)
            wb = wflat[a2:b2].view(-1, g)
            inner = None
            if boundary is None:
                lo = blk.amin(dim=1, keepdim=True)
                hi = blk.amax(dim=1, keepdim=True)
            else:
                inner = blk > boundary
                lo = torch.where(inner, blk, torch.full_like(blk, inf)).amin(dim=1, keepdim=True)
                hi = torch.where(inner, blk, torch.full_like(blk, -inf)).amax(dim=1, keepdim=True)
                some = torch.isfinite(lo)
                lo = torch.where(some, lo, torch.zeros_like(lo))
                hi = torch.where(some, hi, torch.zeros_like(hi))
                wb = torch.where(inner, wb, torch.zeros_like(wb))  # elements at the bound are exact
            offset = blk - lo
            for j, bits in enumerate(_CODE_WIDTHS):
                levels = float(2**bits - 1) if boundary is None else float(2**max(bits, 2) - 2)
                step = (hi - lo) / levels
                live = step > 0
                safe = torch.where(live, step, torch.ones_like(step))
                f = offset / safe
                f = f.sub_(f.floor())
                var = f.mul_(1.0 - f).mul_(safe * safe)  # a constant group (step 0) is exact
                sums[j] += float((var * wb).sum(dim=1).mul_(live.squeeze(1)).sum())
    return sums


def _now() -> float:
    import time

    return time.perf_counter()


def spacing_steps(cost_s: float, step_s: float, max_overhead: float) -> int:
    """The steps of ``step_s`` seconds that an estimate of ``cost_s`` seconds must be spread over to
    take at most ``max_overhead`` of the training time: ceil(cost / (max_overhead x step))."""
    return math.ceil(cost_s / (max_overhead * max(step_s, 1e-9)))


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _option_is_default(name: str) -> bool:
    """Whether option ``name`` holds its table default value (set to that value explicitly counts too)."""
    row = next(r for r in _C.options_table() if r["name"] == name)
    return str(_C.options_current()[name]) == str(row["default"])


def _gather(obj: Any) -> list[Any] | None:
    """With torch.distributed initialized and several ranks: ``obj`` of every rank, in rank order; else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _allreduce_max(n: int) -> int:
    """With torch.distributed initialized: the largest n over the ranks (the same on every rank)."""
    gathered = _gather(int(n))
    return n if gathered is None else max(gathered)


def _allreduce_mean(est: dict[str, Any]) -> dict[str, Any]:
    """With torch.distributed initialized: the per-key mean over the ranks that saw the key,
    identical on every rank (keys sorted), so that ranks that saved the same tensors solve the same
    problem (a rank then keeps the keys it saw itself: AutoPolicy._estimate). A value is
    a number or a list of numbers (the variance at each width), averaged element by element."""
    gathered = _gather(est)
    if gathered is None:
        return est
    sums: dict[str, list[Any]] = {}
    for d in gathered:
        for k, v in d.items():
            sums.setdefault(k, []).append(v)
    out: dict[str, Any] = {}
    for k, vs in sorted(sums.items()):
        if isinstance(vs[0], (list, tuple)):
            out[k] = [math.fsum(float(v[j]) for v in vs) / len(vs) for j in range(len(vs[0]))]
        else:
            out[k] = math.fsum(float(v) for v in vs) / len(vs)
    return out


def make_policy(compressor: Any, budget: float, estimator: Any = None) -> AutoPolicy:
    """The policy a ``Compressor(bits="auto")`` uses (see the module doc). ``adapt_interval``
    comes from the compressor's ``adapt_interval`` attribute when set, else the option."""
    return AutoPolicy(compressor, budget, estimator, adapt_interval=getattr(compressor, "adapt_interval", None))
