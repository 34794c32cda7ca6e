"""GPU check workload: training steps of ResNet-50, a ViT and BERT through gact, arm by arm.

Run by gpu-check (inside ``meson devenv -C build-gpu`` when the Python module was built):

    python train_models.py --result results/train.json --allocator gact --deadline-s 100

``--allocator gact`` makes gact torch's CUDA allocator first (``gact.use_allocator()``, or,
without the Python module, the same registration straight from ``--library libgact.so``),
so every figure below comes through gact's caching allocator; ``--allocator torch`` keeps
torch's own (the "native" comparison, and the CPU).

First the NaN/Inf contract (nonfinite_contract.py, the check the pytest suite runs on the CPU): saved
tensors holding NaN/±Inf come back exactly, on the device through the encoders' verdicts.

For each model (workload_models.py), on one fixed batch, five arms: ``fp32`` (no
compression), ``bits4``, ``bits2``, ``auto`` (``bits="auto", budget=2``) and ``auto_swap``
(the same with ``swap=True``), each through ``gact.Compressor``:

1. gradient agreement: the gradients of one step at the initial weights (same seed, so the
   same dropout) against the fp32 arm's: cosine and relative L2 error;
2. step time: median of the timed steps (SGD with momentum) after warm-up;
3. peak memory: gact's high-water mark of allocated and reserved bytes on the device (its
   allocator holds torch's tensors and the compressed blobs), reset before the timed steps;
   torch's own max_memory_allocated where torch's allocator is in use (under use_allocator()
   the same call answers with gact's figures: ``torch_api_peak_mib``, which must equal
   ``gact_peak_mib``); the store's ratio.

Then the swap check: with deterministic algorithms, the gradients of ``bits=2`` with
``swap=True`` must equal those with ``swap=False`` bit for bit, or differ no more than two
fp32 runs of the same step differ from each other. Last, while time is left, the largest
batch under a memory cap (``torch.cuda.set_per_process_memory_fraction``, which gact's
allocator honours for everything on the device) for fp32 against bits2 and auto.

The result file is rewritten after every arm, so a run cut by its deadline keeps what it
measured. Without the Python module (``--no-module``) only the fp32 arms run; the others are
recorded as skipped with the reason.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

import nonfinite_contract
import workload_models as wm

ARMS: List[Tuple[str, Optional[Dict[str, Any]]]] = [
    ("fp32", None),
    ("bits4", {"bits": 4}),
    ("bits2", {"bits": 2}),
    ("auto", {"bits": "auto", "budget": 2}),
    ("auto_swap", {"bits": "auto", "budget": 2, "swap": True}),
]
#: torch's hook setters and the gact functions for them (as gact.use_allocator wires them)
HOOKS = (("set_record_stream_fn", "gact_record_stream"), ("set_reset_fn", "gact_empty_cache"),
         ("set_memory_fraction_fn", "gact_set_memory_fraction"))
MIB = float(1 << 20)


def install_library(path: str) -> Dict[str, Any]:
    """gact as torch's CUDA allocator straight from a library, for a build without the module."""
    lib = ctypes.CDLL(path)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gact_torch_alloc", "gact_free")
    native = alloc.allocator()
    wired = []
    for setter, fn in HOOKS:
        if hasattr(native, setter):
            getattr(native, setter)(ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value)
            wired.append(setter)
    torch.backends.cudnn.benchmark = False
    torch.cuda.memory.change_current_allocator(alloc)
    return {"library": path, "hooks": wired, "shared_with_store": False}


