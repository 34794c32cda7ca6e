"""GPU check workload: an ordinary torch training script that knows nothing of gact.

gpu-check runs it with ``LD_PRELOAD=build-gpu/bindings/libgact_preload.so`` and
``GACT_STATS_PATH`` set, once with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` and once with
``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``, so torch's allocations reach the CUDA
runtime (cudaMalloc / cudaMallocAsync) where the shim takes them. This script only trains:
a small MLP-and-conv model on one fixed synthetic batch for a few Adam steps, and it passes
when every loss is finite and the last is below the first. gpu-check then judges the stats
dump the shim wrote at exit.

    python preload_train.py --result results/preload_nocache.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch import nn

from workload_models import Result


def body(res: Result, steps: int) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (128,), device=dev)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    # Freed and re-allocated blocks of several sizes: the allocator's reuse path.
    for n in (1 << 10, 1 << 20, 1 << 24, 1 << 20):
        t = torch.empty(n, device=dev)
        t.fill_(1.0)
        assert float(t.sum()) == float(n)
        del t
    torch.cuda.synchronize()
    res.figures.update(losses=losses, torch=torch.__version__, device=torch.cuda.get_device_name(0),
                       env={k: os.environ.get(k) for k in ("PYTORCH_NO_CUDA_MEMORY_CACHING",
                                                          "PYTORCH_CUDA_ALLOC_CONF", "LD_PRELOAD")})
    if not all(math.isfinite(v) for v in losses):
        res.data["error"] = f"non-finite loss: {losses}"
    elif not losses[-1] < losses[0]:
        res.data["error"] = f"loss did not decrease on a fixed batch: {losses}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", required=True)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    return Result(a.result).run(lambda r: body(r, a.steps))


if __name__ == "__main__":
    sys.exit(main())
