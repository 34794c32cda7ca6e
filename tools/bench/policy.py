#!/usr/bin/python3
"""gact-bench policy: gradient variance at equal stored bytes for uniform 2 bits and for the
auto policy with each estimator (online, probe, reference), and each estimator's overhead as a
percentage of training time, amortized over adapt_interval steps.

    gact-bench policy [--model resnet18|mobilenet_v2|encoder] [--size 32] [--batch 32] [--seeds 8]
                      [--ref-batch 8] [--pass-rows N] [--probe-memory 1.0|none] [--interval N]
                      [--probe-vectors 1] [--skip-reference] [--no-fit] [--oracle] [--group-ceiling]
                      [--threads 1]

Method (--model, default resnet18, fresh weights, one random batch; "encoder" is three
transformer encoder layers, width 128, 4 heads, sequence --size):
  g*        the uncompressed gradient of the batch.
  variance  mean over --seeds steps (fresh rounding noise each) of ||g - g*||^2.
  bytes     the store's stored bytes while the step's activations are alive (ReLU masks too).
  uniform   gact at 2 bits.
  auto arms bits="auto", budget=2: estimates from step 0 (sampled), one decision, measured as a
            user gets it (the plain API: budget 2 means uniform 2 bits' bytes); then, unless
            --no-fit, re-solved at the largest budget whose step stores no more than uniform's
            (policy.fit_bytes) and measured again ("@fit" rows).
  online    estimator="online" (no extra pass).
  probe     estimator="probe" (the default): one forward on the sampled step's first --ref-batch
            samples (replayed with the step's output gradient), a backward with create_graph
            and --probe-vectors double backwards.
  reference estimator="reference": 3 forward+backward passes on the same samples per tensor.
  oracle    (--oracle) the ceiling of any per-tensor allocation: each policy tensor's gradient
            variance measured alone at 1, 2 and 4 bits (every other tensor exact, --seeds runs
            each), the widths the policy's solver picks from those measurements at budget 2,
            and that allocation measured (a ceiling up to the measurements' noise).
  group ceiling (--group-ceiling) what any allocation of widths could gain, per tensor or per
            quantization group, under the rounding-variance model: the probe's 2-bit variance of
            each tensor, shared among its groups in proportion to their squared ranges (the
            ranges of the values the store encodes, from a uniform step), each group's variance
            V(b) = V_t(b) x share; then the least total variance at uniform 2 bits' bytes,
            by a Lagrange multiplier, per tensor and per group, with the codec's widths (1, 2, 4,
            8: the probe's V_t) and with every width 1 to 8 (V_t(b >= 2) from V_t(2) by the
            rounding step). Run it with --ref-batch = --batch and --probe-memory none: the probe
            then replays the whole batch (fewer rows under batch norm bias the estimates).
  overhead  (extra time of the sampled step over an ordinary auto step, estimate and solve
            included, and of the step after it, which reserves its memory afresh) / (interval x
            ordinary step time), interval = --interval or the
            adapt_interval option (GACT_ADAPT_INTERVAL, default 1000); "steps" is that extra
            time in ordinary steps. "default interval" is the spacing the policy itself keeps
            with the default adapt_interval (max_overhead 1 %: the larger of 1000 and
            gact.policy.spacing_steps of the measured times), and "at default" the overhead
            there.
Each variance is printed beside uniform's as a ratio (uniform / arm: > 1 is better).
Target (issue 5): uniform / auto >= 2 at <= 1 % overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def oracle(a, m, x, y, step, measure, tensors, bytes_eq):
    """The best per-tensor widths from measured variances (see the module docstring), measured."""
    import gact

    def alone(key, bits):
        comp = gact.Compressor(m, bits=2, policy=gact.policy.FixedWidths({key: bits}))
        v = measure(comp)[0]
        comp.close()
        return v

    import _gact as _C

    var = {}
    for k, r in tensors.items():
        var[k] = {b: alone(k, b) for b in (1, 2, 4) if b >= r["min_bits"]}
        # 8 bits: negligible beside 2 bits' either way
        var[k][8] = var[k][4] * (15 / 255) ** 2 if 4 in var[k] else 0.0
    # the policy's own solver, on the measured variances (the same byte model and budget as auto's)
    pol = _C.PolicyController(budget=2.0, default_bits=2, group_size=256)
    for k, r in tensors.items():
        pol.on_save(k, int(r["numel"]), 32, int(r["min_bits"]))
        v = var[k]
        pol.add_estimate_widths(k, [v.get(1, v[min(v)]), v.get(2, v[min(v)]), v.get(4, v[min(v)]), v[8]])
    pol.decide()
    widths = {k: int(r["bits"]) for k, r in pol.stats()["tensors"].items()}
    comp = gact.Compressor(m, bits=2, policy=gact.policy.FixedWidths(widths, 2))
    v, se, nb, t = measure(comp)
    comp.close()
    return v, se, nb, t


def group_ranges(comp, run):
    """{key: squared range of each quantization group of the values the store encodes} over one step of
    `run` under `comp` (in memory order, as the store groups them; a normalization layer's input as the
    codec sees it: per channel or per row)."""
    from gact import policy as gpol

    seen = {}
    store, gs = comp._store, comp.group_size

    def spy(t, key, d, norm=None, min_bits=0, normalized=False):
        if t.is_floating_point():
            v = t.detach().float()
            if normalized and norm is not None:
                if norm[0] == t.shape[1] and t.dim() >= 2:  # batch norm: per channel
                    dims = [i for i in range(t.dim()) if i != 1]
                    v = (v - v.mean(dims, keepdim=True)) / v.std(dims, keepdim=True).clamp_min(1e-12)
                else:  # a layer norm: per block of norm[1] consecutive elements
                    v = v.reshape(-1, norm[1])
                    v = (v - v.mean(1, keepdim=True)) / v.std(1, keepdim=True).clamp_min(1e-12)
            f = gpol._memory_order(v)[0]
            pad = (-f.numel()) % gs
            if pad:  # a tail group: its own values only
                f = torch.cat([f, f[-1:].expand(pad)])
            g = f.reshape(-1, gs)
            seen[key] = ((g.amax(1) - g.amin(1)).double() ** 2)
        return store(t, key, d, norm, min_bits, normalized)

    comp._store = spy
    try:
        run()
    finally:
        del comp._store
    return seen


def ceilings(tensors, ranges, group_size=256, meta=8):
    """Variance ratios (uniform 2 bits / the least variance at uniform 2 bits' bytes, a bound: the linear
    relaxation of the choice) of width allocations per tensor and per group, with the codec's widths
    (1, 2, 4, 8: the probe's variances) and with every width 1 to 8 (V(1) the probe's; V(b >= 2) = V(2) x (step_b / step_2)^2, the step of
    2^b - 1 levels, 2^b - 2 for a boundary blob). A tensor's widths start at its ``min_bits``, where
    uniform 2 bits stores it too."""
    def cells(mode, every):
        out = []  # per group: ({width: variance}, uniform's width)
        for k, r in tensors.items():
            if k not in ranges or r.get("variance") is None:
                continue
            v = [float(x) for x in r["variance"]]
            boundary = v[0] == v[1] and v[1] > 0  # 1 bit stored as 2 (a boundary blob's floor)
            first = max(1, int(r.get("min_bits") or 1))
            if every:
                levels = (lambda b: 2**b - 2) if boundary else (lambda b: 2**b - 1)
                vb = {b: v[0] if b == 1 else v[1] * (levels(2) / levels(b)) ** 2 for b in range(1, 9)}
            else:
                vb = dict(zip((1, 2, 4, 8), v))
            vb = {b: x for b, x in vb.items() if b >= first}
            uni = min(b for b in vb if b >= 2)
            r2 = ranges[k]
            tot, n = float(r2.sum()), r2.numel()
            shares = (r2 / tot).tolist() if mode == "group" and tot > 0 else [1.0 / n] * n
            out.extend(({b: x * s for b, x in vb.items()}, uni) for s in shares)
        return out

    def best(cs):
        cost = lambda b: b * group_size / 8 + meta  # noqa: E731
        uni = sum(c[u] for c, u in cs)
        budget = sum(cost(u) for _, u in cs)

        def solve(lam):
            tv = tb = 0.0
            for c, _ in cs:
                b = min(c, key=lambda b: c[b] + lam * cost(b))
                tv, tb = tv + c[b], tb + cost(b)
            return tv, tb

        lo, hi = 0.0, max(max(c.values()) for c, _ in cs) / cost(1) + 1e-30
        for _ in range(100):  # the least multiplier whose choice fits uniform's bytes
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if solve(mid)[1] > budget else (lo, mid)
        # the two choices either side of that multiplier, mixed to spend exactly the budget: the linear
        # relaxation's optimum, a bound no choice of whole widths beats (it equals the best choice up to
        # one group's worth, among thousands)
        (v_hi, b_hi), (v_lo, b_lo) = solve(hi), solve(lo)
        v = v_hi if b_lo <= b_hi else v_hi + (v_lo - v_hi) * (budget - b_hi) / (b_lo - b_hi)
        return uni / v if v > 0 else float("inf")

    return {f"{mode}, widths {'1-8' if every else '1/2/4/8'}": best(cells(mode, every))
            for every in (False, True) for mode in ("tensor", "group")}


def main() -> int:
    ap = argparse.ArgumentParser(prog="gact-bench policy")
    ap.add_argument("--model", default="resnet18", choices=("resnet18", "mobilenet_v2", "encoder"))
    ap.add_argument("--oracle", action="store_true", help="also the best per-tensor allocation from measured variances")
    ap.add_argument("--group-ceiling", action="store_true",
                    help="also the ceilings of per-tensor and per-group widths under the variance model")
    ap.add_argument("--no-fit", action="store_true", help="only the plain-API arms (no re-solve at equal bytes)")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--ref-batch", type=int, default=8)
    ap.add_argument("--probe-memory", default="1.0",
                    help="the probe's memory bound, a share of what the step saved, or 'none' (default 1.0)")
    ap.add_argument("--pass-rows", type=int, default=0,
                    help="rows per replayed pass of the probe and its checks (default: the policy's choice)")
    ap.add_argument("--interval", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--probe-vectors", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import torchvision

    import _gact as _C
    import gact
    from gact import policy as gpol

    torch.manual_seed(0)
    if a.model == "encoder":
        class Encoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True,
                                                         activation="gelu")
                self.enc = torch.nn.TransformerEncoder(layer, 3)
                self.head = torch.nn.Linear(128, 10)

            def forward(self, t):
                return self.head(self.enc(t).mean(1))

        m = Encoder()
        x = torch.randn(a.batch, a.size, 128)
    else:
        m = getattr(torchvision.models, a.model)(num_classes=10)
        x = torch.randn(a.batch, 3, a.size, a.size)
    y = torch.randint(0, 10, (a.batch,))
    params = list(m.parameters())
    interval = a.interval or int(_C.options_current()["adapt_interval"])

    def step(comp=None):
        m.zero_grad()
        t0 = time.perf_counter()
        nbytes = 0
        if comp is None:
            loss = torch.nn.functional.cross_entropy(m(x), y)
        else:
            with comp:
                loss = torch.nn.functional.cross_entropy(m(x), y)
            nbytes = _C.store_stored_bytes()
        loss.backward()
        if comp is not None:
            comp.step()
        dt = time.perf_counter() - t0
        return torch.cat([p.grad.reshape(-1) for p in params]).double(), nbytes, dt

    g0, _, _ = step()

    first_step = [0.0]  # the time of measure()'s first step (after an estimate: its memory reserved afresh)

    def measure(comp):
        errs, nb, ts = [], [], []
        for _ in range(a.seeds):
            g, b, dt = step(comp)
            errs.append(float((g - g0).pow(2).sum()))
            nb.append(b)
            ts.append(dt)
        first_step[0] = ts[0]
        return statistics.mean(errs), statistics.stdev(errs) / a.seeds**0.5, max(nb), statistics.median(ts)

    res = {}
    cu = gact.Compressor(m, bits=2)
    res["uniform2"] = measure(cu)
    cu.close()
    bytes_eq = res["uniform2"][2]

    def auto_arm(name, estimator):
        comp = gact.Compressor(m, bits="auto", budget=2, estimator=estimator, adapt_interval=10**9)
        comp.policy.probe_vectors = a.probe_vectors
        comp.policy.probe_samples = a.ref_batch  # no closure: the sampled step's first samples are replayed
        comp.policy.probe_pass_rows = a.pass_rows or None
        comp.policy.probe_memory = None if a.probe_memory == "none" else float(a.probe_memory)
        _, _, t_sampled = step(comp)  # step 0: sampled, then estimate + decide inside comp.step()
        est_s = comp.policy.estimate_seconds
        var, se, nb, t_step = measure(comp)  # the plain API
        after = max(first_step[0] - t_step, 0.0)  # the step after the estimate, over an ordinary one
        if not a.no_fit:
            comp.policy.fit_bytes(lambda: m(x), bytes_eq)
            res[name + "@fit"] = measure(comp)
        d = comp.policy.stats()["last_decision"]
        comp.close()
        extra = max(t_sampled - est_s - t_step, 0.0) + est_s + after
        res[name] = (var, se, nb, t_step)
        res[name + "_overhead_pct"] = 100.0 * extra / (interval * t_step)
        default_gap = max(1000, gpol.spacing_steps(extra, t_step, 0.01))
        res[name + "_default_interval"] = default_gap
        res[name + "_default_overhead_pct"] = 100.0 * extra / (default_gap * t_step)
        res[name + "_estimate_steps"] = extra / t_step
        res[name + "_estimate_s"] = est_s
        res[name + "_decision"] = {k: d[k] for k in ("solved", "unestimated", "stored_bytes", "achieved_avg_bits")}
        res[name + "_verified"] = getattr(comp.policy, "verified", 0)
        res[name + "_check"] = comp.policy.stats().get("last_check")
        if name == "probe" and a.group_ceiling:
            cu2 = gact.Compressor(m, bits=2)
            rng = group_ranges(cu2, lambda: step(cu2))
            cu2.close()
            res["group_ceiling"] = ceilings(comp.policy.stats()["tensors"], rng)
        if name == "probe":
            res["_tensors"] = {k: r for k, r in comp.policy.stats()["tensors"].items() if r.get("variance")}

    auto_arm("online", "online")
    auto_arm("probe", "probe")
    if not a.skip_reference:
        auto_arm("reference", "reference")

    if a.oracle:
        res["oracle"] = oracle(a, m, x, y, step, measure, res.pop("_tensors", {}), bytes_eq)
    res.pop("_tensors", None)

    vu = res["uniform2"][0]
    print(f"gact-bench policy: {a.model} {a.size}px batch {a.batch}, {a.seeds} seeds, estimators on "
          f"{a.ref_batch} samples, adapt_interval {interval}")
    print(f"{'arm':<10} {'grad variance':>14} {'± s.e.':>10} {'stored B':>9} {'uniform/arm':>12} "
          f"{'steps':>7} {'overhead %':>11} {'default interval':>17} {'at default %':>13}")
    for name in ("uniform2", "online", "online@fit", "probe", "probe@fit", "reference", "reference@fit", "oracle"):
        if name not in res:
            continue
        v, se, nb, _ = res[name]
        ov = res.get(name + "_overhead_pct")
        steps = res.get(name + "_estimate_steps")
        tail = "" if ov is None else (f"{steps:7.2f} {ov:11.3f} {res[name + '_default_interval']:17d} "
                                      f"{res[name + '_default_overhead_pct']:13.3f}")
        print(f"{name:<10} {v:14.4g} {se:10.3g} {nb:9d} {vu / v:12.3f} {tail}")
    if "group_ceiling" in res:
        print("ceilings under the variance model (uniform 2 bits / the best at its bytes): " +
              ", ".join(f"per {k} {v:.3f}x" for k, v in res["group_ceiling"].items()))
    print(f"ordinary auto step {res['online'][3]:.3f} s; probe estimate {res['probe_estimate_s']:.2f} s; "
          f"reference estimate {res.get('reference_estimate_s', float('nan')):.1f} s; "
          f"online estimate+solve {res['online_estimate_s'] * 1e3:.1f} ms")
    print(json.dumps({k: v for k, v in res.items()}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