class GactStats:
    """gact's statistics document read through the C ABI of the library torch uses (or the module)."""

    def __init__(self, path: Optional[str], module: Any = None):
        self.lib = None
        self.module = None
        if path:
            lib = ctypes.CDLL(path)
            try:
                lib.gact_stats_json.restype = ctypes.c_void_p
                lib.gact_free_string.argtypes = [ctypes.c_void_p]
                self.lib = lib
            except AttributeError:
                # a build without the CUDA half has no C ABI: the same document from the Python package
                self.module = module

    def document(self) -> Dict[str, Any]:
        if self.lib is None:
            return self.module.stats() if self.module is not None else {}
        p = self.lib.gact_stats_json()
        if not p:
            raise RuntimeError("gact_stats_json() returned NULL")
        try:
            return json.loads(ctypes.string_at(p).decode("utf-8"))
        finally:
            self.lib.gact_free_string(p)

    def reset_peaks(self) -> None:
        if self.lib is not None:
            self.lib.gact_reset_peak_stats()

    def device(self, index: int, suffix: str = "") -> Dict[str, Any]:
        """gact's device allocator of a device (suffix ":store": the store's thin layer over torch's pool)."""
        a = (self.document().get("allocators") or {}).get(f"cuda:{index}{suffix}")
        return a if isinstance(a, dict) else {}


