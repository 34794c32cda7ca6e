"""GPU check workload: gact as torch's CUDA allocator (``gact.use_allocator()``) in real training.

Run by gpu-check inside ``meson devenv -C build-gpu`` (so ``import gact`` finds the build):

    python torch_allocator_step.py --result results/torch_use_allocator.json

It registers gact's allocator before CUDA is initialised, trains a small CNN on one fixed
synthetic batch for a few SGD steps (plain, then inside ``gact.Compressor(model, bits=4)``),
and passes when: every loss is finite, the loss on the fixed batch went down, torch reports
memory in use during the step, and gact's stats count allocations on a CUDA allocator with
no allocator errors.
"""

from __future__ import annotations

import argparse
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
        errors += sum(int(v) for v in e.values() if isinstance(v, (int, float))) if isinstance(e, dict) else int(e or 0)
    return {"allocators": names, "allocations": allocs, "errors": errors, "peak_bytes": peak}


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
        in_use = max(in_use, torch.cuda.memory_allocated())
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
    counts = _allocator_counts(gact.stats())
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
