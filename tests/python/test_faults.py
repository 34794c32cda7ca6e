"""Faults under training: what a job sees when memory, threads or a blob fail, and that it goes on.

gact sits under a training job, so a fault inside it must either be absorbed without changing the
result (a worker thread that cannot start: the calling thread does its work; the arena cannot hold a
blob while torch's tensors live elsewhere: the tensor is kept as it is, counted as skipped for
`memory`; the swap pool has no room: the blob stays where it is) or surface as a clear error on the
step it hit (a corrupt blob in backward; the shared host arena out of memory under gact's CPU
allocator, the default: torch raises gact's out-of-memory text), and in every case leave nothing
behind: no handle alive once the graph is gone, and the next clean step exactly as good as before
the fault. The faults are injected through test hooks of the extension (``_C._testing_*``); each
test turns them off again even when it fails.

Bounds: at 8 bits the stochastic rounding of a group of range R adds noise of variance at most
(R/255)^2/4 per element, about 1.2 % of the group's spread, so the relative gradient error stays near
1e-2 and the cosine with fp32 above 1 - 1e-4; 0.999 leaves a wide margin for the layers that amplify
it. Where no byte of any blob changes (thread fallback, swap refusals), gradients are compared for
exact equality with the same run without the fault.
"""

import gc
import random
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import _gact as _C
import gact
from evalkit import compute_grad, cosine, flat_grad, run_threads

COS_8BIT = 0.999


@pytest.fixture(autouse=True)
def _faults_off():
    yield
    _C._testing_fail_reserves("host", 0, 0)
    _C._testing_fail_reserves("pinned", 0, 0)
    _C._testing_fail_threads_after(0)
    _C._testing_fail_allocations(0, 0)


@pytest.fixture
def torch_own_allocator():
    """torch's CPU tensors from torch's allocator for the test, so that an injected host-arena
    failure hits gact's blobs only (with gact's CPU allocator, the default, it hits torch too)."""
    gact.Compressor()  # the first Compressor decides the default; then override it
    was = gact.cpu_allocator_installed()
    gact.use_cpu_allocator(False)
    yield
    gact.use_cpu_allocator(was)


def _net(wide=8192, act=torch.nn.ReLU):
    # the hidden activation (64 x 8192 floats) is large enough for a 2-thread encode
    return torch.nn.Sequential(torch.nn.Linear(256, wide), act(), torch.nn.Linear(wide, 10))


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)


def _grad(model, x, y, comp=None):
    return compute_grad(model, lambda m: F.cross_entropy(m(x), y), comp)


def _skipped(comp, reason):
    return comp.stats()["store"]["skipped"][reason]["tensors"]


def _thread_fallbacks():
    return gact.stats()["codecs"]["thread_fallbacks"]


def _live():
    gc.collect()
    return _C.store_live_handles()


class _Recorder:
    """Keeps the _Packed objects a Compressor stores in one forward (to corrupt one of them)."""

    def __init__(self, comp):
        self.comp, self.packs = comp, []
        self._orig = comp._store

        def store(*a, **k):
            p = self._orig(*a, **k)
            self.packs.append(p)
            return p

        comp._store = store

    def handles(self):
        return sorted({p.handle for p in self.packs if getattr(p, "handle", 0)})

    def close(self):
        del self.comp._store
        self.packs.clear()


