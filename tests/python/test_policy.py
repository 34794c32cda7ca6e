"""Tests of the adaptive bit policy's Python driver (gact/policy.py, ``bits="auto"``).

* The online formula agrees with the C++ controller's own (add_online_sample).
* Planted sensitivities: four parallel linear layers whose gradients are scaled by
  known factors w_i, so C_i ∝ w_i²; every estimator recovers the ratios and the
  chosen bits follow them.
* resnet18 at 32 px, batch 32: auto+probe at the stored bytes of uniform 2 bits has
  measurably lower gradient variance (one-sided Welch test over seeds, stated below; the 2x
  target is a strict xfail); auto+online is not significantly worse than 1.15x uniform.
* The probe's variance of each stored form against the variance measured with only that
  tensor quantized; a decision measured worse than uniform is not used; a normalization
  input at 1 bit is measured before it is trusted.
* The closure API (``comp.step(closure)``) and its errors.
* Training with auto ends no worse than uniform 2 bits (tolerance stated).
* A dynamic graph (a branch on some steps only) trains under auto.
"""

import math
import warnings

import pytest
import torch

import _gact as _C
import gact
from gact import policy as gpol
from gact import saved as gsaved


def test_online_formula_matches_controller():
    c = _C.PolicyController(budget=2.0)
    c.on_save("k:0", 4096, 32)
    c.add_online_sample("k:0", 123.5, 4096, 256, 7.25, 576.0)
    c.apply_online_estimates()
    got = c.stats()["tensors"]["k:0"]["C"]
    assert got == pytest.approx(gpol.online_sensitivity(123.5, 4096, 256, 7.25, 576.0), rel=1e-12)


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="estimator"):
        gact.Compressor(torch.nn.Linear(4, 4), bits="auto", estimator="magic")


W = (1.0, 4.0, 16.0, 64.0)  # planted gradient scales; C_i ∝ w_i²


class Planted(torch.nn.Module):
    """Four branches u_i = x_i·1 (saved by lin_i), loss Σ w_i·<lin_i(u_i), r>: the noise of
    u_i reaches ∇W_i scaled by w_i and nothing else, so C_i = w_i²·C_1 exactly
    (the u_i are i.i.d., so their range statistics agree up to sampling noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(256, 64, bias=False) for _ in W)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(())
        for i, lin in enumerate(self.lins):
            u = x[i] * 1.0  # a fresh non-input tensor, saved by lin
            out = out + W[i] * (lin(u) * r).sum()
        return out


def _planted_run(estimator: str) -> dict:
    """estimator "replay": the default (the probe, replaying the sampled step, no closure)."""
    m = Planted()
    x = torch.randn(len(W), 64, 256)
    r = torch.randn(64, 64)
    comp = gact.Compressor(m, bits="auto", budget=2, estimator=None if estimator == "replay" else estimator,
                           min_bytes=0, adapt_interval=1)
    assert comp.policy.estimator == ("probe" if estimator == "replay" else estimator)
    for _ in range(3):  # three adaptations, EMA-smoothed
        with comp:
            loss = m(x, r)
        loss.backward()
        m.zero_grad()
        # the closure returns the loss of one forward pass
        comp.step(None if estimator in ("online", "replay") else lambda: m(x, r))
    comp.close()
    return comp.policy.stats()["tensors"]


@pytest.mark.parametrize("estimator", ["online", "probe", "replay", "reference"])
def test_estimator_recovers_planted_sensitivities(estimator):
    t = _planted_run(estimator)
    keys = [f"lins.{i}:0" for i in range(len(W))]
    cs = [t[k]["C"] for k in keys]
    assert all(c is not None and c > 0 for c in cs), t
    # Online: the ratio C_i/C_0 differs from w_i² only through Σ R_g² of i.i.d. data over
    # 64 groups (relative SD of a range² ≈ 10 %, /√64 → ~1.3 % each), so ±15 % is > 8 SD.
    # Reference: one probe has relative SD ≈ 20 % (policy/README.md); with the EMA over 3
    # probes (weights .25,.25,.5 → SD ≈ 0.61·20 % ≈ 12 %) a ratio of two has SD ≈ 17 %:
    # a factor 2 is > 4 SD on the log scale. Probe: (J_iᵀv)² averaged over 16384 elements of
    # u_i with one sign vector v has relative SD ≈ √(2/16384) ≈ 1.1 %, Σ var over i.i.d. data
    # another ~1 %: ±15 % is > 7 SD. Either way the 16× spacing fixes the order.
    tol = 0.15 if estimator in ("online", "probe", "replay") else 1.0
    for i in range(1, len(W)):
        ratio = cs[i] / cs[0] / (W[i] ** 2 / W[0] ** 2)
        assert 1 / (1 + tol) < ratio < 1 + tol, (estimator, i, ratio, cs)
    bits = [t[k]["bits"] for k in keys]
    assert bits == sorted(bits) and bits[0] < bits[-1], bits


def _grad(m, x, y, comp=None):
    m.zero_grad()
    nbytes = 0
    if comp is None:
        loss = torch.nn.functional.cross_entropy(m(x), y)
    else:
        with comp:
            loss = torch.nn.functional.cross_entropy(m(x), y)
        nbytes = _C.store_stored_bytes()
    loss.backward()
    g = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).double()
    if comp is not None:
        comp.step()  # next step: fresh rounding noise
    return g, nbytes


def _arm_errors(m, x, y, g0, comp, k):
    errs, nbytes = [], []
    for _ in range(k):
        g, b = _grad(m, x, y, comp)
        errs.append(float((g - g0).pow(2).sum()))
        nbytes.append(b)
    return errs, max(nbytes)


def _welch_t(a, b, scale_b=1.0):
    """Welch's t for mean(a) − scale_b·mean(b) > 0 (per-seed squared errors are i.i.d. within an arm)."""
    ka, kb = len(a), len(b)
    ma, mb = sum(a) / ka, sum(b) / kb
    va = sum((e - ma) ** 2 for e in a) / (ka - 1)
    vb = sum((e - mb) ** 2 for e in b) / (kb - 1)
    return (ma - scale_b * mb) / math.sqrt(va / ka + scale_b**2 * vb / kb)


@pytest.fixture(scope="module")
def resnet_uniform():
    """resnet18 at 32 px, batch 32: exact gradient, uniform 2-bit errors and stored bytes."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))
    g0, _ = _grad(m, x, y)
    cu = gact.Compressor(m, bits=2)
    eu, bu = _arm_errors(m, x, y, g0, cu, 4)
    cu.close()
    return m, x, y, g0, eu, bu


def _auto_arm(resnet_uniform, estimator, closure=None):
    m, x, y, g0, eu, bu = resnet_uniform
    ca = gact.Compressor(m, bits="auto", budget=2, estimator=estimator, adapt_interval=10**6)
    with ca:
        loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    ca.step(closure)  # step 0 was sampled: one decision now
    assert ca.policy.decisions == 1
    # The same stored bytes (ReLU masks and all): the largest budget whose step fits.
    ca.policy.fit_bytes(lambda: m(x), bu)
    ea, ba = _arm_errors(m, x, y, g0, ca, 4)
    ca.close()
    assert ba <= bu, (ba, bu)
    return ea


@pytest.fixture(scope="module")
def resnet_probe_errors(resnet_uniform):
    m, x, y, _, eu, _ = resnet_uniform
    return _auto_arm(resnet_uniform, "probe", lambda: torch.nn.functional.cross_entropy(m(x[:8]), y[:8]))


def test_resnet18_auto_probe_lower_variance_at_equal_bytes(resnet_uniform, resnet_probe_errors):
    """auto with the probe estimator, at uniform 2 bits' stored bytes, has measurably lower gradient
    variance than uniform 2 bits (measured 1.2x: 395 against 477)."""
    eu, ea = resnet_uniform[4], resnet_probe_errors
    # H0: mean(eu) <= 1.05 mean(ea). Welch with K = 4 per arm (>= 3 dof): reject at one-sided p < 1 %
    # when t > 4.54.
    t = _welch_t(eu, ea, 1.05)
    assert t > 4.54, (sum(eu) / 4, sum(ea) / 4, t, eu, ea)


@pytest.mark.xfail(strict=True, reason="issue 16: uniform 2 bits keeps ReLU outputs as boundary blobs (at least 2 "
                                       "bits) and normalizes BatchNorm inputs; what is left to redistribute gives "
                                       "1.23x at batch 32, and the best allocation of measured per-tensor "
                                       "variances 1.29x (gact-bench policy --oracle): 2x is beyond any allocation "
                                       "of the codec's widths on this model at this budget, per tensor or per group "
                                       "of 256 (1.29x / 1.36x under the probe's model: gact-bench policy "
                                       "--group-ceiling)")
def test_resnet18_auto_probe_halves_variance_at_equal_bytes(resnet_uniform, resnet_probe_errors):
    """The policy issue's target: at least 2x lower variance than uniform 2 bits at equal bytes."""
    eu, ea = resnet_uniform[4], resnet_probe_errors
    t = _welch_t(eu, ea, 2.0)
    assert t > 4.54, (sum(eu) / 4, sum(ea) / 4, t, eu, ea)


def test_resnet18_auto_online_not_worse_at_equal_bytes(resnet_uniform):
    """auto+online at uniform 2 bits' stored bytes stays within 15 % of uniform's variance.

    Not "measurably lower": the online model covers only blobs whose every saver is a
    conv/linear (see gact/policy.py); the rest keep 2 bits (measured: 1.06x uniform's
    variance). It is the fallback; the target needs the probe.
    """
    _, _, _, _, eu, _ = resnet_uniform
    ea = _auto_arm(resnet_uniform, "online")
    # "more than 15 % worse" at one-sided p < 1 % when t > 4.54 (K = 4, >= 3 dof).
    t = _welch_t(ea, eu, 1.15)
    assert t < 4.54, (sum(eu) / 4, sum(ea) / 4, t, eu, ea)


class NotReplayable(torch.nn.Module):
    """Given its batch as nested Python lists, no tensor among its arguments: the sampled step cannot be replayed (a
    model called with tensors as keyword arguments only could not be under torch 1.13 either, whose forward hooks are
    not given them)."""

    def __init__(self) -> None:
        super().__init__()
        # GELU: the second Linear's input is a plain values blob (a ReLU's output would be one blob with
        # the ReLU's mask, which the online estimator leaves out)
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    def forward(self, *, x: list) -> torch.Tensor:
        return self.body(torch.tensor(x))


def test_closure_api_errors():
    m = NotReplayable()
    x = torch.randn(32, 64).tolist()
    with pytest.raises(ValueError, match="adapt_interval"):
        gact.Compressor(m, bits="auto", adapt_interval=0)
    fixed = gact.Compressor(m, bits=4)
    with pytest.raises(ValueError, match="closure"):
        fixed.step(lambda: m(x=x).sum())
    with pytest.raises(TypeError, match="callable"):
        fixed.step(closure=3)
    fixed.close()
    for estimator, closure, err, match in (("probe", None, RuntimeError, "needs a closure"),
                                           ("reference", None, RuntimeError, "needs a closure"),
                                           ("probe", lambda: None, TypeError, "scalar loss")):
        comp = gact.Compressor(m, bits="auto", estimator=estimator, adapt_interval=1)
        with comp:
            loss = m(x=x).sum()
        loss.backward()
        with pytest.raises(err, match=match):
            comp.step(closure)
        comp.close()
        # the model's gradients and hooks are as they were: a plain step still works
        with gact.Compressor(m, bits=2) as c2:
            m(x=x).sum().backward()
        c2.close()


def test_default_probe_falls_back_to_online_with_a_warning():
    """The default estimator is the probe; where it cannot replay the step (no tensor among the call's arguments)
    and has no closure, it says why and the online estimator decides instead."""
    m = NotReplayable()
    x = torch.randn(32, 64).tolist()
    comp = gact.Compressor(m, bits="auto", adapt_interval=1, min_bytes=0)
    assert comp.policy.estimator == "probe"
    for step in range(2):
        with comp:
            loss = m(x=x).sum()
        loss.backward()
        if step == 0:
            with pytest.warns(RuntimeWarning, match="online estimator"):
                comp.step()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # warned once: the online estimator from now on
                comp.step()
    comp.close()
    t = comp.policy.stats()["tensors"]
    assert comp.policy.decisions == 2
    assert t["body.2:0"]["C"] is not None and t["body.2:0"]["C"] > 0, t  # the Linear's input: online covers it


