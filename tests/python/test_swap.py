"""Swap through the Python package: ``gact.Compressor(model, bits=4, swap=True)``.

On the CPU the swap layer moves each compressed blob from the host arena to the
(plain host memory) pinned pool and back, through the same mover the GPU uses.
Training with swap must give gradients bit-identical to training without it for
the same seed: swap moves bytes, it never changes them. The mover's counters
show that the blobs really went out and came back.
"""

import pytest
import torch

import _gact as _C
import gact


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc1 = torch.nn.Linear(8 * 8 * 8, 64)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        h = torch.nn.functional.max_pool2d(h, 2)
        h = torch.nn.functional.gelu(self.fc1(h.flatten(1)))
        return self.fc2(self.drop(h))


def _host_swap_stats():
    """Summed counters of the movers over the host arena."""
    keys = ("puts", "offloads", "bytes_out", "bytes_in", "fetches", "prefetch_hits", "prefetch_misses",
            "resident_gets", "live_blobs", "host_bytes")
    tot = dict.fromkeys(keys, 0)
    for s in _C.swap_stats():
        if s["device_arena"] == "host":
            for k in keys:
                tot[k] += s[k]
    return tot


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


def _train(swap, steps=3, seed=7, **kw):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comp = gact.Compressor(model, bits=4, swap=swap, seed=seed, min_bytes=1024, **kw)
    gen = torch.Generator().manual_seed(1)
    grads = []
    try:
        for _ in range(steps):
            x = torch.randn(16, 3, 16, 16, generator=gen)
            y = torch.randint(0, 10, (16,), generator=gen)
            torch.manual_seed(100)  # same dropout masks in both runs
            with comp:
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            assert comp.step() == 0  # no handle leaked
    finally:
        comp.close()
    return grads


def test_swap_gradients_identical_to_no_swap():
    before = _host_swap_stats()
    plain = _train(swap=False)
    mid = _host_swap_stats()
    swapped = _train(swap=True)
    after = _host_swap_stats()

    assert _delta(before, mid)["puts"] == 0, "swap=False must not hand blobs to the mover"
    d = _delta(mid, after)
    assert d["puts"] > 0
    assert d["offloads"] == d["puts"], "budget 0 offloads every blob"
    assert d["bytes_out"] > 0 and d["bytes_in"] == d["bytes_out"], "every blob came back exactly once"
    assert d["prefetch_hits"] + d["prefetch_misses"] + d["resident_gets"] == d["puts"]
    assert d["prefetch_hits"] > 0, "prefetch (2 blobs ahead) serves most gets"
    assert after["live_blobs"] == 0 and after["host_bytes"] == 0, "every blob was released"

    assert len(plain) == len(swapped)
    for step, (ga, gb) in enumerate(zip(plain, swapped)):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"step {step}, parameter {i}: gradients differ with swap=True"


def test_swap_budget_keeps_blobs_resident():
    comp = gact.Compressor(None, bits=4, swap=True)
    comp._swap_budget = 1 << 40  # far above what the step stores: nothing goes out
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    before = _host_swap_stats()
    with comp:
        y = torch.tanh(x @ w).sum()
    y.backward()
    comp.step()
    d = _delta(before, _host_swap_stats())
    assert d["puts"] > 0
    assert d["offloads"] == 0
    assert d["resident_gets"] == d["puts"]


def test_swap_section_in_stats_document():
    _train(swap=True, steps=1)
    doc = gact.Compressor(None).stats()
    sections = [k for k in doc if k == "swap" or k.startswith("swap#")]
    assert sections, f"no swap section in {sorted(doc)}"
    s = doc[sections[0]]
    for k in ("bytes_out", "bytes_in", "prefetch_hits", "prefetch_misses", "stall_ns", "pinned_pool"):
        assert k in s
    assert s["pinned_pool"]["slab_reserves"] <= 4, "pinned slabs are reused, never one per tensor"
