"""GPU check workload: gact as torch's CUDA allocator (``gact.use_allocator()``) in real training.

Run by gpu-check inside ``meson devenv -C build-gpu`` (so ``import gact`` finds the build):

    python torch_allocator_step.py --result results/torch_use_allocator.json

It registers gact's allocator before CUDA is initialised, trains a small CNN on one fixed
synthetic batch for a few SGD steps (plain, then inside ``gact.Compressor(model, bits=4)``),
reads the statistics of libgact.so (torch's allocator now; its own registry, apart from the
``_gact`` module's) through ``gact_stats_json()``, and passes when: every loss is finite, the
loss on the fixed batch went down, and libgact.so's stats count allocations with no allocator
errors (torch's own memory counters are recorded where the pluggable allocator supports them,
-1 otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys

import torch
from torch import nn

from workload_models import Result


def _allocator_counts(doc: dict) -> dict:
    allocs, errors, peak = 0, 0, 0
    names = []
    for name, a in (doc.get("allocators") or {}).items():
        if not isinstance(a, dict):
            continue
        names.append(name)
        allocs += int(a.get("allocation.all.allocated", 0) or 0)
        peak = max(peak, int(a.get("allocated_bytes.all.peak", 0) or 0))
        e = a.get("errors", 0)
        items = e.items() if isinstance(e, dict) else [("errors", e)]
        # zero_size: a 0-byte request answered with nullptr (as cudaMalloc does), not a failure
        errors += sum(int(v) for k, v in items if isinstance(v, (int, float)) and k != "zero_size")
    return {"allocators": names, "allocations": allocs, "errors": errors, "peak_bytes": peak}


def _library_stats(path: str) -> dict:
    """The stats document of libgact.so (gact_stats_json of bindings/gact.h), as loaded by torch."""
    lib = ctypes.CDLL(path)          # the handle torch's dlopen already holds
    lib.gact_stats_json.restype = ctypes.c_void_p
    lib.gact_free_string.argtypes = [ctypes.c_void_p]
    p = lib.gact_stats_json()
    if not p:
        raise RuntimeError(f"gact_stats_json() of {path} returned NULL")
    try:
        return json.loads(ctypes.string_at(p).decode("utf-8"))
    finally:
        lib.gact_free_string(p)


def _torch_in_use() -> int:
    """torch.cuda.memory_allocated(), or -1 where torch's pluggable allocator has no device stats."""
    try:
        return int(torch.cuda.memory_allocated())
    except RuntimeError:
        return -1


def body(res: Result, steps: int) -> None:
    import gact
    lib = gact.use_allocator()          # must precede every CUDA call
    res.figures["library"] = lib
    res.figures["torch"] = torch.__version__
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(64, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (64,), device=dev)
    losses = []
    in_use = 0
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        in_use = max(in_use, _torch_in_use())
        loss.backward()
        opt.step()
        losses.append(float(loss))
    comp_losses = []
    try:
        comp = gact.Compressor(model, bits=4)
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            with comp:
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            comp.step()
            comp_losses.append(float(loss))
        res.figures["compressor_store"] = {k: v for k, v in (comp.stats().get("store") or {}).items()
                                           if k in ("bytes_in", "bytes_stored", "ratio", "leaks")}
    except Exception as exc:
        res.data["error"] = f"training inside gact.Compressor under gact's allocator failed: {type(exc).__name__}: {exc}"
    torch.cuda.synchronize()
    # libgact.so (torch's allocator now) keeps its own statistics, apart from the _gact module's.
    counts = _allocator_counts(_library_stats(lib))
    res.figures["python_module_allocators"] = _allocator_counts(gact.stats())
    res.figures.update(losses=losses, compressor_losses=comp_losses, torch_memory_allocated_max=in_use, **counts)
    problems = []
    if not all(math.isfinite(v) for v in losses + comp_losses):
        problems.append(f"non-finite loss: {losses + comp_losses}")
    if len(losses) >= 2 and not losses[-1] < losses[0]:
        problems.append(f"loss did not decrease on a fixed batch: {losses}")
    if counts["allocations"] <= 0:
        problems.append("gact's stats count no allocation: torch is not using gact's allocator")
    if counts["errors"]:
        problems.append(f"{counts['errors']} allocator error(s) in gact's stats")
    if problems:
        res.data["error"] = "; ".join(([res.data["error"]] if res.data["error"] else []) + problems)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", required=True)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    res = Result(a.result)
    return res.run(lambda r: body(r, a.steps))


if __name__ == "__main__":
    sys.exit(main())