def test_probe_leaves_batch_norm_statistics_alone():
    """The probe's extra forward pass (replayed here) must not move running statistics."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 4))
    x = torch.randn(16, 3, 16, 16)
    comp = gact.Compressor(m, bits="auto", adapt_interval=1)
    with comp:
        loss = m(x).square().mean()
    loss.backward()
    bn = m[1]
    before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    comp.step()
    comp.close()
    assert comp.policy.decisions == 1
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2] == 1
    c = comp.policy.stats()["tensors"]
    assert all(v["C"] is not None for v in c.values()), c  # every tensor estimated by the replay


class SmallNet(torch.nn.Module):
    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.extra = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 8 * 8, 10)
        self.step = 0  # set by the training loop (a probe's forward must not advance it)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        if self.branch and self.step % 3 == 1:  # taken on some steps only
            h = torch.relu(self.extra(h)) + h
        h = torch.relu(self.c2(h))
        h = torch.nn.functional.max_pool2d(h, 2)
        return self.fc(h.flatten(1))


def _train(bits, steps=12, branch=False, adapt=3, estimator=None):
    torch.manual_seed(1)
    m = SmallNet(branch)
    x = torch.randn(16, 3, 16, 16)
    y = torch.randint(0, 10, (16,))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    if bits == "auto":
        comp = gact.Compressor(m, bits=bits, budget=2, estimator=estimator, adapt_interval=adapt)
    else:
        comp = gact.Compressor(m, bits=bits)
    losses = []
    for i in range(steps):
        m.step = i
        with comp:
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        comp.step(None if estimator is None else lambda: torch.nn.functional.cross_entropy(m(x[:4]), y[:4]))
        losses.append(float(loss))
    comp.close()
    return losses, comp


@pytest.mark.parametrize("estimator", [None, "probe"])
def test_training_auto_no_worse_than_uniform_2bit(estimator):
    la, comp = _train("auto", estimator=estimator)
    lu, _ = _train(2)
    assert comp.policy.decisions >= 3
    assert math.isfinite(la[-1]) and la[-1] < la[0]
    # Both arms start from the same weights and batch; with 12 steps the loss falls from
    # ~2.3 to well under 1, and seed-to-seed spread of the last loss at 2 bits is ~0.05:
    # auto must not end higher than uniform by more than 0.1 + 10 %.
    assert la[-1] <= lu[-1] * 1.1 + 0.1, (la, lu)


@pytest.mark.parametrize("estimator", [None, "probe"])
def test_dynamic_graph_trains_under_auto(estimator):
    losses, comp = _train("auto", steps=9, branch=True, adapt=2, estimator=estimator)
    assert all(math.isfinite(v) for v in losses)
    t = comp.policy.stats()["tensors"]
    # The policy's tensors are the values the layers read: b1's input (normalized), c2's input
    # (torch.relu's mask upgraded to values, one blob), fc's input; extra's input exists only
    # on the steps where the branch ran (torch.relu masks and max_pool2d's input, read for its
    # shape, are not policy tensors).
    assert {"b1:0", "c2:0", "fc:0", "extra:0"} <= set(t), sorted(t)
    assert not any(k.startswith("<root>") for k in t), sorted(t)
    assert comp.policy.decisions >= 4
    assert comp.stats()["policy"]["last_decision"]["status"] in ("ok", "infeasible")


def _allreduce_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    est = {"a:0": 1.0 + rank, f"only{rank}:0": 10.0 * (rank + 1), "w:0": [1.0 + rank, 2.0, 3.0 * rank, 0.0]}
    got = gpol._allreduce_mean(est)
    got["spacing"] = gpol._allreduce_max(1000 + 37 * rank)  # the policy's spacing: the largest
    torch.save(got, f"{out_dir}/r{rank}.pt")  # before the teardown, which can hang (evalkit.spawn_ranks)
    dist.destroy_process_group()


def test_estimates_are_averaged_over_ranks(tmp_path):
    """With torch.distributed (gloo, 2 ranks) every rank gets the same per-key means over the
    ranks that saw the key, so the deterministic solve gives every rank the same bits, and the
    same spacing to the next estimate (the largest), so every rank samples the same steps."""
    import socket

    import evalkit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    evalkit.spawn_ranks(_allreduce_worker, (2, port, str(tmp_path)), [tmp_path / f"r{r}.pt" for r in range(2)])
    r0, r1 = torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")
    assert r0 == r1 == {"a:0": 1.5, "only0:0": 10.0, "only1:0": 20.0, "w:0": [1.5, 2.0, 1.5, 0.0], "spacing": 1037}


def _auto_rank_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(3)
    m = StoredForms()
    torch.manual_seed(100 + rank)  # each rank its own batch
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    _grad(m, x, y, comp)
    st = comp.policy.stats()
    out = {"bits": {k: r["bits"] for k, r in st["tensors"].items()}, "check": st.get("last_check"),
           "uniform": comp.policy._uniform}
    comp.close()
    torch.save(out, f"{out_dir}/a{rank}.pt")  # before the teardown, which can hang (evalkit.spawn_ranks)
    dist.destroy_process_group()


def test_ranks_decide_alike_with_their_own_batches(tmp_path):
    """Two ranks (gloo) with different batches: the estimates, the 1-bit measurements and the check
    against uniform are averaged over the ranks, so both use the same widths and the same verdict."""
    import socket

    import evalkit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    evalkit.spawn_ranks(_auto_rank_worker, (2, port, str(tmp_path)), [tmp_path / f"a{r}.pt" for r in range(2)])
    a0, a1 = torch.load(tmp_path / "a0.pt"), torch.load(tmp_path / "a1.pt")
    assert a0["bits"] and a0["bits"] == a1["bits"]
    assert a0["uniform"] == a1["uniform"]
    # the decision differs from uniform here, so it was measured: one verdict from both ranks' runs
    assert a0["check"]["variance_auto"] == a1["check"]["variance_auto"], (a0["check"], a1["check"])


class _SkippedOnRankZero(torch.nn.Module):
    """A block that rank 0 skips (stochastic depth, an early exit, an expert that got no tokens)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
        self.o = torch.nn.Linear(256, 10)

    def forward(self, x, skip):
        h = self.a(x)
        return self.o(h if skip else h + self.b(h))


def _auto_steps_worker(rank, world, port, out_dir, case):
    """Three bits="auto" training steps on each of two gloo ranks: "skip", a block rank 0 skips; "ddp", the Compressor
    given a DistributedDataParallel wrapper. Saves {error, keys, inner (the Compressor took the module inside)}."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if case == "skip":
        m = _SkippedOnRankZero()
        model, forward = m, lambda x: m(x, rank == 0)
    else:
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        model = forward = torch.nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    comp = gact.Compressor(model, bits="auto", budget=2)
    out = {"inner": comp.model is m, "error": None}
    try:
        for i in range(3):
            torch.manual_seed(10 * i + rank)
            x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
            with comp:
                loss = torch.nn.functional.cross_entropy(forward(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            comp.step()
        out["keys"] = sorted(comp.policy.stats()["tensors"])
    except Exception as e:  # (said in the tests' assertions)
        out["error"] = f"{type(e).__name__}: {e}"
    comp.close()
    torch.save(out, f"{out_dir}/{case}{rank}.pt")  # before the teardown, which can hang (evalkit.spawn_ranks)
    dist.destroy_process_group()


def _auto_steps_on_two_ranks(tmp_path, case):
    """_auto_steps_worker's results, rank 0's and rank 1's."""
    import socket

    import evalkit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    files = [tmp_path / f"{case}{r}.pt" for r in range(2)]
    evalkit.spawn_ranks(_auto_steps_worker, (2, port, str(tmp_path), case), files)
    return [torch.load(f) for f in files]


def test_a_block_one_rank_skips_does_not_stop_the_others_decision(tmp_path):
    """A key only some ranks saw: the means over the ranks held it, and a rank that never saw it raised
    "unknown tensor key 'b.0:0' (observe it first)" at its first step() (the other rank then died on the lost
    connection). Each rank now decides for its own tensors, with every rank's means for them."""
    s0, s1 = _auto_steps_on_two_ranks(tmp_path, "skip")
    assert s0["error"] is None and s1["error"] is None, (s0, s1)
    assert not any(k.startswith("b.") for k in s0["keys"]) and any(k.startswith("b.") for k in s1["keys"]), (s0, s1)


class _Branches(torch.nn.Module):
    """A model whose keyword arguments pick the computation (a branch, a scale), and that records its calls."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU())
        self.b = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()) for _ in range(2))
        self.o = torch.nn.Linear(256, 10)
        self.calls = []

    def forward(self, x, branch=0, scale=1.0):
        self.calls.append((branch, scale))
        return self.o(self.b[branch](self.a(x) * scale))


@pytest.mark.skipif(not gact._compat.HAS_HOOK_KWARGS, reason="torch 1.13's forward hooks are not given kwargs")
def test_the_probe_replays_the_forwards_keyword_arguments():
    """`model(x, branch=1, scale=30.)`: the probe replayed `model(x)`, another computation, and estimated the tensors of a
    branch the step never ran (those it did run: unestimated), without a word. The call's keyword arguments are
    kept and replayed with its rows cut like the positional ones."""
    torch.manual_seed(0)
    m = _Branches()
    comp = gact.Compressor(m, bits="auto", budget=2)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    with comp:
        loss = torch.nn.functional.cross_entropy(m(x, branch=1, scale=30.0), y)
    loss.backward()
    comp.step()
    comp.close()
    assert len(m.calls) > 1 and set(m.calls) == {(1, 30.0)}, m.calls
    tensors = comp.policy.stats()["tensors"]
    assert tensors and all(v["C"] is not None for v in tensors.values()), tensors


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(32, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.b(t)), h)  # (reentrant: torch 1.13's default)
        return self.c(h)


def test_the_policy_s_own_runs_give_none_of_the_program_s_warnings():
    """The policy tests whether a model computes its rows apart by running it under no_grad: a reentrant checkpoint
    in it warned that none of its inputs required grad, a warning the program itself never gives, and under
    `-W error` that raise failed the test, changing the replay and the run's losses. gact's own runs now keep the
    program's warnings to themselves."""
    torch.manual_seed(0)
    m = _Checkpointed()
    comp = gact.Compressor(m, bits="auto", budget=2)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
            with comp:
                loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            comp.step()
    comp.close()
    assert not [w for w in caught if "requires_grad" in str(w.message)], [str(w.message) for w in caught]


def test_a_ddp_wrapper_gives_the_compressor_its_module(tmp_path):
    """`Compressor(ddp_model, bits="auto")`: the policy's probe replayed DDP's forward, which prepared a gradient
    reduction the probe never finished: the next forward raised "Expected to have finished reduction in the prior
    iteration" on every rank. The Compressor takes the module inside, whose keys carry no "module." prefix."""
    for d in _auto_steps_on_two_ranks(tmp_path, "ddp"):
        assert d["error"] is None and d["inner"], d
        assert d["keys"] and not any(k.startswith("module.") for k in d["keys"]), d


def test_probe_runs_on_a_transformer_without_falling_back():
    """Regression: the replayed loss saves the recorded output gradient outside the model
    ("<none>:0", no grad); it must be left out of the probe, not fail it."""
    import evalkit as k

    torch.manual_seed(0)
    model = k.CharLM(d_model=48, heads=4, layers=2, ctx=32)
    idx = torch.randint(0, 256, (16, 32))
    comp = gact.Compressor(model, bits="auto", budget=2, adapt_interval=10**6)
    with comp:
        out = model(idx)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 256), idx.reshape(-1))
    loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp.step()
    comp.close()
    t = comp.policy.stats()["tensors"]
    assert comp.policy.decisions == 1
    inside = {key: v for key, v in t.items() if key.startswith("encoder.")}
    assert inside and all(v["C"] is not None for v in inside.values()), t


_SDPA = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
_ATTENTION_CASES = {
    "plain": dict(), "causal": dict(is_causal=True), "scale": dict(scale=0.3),
    "bool-mask": dict(mask="bool"), "float-mask": dict(mask="float"), "learned-bias": dict(mask="learned"),
    "gqa": dict(gqa=True), "masked-row": dict(mask="dead-row"),
}


def _attention_inputs(case, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    heads_kv = 2 if case.get("gqa") else 4
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, heads_kv, 7, 8, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, heads_kv, 7, 8, generator=g, dtype=dtype, requires_grad=True)
    kw = {key: val for key, val in case.items() if key in ("is_causal", "scale")}
    if case.get("gqa"):
        kw["enable_gqa"] = True
    mask = case.get("mask")
    if mask == "bool":
        kw["attn_mask"] = torch.rand(6, 7, generator=g) > 0.3
        kw["attn_mask"][:, 0] = True
    elif mask == "dead-row":
        kw["attn_mask"] = torch.rand(6, 7, generator=g) > 0.3
        kw["attn_mask"][:, 0] = True
        kw["attn_mask"][2] = False  # a query that sees no key: torch's kernels give it 0
    elif mask in ("float", "learned"):
        kw["attn_mask"] = torch.randn(4, 6, 7, generator=g, dtype=dtype).requires_grad_(mask == "learned")
    return q, k, v, kw


@pytest.mark.skipif(_SDPA is None, reason="torch 1.13 has no scaled_dot_product_attention")
@pytest.mark.parametrize("case", list(_ATTENTION_CASES), ids=list(_ATTENTION_CASES))
def test_attention_stand_in_saves_as_torch_and_differentiates_twice(case):
    """The probe's stand-in for scaled_dot_product_attention (torch 2.x's fused kernels have a backward
    without a derivative): the same output and gradients as torch's call (1e-10 in float64), the same
    tensors saved in the same order (so the probe's keys are the step's), and a backward that
    differentiates again: gradgradcheck against finite differences."""
    c = _ATTENTION_CASES[case]
    if c.get("gqa") and "enable_gqa" not in str(getattr(_SDPA, "__doc__", "")):
        pytest.skip("this torch has no enable_gqa")
    q, k, v, kw = _attention_inputs(c)
    leaves = [q, k, v] + ([kw["attn_mask"]] if c.get("mask") == "learned" else [])

    def saves(f):
        got = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: got.append(t) or t, lambda t: t):
            out = f(q, k, v, **kw)
        return out, [(tuple(t.shape), t.dtype) for t in got]

    ref, ref_saves = saves(_SDPA)
    out, out_saves = saves(gsaved._attention_twice_differentiable)
    assert out_saves == ref_saves
    fused = ref.grad_fn.name().startswith(gsaved._FUSED_ATTENTION_NODES)
    assert (type(out.grad_fn).__name__ == "_AttentionFunctionBackward") == fused, ref.grad_fn.name()
    assert torch.allclose(out, ref, rtol=0, atol=1e-10)
    d = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, leaves, d), torch.autograd.grad(ref, leaves, d)):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    if c.get("mask") == "dead-row":
        assert torch.all(out[:, :, 2] == 0)
    assert torch.autograd.gradgradcheck(lambda *x: gsaved._attention_twice_differentiable(
        *x[:3], **dict(kw, **({"attn_mask": x[3]} if len(x) > 3 else {}))), tuple(leaves))


