"""gact's host arena as torch's CPU allocator (``gact.use_cpu_allocator``, on by default once a
Compressor exists): torch's CPU tensors, the blobs and the decoded tensors in one pool.

What must hold: torch's tensors really come from the arena (its `torch` tag counts them to the
byte), switching either way at any time leaves every tensor valid (each keeps the deleter of
the allocator that served it), a request over ``memory_limit`` is torch's RuntimeError naming
gact and leaves the arena usable, gradients are bit-identical under either allocator, threads
allocating at once get disjoint memory, and the default follows the ``cpu_allocator`` option.
The peak this buys is in test_peak.py.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import _gact as _C
import gact
from evalkit import run_threads


@pytest.fixture
def gact_allocator():
    was = gact.cpu_allocator_installed()
    assert gact.use_cpu_allocator(True)
    yield
    gact.use_cpu_allocator(was)


def _torch_tag():
    return _C.stats_document()["allocators"]["host"]["tags"].get("torch", {"current_bytes": 0, "total_allocs": 0})


def test_torch_tensors_come_from_the_arena_to_the_byte(gact_allocator):
    before = _torch_tag()
    t = torch.empty(1 << 20)  # 4 MiB
    after = _torch_tag()
    assert after["current_bytes"] - before["current_bytes"] == 4 << 20
    assert after["total_allocs"] - before["total_allocs"] == 1
    del t
    assert _torch_tag()["current_bytes"] == before["current_bytes"]


def test_switching_either_way_keeps_every_tensor_valid(gact_allocator):
    a = torch.arange(1 << 16, dtype=torch.float32)  # served by gact
    base = _torch_tag()["current_bytes"]
    gact.use_cpu_allocator(False)
    assert not gact.cpu_allocator_installed()
    b = torch.arange(1 << 16, dtype=torch.float32) * 2  # served by torch's allocator
    assert _torch_tag()["current_bytes"] == base
    gact.use_cpu_allocator(True)
    c = a + b  # served by gact again
    assert torch.equal(c, torch.arange(1 << 16, dtype=torch.float32) * 3)
    del a, b  # each freed by the allocator that served it
    assert _torch_tag()["current_bytes"] == base  # c replaced a
    del c


def test_over_the_memory_limit_is_torchs_error_naming_gact(gact_allocator):
    gact.configure(memory_limit=32 << 20)
    try:
        with pytest.raises(RuntimeError, match=r"gact: CPU allocator.*cannot allocate 268435456 bytes"):
            torch.empty(1 << 26)  # 256 MiB
        small = torch.ones(1000)  # the arena still serves what fits
        assert float(small.sum()) == 1000.0
    finally:
        gact.configure(memory_limit=0)
    big = torch.ones(1 << 26, dtype=torch.uint8)
    assert int(big[-1]) == 1


def _train_grads(steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_training_is_bit_identical_under_either_allocator(gact_allocator):
    with_gact = _train_grads()
    gact.use_cpu_allocator(False)
    with_torch = _train_grads()
    assert torch.equal(with_gact, with_torch)


def test_threads_allocating_at_once_get_disjoint_memory(gact_allocator):
    errors = []

    def work(k):
        try:
            for i in range(200):
                t = torch.full((4096 + 37 * k,), float(k * 1000 + i))
                u = t * 2
                if not (bool((t == k * 1000 + i).all()) and bool((u == 2 * (k * 1000 + i)).all())):
                    errors.append((k, i))
        except BaseException as e:  # reported below
            errors.append(e)

    run_threads(work, 4)
    assert not errors, errors[:5]


def _fresh(code, **env):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, **env), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_the_first_compressor_installs_it_unless_the_option_says_no():
    code = ("import torch, gact; a = gact.cpu_allocator_installed(); gact.Compressor(torch.nn.Linear(2, 2)); "
            "print(a, gact.cpu_allocator_installed())")
    assert _fresh(code) == "False True"
    assert _fresh(code, GACT_CPU_ALLOCATOR="0") == "False False"
    # a choice the user made before the first Compressor stands
    code = ("import torch, gact; gact.use_cpu_allocator(False); gact.Compressor(torch.nn.Linear(2, 2)); "
            "print(gact.cpu_allocator_installed())")
    assert _fresh(code) == "False"


def test_a_fork_while_another_thread_allocates_never_hangs_the_child(gact_allocator):
    """DataLoader workers fork; torch's intra-op or the user's threads may be inside the host arena
    at that moment. Without the fork handlers a child inherits the arena's lock held and hangs on
    its first tensor (seen here within a few dozen forks); with them every child finishes."""
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            torch.empty(1 << 12).fill_(1.0)

    t = threading.Thread(target=churn)
    t.start()
    hung = 0
    try:
        for _ in range(100):
            pid = os.fork()
            if pid == 0:  # the child: one tensor from the arena, then out without cleanup
                os._exit(0 if float(torch.ones(1000).sum()) == 1000.0 else 1)
            deadline = time.monotonic() + 20
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    hung += 1
                    break
                time.sleep(0.002)
    finally:
        stop.set()
        t.join()
    assert hung == 0, f"{hung} of 100 children hung on the arena's lock"


_RSS = "import os\ndef rss():\n    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20\n"


def test_a_large_freed_tensor_goes_back_to_the_system():
    """Issue 33 row 6: a freed 1-2 GiB CPU tensor stayed in the arena (RSS +1-2 GiB) after `del`,
    comp.close() and use_cpu_allocator(False). A wholly free segment of 256 MiB or more is now returned
    at once, as glibc returns a large chunk; smaller ones stay cached until gact.empty_cache()."""
    out = _fresh(_RSS + """