def test_stress_faults_between_clean_steps_leave_training_intact():
    torch.set_num_threads(2)  # a multi-threaded encode and decode, so thread faults bite
    allocator_was = gact.cpu_allocator_installed()
    gact.use_cpu_allocator(True)  # the default under a Compressor; set here whatever earlier tests chose
    try:
        model = _net()
        x, y = _batch()
        ref = _grad(model, x, y)
        comp = gact.Compressor(model, bits=8)
        base = _live()
        rng = random.Random(1234)
        faults = ["memory", "threads", "corrupt", "none"] * 6
        rng.shuffle(faults)
        seen = {f: 0 for f in faults}
        for step, fault in enumerate(faults):
            if fault == "memory":
                # torch's tensors and the blobs share the host arena (gact's CPU allocator): the first
                # tensor of the forward cannot be allocated, and torch raises gact's out-of-memory text
                assert gact.cpu_allocator_installed()
                _C._testing_fail_allocations(0, 1 << 20)  # every allocation from the host arena fails
                model.zero_grad(set_to_none=True)
                try:
                    with pytest.raises(RuntimeError, match="gact.*out of memory"):
                        with comp:
                            F.cross_entropy(model(x), y).backward()
                finally:
                    _C._testing_fail_allocations(0, 0)
                model.zero_grad(set_to_none=True)
                comp.step()
            elif fault == "threads":
                before = _thread_fallbacks()
                _C._testing_fail_threads_after(1)
                g = _grad(model, x, y, comp)
                _C._testing_fail_threads_after(0)
                assert _thread_fallbacks() >= before + 2, "neither the encode nor the decode fell back"
                assert cosine(g, ref) > COS_8BIT
            elif fault == "corrupt":
                rec = _Recorder(comp)
                model.zero_grad(set_to_none=True)
                try:
                    with comp:
                        loss = F.cross_entropy(model(x), y)
                    hs = rec.handles()
                    assert hs, "nothing was stored to corrupt"
                    _C._testing_corrupt_blob(hs[rng.randrange(len(hs))], rng.randrange(16), 1 << rng.randrange(8))
                    with pytest.raises(RuntimeError, match="corrupt blob"):
                        loss.backward()
                finally:
                    rec.close()
                del loss
                model.zero_grad(set_to_none=True)
                comp.step()  # leaks of the failed step are counted, not raised
            else:
                g = _grad(model, x, y, comp)
                assert cosine(g, ref) > COS_8BIT
            seen[fault] += 1
            assert _live() == base, f"step {step} ({fault}): handles left alive after the graph is gone"
            # the next clean step is as good as any
            assert cosine(_grad(model, x, y, comp), ref) > COS_8BIT, f"after {fault} at step {step}"
        assert all(n == 6 for n in seen.values())
    finally:
        torch.set_num_threads(1)
        gact.use_cpu_allocator(allocator_was)


def test_thread_fallback_changes_no_byte():
    torch.set_num_threads(2)
    try:
        model = _net()
        x, y = _batch()
        clean = _grad(model, x, y, gact.Compressor(model, bits=4, seed=5))
        _C._testing_fail_threads_after(1)
        faulted = _grad(model, x, y, gact.Compressor(model, bits=4, seed=5))
        _C._testing_fail_threads_after(0)
        assert torch.equal(clean, faulted)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("act", [torch.nn.ReLU, torch.nn.SiLU])
def test_arena_out_of_memory_keeps_the_tensor_warns_once_and_counts_it(torch_own_allocator, act):
    """(SiLU: its input, stored as the derivative when there is room, is kept as the input itself)"""
    model = _net(wide=1024, act=act)
    x, y = _batch()
    ref = _grad(model, x, y)
    comp = gact.Compressor(model, bits=4)
    _C._testing_fail_allocations(0, 1 << 20)  # torch's tensors come from torch's allocator here
    try:
        with pytest.warns(RuntimeWarning, match=r"out of memory.*skipped: memory") as w:
            g1 = _grad(model, x, y, comp)
            g2 = _grad(model, x, y, comp)
    finally:
        _C._testing_fail_allocations(0, 0)
    assert len([m for m in w if "out of memory" in str(m.message)]) == 1, "warned more than once"
    s = comp.stats()["store"]
    assert s["skipped"]["memory"]["tensors"] >= 2 and s["tensors_in"] == 0
    # nothing was compressed, so the gradients are fp32's
    assert torch.allclose(g1, ref, rtol=1e-5, atol=1e-7) and torch.allclose(g2, ref, rtol=1e-5, atol=1e-7)
    # and compression resumes once memory is back
    _grad(model, x, y, comp)
    assert comp.stats()["store"]["tensors_in"] > 0


def test_swap_pool_out_of_memory_keeps_blobs_in_place_with_identical_gradients():
    model = _net(wide=1024)
    x, y = _batch()
    clean = _grad(model, x, y, gact.Compressor(model, bits=4, seed=3, swap=True, min_bytes=1024))

    def failures():
        return sum(s["pinned_alloc_failures"] for s in _C.swap_stats() if s["device_arena"] == "host")

    comp = gact.Compressor(model, bits=4, seed=3, swap=True, min_bytes=1024)
    _C._testing_empty_caches()
    before = failures()
    _C._testing_fail_reserves("pinned", 0, 1 << 20)
    try:
        faulted = _grad(model, x, y, comp)
    finally:
        _C._testing_fail_reserves("pinned", 0, 0)
    assert failures() > before
    assert torch.equal(clean, faulted)
    assert _live() == 0