@pytest.mark.skipif(_SDPA is None, reason="torch 1.13 has no scaled_dot_product_attention")
def test_attention_stand_in_with_dropout_matches_its_own_mask():
    """With dropout the stand-in draws its own mask (torch's fused kernels draw theirs from philox state it
    cannot read): output and gradients are those of softmax(q kᵀ/√d) ∘ M/(1−p) · v for that mask, and
    the backward differentiates again."""
    q, k, v, _ = _attention_inputs({})

    def run(q, k, v):
        torch.manual_seed(11)
        return gsaved._AttentionFunction.apply(q, k, v, None, ("q", "k", "v", "out"), {}, 0.4, False, None, False, None)

    torch.manual_seed(11)
    s = q @ k.transpose(-2, -1) / math.sqrt(8)
    attn = torch.softmax(s, -1)
    keep = torch.rand_like(attn) >= 0.4
    ref = (attn * keep / 0.6) @ v
    out = run(q, k, v)
    assert 0.3 < keep.double().mean() < 0.9 and torch.allclose(out, ref, rtol=0, atol=1e-10)
    d = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), d), torch.autograd.grad(ref, (q, k, v), d)):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert torch.autograd.gradgradcheck(run, (q, k, v))


class _BertLike(torch.nn.Module):
    """BERT's shape in small: token and position embeddings, a layer norm, post-norm encoder layers with
    GELU (torch 2.x runs their attention through scaled_dot_product_attention's fused CPU kernel) and a
    classifier on the first token."""

    def __init__(self, d=64, heads=4, layers=3, seq=48):
        super().__init__()
        self.tok = torch.nn.Embedding(512, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        self.norm = torch.nn.LayerNorm(d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, 10)

    def forward(self, idx):
        h = self.norm(self.tok(idx) + self.pos[: idx.shape[1]])
        return self.head(self.encoder(h)[:, 0])


def test_auto_on_a_bert_like_encoder_is_no_worse_than_uniform_at_its_bytes():
    """bits="auto" (budget 2, the probe) on a BERT-shaped encoder: the probe runs without falling back (under
    torch 2.x it replays the fused attention through gact's twice-differentiable stand-in; it used to fail and
    hand over to the online estimator, whose decision on BERT was worse than uniform 2 bits: relative error
    0.88 against 0.74 on an H200), and at uniform 2 bits' stored bytes its gradient error is not
    significantly larger than uniform's: Welch's t for mean(auto) - mean(uniform) stays below 2.35
    (one-sided 5 % with 3 degrees of freedom, 4 rounding seeds per arm)."""
    torch.manual_seed(4)
    m = _BertLike()
    x, y = torch.randint(0, 512, (8, 48)), torch.randint(0, 10, (8,))
    g0, _ = _grad(m, x, y)
    cu = gact.Compressor(m, bits=2)
    eu, bu = _arm_errors(m, x, y, g0, cu, 4)
    cu.close()
    ca = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _grad(m, x, y, ca)  # step 0 is sampled: the probe runs in its step()
    # (a decision measured worse than uniform on the sampled batch is replaced by uniform: that is allowed)
    assert not [w for w in said if "online estimator" in str(w.message)], [str(w.message) for w in said]
    assert ca.policy.decisions == 1
    attn = {k: r for k, r in ca.policy.stats()["tensors"].items() if ".self_attn:" in k and r["decided"]}
    assert len(attn) >= 3 * 4, sorted(attn)  # each layer's projection input, q, k, v (and more) estimated
    ea, ba = _arm_errors(m, x, y, g0, ca, 4)
    ca.close()
    assert ba <= bu * 1.02, (ba, bu)
    assert all(math.isfinite(e) for e in ea + eu)
    t = _welch_t(ea, eu)
    assert t < 2.35, (sum(ea) / 4, sum(eu) / 4, t, ea, eu)


# ---- the budget's meaning: at budget=b, the bytes of uniform b bits -------------------------------


def _step_bytes(model, batch, loss_of, bits, budget=None, steps=3):
    """Bytes the store wrote in the last of `steps` steps (a decision is taken after step 0)."""
    comp = gact.Compressor(model, bits=bits) if budget is None else gact.Compressor(model, bits=bits, budget=budget)
    out = 0
    for _ in range(steps):
        before = comp.stats()["store"]["bytes_stored"]
        with comp:
            loss = loss_of(model, batch)
        out = comp.stats()["store"]["bytes_stored"] - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        comp.step()
    decided = budget is None or comp.policy.decisions >= 1
    comp.close()
    assert decided, "the policy never decided"
    return out


def _vision(name):
    import torchvision
    torch.manual_seed(0)
    m = getattr(torchvision.models, name)(num_classes=10)
    batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    return m, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, activation="gelu")
    m = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2), torch.nn.Flatten(), torch.nn.Linear(64 * 32, 10))
    batch = (torch.randn(8, 32, 64), torch.randint(0, 10, (8,)))
    return m, batch, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("make,budget", [(lambda: _vision("resnet18"), 2), (lambda: _vision("mobilenet_v2"), 4),
                                         (_encoder, 2)], ids=["resnet18-2", "mobilenet_v2-4", "encoder-2"])
def test_budget_stores_the_bytes_of_uniform_bits(make, budget):
    """The whole step (masks, metadata and tensors kept at higher bits by rule included) stores
    what uniform `budget` bits stores, within 2 %, and never more: the policy spends the budget
    differently, not less of it."""
    model, batch, loss_of = make()
    uniform = _step_bytes(model, batch, loss_of, budget)
    auto = _step_bytes(model, batch, loss_of, "auto", budget)
    assert 0.98 * uniform <= auto <= uniform, (auto, uniform, auto / uniform)


def test_fractional_budget_lies_between_its_widths():
    model, batch, loss_of = _vision("resnet18")
    u2 = _step_bytes(model, batch, loss_of, 2)
    u4 = _step_bytes(model, batch, loss_of, 4)
    a3 = _step_bytes(model, batch, loss_of, "auto", 3)
    # uniform bytes are linear in the width (codes), the rest (headers, metadata, masks) is the same
    assert 0.98 * (u2 + u4) / 2 <= a3 <= (u2 + u4) / 2, (u2, a3, u4)


def test_an_infeasible_budget_names_the_smallest_feasible_one():
    # a tensor without an estimate keeps its 4 bits; the other's narrowest is 1 bit: 2.5 bits on average
    c = _C.PolicyController(budget=1.0, default_bits=4)
    c.on_save("kept:0", 256 * 64, 32)
    c.on_save("solved:0", 256 * 64, 32)
    c.add_estimate("solved:0", 1.0)
    d = c.decide()["last_decision"]
    assert d["status"] == "infeasible"
    assert d["min_feasible_budget"] == pytest.approx(2.5)
    c.set_budget(2.5)
    assert c.decide()["last_decision"]["status"] == "ok"


def test_a_budget_below_one_bit_is_refused_by_name():
    with pytest.raises(ValueError, match="budget"):
        gact.Compressor(torch.nn.Linear(4, 4), bits="auto", budget=0.5)