import torch, gact
gact.use_cpu_allocator(True)
base = rss()
t = torch.empty(1100 << 20, dtype=torch.uint8).fill_(1)
held = rss()
del t
freed = rss()
small = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(8)]  # 64 MiB of 8 MiB tensors
del small
cached = rss()
gact.empty_cache()
print(held - base, freed - base, cached - base, rss() - base)
""")
    held, freed, cached, emptied = map(int, out.split())
    assert held >= 1000  # the tensor was touched
    assert freed < 100, out
    assert cached >= 50, out  # smaller segments stay warm for the next step
    assert emptied < 40, out


def test_an_allocation_the_machine_cannot_back_fails_up_front():
    """Issue 33 row 7: segments were mapped with MAP_NORESERVE, so torch.empty of twice the machine's
    memory succeeded and touching it brought the OOM killer. Now it fails at once with a RuntimeError."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    swap = 0
    for line in open("/proc/meminfo"):
        if line.startswith("SwapTotal:"):
            swap = int(line.split()[1]) << 10
    if int(open("/proc/sys/vm/overcommit_memory").read()) == 1:
        pytest.skip("vm.overcommit_memory=1: the kernel backs every mapping on paper")
    out = _fresh(f"""
import torch, gact
gact.use_cpu_allocator(True)
try:
    torch.empty({2 * (total + swap)}, dtype=torch.uint8)
    print("allocated")
except RuntimeError as e:
    print("refused:", "cannot allocate" in str(e) or "out of memory" in str(e))
t = torch.ones(1000)  # the allocator still serves
print(float(t.sum()))
""")
    assert out.splitlines() == ["refused: True", "1000.0"], out


def test_use_cpu_allocator_takes_a_bool_only():
    """Issue 33 row 10: use_cpu_allocator("False") installed the pool (a non-empty string is true)."""
    for bad in ("False", "yes", 2, None):
        with pytest.raises(TypeError, match="enable must be True or False"):
            gact.use_cpu_allocator(bad)


