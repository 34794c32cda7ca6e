"""gact-bench train's profile (tools/bench/train.py): timing gact's entry points must not change what
gact does. Its op-tracker wrapper once hid each op's name from the storage table, so batch norm's
statistics were quantized as values and the profiled steps trained to NaN."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import gact
from evalkit import load_bench


def _bench_train():
    return load_bench("train")


def _store_counts(comp):
    s = comp.stats()["store"]
    return ({r: v["tensors"] for r, v in s["skipped"].items()}, {r: v["tensors"] for r, v in s["roles"].items()},
            s["tensors_in"], s["bytes_stored"])


def test_profile_keeps_every_storage_decision():
    train = _bench_train()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    counts = []

    def step(arm):
        comp = gact.Compressor(model, bits=4)
        with comp:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        counts.append(_store_counts(comp))
        model.zero_grad(set_to_none=True)
        comp.step()
        comp.close()
        return 0

    step("gact4")
    plain = counts[-1]
    res = train.profile_breakdown(step, "gact4", steps=1)
    assert counts[-1] == plain, (counts[-1], plain)
    assert plain[0].get("stats", 0) >= 4  # the two batch norms' mean and invstd, kept exact
    assert res["encode_s"] > 0 and res["python_s"] >= 0


def test_saved_tensor_count_is_every_save_of_the_step():
    """The µs/tensor column divides by the saved tensors the Compressor saw in a step (stored or kept):
    on the tinystack workload that count equals the number of saves autograd makes in a plain step."""
    import types

    train = _bench_train()
    torch.manual_seed(0)
    w = train.Workload(types.SimpleNamespace(model="tinystack", batch=2, size=64, threads=1))
    saves = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saves.append(1) or t, lambda t: t):
        loss = w.loss(w.model(w.x))
    loss.backward()
    w.model.zero_grad(set_to_none=True)
    comps = {4: gact.Compressor(w.model, bits=4)}
    step = train.make_step(w, comps)
    step("gact4")
    got = train.gact_step_bytes(gact, comps[4], step, "gact4")
    comps[4].close()
    assert got["saved_tensors"] == len(saves) > 64, (got, len(saves))
    assert got["stored"] > 0