def test_set_model_gives_a_model_less_compressor_an_estimating_policy():
    # gact-run makes its Compressor without a model and gives it the first module trained:
    # from the next step the policy estimates on it (the probe), the keys carry the module
    # names, and the step in which the model arrived is not sampled (its tensors were saved
    # before the policy existed).
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                            torch.nn.Linear(256, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    comp = gact.Compressor(None, bits="auto", budget=3, min_bytes=0)
    assert comp.policy.estimator == "online"  # nothing to replay without a model

    def step():
        opt.zero_grad()
        with comp:
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        comp.step()

    step()
    with comp:
        out = m(x)  # the model arrives in the middle of a step
    comp.set_model(m)
    torch.nn.functional.cross_entropy(out, y).backward()
    comp.step()
    pol = comp.policy
    assert pol.estimator == "probe" and pol.decisions == 0
    step()
    assert pol.decisions == 1
    st = comp.stats()["policy"]
    assert st["last_decision"] is not None and st["budget_avg_bits"] == 3.0
    assert st["last_decision"]["stored_bytes"] <= st["last_decision"]["budget_bytes"]
    estimated = {k for k, t in st["tensors"].items() if t["estimates"] > 0}
    assert estimated and all(k.split(":")[0] in {"0", "1", "2", "3", "4", "<root>"} for k in estimated), st
    with pytest.raises(ValueError, match="has a model already"):
        comp.set_model(m)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        gact.Compressor(None, bits=4).set_model("model")
    comp.close()


def test_sampled_steps_double_early_then_follow_the_interval():
    # Sensitivities measured at initialization alone went stale on a character-level transformer
    # (attention probabilities at 1 bit while they sharpened): the policy re-estimates at steps
    # 10, 20, 40, ... before its first interval, then every adapt_interval steps.
    m = torch.nn.Linear(8, 8)
    pol = gact.Compressor(m, bits="auto").policy
    assert pol.adapt_interval == 1000  # the default
    assert [s for s in range(3001) if pol.samples_at(s)] == [0, 10, 20, 40, 80, 160, 320, 640, 1000, 2000, 3000]
    pol30 = gact.Compressor(m, bits="auto", adapt_interval=30).policy
    assert [s for s in range(100) if pol30.samples_at(s)] == [0, 10, 20, 30, 60, 90]
    pol1 = gact.Compressor(m, bits="auto", adapt_interval=1).policy
    assert all(pol1.samples_at(s) for s in range(50))


def test_reference_estimator_measures_the_width_it_asks_for():
    # The reference estimator replays 8 samples: a batch norm over 2x2 images has 32 values per
    # channel there (a small block, raised to 8 bits by the storage rule) but 128 in the whole batch
    # (1 bit is 1 bit). Measured at 8 bits while asking 1, its inputs looked insensitive (C ~ 0),
    # went to 1 bit, and resnet18's gradient variance came out 9x worse than uniform 2 bits.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x, y = torch.randn(32, 3, 2, 2), torch.randint(0, 10, (32,))
    comp = gact.Compressor(m, bits="auto", budget=2, estimator="reference", adapt_interval=10**6, min_bytes=0)
    with comp:
        loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    comp.step()
    tensors = comp.stats()["policy"]["tensors"]
    c = {k: t["C"] for k, t in tensors.items() if t["C"] is not None}
    top = max(c.values())
    bn_inputs = [k for k in c if k.split(":")[0] in ("1", "4")]
    assert len(bn_inputs) == 2, c
    for k in bn_inputs:
        assert c[k] > 0.01 * top, c  # measured at the width asked (was ~1e-5 of the top)
    comp.close()


# ---- the probe's variances against measurement ----------------------------------------------

class StoredForms(torch.nn.Module):
    """Every stored form the probe models: a plain conv input (the batch copy through a conv), batch-norm
    inputs (normalized), ReLU outputs read by the next conv (boundary blobs), a max-pool output, a
    layer-norm input (normalized per row) and a linear input."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.b2 = torch.nn.BatchNorm2d(16)
        self.c3 = torch.nn.Conv2d(16, 8, 3, padding=1)
        self.ln = torch.nn.LayerNorm(8 * 8 * 8)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)))
        h = torch.nn.functional.max_pool2d(h, 2)
        h = self.c3(h)
        return self.fc(self.ln(h.flatten(1)))


def _stored_forms():
    torch.manual_seed(3)
    m = StoredForms()
    x = torch.randn(8, 3, 16, 16)
    y = torch.randint(0, 10, (8,))
    g0, _ = _grad(m, x, y)
    return m, x, y, g0


@pytest.fixture(scope="module")
def stored_forms_probe():
    m, x, y, g0 = _stored_forms()
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    comp.policy.probe_vectors = 128
    comp.policy.probe_memory = None  # the whole batch, as measured below (not fewer rows to fit in memory)
    _grad(m, x, y, comp)  # sampled: the probe runs in step()
    tensors = {k: r for k, r in comp.policy.stats()["tensors"].items() if r["variance"] is not None}
    comp.close()
    return m, x, y, g0, tensors


def _probe_against_measured(stored_forms_probe, keys, widths=((2, 1), (4, 2))):
    m, x, y, g0, tensors = stored_forms_probe
    out = []
    for bits, col in widths:
        for key in keys:
            r = tensors[key]
            if r["min_bits"] > bits:
                continue
            c = gact.Compressor(m, bits=2, policy=gact.policy.FixedWidths({key: bits}))
            errs, _ = _arm_errors(m, x, y, g0, c, 24)
            c.close()
            measured = sum(errs) / len(errs)
            out.append((key, bits, r["variance"][col], measured, r["variance"][col] / measured))
    return out


def test_probe_variance_of_each_tensor_matches_its_measured_variance(stored_forms_probe):
    """The probe's variance of each tensor at 2 and 4 bits, in the form the store keeps it (boundary blobs,
    normalized batch-norm inputs, plain values), against the gradient variance measured with only that
    tensor quantized (every other exact), the whole batch replayed (8 samples).

    Bounds: the measured mean over 24 seeds has a relative standard error of about 0.2/sqrt(24) = 4 %
    (one seed's squared error spreads ~20 % here); the probe with 128 sign vectors about 0.2/sqrt(128)
    = 2 % for most tensors, but a layer norm's input couples each row through x̂·mean(δ·x̂), and its
    Hutchinson estimate is far noisier (16 vectors: 1.5x; 128: 1.2x; finite differences of the native
    backward agree with the measurement). A ratio outside [0.7, 1.45] is then > 5 combined standard
    errors. The 1-bit model scaled by v(b), used before, put boundary blobs at 1/2.25 of their 2-bit
    variance and fails this test."""
    tensors = stored_forms_probe[4]
    assert len(tensors) >= 6, sorted(tensors)
    assert any(r["min_bits"] == 2 for r in tensors.values()), "no boundary blob among the keys"
    for key, bits, predicted, measured, ratio in _probe_against_measured(stored_forms_probe, sorted(tensors)):
        assert 0.7 < ratio < 1.45, (key, bits, predicted, measured, ratio)


class _Activations(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.act1 = torch.nn.Linear(32, 64), torch.nn.SiLU()
        self.b, self.act2 = torch.nn.Linear(64, 64), torch.nn.GELU()
        self.c = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.c(self.act2(self.b(self.act1(self.a(x)))).mean(1))


def test_probe_variance_of_activation_derivatives_matches_their_measured_variance():
    """Under bits="auto" the inputs of SiLU and GELU are stored as the activation's derivative f'(x), as with
    fixed bits; the probe estimates f'(x)'s own variance (its leaf, which the stand-in's backward multiplies
    by: the unpacked save is tied to the saved input, and with it the estimate was 0 and the decision put
    those tensors at 1 bit, measured 4 500x worse than uniform on efficientnet_b0). Each activation's
    estimate at 2 and 4 bits within [0.7, 1.45] of its measured variance (24 seeds; bounds as above)."""
    torch.manual_seed(3)
    m = _Activations()
    x, y = torch.randn(8, 16, 32), torch.randint(0, 10, (8,))
    g0, _ = _grad(m, x, y)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    comp.policy.probe_vectors = 128
    comp.policy.probe_memory = None
    _grad(m, x, y, comp)
    tensors = {k: r for k, r in comp.policy.stats()["tensors"].items() if r["variance"] is not None}
    comp.close()
    assert {"act1:0", "act2:0"} <= set(tensors), sorted(tensors)
    rows = _probe_against_measured((m, x, y, g0, tensors), ["act1:0", "act2:0"])
    assert len(rows) == 4
    for key, bits, predicted, measured, ratio in rows:
        assert 0.7 < ratio < 1.45, (key, bits, predicted, measured, ratio)


def _probed_sequences(m, vectors=128):
    """A sampled auto step of ``m`` on 8 random sequences of 16 x 32 (the probe on the whole batch with
    ``vectors`` sign vectors): (m, x, y, g0, the estimated tensors, {key: size} of the step's saves, {key:
    size} of the probe's)."""
    x = torch.randn(8, 16, 32)
    y = torch.randint(0, 10, (8,))
    g0, _ = _grad(m, x, y)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    comp.policy.probe_vectors = vectors
    comp.policy.probe_memory = None
    probed = {}
    real = gpol.AutoPolicy._probe_estimates

    def spy(self, closure, copy_inputs=False):
        est = real(self, closure, copy_inputs)
        probed.update(self._probe_numels)
        return est

    gpol.AutoPolicy._probe_estimates = spy
    try:
        with comp:
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        saved = {k: math.prod(r["shape"]) for k, r in comp.policy._saved.items()}
        comp.step()
    finally:
        gpol.AutoPolicy._probe_estimates = real
    tensors = {k: r for k, r in comp.policy.stats()["tensors"].items() if r["variance"] is not None}
    comp.close()
    return m, x, y, g0, tensors, saved, probed


class _Attention(torch.nn.Module):
    """A projection, one multi-head attention (its projections, products and softmax run as functional
    calls inside the one module) and a head."""

    def __init__(self, weights=False):
        super().__init__()
        self.inp = torch.nn.Linear(32, 32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 10)
        self.weights = weights

    def forward(self, t):
        h = self.inp(t)
        o, w = self.attn(h, h, h, need_weights=self.weights)
        out = self.head(o.mean(1))
        if w is not None:  # the returned weights read outside any module
            out = out + 3.0 * (w * w).sum((1, 2))[:, None] * torch.linspace(-1, 1, 10)
        return out


@pytest.mark.parametrize("weights", [False, True], ids=["output", "output-and-weights"])
def test_probe_variance_of_attention_internals_matches_their_measured_variance(weights):
    """Inside torch.nn.MultiheadAttention the probe cuts at the inputs of its products and softmax, so
    that q, k, v, the attention matrix and the output projection's input each get their own derivative.
    Without those cuts each collected the derivatives of the tensors saved after it through the forward
    graph (v: 30-60x its measured variance on a 3-layer encoder, q and k 2-4x). The attention's width
    (32) is not a multiple of the group size, so its time-first tensors put several rows in a group and
    the rows are replayed together (in one-row passes the output projection's input measured 0.56-0.77
    of its variance over seeds 5-7). Bounds as in the test above ([0.7, 1.45], > 5 combined standard
    errors); and the functions the probe wraps are torch's own again once it ends. With the attention
    weights returned and read outside any module, the attention's outputs are cut too (uncut, the
    softmax output's estimate was 2.5x its variance)."""
    torch.manual_seed(5)
    originals = (torch.bmm, torch.baddbmm, torch.matmul, torch.nn.functional.linear, torch.nn.functional.softmax)
    m, x, y, g0, tensors, _, _ = _probed_sequences(_Attention(weights))
    assert (torch.bmm, torch.baddbmm, torch.matmul, torch.nn.functional.linear,
            torch.nn.functional.softmax) == originals
    inner = sorted(k for k in tensors if k.startswith("attn:"))
    assert len(inner) >= 4, sorted(tensors)  # q, k, v, the attention matrix, the projection's input
    ratios = _probe_against_measured((m, x, y, g0, tensors), inner, widths=((2, 1),))
    for key, bits, predicted, measured, ratio in ratios:
        assert 0.7 < ratio < 1.45, (key, bits, predicted, measured, ratio)


class _CrossAttention(torch.nn.Module):
    """Self-attention over one sequence's projection, cross-attention from it to another's (keys and values
    from the context: the packed projection weight is split into views), and a decoder layer (its second
    attention is cross-attention too)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, 32)
        self.ctx = torch.nn.Linear(32, 32)
        self.cross = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.dec = torch.nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, t):
        h, c = self.inp(t), self.ctx(t.flip(1))
        h = h + self.cross(h, c, c, need_weights=False)[0]
        return self.head(self.dec(h, c).mean(1))


def test_probe_keys_of_cross_attention_are_the_steps():
    """Cross-attention splits its packed projection weight into views that have a graph; the probe's cuts
    inside the attention must leave them alone (cut, they were saved and keyed as activations, and every
    later key of the module moved: the probe's estimates went to the wrong tensors, 0x to 175x their
    measured variances). Every tensor the probe estimates has the step's key and size, and each of the
    cross-attention's tensors is within [0.6, 1.6] of its measured variance (32 sign vectors: a looser
    bound than the tests above, which use 128)."""
    torch.manual_seed(2)
    m, x, y, g0, tensors, saved, sizes = _probed_sequences(_CrossAttention(), vectors=32)
    cross = sorted(k for k in tensors if k.startswith("cross:"))
    assert len(cross) >= 4 and any(k.startswith("dec.multihead_attn:") for k in tensors), sorted(tensors)
    assert sizes and all(saved.get(k) == n for k, n in sizes.items()), \
        {k: (n, saved.get(k)) for k, n in sizes.items() if saved.get(k) != n}
    for key, bits, predicted, measured, ratio in _probe_against_measured((m, x, y, g0, tensors), cross,
                                                                           widths=((2, 1),)):
        assert 0.6 < ratio < 1.6, (key, bits, predicted, measured, ratio)


def test_inner_cuts_act_only_in_the_probing_threads_attention_calls():
    """The functions the probe wraps act only inside an attention call of the thread that runs its forward:
    another thread running the same attention (the module hooks are the model's, for every thread) gets
    no cuts, nor do the probing thread's products outside the attention; inside it they are cut, an
    in-place write to the attention's returned output is allowed, and every wrapped function is torch's
    own again afterwards."""
    import threading

    funcs = (torch.matmul, torch.bmm, torch.nn.functional.linear, torch.nn.functional.softmax)
    attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    cuts = []
    with gpol._InnerCuts(cuts, gpol._ProbeRecorder(256), torch.nn.ModuleList([attn])) as ic:
        assert torch.matmul is not funcs[0]  # wrapped while the probe's forward runs

        def other():
            z = torch.randn(2, 3, 32, requires_grad=True) * 2
            attn(z, z, z)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert ic.depth == 0 and cuts == []
        a = torch.randn(4, 32, requires_grad=True) * 2  # a forward graph: cut only inside the attention
        a @ torch.randn(32, 2)
        assert cuts == []
        o, _ = attn(a.view(1, 4, 32), a.view(1, 4, 32), a.view(1, 4, 32), need_weights=False)
        assert ic.depth == 0 and len(cuts) > 2
        o += 1  # the returned output is an alias, not the leaf of its cut
    assert (torch.matmul, torch.bmm, torch.nn.functional.linear, torch.nn.functional.softmax) == funcs


def test_attention_narrower_than_a_group_replays_its_rows_together():
    """Multi-head attention lays its rows time first: at a width that is not a multiple of the group size a
    group holds parts of several rows, and one-row passes would group its tensors otherwise than the step."""
    def mha(width):
        return torch.nn.Sequential(torch.nn.Linear(width, width)), torch.nn.MultiheadAttention(width, 4)

    assert gpol._groups_span_rows(torch.nn.ModuleList(mha(32)), 256)
    assert gpol._groups_span_rows(torch.nn.ModuleList(mha(384)), 256)
    assert not gpol._groups_span_rows(torch.nn.ModuleList(mha(512)), 256)
    assert not gpol._groups_span_rows(torch.nn.Linear(32, 32), 256)


def test_a_decision_measured_worse_than_uniform_is_not_used(monkeypatch):
    """Estimates turned upside down (the most sensitive tensor looks the least): the decision is measured
    against uniform 2 bits on the sampled batch, found worse, and every tensor keeps 2 bits, with a warning
    and the measurement in the stats."""
    m, x, y, g0 = _stored_forms()
    real = gpol.AutoPolicy._probe_estimates

    def upside_down(self, closure):
        est = real(self, closure)
        top = max(v[1] for v in est.values())
        return {k: [top * top / max(w, 1e-30) for w in v] for k, v in est.items()}

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", upside_down)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with pytest.warns(RuntimeWarning, match="using uniform 2 bits"):
        _grad(m, x, y, comp)
    check = comp.policy.stats()["last_check"]
    assert check["used"] == "uniform" and check["variance_auto"] > check["variance_uniform"], check
    keys = [k for k, r in comp.policy.stats()["tensors"].items() if r["decided"]]
    assert keys and all(comp.policy.bits_for(k, 1) == 2 for k in keys)
    comp.close()
    # the honest estimates: the decision is used
    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", real)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _grad(m, x, y, comp)
    check = comp.policy.stats()["last_check"]
    assert check.get("used", "auto") == "auto" or check.get("same_as_uniform"), check
    comp.close()


class _Normalize(torch.nn.Module):
    def forward(self, k):
        return torch.nn.functional.normalize(k, dim=-1)


class _PaddedCosine(torch.nn.Module):
    """Zero tokens padded onto a sequence and normalized, as a padded window's keys are in cosine attention:
    a norm of a zero vector, whose second derivative is not finite (NaN in the probe's double backward)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(32, 64)
        self.key = torch.nn.Linear(64, 64, bias=False)
        self.norm = _Normalize()
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        k = self.key(torch.nn.functional.pad(h, (0, 0, 0, 8)))  # 8 zero tokens: their keys are zero vectors
        return self.head(self.norm(k)[:, :-8].mean(1))


def test_a_tensor_whose_estimate_is_not_finite_keeps_the_default_width():
    """The probe's variance of the keys fed to F.normalize is NaN (the norm's second derivative at the zero
    keys). It is left without an estimate: the step goes on, with one warning naming it, and it keeps
    default_bits while the other tensors are decided."""
    torch.manual_seed(0)
    m = _PaddedCosine()
    x, y = torch.randn(8, 24, 32), torch.randint(0, 10, (8,))
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with pytest.warns(RuntimeWarning, match=r"estimate of 1 tensor\(s\) is not finite \(the first: 'norm:0'\)"):
        _grad(m, x, y, comp)
    pol = comp.policy
    assert pol.stats()["nonfinite_estimates"] == 1
    tensors = pol.stats()["tensors"]
    assert not tensors["norm:0"]["decided"] and pol.bits_for("norm:0", 1) == 2, tensors
    assert pol.stats()["last_decision"]["unestimated"] >= 1
    assert [k for k, r in tensors.items() if r["decided"]], tensors  # the others are decided
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # said once
        g, _ = _grad(m, x, y, comp)
    assert torch.isfinite(g).all()
    comp.close()


def test_a_check_measured_as_not_finite_uses_uniform(monkeypatch):
    """The decision's gradient variance measured as NaN (a gradient that overflowed in the check's runs) is
    not taken for better than uniform's."""
    m, x, y, g0 = _stored_forms()
    real = gpol.AutoPolicy._pair_variance
    calls = []

    def nan_for_the_decision(self, params, widths, seeds, closure):
        v = real(self, params, widths, seeds, closure)
        if len(widths) == 1:
            return v  # a 1-bit check
        calls.append(dict(widths))
        return float("nan") if set(widths.values()) != {2} else v  # the decision's, not uniform's

    monkeypatch.setattr(gpol.AutoPolicy, "_pair_variance", nan_for_the_decision)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with pytest.warns(RuntimeWarning, match="using uniform 2 bits"):
        _grad(m, x, y, comp)
    assert comp.policy.stats()["last_check"]["used"] == "uniform"
    assert len(calls) == 2 and calls[0] != calls[1]
    comp.close()


def test_a_normalization_input_at_one_bit_is_measured_first(monkeypatch):
    """A batch-norm input made to look insensitive goes to 1 bit in the first solve; its 1-bit variance is
    then measured (the probe's first-order model misses the second-order term of the normalization's
    backward), the record takes the measurement, and the solve is redone."""
    m, x, y, g0 = _stored_forms()
    real = gpol.AutoPolicy._probe_estimates
    target = "b2:0"

    def hide(self, closure):
        est = real(self, closure)
        assert target in est, sorted(est)
        est[target] = [v * 1e-6 for v in est[target]]
        return est

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", hide)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    _grad(m, x, y, comp)
    rec = comp.policy.stats()["tensors"][target]
    comp.close()
    assert comp.policy.verified >= 1
    # the measured 1-bit variance replaced the hidden estimate (a millionth of the probe's)
    c = gact.Compressor(m, bits=2, policy=gact.policy.FixedWidths({target: 1}))
    errs, _ = _arm_errors(m, x, y, g0, c, 16)
    c.close()
    measured = sum(errs) / len(errs)
    assert rec["variance"][0] > 0.3 * measured, (rec, measured)



def test_a_one_bit_measurement_that_is_not_finite_leaves_the_decision_to_the_check(monkeypatch):
    """The 1-bit verification measures an infinite variance (a gradient that overflowed): the step goes on
    (no finite variance to raise the record to), it is counted, and the check against uniform decides."""
    m, x, y, g0 = _stored_forms()
    real = gpol.AutoPolicy._probe_estimates
    target = "b2:0"

    def hide(self, closure):
        est = real(self, closure)
        est[target] = [v * 1e-6 for v in est[target]]
        return est

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", hide)
    monkeypatch.setattr(gpol.AutoPolicy, "_measure", lambda self, params, key, closure: math.inf)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    _grad(m, x, y, comp)
    assert comp.policy.verified >= 1 and comp.policy.stats()["nonfinite_estimates"] >= 1
    assert comp.policy.stats()["last_check"] is not None
    comp.close()


def test_fixed_widths_pins_each_key_and_rejects_bad_widths():
    class Recording(gact.policy.FixedWidths):
        def on_stored(self, key, info):
            stored[key] = info["bits"]

    stored = {}
    torch.manual_seed(0)
    # (Softplus: its derivative stored as values, read linearly, at any width; ELU's and tanh's saves keep 4 bits at
    # least)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Softplus(), torch.nn.Linear(64, 64),
                            torch.nn.Softplus(), torch.nn.Linear(64, 4))
    comp = gact.Compressor(m, policy=Recording({"1:0": 8}, default=2), min_bytes=0)
    with comp:
        m(torch.randn(32, 64)).sum().backward()
    comp.step()
    comp.close()
    # the first Softplus's derivative, pinned, and the second's, at the default
    assert stored.get("1:0") == 8 and stored.get("3:0") == 2, stored
    for bad in ({"a": 3}, {"a": True}, {"a": "8"}):
        with pytest.raises(ValueError, match="FixedWidths: a="):
            gact.policy.FixedWidths(bad)
    with pytest.raises(ValueError, match="default=16"):
        gact.policy.FixedWidths({}, default=16)


# ---- the probe's memory: cuts without copies, one set of gradients in the checks ------------------

class SharedReads(torch.nn.Module):
    """A tensor read by two modules (a residual block's input, read by its first convolution and by
    its downsampling one), a ReLU module's output read by both, an in-place ReLU after a batch norm,
    and a leaf module that writes its input (the batch norm's output) in place without an ``inplace``
    attribute (``Doubles``), when asked to."""

    class Doubles(torch.nn.Module):
        def forward(self, x):
            return x.mul_(2.0)

    def __init__(self, doubles: bool = False) -> None:
        super().__init__()
        self.c0 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.r0 = torch.nn.ReLU()
        self.ca = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.cb = torch.nn.Conv2d(8, 8, 1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.r1 = torch.nn.ReLU(inplace=True)
        self.doubles = SharedReads.Doubles() if doubles else None
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = self.r0(self.c0(x))
        h = self.bn(self.ca(h) + self.cb(h))
        if self.doubles is not None:
            h = self.doubles(h)  # (before the ReLU, which saves its output: doubling that raises in torch too)
        return self.fc(self.r1(h).flatten(1))


def _classifier_head():
    """vgg's classifier, narrower: Linear, ReLU(inplace), Dropout, twice. With copies at the cuts, the
    ReLU's copy given to the dropout was freed and its address reused by the dropout's output of the
    same shape, which then passed for the ReLU's output (a boundary blob: 0.24x the 1-bit variance)."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(256, 256), nn.ReLU(True),
                         nn.Dropout(0.5), nn.Linear(256, 10))


class SquaredLeaf(torch.nn.Module):
    """A tensor saved by a functional op (tanh's result) and then twice by a leaf module (x * x saves its
    input twice): a correlated call, whose two saves are one blob of their own in the store (a group: tanh's
    backward reads its own save), and one record of their own in the probe, with or without copies."""

    class Square(torch.nn.Module):
        def forward(self, x):
            return x * x

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Linear(32, 64)
        self.sq = SquaredLeaf.Square()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        t = torch.tanh(self.c1(x))
        return self.fc(self.sq(t) + t)


@pytest.mark.parametrize("model", ["inplace-attribute", "undeclared-in-place", "dropout-after-inplace-relu",
                                   "leaf-saving-twice"])
def test_probe_cuts_without_copies_estimate_what_copies_do(monkeypatch, model):
    """The probe cuts the forward graph at every leaf module's inputs with leaves that share the input's
    storage (no copy of the sampled rows' activations). Its estimates must equal those of cuts made with
    copies (the same signs: one seed): a tensor two modules save is one blob whose noise enters both
    uses, so the derivative of each use must be summed (missing the second use changed the estimate
    of a residual block's input by 8 % on resnet18). A module that writes its input in place without
    saying so makes the probe run again with copies (so that case shows the retry works, without a
    fallback; it compares copies with copies). A leaf module saving its input twice adds its cut once. A clamp's
    output is recognized by identity, so the tensors noted as clamps are held while the probe runs: a
    freed one's address taken by another tensor of its shape gave that tensor a boundary form."""
    torch.manual_seed(5)
    if model == "dropout-after-inplace-relu":
        m, x = _classifier_head(), torch.randn(8, 64)
    elif model == "leaf-saving-twice":
        m, x = SquaredLeaf(), torch.randn(8, 32)
    else:
        m, x = SharedReads(model == "undeclared-in-place"), torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 10, (8,))
    real = gpol.AutoPolicy._probe_estimates
    got = {}

    def both(self, closure, copy_inputs=False):
        torch.manual_seed(11)  # the same dropout masks in both
        got["copies"] = real(self, closure, copy_inputs=True)
        torch.manual_seed(11)
        got["leaves"] = real(self, closure)
        return got["leaves"]

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", both)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6, min_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the online estimator
        _grad(m, x, y, comp)
    comp.close()
    assert not comp.policy._probe_disabled
    a, b = got["copies"], got["leaves"]
    assert sorted(a) == sorted(b) and len(a) >= 2, (sorted(a), sorted(b))
    if model in ("inplace-attribute", "undeclared-in-place"):
        shared = [k for k in a if k.startswith("ca:")]
        assert shared and a[shared[0]][0] > 0, a  # the block input read by ca and cb: one blob, one estimate
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), (k, a[k], b[k])


def test_pair_variance_holds_one_set_of_gradients_and_measures_the_same():
    """The checks' variance from two runs: the second run accumulates into the first's gradients negated
    (one parameter-sized set held, not two); the result is ‖g_a − g_b‖²/2 of the two runs made apart,
    to float32 rounding (the order of additions differs only for parameters used twice)."""
    m, x, y, _ = _stored_forms()
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    pol = comp.policy
    params = [p for p in m.parameters() if p.requires_grad]

    def closure():
        return torch.nn.functional.cross_entropy(m(x), y)

    widths = {k: 2 for k in ("c2:0", "b2:0", "fc:0")}
    user = [torch.full_like(p, 7.0) for p in params]
    for p, u in zip(params, user):
        p.grad = u
    with pol._extra_runs(params):
        got = pol._pair_variance(params, widths, (11, 12), closure)
    assert all(p.grad is u for p, u in zip(params, user))  # the user's gradients are back, untouched
    assert all(bool((u == 7.0).all()) for u in user)
    with pol._extra_runs(params):
        a = [g.clone() if g is not None else None for g in pol._grads(params, widths, 11, closure)]
        b = pol._grads(params, widths, 12, closure)
    want = sum(float((ga.double() - gb.double()).pow(2).sum()) for ga, gb in zip(a, b) if ga is not None) / 2
    assert want > 0
    assert got == pytest.approx(want, rel=1e-5)

    # a closure that zeroes the gradients first (as an optimizer's closure does), and one that runs backward
    # itself: the same measurement (the first run's gradients are never where the closure can clear them)
    def zeroing():
        m.zero_grad(set_to_none=False)
        return closure()

    def backward_itself():
        m.zero_grad(set_to_none=False)
        closure().backward()

    for c in (zeroing, backward_itself):
        with pol._extra_runs(params):
            assert pol._pair_variance(params, widths, (11, 12), c) == pytest.approx(want, rel=1e-5), c.__name__
    comp.close()


class WritesItsInput(torch.nn.Module):
    """Writes the batch after a layer saved it: plain torch refuses the backward, and so does gact (issue 33
    row 2). The probe's cut of the batch shares its version counter, so the probe must run with copies."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.lin2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        y = self.lin(x)
        x.add_(1.0)
        return self.lin2(torch.tanh(y) * x)


def test_probe_runs_again_with_copies_when_a_cut_input_is_written_after_its_save(monkeypatch):
    torch.manual_seed(0)
    m = WritesItsInput()
    y = torch.randint(0, 4, (32,))
    calls = []
    real = gpol.AutoPolicy._probe_once

    def counting(self, closure, copy_inputs):
        r = real(self, closure, copy_inputs)
        calls.append((copy_inputs, r is None))
        return r

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_once", counting)
    comp = gact.Compressor(m, bits="auto", budget=2, min_bytes=0, adapt_interval=10**6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the online estimator
        with comp:
            loss = torch.nn.functional.cross_entropy(m(torch.randn(32, 16)), y)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()  # as torch refuses it
        del loss
        # the probe replays the step through a closure, cutting at the batch that the model writes
        comp.step(lambda: torch.nn.functional.cross_entropy(m(torch.randn(8, 16)), y[:8]))
    assert calls == [(False, True), (True, False)], calls
    assert any(r["variance"] for r in comp.policy.stats()["tensors"].values())
    comp.close()


def test_a_probe_saved_tensor_modified_in_place_is_refused():
    """The probe keeps no copy of what autograd saves: a saved tensor changed in place afterwards is
    refused by name (as autograd refuses it), never used with its new values."""
    t = torch.randn(4, 5)
    h = gpol._ProbeSaved(t)
    assert h.probe_unpack() is t
    t.add_(1.0)
    with pytest.raises(RuntimeError, match=r"shape \[4, 5\] saved for backward was modified by an in-place"):
        h.probe_unpack()


# ---- the estimates' share of training time ----------------------------------------------------------

def _drive_schedule(monkeypatch, step_s, cost_s, steps, sampled_extra_s=0.0, after_extra_s=0.0, **kw):
    """A policy driven by a fake clock: each user step takes step_s seconds (a sampled one
    sampled_extra_s more, the one after an estimate after_extra_s more), each estimate cost_s.
    The steps it samples, and the policy."""
    clock = [0.0]
    monkeypatch.setattr(gpol, "_now", lambda: clock[0])

    def estimate(self):
        clock[0] += cost_s
        return {}

    monkeypatch.setattr(gpol.AutoPolicy, "_online_estimates", estimate)
    comp = gact.Compressor(torch.nn.Linear(8, 8), bits="auto", estimator="online", **kw)
    pol = comp.policy
    sampled = [0]  # the Compressor samples its first step
    estimated = False
    for s in range(1, steps + 1):
        clock[0] += step_s + (sampled_extra_s if pol._sampling else 0.0) + (after_extra_s if estimated else 0.0)
        estimated = pol._sampling  # on_step estimates now
        pol.on_step(s)
        if pol._sampling:
            sampled.append(s)
    comp.close()
    return sampled, pol


def test_default_interval_holds_each_estimate_to_one_percent_of_the_training_time_since_the_last(monkeypatch):
    """With the default adapt_interval, an estimate that costs 40 ordinary steps waits 100 x 40 steps after
    the previous one (its cost is then 1 % of the training time between them), not 1000; the early
    estimates (10, 20, ..., 640) keep their steps; estimates that cost less than 10 steps keep the
    interval. The spacing uses the median step time, so one slow step does not move it."""
    early = [0, 10, 20, 40, 80, 160, 320, 640]
    sampled, pol = _drive_schedule(monkeypatch, step_s=0.25, cost_s=10.0, steps=20000)
    assert pol.max_overhead == 0.01
    assert sampled[:8] == early, sampled
    regular = sampled[8:]
    assert len(regular) >= 3, sampled
    # 10 s / (1 % of 0.25 s) = 4000 steps after each estimate (+1: the estimate runs at the next step's start)
    gaps = [b - a for a, b in zip([640] + regular, regular)]
    assert all(4000 <= g <= 4002 for g in gaps), gaps
    sched = pol.stats()["schedule"]
    regular_cost = 10.0 * len(regular)
    assert regular_cost <= 0.01 * (sched["train_seconds"] - 0.25 * 640) * (1 + 1e-9)
    assert sched["next_regular_step"] > regular[-1]
    # cheap estimates: every adapt_interval steps, as before
    sampled, _ = _drive_schedule(monkeypatch, step_s=0.25, cost_s=0.5, steps=5000)
    assert sampled == early + [1000, 2000, 3000, 4000, 5000], sampled


@pytest.mark.parametrize("extra", ["sampled_extra_s", "after_extra_s"])
def test_what_an_estimate_adds_to_the_steps_counts_as_its_cost(monkeypatch, extra):
    """A sampled step slower than the others (the estimators' hooks run in it), or the step after an
    estimate (it reserves its memory afresh: the estimate returned the host arena's free segments):
    the difference to the median step counts as estimate time, not training time, and spaces the
    estimates too."""
    sampled, pol = _drive_schedule(monkeypatch, step_s=0.25, cost_s=5.0, steps=12000, **{extra: 5.0})
    regular = sampled[8:]
    gaps = [b - a for a, b in zip([640] + regular, regular)]
    assert regular and all(4000 <= g <= 4002 for g in gaps), gaps  # (5 + 5) s at 1 % of 0.25 s
    sched = pol.stats()["schedule"]
    # every estimate but step 0's carries its 5 s (before step 0's, and after it, no ordinary step
    # has been measured to compare with: that step counts as training)
    assert sched["estimate_seconds"] == pytest.approx(5.0 * len(sampled) + 5.0 * (len(sampled) - 1))
    assert sched["train_seconds"] == pytest.approx(0.25 * 12000 + 5.0)


def test_an_interval_the_user_chose_is_kept_whatever_the_estimates_cost(monkeypatch):
    sampled, pol = _drive_schedule(monkeypatch, step_s=0.25, cost_s=10.0, steps=3000, adapt_interval=1000)
    assert pol.max_overhead is None and pol.stats()["schedule"]["max_overhead"] is None
    assert sampled == [0, 10, 20, 40, 80, 160, 320, 640, 1000, 2000, 3000], sampled
    before = gact.options()["adapt_interval"]
    try:
        gact.configure(adapt_interval=500)  # configured to another value: the user's choice too
        sampled, pol = _drive_schedule(monkeypatch, step_s=0.25, cost_s=10.0, steps=1500)
        assert pol.max_overhead is None
        assert sampled == [0, 10, 20, 40, 80, 160, 320, 500, 1000, 1500], sampled
    finally:
        gact.configure(adapt_interval=before)
    with pytest.raises(ValueError, match="max_overhead"):
        gpol.AutoPolicy(gact.Compressor(torch.nn.Linear(2, 2), bits=2), 2, max_overhead=1.5)


class _GateBackward(torch.autograd.Function):
    """The gate's gradient, recorded under create_graph as a node whose own backward is not implemented (what
    torch 1.13 records for hardsigmoid_backward): the error comes when a double backward reaches it."""

    @staticmethod
    def forward(ctx, grad, h):
        return grad * ((h > -3) & (h < 3)).to(grad.dtype) * (1.0 / 6.0)

    @staticmethod
    def backward(ctx, _gg):
        raise RuntimeError("derivative for gate_backward is not implemented")


class _GateWithoutSecondDerivative(gsaved._HardsigmoidFunction):
    """hardsigmoid as a user's autograd.Function (the probe's stand-in's forward) whose backward autograd
    cannot differentiate."""

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return _GateBackward.apply(grad, h)


class NoDoubleBackward(torch.nn.Module):
    """A model with an op autograd cannot differentiate twice (a gate like a squeeze-excitation's, whose input
    gradient depends on a saved tensor; ``gate="hardsigmoid"``: nn.Hardsigmoid, which torch 1.13 cannot
    differentiate twice either, but the probe runs a stand-in for it)."""

    def __init__(self, gate: str = "custom") -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.act = torch.nn.Hardsigmoid()
        self.gate = gate
        self.fc = torch.nn.Linear(16 * 8 * 8, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        h = self.c2(self.c1(x))
        g = _GateWithoutSecondDerivative.apply(h) if self.gate == "custom" else self.act(h)
        return self.fc2(self.fc((h * g).flatten(1)))


def _probe_without_fallback(m, x, y):
    """One sampled step of bits="auto" whose probe must run (a fallback to the online estimator raises): the
    Compressor and its policy's stats; every tensor the model saved has the probe's estimate (only the
    loss's, outside the model, has none)."""
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6, min_bytes=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*online estimator")
        _grad(m, x, y, comp)
    st = comp.policy.stats()
    assert comp.policy.decisions == 1, st
    assert all((v["C"] is not None) != k.startswith("<none>:") for k, v in st["tensors"].items()), st["tensors"]
    return comp, st


def test_the_probe_runs_through_hardsigmoid():
    """torch 1.13 has no derivative of hardsigmoid's backward, so the probe's double backward failed on the
    mobilenet_v3 family and the online estimator decided. The probe's passes run a stand-in with the same
    values and saved input whose backward is differentiable: no fallback, the probe's estimates for every
    stored tensor, its decision checked against uniform; ordinary steps run hardsigmoid itself."""
    torch.manual_seed(2)
    m = NoDoubleBackward(gate="hardsigmoid")
    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 10, (8,))
    comp, st = _probe_without_fallback(m, x, y)
    assert st["last_check"] is not None, st
    # the Linear's input, the product h * hardsigmoid(h): its estimate went through the stand-in's backward
    assert st["tensors"]["fc:0"]["C"] > 0 and math.isfinite(st["tensors"]["fc:0"]["C"]), st["tensors"]["fc:0"]
    nodes = []
    hook = m.act.register_forward_hook(lambda _m, _i, out: nodes.append(type(out.grad_fn).__name__))
    _grad(m, x, y, comp)  # an ordinary step: hardsigmoid itself, not the stand-in
    hook.remove()
    comp.close()
    assert nodes == ["HardsigmoidBackward0"], nodes


def test_the_hardsigmoid_stand_in_equals_hardsigmoid_and_differentiates_twice():
    """The stand-in gives hardsigmoid's values and input gradient bit for bit (at and around -3 and 3 too),
    and its gradient differentiates: d(grad)/d(grad_output) is the in-range indicator over 6."""
    from gact import saved
    stand_in = saved.DOUBLE_BACKWARD[torch.nn.functional.hardsigmoid]
    x = torch.cat([torch.linspace(-5, 5, 1001), torch.tensor([-3.0, 3.0, -2.9999998, 2.9999998])])
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = torch.nn.functional.hardsigmoid(a), stand_in(b)
    assert torch.equal(ya, yb)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    ga, = torch.autograd.grad(ya, a, w)
    gb, = torch.autograd.grad(yb, b, w.clone().requires_grad_(), create_graph=True)
    assert torch.equal(ga, gb.detach())
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    wg = w.clone().requires_grad_()
    gb, = torch.autograd.grad(stand_in(b), b, wg, create_graph=True)
    dw, = torch.autograd.grad((gb * v).sum(), wg)
    assert torch.equal(dw, v * ((x > -3) & (x < 3)).float() * (1.0 / 6.0))
    # the stand-in's own node where a gradient is taken; in place: hardsigmoid itself
    z = x.clone().requires_grad_() * 1.0
    assert type(stand_in(z).grad_fn).__name__ == "_HardsigmoidFunctionBackward"
    assert type(stand_in(z * 1.0, inplace=True).grad_fn).__name__ == "HardsigmoidBackward0"


def test_the_roi_align_stand_in_equals_roi_align_and_differentiates_twice():
    """torchvision's roi_align has no double backward; the probe's stand-in gives its values and input gradient
    bit for bit, and the gradient's derivative by the output's gradient is roi_align itself (the backward is
    its adjoint: <roi_align(v), w> = <v, backward(w)>)."""
    tv = pytest.importorskip("torchvision")
    stand_in = gsaved.double_backward_substitutes()[torch.ops.torchvision.roi_align]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=gen, requires_grad=True)
    lo = torch.rand(40, 2, generator=gen) * 10
    rois = torch.cat([torch.randint(0, 2, (40, 1), generator=gen).float(), lo, lo + 1 + torch.rand(40, 2, generator=gen) * 5], 1)
    for aligned in (False, True):
        y0 = tv.ops.roi_align(x, rois, (3, 3), 0.5, 2, aligned)
        y1 = stand_in(x, rois, 0.5, 3, 3, 2, aligned)
        assert torch.equal(y0, y1)
        w = torch.randn(y0.shape, generator=gen)
        g0, = torch.autograd.grad(y0, x, w)
        wg = w.clone().requires_grad_()
        g1, = torch.autograd.grad(y1, x, wg, create_graph=True)
        assert torch.equal(g0, g1)
        v = torch.randn(x.shape, generator=gen)
        dw, = torch.autograd.grad((g1 * v).sum(), wg)
        assert torch.equal(dw, tv.ops.roi_align(v, rois, (3, 3), 0.5, 2, aligned))
    assert type(y1.grad_fn).__name__ == "_RoIAlignFunctionBackward"  # the stand-in's own node


class _BoxHead(torch.nn.Module):
    """A convolution, roi_align over fixed boxes in a module of its own (as torchvision's MultiScaleRoIAlign), a
    GELU and a linear head: a detection model's second stage. The GELU's saved input depends on the pooling,
    which puts roi_align's backward on the probe's double backward's path."""

    def __init__(self) -> None:
        super().__init__()
        import torchvision
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.pool = torchvision.ops.RoIAlign((4, 4), 1.0, 2, True)
        self.fc = torch.nn.Linear(16 * 4 * 4, 10)
        gen = torch.Generator().manual_seed(0)
        lo = torch.rand(64, 2, generator=gen) * 8
        self.register_buffer("rois", torch.cat([torch.randint(0, 8, (64, 1), generator=gen).float(), lo,
                                                lo + 2 + torch.rand(64, 2, generator=gen) * 4], 1))

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return self.fc(torch.nn.functional.gelu(self.pool(h, self.rois).flatten(1))).mean(0, keepdim=True)


def test_the_probe_runs_through_roi_align():
    """A model with roi_align: the probe's double backward runs through the stand-in (it fell back to the online
    estimator, as Faster R-CNN's did), and its estimates cover the stored tensors."""
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m = _BoxHead()
    x = torch.randn(8, 3, 16, 16)
    y = torch.randint(0, 10, (1,))
    comp, st = _probe_without_fallback(m, x, y)
    assert st["tensors"]["fc:0"]["C"] > 0, st["tensors"]  # the pooled features: through roi_align's adjoint
    comp.close()


def test_online_decisions_after_a_failed_probe_are_measured_against_uniform(monkeypatch):
    """When the probe cannot run (an op without a double backward) and the online estimator stands in,
    its decisions are measured against uniform on the replayed step as the probe's are: estimates made
    upside down are found worse and not used (every tensor keeps 2 bits, with a warning); honest ones
    are measured and kept. Before, a fallback's decisions went unchecked."""
    torch.manual_seed(2)
    m = NoDoubleBackward()
    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 10, (8,))
    _, _ = _grad(m, x, y)
    real = gpol.AutoPolicy._online_estimates

    def upside_down(self):
        est = real(self)
        top = max(est.values())
        return {k: top * top / max(v, 1e-30) for k, v in est.items()}

    monkeypatch.setattr(gpol.AutoPolicy, "_online_estimates", upside_down)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6, min_bytes=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _grad(m, x, y, comp)
    said = " | ".join(str(r.message) for r in record)
    assert "the probe failed" in said and "using uniform 2 bits" in said, said
    check = comp.policy.stats()["last_check"]
    assert check["used"] == "uniform" and check["variance_auto"] > check["variance_uniform"], check
    comp.close()
    monkeypatch.setattr(gpol.AutoPolicy, "_online_estimates", real)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6, min_bytes=0)
    with pytest.warns(RuntimeWarning, match="the probe failed"):
        _grad(m, x, y, comp)
    check = comp.policy.stats()["last_check"]
    assert check is not None and (check.get("same_as_uniform") or "variance_auto" in check), check
    comp.close()