def test_the_expandable_host_arena_changes_where_memory_lies_not_what_training_computes():
    """The host arena (torch's CPU tensors and the blobs) grows one address range by pages (host_expandable, on by
    default). Placement does not enter the codec's noise, so a compressed training run gives bit-identical gradients
    with fixed segments and with the range; the stats say which layout ran, the range's free pages go back on a
    release, and the process's peak is not above fixed segments'."""
    code = """
import json, resource, torch, gact
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                              torch.nn.ReLU()) for _ in range(4)])
x = torch.randn(8, 8, 48, 48)
comp = gact.Compressor(m, bits=2)
for _ in range(2):
    m.zero_grad(set_to_none=True)
    with comp:
        loss = m(x).square().mean()
    loss.backward()
    comp.step()
g = torch.cat([p.grad.flatten() for p in m.parameters()])
host = gact.stats()["allocators"]["host"]
del loss
comp.close()
gact.use_cpu_allocator(False)  # (what torch's tensors cached goes back: the arena empties its cache)
after = gact.stats()["allocators"]["host"]
print(json.dumps({"grad": g.tolist(), "exp": host["options"]["expandable_segments"],
                  "peak": host["reserved_bytes.all.peak"], "allocated_peak": host["allocated_bytes.all.peak"],
                  "live": after["allocated_bytes.all.current"], "reserved_after": after["reserved_bytes.all.current"],
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
    plain = json.loads(_fresh(code, GACT_HOST_EXPANDABLE="0"))
    exp = json.loads(_fresh(code))
    assert (plain["exp"], exp["exp"]) == (False, True)
    assert exp["grad"] == plain["grad"]
    assert exp["allocated_peak"] > 0
    assert exp["rss"] <= plain["rss"] + (2 << 20), (exp["rss"], plain["rss"])
    # the release unmapped every whole free page: what stays mapped is the pages the live blocks (the gradients,
    # the result) touch
    assert exp["reserved_after"] < exp["peak"], {k: v for k, v in exp.items() if k != "grad"}
    assert exp["reserved_after"] <= exp["live"] + 4 * (2 << 20), {k: v for k, v in exp.items() if k != "grad"}


def test_under_an_address_space_limit_the_arena_leaves_the_process_its_room():
    """`ulimit -v`: the arena's expandable ranges reserved address space of the machine's memory size, halved
    until the limit gave it, so the first range (the small pool's) took most of what the process had left: after one
    compressed step under a 2.9 GB limit (0.8 GB used at the start) a 600 MiB tensor, a 300 MiB numpy array and
    200 MiB of Python bytes each failed where torch alone runs them. A range now takes an eighth of the headroom at most, and more ranges come as they fill."""
    code = """
import numpy as np, torch, torch.nn as nn, gact
model = nn.Linear(16, 16)
comp = gact.Compressor(model, bits=8)
with comp:
    model(torch.randn(4, 16)).sum().backward()
comp.step()
big = torch.ones(600 << 20, dtype=torch.uint8)
arr = np.ones(200 << 20, dtype=np.uint8)
raw = bytearray(100 << 20)
held = [torch.ones(64 << 20, dtype=torch.uint8) for _ in range(4)]
print("ok", int(big[-1]) == 1, len(held))
"""
    r = subprocess.run(["bash", "-c", f"ulimit -v 3000000 && exec {sys.executable} -c '{code}'"],
                       capture_output=True, text=True, env=dict(os.environ, GACT_HOST_EXPANDABLE="1"), timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "True", "4"], (r.stdout, r.stderr[-600:])


def test_a_held_saved_tensor_given_other_memory_at_its_address_is_read_from_its_blob(gact_allocator):
    """A saved tensor the program still holds unchanged at backward is used as it is, not decoded. It is compared by
    its storage itself, not its address: `h.data = a` frees the saved storage (with no version change) and the arena
    hands that very block to the next tensor of its size, which `h.data = b` then puts under h at the saved address.
    Compared by address, tanh's backward read b's values (a constant 0.5: the gradient 0.49 of its norm off at 8
    bits); it is decoded from the blob, the forward's values."""
    if gact.compressor._storage_ref is None:
        pytest.skip("_gact_torch is not built")
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(-1, 1, 64, dtype=torch.float64)

    def grad(swap):
        x.grad = None
        comp = gact.Compressor(None, bits=8, min_bytes=0)
        with comp:
            h = torch.tanh(x * 1.0)  # (tanh saves its result: h, which the program keeps)
        loss = (h * w).sum()
        if swap:
            at = h.data_ptr()
            h.data = torch.zeros(1, dtype=torch.float64)
            held = [torch.full((64, 64), 0.5, dtype=torch.float64) for _ in range(64)]  # (the arena hands the block
            b = next((t for t in held if t.data_ptr() == at), None)  # back to one of them)
            assert b is not None
            h.data = b
            del b, held
        loss.backward()
        comp.close()
        return x.grad.clone()

    want = grad(False)
    got = grad(True)
    assert 0 < (got - want).norm() < 0.05 * want.norm()
