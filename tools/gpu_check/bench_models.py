"""GPU check workload: training-step benchmarks of ResNet-50 and a BERT-base-like encoder.

Run by gpu-check inside ``meson devenv -C build-gpu``:

    python bench_models.py --result results/bench_models.json --deadline-s 150 --memory-cap-gib 4

For each model, five arms train on synthetic data with the same seed: ``baseline`` (plain
torch), ``bits4`` / ``bits2`` (``gact.Compressor(model, bits=...)``), ``auto``
(``bits="auto", budget=2``) and ``auto_swap`` (the same with ``swap=True``). An arm whose
feature this build lacks is recorded as ``unavailable`` with the exception text.

Phase 1 (every arm): samples/s over timed steps after warm-up, ``torch.cuda.max_memory_allocated``,
the bytes autograd saved (baseline: counted by a saved-tensors hook) and gact's store stats
(bytes in, bytes stored, ratio: the change over the arm's steps, since the store is one per
process); each figure beside the baseline's as a ratio. Also the
device-to-device copy bandwidth, the reference for the codec benchmark.

Phase 2 (while time is left): the largest batch that fits a memory cap, by doubling then
bisection. torch is capped with ``set_per_process_memory_fraction``; gact's own device arena
is outside torch's accounting, so a batch fits when the step raises no out-of-memory error
and max(torch peak, torch in use + gact device bytes at the end of forward) <= cap.

Results are rewritten after every arm, so a run cut by its deadline keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

import workload_models as wm

ARMS: List[Tuple[str, Optional[Dict[str, Any]]]] = [
    ("baseline", None),
    ("bits4", {"bits": 4}),
    ("bits2", {"bits": 2}),
    ("auto", {"bits": "auto", "budget": 2}),
    ("auto_swap", {"bits": "auto", "budget": 2, "swap": True}),
]

TINY = {  # small shapes for a CPU smoke run of the logic (--tiny)
    "resnet50": {"make": lambda: wm.ResNet50(num_classes=10, width=8), "batch": 4, "sample": (3, 32, 32)},
    "bert_base": {"make": lambda: wm.BertLike(vocab=1000, d_model=64, heads=4, ffn=128, layers=2, max_len=64),
                  "batch": 4, "sample": (16,)},
}


class FeatureUnavailable(Exception):
    """gact.Compressor refused these settings (e.g. swap or the auto policy missing from this build)."""


class Bench:
    def __init__(self, args: argparse.Namespace, res: wm.Result):
        self.a = args
        self.res = res
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.t_end = time.monotonic() + args.deadline_s
        self.cap_bytes = int(args.memory_cap_gib * (1 << 30))

    # -- helpers ---------------------------------------------------------------------------
    def left(self) -> float:
        return self.t_end - time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def spec(self, name: str) -> Dict[str, Any]:
        return TINY[name] if self.a.tiny else wm.MODELS[name]

    def batch(self, name: str, b: int, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec(name)
        if name == "resnet50":
            x = torch.randn((b,) + tuple(spec["sample"]), generator=gen).to(self.dev)
            y = torch.randint(0, 10 if self.a.tiny else 1000, (b,), generator=gen).to(self.dev)
        else:
            vocab = 1000 if self.a.tiny else 30522
            x = torch.randint(0, vocab, (b, spec["sample"][0]), generator=gen).to(self.dev)
            y = torch.randint(0, vocab, (b, spec["sample"][0]), generator=gen).to(self.dev)
        return x, y

    def build(self, name: str, kw: Optional[Dict[str, Any]]):
        torch.manual_seed(0)
        model = self.spec(name)["make"]().to(self.dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        comp = None
        if kw is not None:
            import gact   # an ImportError here is a broken build, not a missing feature
            try:
                comp = gact.Compressor(model, **kw)
            except Exception as exc:
                raise FeatureUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return model, opt, comp

    STORE_COUNTERS = ("bytes_in", "bytes_stored", "tensors_in", "steps", "leaks", "skipped_bytes",
                      "nonfinite_fallbacks")

    def store_counters(self, comp) -> Dict[str, int]:
        """The store's cumulative counters now (empty without a compressor)."""
        if comp is None:
            return {}
        store = comp.stats().get("store") or {}
        return {k: int(store[k]) for k in self.STORE_COUNTERS if isinstance(store.get(k), (int, float))}

    @staticmethod
    def gact_device_bytes(doc: Dict[str, Any], key: str) -> int:
        tot = 0
        for aname, a in (doc.get("allocators") or {}).items():
            if isinstance(a, dict) and str(aname).startswith("cuda"):
                tot += int(a.get(key, 0) or 0)
        return tot

    def step(self, name: str, model, opt, comp, x, y) -> Tuple[float, int]:
        """One training step; returns (loss, bytes in use at the end of forward: torch + gact device arena)."""
        opt.zero_grad(set_to_none=True)
        if comp is not None:
            with comp:
                loss = wm.loss_of(name, model(x), y)
        else:
            loss = wm.loss_of(name, model(x), y)
        fwd_end = 0
        if self.cuda:
            fwd_end = torch.cuda.memory_allocated()
            if comp is not None:
                fwd_end += self.gact_device_bytes(comp.stats(), "allocated_bytes.all.current")
        loss.backward()
        opt.step()
        if comp is not None:
            comp.step()
        return float(loss), fwd_end

    def cleanup(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # -- figures ---------------------------------------------------------------------------
    def copy_bandwidth(self) -> Optional[float]:
        if not self.cuda:
            return None
        n = 256 << 20
        src = torch.empty(n, dtype=torch.uint8, device=self.dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        self.sync()
        iters = 20
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        self.sync()
        dt = time.perf_counter() - t0
        del src, dst
        self.cleanup()
        return round(n * iters / dt / 1e9, 2)

    def saved_bytes(self, name: str, model, x, y) -> int:
        """Bytes of the tensors autograd saves in one forward, parameters excluded."""
        params = {p.data_ptr() for p in model.parameters()}
        total = [0]

        def pack(t):
            if t.data_ptr() not in params:
                total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = wm.loss_of(name, model(x), y)
        del loss
        return total[0]

    def measure(self, name: str, arm: str, kw: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"status": "running", "settings": kw or {}}
        try:
            model, opt, comp = self.build(name, kw)
        except FeatureUnavailable as exc:
            return {"status": "unavailable", "error": str(exc), "settings": kw or {}}
        except Exception as exc:
            return {"status": "fail", "error": f"{type(exc).__name__}: {exc}", "settings": kw or {}}
        gen = torch.Generator().manual_seed(1)
        b = self.spec(name)["batch"]
        x, y = self.batch(name, b, gen)
        losses = []
        before = self.store_counters(comp)
        try:
            for _ in range(self.a.warmup):
                losses.append(self.step(name, model, opt, comp, x, y)[0])
            self.sync()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(self.a.steps):
                losses.append(self.step(name, model, opt, comp, x, y)[0])
            self.sync()
            dt = time.perf_counter() - t0
            out.update(batch=b, steps=self.a.steps, seconds=round(dt, 4),
                       samples_per_s=round(b * self.a.steps / dt, 2),
                       losses=[round(v, 4) for v in losses])
            if self.cuda:
                out["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            pol = getattr(comp, "policy", None) if comp is not None else None
            if pol is not None and getattr(pol, "decisions", 0):
                # the adaptive policy's estimate (made after the first warm-up step) in ordinary steps
                per = pol.estimate_seconds / pol.decisions / (dt / self.a.steps)
                out["policy"] = {"estimator": pol.estimator, "decisions": pol.decisions,
                                 "estimate_s": round(pol.estimate_seconds / pol.decisions, 4),
                                 "estimate_steps": round(per, 2), "adapt_interval": pol.adapt_interval,
                                 "overhead_pct": round(100.0 * per / pol.adapt_interval, 3),
                                 "achieved_avg_bits": pol.stats()["last_decision"].get("achieved_avg_bits")}
            if comp is None:
                out["saved_activation_bytes"] = self.saved_bytes(name, model, x, y)
            else:
                # The store is one per process: this arm's figures are the change over its steps.
                after = self.store_counters(comp)
                delta = {k: after[k] - before.get(k, 0) for k in after}
                out["store"] = delta
                if delta.get("bytes_stored"):
                    out["store_ratio"] = round(delta["bytes_in"] / delta["bytes_stored"], 3)
            bad = [v for v in losses if not math.isfinite(v)]
            out["status"] = "fail" if bad else "pass"
            if bad:
                out["error"] = f"non-finite losses: {losses}"
        except Exception as exc:
            out.update(status="fail", error=f"{type(exc).__name__}: {exc}")
        finally:
            if comp is not None and hasattr(comp, "close"):
                try:
                    comp.close()
                except Exception:
                    pass
            del model, opt, comp, x, y
            self.cleanup()
        return out

    def fits(self, name: str, model, opt, comp, b: int, gen: torch.Generator) -> Tuple[bool, float]:
        t0 = time.monotonic()
        ok = False
        try:
            x, y = self.batch(name, b, gen)
            torch.cuda.reset_peak_memory_stats()
            loss, fwd_end = self.step(name, model, opt, comp, x, y)
            self.sync()
            used = max(torch.cuda.max_memory_allocated(), fwd_end)
            ok = math.isfinite(loss) and used <= self.cap_bytes
            del x, y
        except Exception as exc:
            if not wm.is_oom(exc):
                raise
            if comp is not None:
                try:
                    comp.step()   # end the interrupted iteration
                except Exception:
                    pass
        opt.zero_grad(set_to_none=True)
        self.cleanup()
        return ok, time.monotonic() - t0

    def max_batch(self, name: str, kw: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        try:
            model, opt, comp = self.build(name, kw)
        except Exception as exc:
            return {"max_batch": None, "error": f"{type(exc).__name__}: {exc}"}
        gen = torch.Generator().manual_seed(2)
        lo, hi, b, last = 0, None, 4, 1.0
        probes: List[Tuple[int, bool]] = []
        cut = False
        limit = self.spec(name).get("max_batch", 4096)
        try:
            while hi is None and b <= limit:
                if self.left() < 3 * last + 2:
                    cut = True
                    break
                ok, last = self.fits(name, model, opt, comp, b, gen)
                probes.append((b, ok))
                if ok:
                    lo, b = b, b * 2
                else:
                    hi = b
            while hi is not None and hi - lo > max(1, lo // 16) and not cut:
                if self.left() < 3 * last + 2:
                    cut = True
                    break
                mid = (lo + hi) // 2
                ok, last = self.fits(name, model, opt, comp, mid, gen)
                probes.append((mid, ok))
                if ok:
                    lo = mid
                else:
                    hi = mid
        finally:
            if comp is not None and hasattr(comp, "close"):
                try:
                    comp.close()
                except Exception:
                    pass
            del model, opt, comp
            self.cleanup()
        return {"max_batch": lo or None, "first_failing_batch": hi, "search_cut_by_deadline": cut,
                "probes": probes}

    # -- driver ----------------------------------------------------------------------------
    def run(self) -> None:
        f = self.res.figures
        f["torch"] = torch.__version__
        f["device"] = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        f["memory_cap_mib"] = self.cap_bytes // 2**20
        f["cap_accounting"] = ("fits = no OOM under torch.cuda.set_per_process_memory_fraction(cap) and "
                               "max(torch peak, torch in use + gact cuda arena bytes at end of forward) <= cap")
        f["d2d_copy_gbps"] = self.copy_bandwidth()
        models = [m for m in self.a.models.split(",") if m]
        arms = [(n, kw) for n, kw in ARMS if n in self.a.arms.split(",")]
        f["models"] = {m: {"batch": self.spec(m)["batch"], "arms": {}} for m in models}
        self.res.save()
        for m in models:
            arms_out = f["models"][m]["arms"]
            for arm, kw in arms:
                if self.left() < 5:
                    arms_out[arm] = {"status": "skipped", "error": "out of time"}
                    continue
                arms_out[arm] = self.measure(m, arm, kw)
                self.res.save()
            base = arms_out.get("baseline", {})
            for arm, a in arms_out.items():
                if arm == "baseline" or a.get("status") != "pass" or base.get("status") != "pass":
                    continue
                a["throughput_vs_baseline"] = round(a["samples_per_s"] / base["samples_per_s"], 3)
                if a.get("peak_mib") and base.get("peak_mib"):
                    a["peak_vs_baseline"] = round(a["peak_mib"] / base["peak_mib"], 3)
                st = a.get("store") or {}
                if st.get("bytes_in") and st.get("steps") and base.get("saved_activation_bytes"):
                    # share of autograd's saved bytes (per step) that went through the store
                    a["store_bytes_in_vs_saved"] = round(st["bytes_in"] / st["steps"] / base["saved_activation_bytes"], 3)
            self.res.save()
        failed = [f"{m}/{arm}: {a.get('error')}" for m in models for arm, a in f["models"][m]["arms"].items()
                  if a.get("status") == "fail"]
        if failed:
            self.res.data["error"] = "; ".join(failed)
        if not self.cuda:
            f["max_batch_search"] = "not run on the CPU (no out-of-memory to search against)"
            return
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_bytes / total))
        for m in models:
            arms_out = f["models"][m]["arms"]
            for arm, kw in arms:
                a = arms_out.get(arm, {})
                if a.get("status") != "pass":
                    continue
                if self.left() < 10:
                    a["max_batch_note"] = "not searched: out of time"
                    continue
                a.update(self.max_batch(m, kw))
                self.res.save()
            base = arms_out.get("baseline", {})
            for arm, a in arms_out.items():
                if arm != "baseline" and a.get("max_batch") and base.get("max_batch"):
                    a["max_batch_vs_baseline"] = round(a["max_batch"] / base["max_batch"], 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", required=True)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--memory-cap-gib", type=float, default=4.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run of this script)")
    ap.add_argument("--models", default="resnet50,bert_base")
    ap.add_argument("--arms", default=",".join(n for n, _ in ARMS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    res = wm.Result(a.result)
    if a.device == "cuda" and not torch.cuda.is_available():
        res.data["error"] = f"torch {torch.__version__} sees no CUDA device"
        res.save()
        print(res.data["error"])
        return 1
    return res.run(lambda r: Bench(a, r).run())


if __name__ == "__main__":
    sys.exit(main())