# ---- Compressors and threads -------------------------------------------------------------------


@pytest.mark.parametrize("act", [torch.nn.ReLU, torch.nn.SiLU])
def test_two_threads_in_one_compressor_each_compress_their_own_forward(act):
    """`with comp:` is per thread: both threads' forwards are compressed while they are inside, one
    thread leaving does not end the other's, and the thread that left saves nothing into gact (SiLU:
    nor stores a derivative for a forward outside)."""
    models = [_net(wide=512, act=act), _net(wide=512, act=act)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = _batch()
    ref = _grad(models[0], x, y)
    comp = gact.Compressor(bits=8)
    both_inside = threading.Barrier(2)
    first_left = threading.Event()
    out, errors = {}, []

    def tensors_in():
        return comp.stats()["store"]["tensors_in"]

    def run(i):
        try:
            m, xi = models[i], x.clone()
            with comp:
                h = m[0](xi)  # saves xi
                both_inside.wait(timeout=60)
                if i == 1:
                    first_left.wait(timeout=60)  # thread 0 has left and run a forward outside
                    c = tensors_in()
                loss = F.cross_entropy(m[2](m[1](h)), y)
                if i == 1:
                    out["second_rest"] = tensors_in() - c
            if i == 0:
                c = tensors_in()
                F.cross_entropy(m(xi), y).backward()  # outside `with`, while thread 1 is inside
                out["first_outside"] = tensors_in() - c
                m.zero_grad(set_to_none=True)
                first_left.set()
            loss.backward()
            out[i] = flat_grad(m.parameters())
        except BaseException as e:  # reported by the main thread
            first_left.set()
            errors.append(e)

    run_threads(run, 2)
    assert not errors, errors
    assert out["first_outside"] == 0, "a thread that left `with comp:` still compresses"
    assert out["second_rest"] >= 1, "a thread still inside `with comp:` stopped compressing"
    for i in range(2):
        assert cosine(out[i], ref) > COS_8BIT
    # each thread saved its input, ReLU's output (one blob read by ReLU and Linear 2) and more
    assert comp.stats()["store"]["tensors_in"] >= 2 * (1 + out["second_rest"])


def test_per_compressor_stats_count_only_their_own_tensors_and_leaks():
    gen, disc = _net(wide=512), _net(wide=512)
    cg, cd = gact.Compressor(gen, bits=4), gact.Compressor(disc, bits=4)
    x, y = _batch()
    _grad(gen, x, y, cg)
    with cd:
        kept = F.cross_entropy(disc(x), y)  # a graph alive at step(): one of cd's own leaks
    leaks_g = cg.step()
    leaks_d = cd.step()
    sg, sd = cg.stats()["store"], cd.stats()["store"]
    proc = cg.stats()["store_process"]
    assert sg["owner"] != sd["owner"]
    assert sg["tensors_in"] > 0 and sd["tensors_in"] > 0
    assert proc["tensors_in"] >= sg["tensors_in"] + sd["tensors_in"]
    assert leaks_g == 0 and leaks_d > 0, (leaks_g, leaks_d)
    del kept


def test_compressors_dropped_without_close_are_collected_with_their_hooks():
    model = _net(wide=64)
    n_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    refs = []
    for _ in range(200):
        c = gact.Compressor(model, bits=4)
        refs.append(weakref.ref(c))
        del c
    gc.collect()
    assert all(r() is None for r in refs), "a Compressor is kept alive by its own hooks"
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == n_hooks


def test_auto_policy_compressors_are_collected_too():
    model = _net(wide=64)
    refs = []
    for _ in range(20):
        c = gact.Compressor(model, bits="auto", budget=2)
        refs.append(weakref.ref(c))
        del c
    gc.collect()
    assert all(r() is None for r in refs)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_estimator_with_fixed_bits_is_refused():
    with pytest.raises(ValueError, match="bits='auto'"):
        gact.Compressor(_net(wide=64), bits=2, estimator="probe")
