"""What gact promises for saved tensors holding NaN or ±Inf, checked on one device.

One contract for the CPU and the GPU, run by the pytest suite on the CPU (and on a GPU where
there is one: tests/python/test_integration.py) and by gpu-check's train stage on the GPU:

* a saved tensor holding NaN, +Inf and -Inf comes back with every value exactly where it was
  (the CPU encoder refuses it and the store keeps it raw; a device encode reports it through
  mapped memory and the Compressor serves the tensor it kept until then, codecs/verdict.hpp);
* a finite tensor saved beside it is still compressed (it comes back within one quantization
  step of its range, and not exactly), so the fallback does not spread to its neighbours;
* a saved tensor holding a mask's finite fill (torch.finfo(dtype).min, a magnitude of 2^15 or
  more) comes back exactly too (the codec refuses such a group, codec.hpp k_store_max_magnitude; on
  a device through the same verdict), where its group's step would have swamped every other value;
* a policy network with masked actions (logits set to -inf, then log_softmax, as reinforcement
  learning masks invalid actions; or to finfo.min) trains with finite gradients as in fp32, close to
  fp32's (MASKED_POLICY_MIN_COS).

``run(device)`` returns {"cases", "failures": [text, ...], "device_nonfinite": the store's count of
device encodes that reported such a value}; no failure is the pass.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the masked policy's gradient cosine to fp32, at least (measured on the CPU: 0.997 at 4 bits, 0.880 at 2; a
#: device encodes the same bytes)
MASKED_POLICY_MIN_COS = {2: 0.85, 4: 0.99}


class _Echo(torch.autograd.Function):
    """Saves ``t`` and hands what backward gets back to ``out``."""

    gact_saves = "values"  # (its backward reads nothing: gact stores the save, which the contract checks)

    @staticmethod
    def forward(ctx, x, t, out):
        ctx.save_for_backward(t)
        ctx.out = out
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        ctx.out.append(t.detach().clone())
        return g, None, None


def _store_count(gact: Any, key: str) -> int:
    return int(gact.stats()["store"].get(key, 0))


def _echo(gact: Any, ts: List[torch.Tensor], bits: int) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    x = torch.randn(4, device=ts[0].device, requires_grad=True)
    comp = gact.Compressor(None, bits=bits)
    try:
        with comp:
            y = x
            for t in ts:
                # (a copy the program drops: one it still held unchanged at backward would be used as it is)
                y = _Echo.apply(y, t.clone(), out)
        if y.is_cuda:
            # the encodes have run before backward reads them: a verdict still out there would have the tensor
            # served as it is (exact, also when clean), and the check of the finite neighbour could not tell
            torch.cuda.synchronize(y.device)
        y.sum().backward()
        comp.step()
    finally:
        comp.close()
    return out[::-1]  # (backward runs last save first)


def _masked_policy(device: torch.device, gact: Any, bits: int, fill: float = float("-inf")) -> Dict[str, float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)).to(device)
    obs = torch.randn(128, 32, device=device)
    valid = torch.rand(128, 64, device=device) < 0.3
    valid[:, 0] = True
    act = torch.multinomial(valid.float(), 1).squeeze(1)
    adv = torch.randn(128, device=device)

    def grads(comp: Any) -> torch.Tensor:
        net.zero_grad()
        if comp is None:
            logp = F.log_softmax(net(obs).masked_fill(~valid, fill), dim=-1)
        else:
            with comp:
                logp = F.log_softmax(net(obs).masked_fill(~valid, fill), dim=-1)
        # the policy-gradient loss and an entropy bonus that reads every log-probability (0 * -inf := 0)
        p = logp.exp()
        ent = -(p * logp.masked_fill(~valid, 0.0)).sum(-1)
        loss = -(logp.gather(1, act[:, None]).squeeze(1) * adv).mean() - 0.01 * ent.mean()
        loss.backward()
        return torch.cat([q.grad.flatten() for q in net.parameters()]).double()

    ref = grads(None)
    comp = gact.Compressor(net, bits=bits)
    try:
        g = grads(comp)
        comp.step()
    finally:
        comp.close()
    finite = bool(torch.isfinite(g).all())
    cos = float(F.cosine_similarity(g, ref, dim=0)) if finite else float("nan")
    return {"finite": finite, "cos": cos, "ref_finite": bool(torch.isfinite(ref).all())}


def run(device: str | torch.device, gact: Any = None) -> Dict[str, Any]:
    if gact is None:
        import gact as gact_mod
        gact = gact_mod
    dev = torch.device(device)
    failures: List[str] = []
    cases = 0
    before = _store_count(gact, "device_nonfinite")
    for dtype in DTYPES:
        for bits in (2, 4):
            cases += 1
            g = torch.Generator().manual_seed(bits)
            special = torch.randn(64, 512, generator=g).to(dtype)
            # NaN, +Inf and -Inf in a few groups, one of them a whole row
            special[3, 5], special[10, 7], special[20, 1] = float("inf"), float("-inf"), float("nan")
            special[40] = float("-inf")
            finite = torch.randn(64, 512, generator=g).to(dtype)
            special, finite = special.to(dev), finite.to(dev)
            try:
                back_special, back_finite = _echo(gact, [special, finite], bits)
            except Exception as exc:  # a failure to report, not to raise
                failures.append(f"{dtype} {bits} bits: {type(exc).__name__}: {exc}")
                continue
            nan = special.isnan()
            same = torch.equal(back_special.isnan(), nan) and torch.equal(back_special[~nan], special[~nan])
            if not same:
                wrong = int((back_special[~nan] != special[~nan]).sum()) + int((back_special.isnan() != nan).sum())
                failures.append(f"{dtype} {bits} bits: the tensor with NaN/Inf came back with {wrong} values changed")
            f64 = finite.double()
            step = float(f64.max() - f64.min()) / (2 ** bits - 1)
            err = float((back_finite.double() - f64).abs().max())
            ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
            bound = step + ulp * float(f64.abs().max())
            if not math.isfinite(err) or err > bound:
                failures.append(f"{dtype} {bits} bits: its finite neighbour is off by {err:.4g} > one step {bound:.4g}")
            elif err == 0.0:
                failures.append(f"{dtype} {bits} bits: its finite neighbour came back exact: it was not compressed")
        # a mask's finite fill in a few rows (a causal mask's, an action mask's): exact, as NaN/Inf are
        cases += 1
        g = torch.Generator().manual_seed(7)
        wide = torch.randn(64, 512, generator=g).to(dtype)
        wide[5:9, 100:300] = torch.finfo(dtype).min
        wide = wide.to(dev)
        try:
            (back_wide,) = _echo(gact, [wide], 8)
        except Exception as exc:
            failures.append(f"{dtype} mask fill: {type(exc).__name__}: {exc}")
        else:
            if not torch.equal(back_wide, wide):
                failures.append(f"{dtype} mask fill: the tensor with finfo.min came back with "
                                f"{int((back_wide != wide).sum())} values changed")
    for fill in (float("-inf"), torch.finfo(torch.float32).min):
        for bits in (2, 4):
            cases += 1
            r = _masked_policy(dev, gact, bits, fill)
            what = "masked policy" + ("" if fill == float("-inf") else " (finfo.min)")
            if not r["ref_finite"]:
                failures.append(f"{what}: the fp32 gradients are not finite (the case is broken)")
            elif not r["finite"]:
                failures.append(f"{what}, {bits} bits: gradients not finite where fp32's are")
            elif not r["cos"] >= MASKED_POLICY_MIN_COS[bits]:
                failures.append(f"{what}, {bits} bits: gradient cosine to fp32 {r['cos']:.4f} < "
                                f"{MASKED_POLICY_MIN_COS[bits]}")
    return {"cases": cases, "failures": failures,
            "device_nonfinite": _store_count(gact, "device_nonfinite") - before}