class Trainer:
    def __init__(self, a: argparse.Namespace, res: wm.Result):
        self.a = a
        self.res = res
        self.dev = torch.device(a.device)
        self.cuda = self.dev.type == "cuda"
        self.t_end = time.monotonic() + a.deadline_s
        # the arms stop early enough to leave the batch search its share
        searching = self.cuda and a.max_batch_arms != ""
        self.arms_end = self.t_end - (a.search_reserve_s if searching else 0.0)
        self.gact = None if a.no_module else __import__("gact")
        self.stats = GactStats(None)
        self.torch_allocator = a.allocator == "torch" or not self.cuda
        self.oom_errors: Dict[str, int] = {}  # the batch search's out-of-memory errors by type

    def left(self) -> float:
        return self.t_end - time.monotonic()

    def arms_left(self) -> float:
        return self.arms_end - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def cleanup(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- one step ------------------------------------------------------------------------
    def compressor(self, model, kw):
        return None if kw is None else self.gact.Compressor(model, **kw)

    @staticmethod
    def forward_backward(w: wm.Workload, comp, x, y) -> torch.Tensor:
        """Forward (saving through `comp` when given) and backward; the loss."""
        if comp is not None:
            with comp:
                loss = w.loss(x, y)
        else:
            loss = w.loss(x, y)
        loss.backward()
        return loss

    def step(self, w: wm.Workload, opt, comp, x, y) -> float:
        opt.zero_grad(set_to_none=True)
        loss = self.forward_backward(w, comp, x, y)
        opt.step()
        if comp is not None:
            comp.step()
        return float(loss)

    def gradients(self, w: wm.Workload, init, kw, x, y) -> torch.Tensor:
        """All parameter gradients of one step at the initial weights, flattened (float64)."""
        w.model.load_state_dict(init)
        w.model.zero_grad(set_to_none=True)
        comp = self.compressor(w.model, kw)
        try:
            torch.manual_seed(1234)       # the same dropout in every arm
            self.forward_backward(w, comp, x, y)
            if comp is not None:
                comp.step()
            g = torch.cat([p.grad.reshape(-1).double() for p in w.model.parameters() if p.grad is not None])
        finally:
            if comp is not None:
                comp.close()
        w.model.zero_grad(set_to_none=True)
        return g

    @staticmethod
    def agreement(g: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
        nr = float(ref.norm())
        cos = float(torch.dot(g, ref) / (g.norm() * ref.norm())) if nr > 0 else float("nan")
        return {"grad_cosine": round(cos, 6), "grad_rel_l2": round(float((g - ref).norm()) / nr, 6) if nr > 0 else None}

    # -- an arm --------------------------------------------------------------------------
    def arm(self, w: wm.Workload, name: str, kw, init, ref: Optional[torch.Tensor], x, y) -> Dict[str, Any]:
        out: Dict[str, Any] = {"status": "running", "settings": kw or {}}
        comp = None
        try:
            g = self.gradients(w, init, kw, x, y)
            if ref is not None:
                out.update(self.agreement(g, ref))
            del g
            w.model.load_state_dict(init)
            opt = torch.optim.SGD(w.model.parameters(), lr=1e-3, momentum=0.9)
            comp = self.compressor(w.model, kw)
            before = self.store_counters(comp)
            losses, times = [], []
            for i in range(self.a.warmup + self.a.steps):
                if i == self.a.warmup:
                    self.sync()
                    self.reset_peaks()
                t0 = time.perf_counter()
                losses.append(self.step(w, opt, comp, x, y))
                self.sync()
                if i >= self.a.warmup:
                    times.append(time.perf_counter() - t0)
            out.update(batch=x.shape[0], steps=len(times), step_ms=round(1000 * statistics.median(times), 3),
                       samples_per_s=round(x.shape[0] / statistics.median(times), 2),
                       losses=[round(v, 4) for v in losses])
            out.update(self.peaks())
            if comp is None and self.gact is not None:
                out["saved_mib"] = round(self.saved_bytes(w, x, y) / MIB, 3)
            if comp is not None:
                after = self.store_counters(comp)
                delta = {k: after[k] - before.get(k, 0) for k in after}
                out["store"] = {k: v for k, v in delta.items() if "." not in k}
                self.step_bytes(out, delta)
                if delta.get("bytes_stored"):
                    out["store_ratio"] = round(delta["bytes_in"] / delta["bytes_stored"], 3)
                if delta.get("bytes_in"):
                    # 1.0 each when every saved tensor is encoded once and decoded once (issue 30)
                    out["encoded_vs_saved"] = round(delta.get("bytes_encoded", 0) / delta["bytes_in"], 3)
                    out["decoded_vs_saved"] = round(delta.get("decode_bytes", 0) / delta["bytes_in"], 3)
                pol = getattr(comp, "policy", None)
                if pol is not None and getattr(pol, "decisions", 0):
                    per = pol.estimate_seconds / pol.decisions / statistics.median(times)
                    out["policy"] = {"estimator": pol.estimator, "decisions": pol.decisions,
                                     "estimate_steps": round(per, 2), "adapt_interval": pol.adapt_interval,
                                     "overhead_pct": round(100.0 * per / pol.adapt_interval, 3)}
            bad = [v for v in losses if not math.isfinite(v)]
            out["status"] = "fail" if bad else "pass"
            if bad:
                out["error"] = f"non-finite losses: {losses}"
            if isinstance(out.get("grad_cosine"), float) and math.isnan(out["grad_cosine"]):
                out["status"], out["error"] = "fail", "gradient cosine is NaN"
        except Exception as exc:
            out.update(status="fail", error=f"{type(exc).__name__}: {exc}"[:1000])
        finally:
            if comp is not None:
                comp.close()
            self.cleanup()
        return out

    STORE_COUNTERS = ("bytes_in", "bytes_stored", "tensors_in", "steps", "leaks", "skipped_bytes", "bytes_encoded",
                      "decode_bytes", "device_nonfinite", "verdict_waits")
    #: skip reasons that keep no memory of their own: the model's parameters and inputs exist anyway
    FREE_SKIPS = ("parameter", "input")

    def store_counters(self, comp) -> Dict[str, int]:
        """The store's counters of this Compressor, with skipped.<reason> and unstored.<kind> bytes flattened."""
        if comp is None:
            return {}
        store = comp.stats().get("store") or {}
        out = {k: int(store[k]) for k in self.STORE_COUNTERS if isinstance(store.get(k), (int, float))}
        for section in ("skipped", "unstored"):
            for reason, v in (store.get(section) or {}).items():
                if isinstance(v, dict) and isinstance(v.get("bytes"), (int, float)):
                    out[f"{section}.{reason}"] = int(v["bytes"])
        return out

    @classmethod
    def step_bytes(cls, out: Dict[str, Any], delta: Dict[str, int]) -> None:
        """Per step: bytes stored, kept (by reason: what stays uncompressed and why) and held, from counter
        deltas over the arm's steps; run() turns them into what compression promises at the fp32 peak."""
        steps = max(1, delta.get("steps", 0))
        kept = {k.split(".", 1)[1]: v / steps for k, v in delta.items() if k.startswith("skipped.") and v > 0}
        out["per_step_mib"] = {
            "stored": round(delta.get("bytes_stored", 0) / steps / MIB, 3),
            "kept": round(sum(v for r, v in kept.items() if r not in cls.FREE_SKIPS) / MIB, 3),
            "held": round(delta.get("unstored.held", 0) / steps / MIB, 3)}
        out["kept_mib_by_reason"] = {r: round(v / MIB, 3) for r, v in sorted(kept.items(), key=lambda kv: -kv[1])}

    def saved_bytes(self, w: wm.Workload, x, y) -> int:
        """Bytes autograd's saves keep alive in one fp32 step: each storage a saved tensor lives in, once, whole;
        parameters, buffers and the batch left out (gact-bench train's definition)."""
        from gact import _compat
        skip = {_compat.storage_base(t) for t in list(w.model.parameters()) + list(w.model.buffers()) + [x, y]}
        seen, total = set(), [0]

        def pack(t):
            base = _compat.storage_base(t)
            if base not in skip and base not in seen:
                seen.add(base)
                total[0] += (t.untyped_storage() if _compat.HAS_UNTYPED_STORAGE else t.storage()).nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = w.loss(x, y)
        loss.backward()
        w.model.zero_grad(set_to_none=True)
        return total[0]

    @staticmethod
    def realized(mo: Dict[str, Any]) -> None:
        """Beside each compressed arm: what its counters promise the peak drops by (the fp32 step's saved bytes
        less what the arm stored, kept and found held) and the part of it the device peak realized."""
        base = mo["arms"].get("fp32") or {}
        saved = base.get("saved_mib")
        if base.get("status") != "pass" or not saved:
            return
        for arm, r in mo["arms"].items():
            per = r.get("per_step_mib")
            if arm == "fp32" or r.get("status") != "pass" or not per:
                continue
            promised = saved - per["stored"] - per["kept"] - per["held"]
            r["promised_mib"] = round(promised, 3)
            for k in ("gact_peak_mib", "torch_peak_mib"):
                if r.get(k) is not None and base.get(k) is not None and promised > 0:
                    r[k.replace("_peak_mib", "_realized")] = round((base[k] - r[k]) / promised, 3)

    def reset_peaks(self) -> None:
        self.stats.reset_peaks()
        if self.cuda and self.torch_allocator:
            torch.cuda.reset_peak_memory_stats()

    def peaks(self) -> Dict[str, Any]:
        p: Dict[str, Any] = {}
        if self.cuda:
            d = self.stats.device(self.dev.index or 0)
            if d:
                p["gact_peak_mib"] = round(int(d.get("allocated_bytes.all.peak", 0)) / MIB, 1)
                p["gact_reserved_peak_mib"] = round(int(d.get("reserved_bytes.all.peak", 0)) / MIB, 1)
                act = ((d.get("tags") or {}).get("activation") or {}).get("peak_bytes")
                if isinstance(act, (int, float)):
                    p["gact_activation_peak_mib"] = round(act / MIB, 1)
            if self.torch_allocator:
                p["torch_peak_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
                # what the device gave both pools at their peaks (gact's own pool, when the blobs live there, beside
                # torch's cache): the memory the job needs, whichever pool holds it
                p["torch_reserved_peak_mib"] = round(torch.cuda.max_memory_reserved() / MIB, 1)
                p["device_reserved_peak_mib"] = round(p["torch_reserved_peak_mib"] + (
                    int(d.get("reserved_bytes.all.peak", 0)) / MIB if d else 0.0), 1)
                # where the blobs lived: "torch" (its caching allocator: torch_peak_mib counts them) or "gact"
                pool = getattr(getattr(self.gact, "allocator", None), "device_pool", None) if self.gact else None
                if pool is not None:
                    p["device_pool"] = pool
                st = self.stats.device(self.dev.index or 0, ":store")
                if st:
                    p["store_blocks_peak_mib"] = round(int(st.get("allocated_bytes.all.peak", 0)) / MIB, 1)
            else:  # torch's memory API under use_allocator() answers with gact's figures: the same peak
                try:
                    p["torch_api_peak_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
                except Exception as e:  # noqa: BLE001 (reported, not fatal)
                    p["torch_api_error"] = f"{type(e).__name__}: {e}"[:200]
        return p

    # -- swap ----------------------------------------------------------------------------
    def swap_check(self, w: wm.Workload, init, x, y) -> Dict[str, Any]:
        """bits=2 with swap against without, under deterministic algorithms (see the docstring)."""
        if self.cuda:
            torch.backends.cudnn.deterministic = True
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            a = self.gradients(w, init, None, x, y)
            b = self.gradients(w, init, None, x, y)
            noise = float((a - b).norm() / a.norm())
            del b
            s0 = self.gradients(w, init, {"bits": 2}, x, y)
            s1 = self.gradients(w, init, {"bits": 2, "swap": True}, x, y)
            equal = bool(torch.equal(s0, s1))
            diff = float((s0 - s1).norm() / s0.norm())
            within = diff <= max(2.0 * noise, 1e-12)
            out = {"bitwise_equal": equal, "rel_l2_swap_vs_no_swap": diff, "rel_l2_fp32_run_to_run": noise,
                   "status": "pass" if equal or within else "fail",
                   "verdict": "equal" if equal else ("within fp32 run-to-run noise" if within else "DIFFERENT")}
            del a, s0, s1
            return out
        except Exception as exc:
            return {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[:1000]}
        finally:
            if self.cuda:
                torch.use_deterministic_algorithms(False)
                torch.backends.cudnn.deterministic = False
            self.cleanup()

    # -- a profile of one compressed step ------------------------------------------------
    #: profiler event names of the runtime calls that wait for the device
    SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                  "cudaStreamWaitEvent")

    def profile(self, w: wm.Workload, init, x, y, kw: Dict[str, Any]) -> Dict[str, Any]:
        """One compressed step (after two warm-up steps) under torch.profiler, reduced to what says where its
        time goes: gact's host time per saved tensor (its pack and unpack hooks, timed around the calls),
        the device time of gact's encode and decode kernels beside all kernels, the runtime calls that wait
        for the device, and the allocations of the step."""
        from torch.profiler import ProfilerActivity, profile
        w.model.load_state_dict(init)
        opt = torch.optim.SGD(w.model.parameters(), lr=1e-3)
        comp = self.compressor(w.model, kw)
        timed = {"pack": [0.0, 0], "unpack": [0.0, 0]}

        def wrap(name, fn):
            acc = timed[name]

            def hook(t):
                t0 = time.perf_counter()
                try:
                    return fn(t)
                finally:
                    acc[0] += time.perf_counter() - t0
                    acc[1] += 1
            return hook

        try:
            for _ in range(2):
                self.step(w, opt, comp, x, y)
            self.sync()
            comp._pack, comp._unpack = wrap("pack", comp._pack), wrap("unpack", comp._unpack)  # read at `with`
            allocs0 = self.allocation_count()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                self.step(w, opt, comp, x, y)
                self.sync()
            step_ms = 1000 * (time.perf_counter() - t0)
            allocs = self.allocation_count() - allocs0 if allocs0 is not None else None
            kern = {"encode": 0.0, "decode": 0.0, "all": 0.0}
            syncs: Dict[str, int] = {}
            for e in prof.events():
                name = e.name or ""
                dev_us = float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) or 0.0) \
                    if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA") else 0.0
                if dev_us:
                    kern["all"] += dev_us
                    if "_encode_kernel" in name:
                        kern["encode"] += dev_us
                    elif name.startswith("decode_kernel") or "decode_kernel<" in name:
                        kern["decode"] += dev_us
                if name in self.SYNC_CALLS:
                    syncs[name] = syncs.get(name, 0) + 1
            packs = max(1, timed["pack"][1])
            return {"status": "pass", "model": w.name, "arm": kw, "step_ms_profiled": round(step_ms, 3),
                    "saved_tensors": timed["pack"][1], "unpacks": timed["unpack"][1],
                    "host_us_per_saved_tensor": round(1e6 * (timed["pack"][0] + timed["unpack"][0]) / packs, 2),
                    "pack_us": round(1e6 * timed["pack"][0] / packs, 2),
                    "unpack_us": round(1e6 * timed["unpack"][0] / max(1, timed["unpack"][1]), 2),
                    "encode_kernels_ms": round(kern["encode"] / 1000, 3),
                    "decode_kernels_ms": round(kern["decode"] / 1000, 3),
                    "all_kernels_ms": round(kern["all"] / 1000, 3),
                    "syncs": syncs, "sync_count": sum(syncs.values()), "allocations": allocs}
        except Exception as exc:
            return {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[:1000]}
        finally:
            if comp is not None:
                comp.close()
            del opt
            self.cleanup()

    def allocation_count(self) -> Optional[int]:
        """Allocations served so far on the device (torch's count; gact's under use_allocator, which
        answers torch's memory_stats), or on the CPU none counted."""
        if not self.cuda:
            return None
        try:
            return int(torch.cuda.memory_stats(0).get("allocation.all.allocated", 0))
        except Exception:  # a torch whose pluggable allocator has no statistics
            return None

    # -- largest batch under a cap -------------------------------------------------------
    def fits(self, w: wm.Workload, opt, comp, b: int, gen: torch.Generator) -> bool:
        ok = False
        try:
            x, y = w.inputs(b, self.dev, gen)
            ok = math.isfinite(self.step(w, opt, comp, x, y))
            self.sync()
            del x, y
        except Exception as exc:
            if not wm.is_oom(exc):
                raise
            # which error an exhausted pool raised: torch.OutOfMemoryError is what users' retry loops and
            # cuDNN's workspace fallback catch (under use_allocator, only with gact's thrower set)
            kind = type(exc).__module__ + "." + type(exc).__name__
            self.oom_errors[kind] = self.oom_errors.get(kind, 0) + 1
            if comp is not None:
                # free the failed step's blobs now: the caught exception still holds its graph
                getattr(comp, "abort_step", comp.step)()
            del exc
        opt.zero_grad(set_to_none=True)
        self.cleanup()
        return ok

    def max_batch(self, w: wm.Workload, kw, init, deadline: float) -> Dict[str, Any]:
        w.model.load_state_dict(init)
        opt = torch.optim.SGD(w.model.parameters(), lr=1e-3, momentum=0.9)
        comp = self.compressor(w.model, kw)
        gen = torch.Generator().manual_seed(2)
        lo, hi, b, probes, cut = 0, None, max(2, w.batch // 8), [], False
        try:
            while hi is None and b <= 8192:
                if time.monotonic() > deadline:
                    cut = True
                    break
                ok = self.fits(w, opt, comp, b, gen)
                probes.append([b, ok])
                lo, hi, b = (b, None, b * 2) if ok else (lo, b, b)
            while hi is not None and hi - lo > max(1, lo // 16):
                if time.monotonic() > deadline:
                    cut = True
                    break
                mid = (lo + hi) // 2
                ok = self.fits(w, opt, comp, mid, gen)
                probes.append([mid, ok])
                lo, hi = (mid, hi) if ok else (lo, mid)
        finally:
            if comp is not None:
                comp.close()
            del opt
            self.cleanup()
        return {"max_batch": lo or None, "first_failing_batch": hi, "cut_by_deadline": cut, "probes": probes}

    # -- driver --------------------------------------------------------------------------
    def install(self) -> None:
        f = self.res.figures
        f["torch"] = torch.__version__
        f["python_module"] = "not used (--no-module)" if self.gact is None else "imported"
        if self.gact is not None:  # (saved.py's correlation walk: C++ where _gact_torch was built with autograd's headers)
            from gact import saved as gact_saved
            f["graph_walk"] = "C++" if getattr(gact_saved, "_graph_reaches", None) is not None else "Python"
        if self.cuda and not self.torch_allocator:  # before anything initializes CUDA
            if self.gact is not None:
                self.gact.use_allocator()
                info = dict(self.gact.allocator.installed or {})
            else:
                if not self.a.library:
                    raise RuntimeError("--allocator gact without the Python module needs --library libgact.so")
                info = install_library(self.a.library)
            self.stats = GactStats(str(info["library"]))
            f["allocator"] = info
        else:
            f["allocator"] = {"torch": "its own caching allocator" if self.cuda else "cpu"}
            if self.gact is not None:
                import _gact
                self.stats = GactStats(_gact.__file__, self.gact)
        f["device"] = torch.cuda.get_device_name(0) if self.cuda else "cpu"

    def run(self) -> None:
        self.install()
        f = self.res.figures
        arms = [(n, kw) for n, kw in ARMS if n in self.a.arms.split(",")]
        models = [m for m in self.a.models.split(",") if m]
        f["arms"] = [n for n, _ in arms]
        f["models"] = {}
        f["swap_check"] = {}
        if self.gact is not None:
            # the NaN/Inf contract, the same check the pytest suite runs on the CPU (a few seconds)
            try:
                f["nonfinite"] = nonfinite_contract.run(self.dev, self.gact)
            except Exception as exc:
                f["nonfinite"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            self.cleanup()
        self.res.save()
        inputs = {}
        for m in models:
            if self.arms_left() < 10:
                f["models"][m] = {"status": "skipped", "note": "out of time"}
                continue
            torch.manual_seed(0)
            w = wm.make_workload(m, self.a.tiny)
            w.model.to(self.dev)
            init = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
            x, y = w.inputs(w.batch, self.dev, torch.Generator().manual_seed(1))
            inputs[m] = (w, init)
            mo: Dict[str, Any] = {"source": w.source, "batch": w.batch, "arms": {}}
            f["models"][m] = mo
            ref = None
            for arm, kw in arms:
                if kw is not None and self.gact is None:
                    mo["arms"][arm] = {"status": "skipped", "note": self.a.module_note or "the Python module is not available"}
                    continue
                if self.arms_left() < 5:
                    mo["arms"][arm] = {"status": "skipped", "note": "out of time"}
                    continue
                if ref is None and arm == "fp32":
                    try:
                        ref = self.gradients(w, init, None, x, y)
                    except Exception as exc:
                        mo["arms"][arm] = {"status": "fail", "error": f"{type(exc).__name__}: {exc}"[:1000]}
                        continue
                mo["arms"][arm] = self.arm(w, arm, kw, init, ref, x, y)
                self.res.save()
            del ref
            self.realized(mo)
            base = mo["arms"].get("fp32", {})
            for arm, r in mo["arms"].items():
                if arm == "fp32" or r.get("status") != "pass" or base.get("status") != "pass":
                    continue
                r["step_time_vs_fp32"] = round(r["step_ms"] / base["step_ms"], 3)
                for k in ("gact_peak_mib", "torch_peak_mib"):
                    if r.get(k) and base.get(k):
                        r[k.replace("_mib", "_vs_fp32")] = round(r[k] / base[k], 3)
            if self.gact is not None and "profile" not in f and self.arms_left() > 5:
                # where a compressed step's time goes, for the first model (resnet50 in the default list)
                f["profile"] = self.profile(w, init, x, y, {"bits": 4})
                self.res.save()
            if self.gact is not None and not self.a.no_swap_check:
                if self.arms_left() > 5:
                    f["swap_check"][m] = self.swap_check(w, init, x, y)
                else:
                    f["swap_check"][m] = {"status": "skipped", "note": "out of time"}
            del x, y
            w.model.to("cpu")
            self.cleanup()
            self.res.save()
        if self.cuda and not self.torch_allocator:
            d = self.stats.device(0)
            f["gact_allocations_on_device"] = int(d.get("allocation.all.allocated", 0) or 0)
            f["gact_num_ooms"] = int(d.get("num_ooms", 0) or 0)
            # One device allocator per process: torch's tensors and the store's blobs in one.
            names = sorted(n for n in (self.stats.document().get("allocators") or {}) if n.startswith("cuda"))
            act = ((d.get("tags") or {}).get("activation") or {}).get("peak_bytes", 0)
            f["device_allocators"] = names
            f["activation_peak_bytes_in_torch_allocator"] = act
        self.search_batches(inputs)
        f["max_batch_oom_errors"] = dict(self.oom_errors)
        if self.cuda and not self.torch_allocator:
            d = self.stats.device(0)
            # read again after the search, which is where out-of-memory events happen
            f["gact_num_ooms"] = int(d.get("num_ooms", 0) or 0)
            # every out-of-memory of the search as torch's own type (gact.allocator.set_oom_thrower)
            f["oom_errors_are_torchs"] = bool(self.oom_errors) and all(
                k.endswith("OutOfMemoryError") for k in self.oom_errors)
            # handles alive once every search step is over: a failed step's blobs must not outlive it
            f["store_live_handles_after_search"] = int((self.stats.document().get("store") or {}).get("live_handles", 0) or 0)
        problems = [f"{m}/{arm}: {r.get('error')}" for m, mo in f["models"].items()
                    for arm, r in (mo.get("arms") or {}).items() if r.get("status") == "fail"]
        problems += [f"swap check {m}: {r.get('verdict') or r.get('error')}" for m, r in f["swap_check"].items()
                     if r.get("status") == "fail"]
        if self.cuda and not self.torch_allocator and not f.get("gact_allocations_on_device"):
            problems.append("gact's device allocator counts no allocation: torch is not using it")
        shared = (f.get("allocator") or {}).get("shared_with_store")
        if shared and (len(f.get("device_allocators") or []) != 1 or not f.get("activation_peak_bytes_in_torch_allocator")):
            problems.append(f"the store's device arena is not torch's allocator: allocators {f.get('device_allocators')}, "
                            f"activation peak {f.get('activation_peak_bytes_in_torch_allocator')} bytes in cuda:0")
        if problems:
            self.res.data["error"] = "; ".join(problems)[:3000]

    def search_batches(self, inputs) -> None:
        f = self.res.figures
        if not self.cuda or self.a.max_batch_arms == "":
            f["max_batch"] = {"note": "not searched: " + ("on the CPU" if not self.cuda else "no arms asked for")}
            return
        # where the store's blobs live during the search: under use_allocator gact's allocator serves everything;
        # on torch's allocator they are blocks of torch's pool by default, which torch's cap covers ("gact" there:
        # a pool of gact's own beside torch's, outside the cap)
        pool = "gact (use_allocator)"
        if self.torch_allocator:
            pool = (getattr(self.gact.allocator, "device_pool", None) if self.gact is not None else None) or "torch"
        f["max_batch_pool"] = pool
        cap = int(self.a.memory_cap_gib * (1 << 30))
        total = torch.cuda.get_device_properties(0).total_memory
        f["memory_cap_mib"] = cap >> 20
        mb: Dict[str, Any] = {}
        f["max_batch"] = mb
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        try:
            wanted = [(n, kw) for n, kw in ARMS if n in self.a.max_batch_arms.split(",")]
            for m, (w, init) in inputs.items():
                w.model.to(self.dev)
                mb[m] = {}
                for arm, kw in wanted:
                    if kw is not None and self.gact is None:
                        continue
                    if self.left() < 10:
                        mb[m][arm] = {"note": "out of time"}
                        continue
                    mb[m][arm] = self.max_batch(w, kw, init, time.monotonic() + min(self.left() - 5, self.a.search_s))
                    self.res.save()
                base = (mb[m].get("fp32") or {}).get("max_batch")
                for arm, r in mb[m].items():
                    if arm != "fp32" and base and r.get("max_batch"):
                        r["vs_fp32"] = round(r["max_batch"] / base, 3)
                w.model.to("cpu")
                self.cleanup()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke run)")
    ap.add_argument("--allocator", default="gact", choices=["gact", "torch"])
    ap.add_argument("--library", help="libgact.so, for --allocator gact without the Python module")
    ap.add_argument("--no-module", action="store_true", help="do not import gact: fp32 arms only")
    ap.add_argument("--module-note", default="", help="why the module is not used (for the report)")
    ap.add_argument("--models", default=",".join(wm.MODEL_NAMES))
    ap.add_argument("--arms", default=",".join(n for n, _ in ARMS))
    ap.add_argument("--max-batch-arms", default="fp32,bits2,auto")
    ap.add_argument("--no-swap-check", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--search-s", type=float, default=15.0, help="time box of one batch search")
    ap.add_argument("--search-reserve-s", type=float, default=35.0,
                    help="seconds of the deadline kept from the arms for the batch searches")
    ap.add_argument("--memory-cap-gib", type=float, default=8.0)
    a = ap.parse_args()
    res = wm.Result(a.result)
    if a.device == "cuda" and not torch.cuda.is_available():
        res.data["error"] = f"torch {torch.__version__} sees no CUDA device"
        res.save()
        print(res.data["error"])
        return 1
    return res.run(lambda r: Trainer(a, r).run())


if __name__ == "__main__":
    sys.exit(main())