def test_probe_estimates_the_same_without_cuts_at_modules_whose_saves_carry_no_derivative(monkeypatch):
    """The probe does not cut at ReLU, dropout, pooling, identity and flatten modules (their saves are
    masks, indices or shapes: nothing a later tensor's derivative can leak through), which spares a copy
    of every in-place ReLU's input; the estimates are those of a probe that cuts at every leaf module
    (float rounding apart). torchvision's resnet18 at batch 4: ReLU(inplace), max-pool, average pool."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    m = tv.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    y = torch.randint(0, 10, (4,))
    real = gpol.AutoPolicy._probe_estimates
    got = {}

    def both(self, closure, copy_inputs=False):
        monkeypatch.setattr(gpol, "_NO_CUT", ())
        got["every"] = real(self, closure)
        monkeypatch.undo()
        got["fewer"] = real(self, closure)
        return got["fewer"]

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", both)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    _grad(m, x, y, comp)
    comp.close()
    a, b = got["every"], got["fewer"]
    assert sorted(a) == sorted(b) and len(a) >= 20
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5), (k, a[k], b[k])


# ---- the probe in passes: one row at a time where the rows are independent --------------------------

class RowWise(torch.nn.Module):
    """Each row computed on its own; 256 features per saved row, so that a group of 256 never holds two
    rows (the sum over passes is then exact) and a row's saves are under min_bytes (4096) while the
    kept rows' are not (a pass must key what the step stored)."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.Tanh(),
                                 nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)


def test_probe_in_passes_estimates_what_one_pass_does(monkeypatch):
    """Where the rows are independent, the probe replays the kept rows one per pass and adds up the
    estimates: the same sign vector in every pass, so the sum is the one-pass estimate (float rounding
    apart), while the probe holds one row's saved tensors at a time instead of all eight."""
    torch.manual_seed(3)
    m, x, y = RowWise(), torch.randn(8, 64), torch.randint(0, 10, (8,))
    real = gpol.AutoPolicy._probe_estimates
    got, held, holding = {}, [], []
    real_close = gpol._ProbeRecorder.close

    def close(rec):
        held.append(sum(t.numel() * t.element_size() for t in rec.tensors))
        real_close(rec)

    def both(self, closure, copy_inputs=False):
        got["passes"] = len(closure) if isinstance(closure, gpol._Passes) else 1
        held.clear()
        got["one"] = real(self, self._replay_closure())
        holding.append(max(held))
        held.clear()
        got["split"] = real(self, closure)
        holding.append(max(held))
        return got["split"]

    monkeypatch.setattr(gpol._ProbeRecorder, "close", close)
    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", both)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        _grad(m, x, y, comp)
    assert comp.policy._rows_independent is True and got["passes"] == 8
    comp.close()
    a, b = got["one"], got["split"]
    assert sorted(a) == sorted(b) and len(a) >= 3, (sorted(a), sorted(b))
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-4), (k, a[k], b[k])
    assert holding[1] * 8 == holding[0], holding  # one row's saves at a time


def test_measuring_runs_in_passes_add_up_to_the_whole():
    """The checks' runs replay the same passes and accumulate the gradients across them: with every tensor
    kept exact, the gradient of the passes is the one-pass replay's."""
    torch.manual_seed(4)
    m, x, y = RowWise(), torch.randn(8, 64), torch.randint(0, 10, (8,))
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    pol = comp.policy
    with comp:
        loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    passes, whole = pol._replay_passes(), pol._replay_closure()
    assert isinstance(passes, gpol._Passes) and len(passes) == 8
    params = [p for p in m.parameters()]
    with pol._extra_runs(params):
        a = [g.clone() for g in pol._grads(params, {}, 5, whole)]
        b = pol._grads(params, {}, 5, passes)
    for ga, gb in zip(a, b):
        assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-7)
    comp.close()


class MixesRows(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.tanh(x - x.mean(0)))


class TimeFirst(torch.nn.Module):
    """An LSTM with time as the first dimension (batch_first=False): rows of the input are time steps."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 32)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


@pytest.mark.parametrize("model", ["batch-norm", "mixes-rows", "time-first"])
def test_probe_replays_the_rows_together_where_they_interact(model):
    """Batch norm in training mode joins the rows through its statistics; a model may mix rows itself or
    have time as its first dimension. The probe then replays the kept rows (8 of 12) in one pass: all of
    them where the model mixes rows or runs through time, and under batch norm the rows that fit, here
    all 8 too (a batch norm over (rows, 64) has one value per channel and row: it needs 16 rows)."""
    torch.manual_seed(6)
    if model == "batch-norm":
        m, x = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10)), \
            torch.randn(12, 16)
    elif model == "mixes-rows":
        m, x = MixesRows(), torch.randn(12, 16)
    else:
        m, x = TimeFirst(), torch.randn(12, 3, 16)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6, min_bytes=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*measured a gradient variance")  # a check may prefer uniform
        warnings.filterwarnings("error", message=".*online estimator")  # no fallback
        with comp:
            out = m(x)
        out.square().mean().backward()
        replay = comp.policy._replay_passes()
        assert not isinstance(replay, gpol._Passes) and replay.row_share * 12 == 8
        comp.step()
    # in eval mode, batch norm takes its running statistics: each row on its own but for them
    assert comp.policy._rows_independent is (model == "batch-norm") and comp.policy.decisions == 1
    assert all(mod.training for mod in m.modules())  # the eval-mode test put every module back
    comp.close()


class ScaledWeight(torch.nn.Module):
    """A tensor made from parameters alone and saved (x * w.exp() saves w.exp()): every row's derivative
    reaches it. 1 KiB: under min_bytes at the step, over a one-row pass's share of it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 256)
        self.w = torch.nn.Parameter(torch.randn(256) * 0.1)
        self.big = torch.nn.Parameter(torch.randn(4, 1024) * 0.1)
        self.fc = torch.nn.Linear(256, 10)

    def forward(self, x):
        h = torch.tanh(self.lin(x) * self.w.exp())
        h = h + (torch.tanh(self.big.exp()).sum(0)[:256] * h)  # a shared tensor the step stores (16 KiB)
        return self.fc(h)


def test_probe_replays_the_rows_together_when_a_tensor_is_shared_by_them(monkeypatch):
    """A saved tensor made from parameters alone has the derivatives of every row summed in it, so the sum
    over one-row passes of its squares is not its estimate: found in the first pass, the probe replays the
    rows together instead (from then on), with the same estimates as one pass. Keys follow the order of
    saves whatever their sizes: w.exp(), under min_bytes at the step and over a pass's share of it, does
    not move the keys after it."""
    torch.manual_seed(10)
    m, x, y = ScaledWeight(), torch.randn(8, 64), torch.randint(0, 10, (8,))
    real = gpol.AutoPolicy._probe_estimates
    got = []

    def spy(self, closure, copy_inputs=False):
        est = real(self, closure, copy_inputs)
        got.append((len(closure) if isinstance(closure, gpol._Passes) else 1, est))
        return est

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_estimates", spy)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with comp:
        loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    keys = set(comp.policy._saved)
    comp.step()
    assert [(n, est is None) for n, est in got] == [(8, True), (1, False)]
    assert not comp.policy._splittable and not isinstance(comp.policy._replay_passes(), gpol._Passes)
    assert len(got[1][1]) >= 4 and set(got[1][1]) <= keys, (sorted(got[1][1]), sorted(keys))
    comp.close()


def test_keys_follow_the_saves_when_a_decision_depends_on_the_batch(monkeypatch):
    """x * w.exp() saves w.exp() (256 values) for x's gradient: exact at the step (x has 8 rows: 8x its
    elements, a broadcast factor) but values in a one-row replay (as many elements as x). An exact save took
    no key, so every key after it moved by one in the replay (under torch 2.6 the probe then met tensors of
    other sizes under the step's keys). Exact saves are keyed too: the same key names the same save."""
    torch.manual_seed(10)
    m = ScaledWeight()
    comp = gact.Compressor(m, bits=2, adapt_interval=10**6)
    seen = []
    real = gact.Compressor._next_key

    def spy(self, *stack):
        key, dkey = real(self, *stack)
        frame = self._local.tracker.current()
        seen.append((key, frame.name if frame is not None else None))
        return key, dkey

    monkeypatch.setattr(gact.Compressor, "_next_key", spy)

    def keys(rows):
        seen.clear()
        comp._row_share = rows / 8  # as the probe's replay of `rows` of the step's 8
        try:
            with comp:
                out = m(torch.randn(rows, 64))
        finally:
            comp._row_share = 1.0
        del out
        comp.abort_step()
        return list(seen)

    step, replay = keys(8), keys(1)
    assert step == replay, (step, replay)
    assert ("<root>:1", "mul") in step  # w.exp(), saved by the mul, exact at the step
    comp.close()


def test_probe_pass_rows_is_checked_and_obeyed():
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 10))
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6, min_bytes=0)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="probe_pass_rows"):
            comp.policy.probe_pass_rows = bad
    comp.policy.probe_pass_rows = 4  # asked for: passes even with batch norm (each normalizes its own rows)
    with comp:
        out = m(torch.randn(12, 16))
    out.square().mean().backward()
    passes = comp.policy._replay_passes()
    assert isinstance(passes, gpol._Passes) and len(passes) == 2
    comp.step()
    assert comp.policy.decisions == 1
    comp.close()


class ConvBN(torch.nn.Module):
    """Batch norm in training mode at the input's resolution (side x side values per channel and row)."""

    def __init__(self, pool: bool = False) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1) if pool else None
        self.bn_last = nn.BatchNorm2d(16) if pool else None
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        h = self.body(x)
        if self.pool is not None:
            return self.fc(self.bn_last(self.pool(h)).flatten(1))
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("batch,pool,memory,rows", [(8, False, 1.0, 2), (32, False, 1.0, 8), (8, False, None, 8),
                                                    (8, True, 1.0, 8)])
def test_probe_replays_the_rows_that_fit_when_they_cannot_run_apart(batch, pool, memory, rows):
    """Under batch norm the kept rows run together, holding about 3x their saved bytes: as many as fit in
    what compression saved in the step (2 bits: 8 x (1 - 1/13) / 3 -> 2 of 8 rows, all 8 of 32), but
    never so few that a batch norm normalizes a channel over fewer than 16 values (a 1x1 batch norm:
    all rows); probe_memory=None replays them all."""
    torch.manual_seed(8)
    m = ConvBN(pool)
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    comp.policy.probe_memory = memory
    with comp:
        loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    replay = comp.policy._replay_passes()
    assert not isinstance(replay, gpol._Passes)
    assert replay.row_share * batch == rows
    comp.step()
    assert comp.policy.decisions == 1
    for bad in (0, -1.0, True, "1", math.inf):
        with pytest.raises(ValueError, match="probe_memory"):
            comp.policy.probe_memory = bad
    comp.close()


def test_estimates_run_with_the_host_arena_returning_free_segments(monkeypatch):
    """While the policy estimates, the host arena returns its whole free segments before it reserves a
    new one (the estimators request other sizes than the step), and all of them when it ends;
    afterwards it keeps them again."""
    torch.manual_seed(9)
    m, x, y = RowWise(), torch.randn(8, 64), torch.randint(0, 10, (8,))
    seen = []
    real = gpol.AutoPolicy._probe_or_fallback

    def spy(self):
        seen.append(_C.host_release_on_miss(True))  # the setting in force (set again, unchanged)
        return real(self)

    monkeypatch.setattr(gpol.AutoPolicy, "_probe_or_fallback", spy)
    real_empty = _C.host_empty_cache

    def empty():
        seen.append("emptied")
        real_empty()

    monkeypatch.setattr(_C, "host_empty_cache", empty)
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    _grad(m, x, y, comp)
    assert seen == [True, "emptied"]  # on while estimating; every whole free segment returned at the end
    assert _C.host_release_on_miss(False) is False  # off again after the estimate
    comp.close()
    assert seen == [True, "emptied", "emptied"]  # close() returns the arena's free segments too


def test_keys_follow_the_order_of_saves_whatever_their_sizes():
    """A save kept because it is small still takes its key, so every later save of the module has the key
    it has with min_bytes=0: an estimator's replay of fewer rows (smaller tensors) keys each tensor as the
    step did (a weight-made tensor under min_bytes at the step but over a pass's share moved the keys)."""
    torch.manual_seed(11)
    m, x = ScaledWeight(), torch.randn(8, 64)
    seen = {}
    for min_bytes in (0, 4096):
        got = seen[min_bytes] = {}

        class Spy(gact.policy.FixedWidths):
            def bits_for(self, key, numel):
                got[key] = numel
                return super().bits_for(key, numel)

        comp = gact.Compressor(m, bits=2, min_bytes=min_bytes, policy=Spy({}, default=2))
        with comp:
            m(x).sum().backward()
        comp.close()
    small = set(seen[0]) - set(seen[4096])
    assert small and all(seen[0][k] * 4 < 4096 for k in small)  # w.exp() (256 floats) among them
    assert all(seen[0][k] == n for k, n in seen[4096].items()), (seen[0], seen[4096])


class CheckpointsItsInput(torch.nn.Module):
    """A reentrant checkpoint of the model's own input (which requires grad in the user's step)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        import torch.utils.checkpoint as cp
        h = cp.checkpoint(lambda t: torch.tanh(self.c2(torch.tanh(self.c1(t)))), x, use_reentrant=True)
        return self.fc(h.flatten(1))


def test_the_replay_keeps_an_input_that_requires_grad_so():
    """The replay's copy of an input that required grad requires grad too: a reentrant checkpoint of it
    builds no graph otherwise, and torch warns at every pass ("None of the inputs have requires_grad")."""
    torch.manual_seed(12)
    m = CheckpointsItsInput()
    x, y = torch.randn(8, 3, 8, 8, requires_grad=True), torch.randint(0, 10, (8,))
    comp = gact.Compressor(m, bits="auto", budget=2, adapt_interval=10**6)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*measured a gradient variance")
        warnings.filterwarnings("error", message=".*requires_grad")
        warnings.filterwarnings("error", message=".*online estimator")
        _grad(m, x, y, comp)
    assert comp.policy.decisions == 1 and comp.policy._rows_independent is True  # replayed in passes
    comp.close()


def _bench_policy():
    from evalkit import load_bench

    return load_bench("policy")


def test_width_ceilings_of_the_bench_match_hand_solved_cases():
    """``gact-bench policy --group-ceiling``'s bound on cases solved by hand (the linear relaxation: widths
    raised in order of variance removed per byte, the last one partly, until uniform's bytes are spent).
    Plain stochastic rounding: V(b) = V(2)·(3 / (2^b − 1))², V(1) = 9·V(2); a group costs b·32 + 8 bytes.
    * Two equal tensors with equal groups: uniform 2 bits is the best (ratio 1).
    * Tensor A 100x as sensitive as B (V(2) = 100 and 1, one group each, 144 bytes): from 1 bit each
      (80 bytes, 909), A to 2 bits (112 bytes, 109), then half of A's step to 4 bits (-1.5 per byte):
      61, ratio 101/61. With every width: A to 2, then A to 3 bits: 144 bytes, 100·9/49 + 9, ratio 3.69.
    * One tensor whose two groups' squared ranges are 99 : 1 (V(2) = 1): per tensor nothing moves; per
      group, widths 1-8, the wide group at 3 bits and the narrow one at 1: 1 / (0.99·9/49 + 0.01·9)."""
    bench = _bench_policy()
    v2 = 1.0

    def rec(scale):
        v = [9.0 * v2, v2, v2 * (3 / 15) ** 2, v2 * (3 / 255) ** 2]
        return {"variance": [x * scale for x in v], "min_bits": 1}

    even = torch.ones(4, dtype=torch.float64)
    same = bench.ceilings({"a": rec(1.0), "b": rec(1.0)}, {"a": even, "b": even})
    assert all(r == pytest.approx(1.0) for r in same.values()), same
    skew = bench.ceilings({"a": rec(100.0), "b": rec(1.0)}, {"a": even[:1], "b": even[:1]})
    assert skew["tensor, widths 1/2/4/8"] == pytest.approx(101 / 61, rel=1e-9)
    assert skew["tensor, widths 1-8"] == pytest.approx(101 / (100 * 9 / 49 + 9), rel=1e-9)
    assert skew["group, widths 1-8"] == pytest.approx(skew["tensor, widths 1-8"], rel=1e-9)
    groups = bench.ceilings({"a": rec(1.0)}, {"a": torch.tensor([99.0, 1.0], dtype=torch.float64)})
    assert groups["tensor, widths 1/2/4/8"] == pytest.approx(1.0)
    assert groups["tensor, widths 1-8"] == pytest.approx(1.0)
    assert groups["group, widths 1-8"] == pytest.approx(1 / (0.99 * 9 / 49 + 0.01 * 9), rel=1e-9)


class _CountsCalls(torch.nn.Module):
    """A module that keeps a counter buffer of its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("replaced", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.replaced = self.replaced + 1  # (a new tensor in _buffers)
        return x


def test_the_probe_leaves_the_runs_random_numbers_and_buffers_as_they_were():
    """bits="auto"'s probe replays forward passes inside step(): they drew random numbers (the run's later
    dropout masks and shuffles then differed from the same run without gact), counted in a module's buffer (14
    calls over 3 steps, not 3) and moved spectral norm's power-iteration vector. The run's generator and every
    buffer of the model are as the training step left them."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(32, 64)), _CountsCalls(),
                                   torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 5))

    x, y = torch.randn(16, 32), torch.randint(0, 5, (16,))
    runs = {}
    for name in ("plain", "auto"):
        m = make()
        comp = gact.Compressor(m, bits="auto", budget=8, adapt_interval=1, min_bytes=0) if name == "auto" else None
        draws = []
        for _ in range(3):
            _grad(m, x, y, comp)
            draws.append(torch.rand(()).item())
        if comp is not None:
            assert comp.policy.estimator == "probe"
            comp.close()
        runs[name] = draws, {k: b.clone() for k, b in m.named_buffers()}
    assert runs["auto"][0] == runs["plain"][0]  # the same draws after each step
    assert runs["auto"][1]["1.calls"].item() == 3.0 and runs["auto"][1]["1.replaced"].item() == 3.0
    for k, b in runs["plain"][1].items():
        assert torch.equal(runs["auto"][1][k], b), k


def test_the_probe_replays_a_packed_sequence_input():
    """A model called with a PackedSequence (a named tuple): the probe's replay rebuilt it as a plain tuple and
    comp.step() raised AttributeError from nn.LSTM; the replay keeps its type, and the sequence whole."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    x, lengths = torch.randn(12, 16, 16), torch.arange(12, -4, -1).clamp_min(1)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = torch.nn.LSTM(16, 64, 2), torch.nn.Linear(64, 1)

        def forward(self, p):
            return self.head(pad_packed_sequence(self.rnn(p)[0])[0])

    m = M()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    comp = gact.Compressor(m, bits="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with comp:
                loss = m(pack_padded_sequence(x, lengths)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            comp.step()
    comp.close()
    assert not any("probe failed" in str(w.message) or "could not be replayed" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    assert torch.isfinite(loss)


def test_an_error_in_the_users_closure_reaches_the_user():
    """A replay of the sampled step that raises falls back to the online estimator; the user's own closure with a
    bug in it raises as it would without gact (not turned into a warning)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    comp = gact.Compressor(m, bits="auto")
    x = torch.randn(32, 16)

    def closure():
        return m(x[:8]).sum() + None  # TypeError

    with pytest.raises(TypeError, match="NoneType"):
        for _ in range(3):
            with comp:
                loss = m(x).pow(2).mean()
            loss.backward()
            comp.step(closure)
    comp.close()


def test_the_probe_replays_a_model_that_returns_its_hidden_state():
    """A recurrent model returning (output, hidden), whose hidden state the loop detaches for the next batch (the
    word language model of pytorch/examples): no gradient ever reaches the hidden outputs, and the sampled step
    was declared not replayable (a warning, the online estimator from then on). The unused outputs take no part
    in the replay: its estimates are those of the same model returning its output alone."""

    class LM(torch.nn.Module):
        def __init__(self, hidden_out: bool):
            super().__init__()
            self.emb, self.rnn = torch.nn.Embedding(50, 32), torch.nn.LSTM(32, 64, 2)
            self.dec, self.hidden_out = torch.nn.Linear(64, 50), hidden_out

        def forward(self, x, hidden):
            out, hidden = self.rnn(self.emb(x), hidden)
            logp = torch.log_softmax(self.dec(out).view(-1, 50), dim=1)
            return (logp, hidden) if self.hidden_out else logp

    x, y = torch.randint(0, 50, (12, 16)), torch.randint(0, 50, (12 * 16,))
    estimates = []
    for hidden_out in (True, False):
        torch.manual_seed(0)
        m = LM(hidden_out)
        comp = gact.Compressor(m, bits="auto", seed=3)
        hidden = (torch.zeros(2, 16, 64), torch.zeros(2, 16, 64))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                hidden = tuple(h.detach() for h in hidden)
                with comp:
                    out = m(x, hidden)
                    if hidden_out:
                        out, hidden = out
                    loss = torch.nn.functional.nll_loss(out, y)
                m.zero_grad()
                loss.backward()
                comp.step()
        _assert_the_probe_ran(comp, caught)
        tensors = comp.policy.stats()["tensors"]
        estimates.append({k: v["variance"] for k, v in tensors.items() if v["estimates"]})
        comp.close()
    assert estimates[0] and estimates[0].keys() == estimates[1].keys()
    assert any(v[0] > 0 for v in estimates[0].values())
    for k in estimates[0]:
        assert estimates[0][k] == pytest.approx(estimates[1][k], rel=1e-5, abs=1e-12), k


def test_the_probe_replays_a_model_with_an_unread_sibling_output():
    """A model returning both halves of a chunk, with the loss reading one: torch calls the other half's gradient
    hook with None, and the replay's capture raised AttributeError from the user's loss.backward()."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = torch.nn.Linear(16, 64), torch.nn.Linear(32, 1)

        def forward(self, x):
            mu, aux = torch.relu(self.lin(x)).chunk(2, -1)
            return self.head(mu), aux

    torch.manual_seed(0)
    m = M()
    x = torch.randn(32, 16)
    comp = gact.Compressor(m, bits="auto", min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with comp:
                out, _aux = m(x)
                loss = out.pow(2).mean()
            m.zero_grad()
            loss.backward()
            comp.step()
    comp.close()
    _assert_the_probe_ran(comp, caught)


def _assert_the_probe_ran(comp, caught) -> None:
    """No warning that the probe fell back to the online estimator, and it did not."""
    assert not any("could not be replayed" in str(w.message) or "probe failed" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
    assert not comp.policy._probe_disabled


def test_auto_on_a_float64_model_says_its_activations_get_the_default_bits():
    """The policy decides for float32 and 16-bit activations; a float64 model's were silently stored at the default
    bits with no decision made (a probe found it). It says so, once, and the gradients stay unbiased."""
    torch.manual_seed(0)
    nn, F = torch.nn, torch.nn.functional
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).double()
    x, y = torch.randn(32, 64, dtype=torch.float64), torch.randint(0, 10, (32,))
    comp = gact.Compressor(m, bits="auto", budget=2, min_bytes=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with comp:
                loss = F.cross_entropy(m(x), y)
            loss.backward()
            m.zero_grad(set_to_none=True)
            comp.step()
    comp.close()
    said = [str(w.message) for w in seen if "float64" in str(w.message)]
    assert len(said) == 1 and "default 2 bits" in said[0], said


class _JitBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, h):
        return torch.relu(self.lin(h))


class _NoHooks(torch.nn.Linear):
    """A module that refuses forward pre-hooks, as a scripted one does."""

    def register_forward_pre_hook(self, hook, *args, **kwargs):
        raise RuntimeError("register_forward_pre_hook is not supported here")


@pytest.mark.parametrize("inner", ["scripted", "refuses_hooks"])
def test_the_probe_leaves_no_cut_behind_on_a_module_it_cannot_hook(inner):
    """A probe that could not hook every module (a torch.jit.script'ed block takes no forward hooks) left the hooks it
    had placed before it on the program's modules: from the first estimate on, each layer before it got its input cut
    from the graph (its weight's gradient None at every later step, the cut inputs kept, the leak count growing), also
    after close(). Scripted modules are not cut (their saves are kept exact); a module that refuses a hook makes the
    probe remove the ones it placed."""
    torch.manual_seed(0)
    block = torch.jit.script(_JitBlock()) if inner == "scripted" else _NoHooks(32, 32)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), block,
                                torch.nn.Linear(32, 4))
    x = torch.randn(64, 16)
    comp = gact.Compressor(model, bits="auto", budget=4)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (refuses_hooks: the probe fails and says so)
        for _ in range(4):
            with comp:
                loss = model(x).pow(2).mean()
            loss.backward()
            grads.append(model[0].weight.grad)
            model.zero_grad(set_to_none=True)
            comp.step()
    comp.close()
    assert all(g is not None and g.norm() > 0 for g in grads)
    assert not any(getattr(m, "_forward_pre_hooks", None) for m in model.modules()
                   if not isinstance(m, torch.jit.ScriptModule))


def test_the_probe_models_a_save_normalized_per_row_as_the_store_keeps_it():
    """A save the store keeps normalized per row (F.normalize's input: saved.Decision.rows) has the rounding variance
    of each row's own scale: the probe records it as z = rows / their largest magnitude with that magnitude as std
    (as a normalization input), not as plain groups whose range spans every row's scale (for rows whose norms span
    1000x, about 1000x the variance the store makes)."""
    comp = gact.Compressor(None, bits=2)
    spread = torch.logspace(0, 3, 64).unsqueeze(1)
    t = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * spread
    z, std = comp._probe_rows(t, 16)
    assert z.shape == t.shape and std.shape == t.shape
    assert torch.allclose(z.abs().amax(dim=1), torch.ones(64), rtol=1e-6)
    assert torch.allclose(z * std, t, rtol=1e-5)
    assert comp._probe_rows(t, 256) is None  # (rows as long as a group: plain groups, nothing normalized)
    comp.close()


def test_the_model_s_hooks_can_tell_the_probe_s_replays_from_the_steps():
    """bits="auto" replays samples through the model at the steps that re-estimate (inside step()): the model's forward
    hooks, backward hooks and tensor hooks run there too, and a hook that accumulates (a K-FAC statistic) counted them
    (12 forward calls for 1 step). gact.probing() is true exactly during those replays."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    seen = {True: 0, False: 0}
    grads_seen = {True: 0, False: 0}
    model[0].register_forward_hook(lambda m, i, o: seen.__setitem__(gact.probing(), seen[gact.probing()] + 1))
    model[2].weight.register_hook(lambda g: grads_seen.__setitem__(gact.probing(), grads_seen[gact.probing()] + 1))
    comp = gact.Compressor(model, bits="auto", seed=0)
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    assert not gact.probing()

    def train_step():
        model.zero_grad()
        with comp:
            out = model(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        return comp.step()

    leaks = [train_step() for _ in range(3)]
    comp.close()
    assert leaks == [0, 0, 0]
    assert seen[False] == 3 and grads_seen[False] == 3, (seen, grads_seen)
    assert seen[True] > 0 and grads_seen[True] > 0, (seen, grads_seen)  # (the probe ran, and said so)
    assert not gact.probing()
