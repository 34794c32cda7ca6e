#!/usr/bin/python3
"""gact-bench train: peak memory, step time and saved-activation bytes of a training step, for the
uncompressed baseline, gact at 8/4/2 bits and torch.utils.checkpoint, same model, same run.

    gact-bench train [--model resnet50|resnet18|mobilenet_v2|efficientnet_b0|vit|transformer|word_lm|tinystack]
                     [--size 96] [--batch 8] [--steps 6] [--rounds 3] [--threads 1]
                     [--peak | --no-peak] [--profile] [--accuracy] [--zoo] [--wild] [--json-only]

Peak memory (the headline): each arm runs --peak-steps training steps in a fresh process with glibc's
default malloc settings, and reports its peak RSS (VmHWM), beside what the store's counters say it
saved: baseline saved bytes (pass-through saved-tensor hooks summing every storage a saved tensor lives
in, once and whole, parameters, buffers and the input batch left out) minus what gact stored or kept,
minus what the program still held when backward read it (a tensor the script keeps, such as a language
model's `output`, is used as it is: compressing it saves nothing). The target: the peak drops by at
least 80 % of that promise, and never rises. The peak pass also runs `gactauto`, a Compressor with
bits="auto", budget=2 (the policy's probe and its checks run at step 0, as in any training), so the
peak a user of the policy sees stands beside uniform 2 bits'; it is not timed.

Step time: every arm trains the same model on the same batch in one process with one allocator
configuration, glibc with MALLOC_MMAP_THRESHOLD_=4294967296 and MALLOC_TRIM_THRESHOLD_=100000000000 (the
script re-executes itself with them), so no arm pays for fresh pages another does not. Arms are timed
round-robin (--rounds rounds of --steps timed steps after one warm-up step each), so a change of
machine load falls on all arms alike; the figure is the median step time.

Saved bytes per step: "saved" is the baseline count above for the baseline and checkpoint arms, and for
gact the store's blobs of one step plus the bytes it kept as they are; "ratio" is baseline / arm.
"µs/tensor" is the step time a gact arm adds to the baseline's, divided by the saved tensors the
Compressor saw in one step (stored or kept): what each saved tensor costs, host path and codec together.
--model tinystack (32 x (Linear 64 + GELU) over 16 x batch rows) is where the codec's share is small.

--profile breaks 3 steps per arm down by timing gact's entry points (wall clock): encode (store_put:
the codec pass and its blob), decode (store_get_dlpack and from_dlpack), the Python hooks and tracker
(pack, unpack, deferred normalization stores and the TorchFunctionMode's own code, without the C++
calls), store (comp.step()), and the rest (torch's own work and its dispatch to the mode).

--zoo runs only the fidelity zoo of tests/python/test_fidelity.py (batch 4, two seeds): each model's gradient
cosine to fp32 and whole-step saved-bytes ratio at 8/4/2 bits.

--wild runs only the models of tools/bench/wild.py, which no test was written around (torchvision's
convnext, swin, efficientnet, detection, segmentation and video models, a GRU LM, a hand-written causal
attention, torch's transformer decoder): each one's gradient cosine to fp32 and store ratio at 8/4/2 bits
and auto, through the plain API, with the warnings gact gave.

--accuracy also runs the end-to-end comparison of tests/python/test_training.py with all three seeds
for every model (digits CNN, GCN, char LM): minutes, not seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gact_progress import progress  # noqa: E402  (tools/gact_progress.py)

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "100000000000"}
MODELS = ("resnet50", "resnet18", "mobilenet_v2", "efficientnet_b0", "vit", "transformer", "word_lm", "tinystack")
BITS = (8, 4, 2)


def ensure_malloc_env() -> None:
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    env = dict(os.environ, **MALLOC_ENV)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


# ---- models ----------------------------------------------------------------------------------------

class Workload:
    """A model, its batch, a training step's loss for an arm, and which arms it has."""

    def __init__(self, args):
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        import torch.utils.checkpoint as cp

        torch.manual_seed(0)
        self.keep_output = False
        name = args.model
        if name in ("resnet50", "resnet18", "mobilenet_v2", "efficientnet_b0"):
            import torchvision
            self.model = getattr(torchvision.models, name)(num_classes=10)
            self.x = torch.randn(args.batch, 3, args.size, args.size)
            self.y = torch.randint(0, 10, (args.batch,))
            m = self.model
            if name.startswith("resnet"):
                stages = [m.layer1, m.layer2, m.layer3, m.layer4]

                def ckpt(x):
                    h = m.maxpool(m.relu(m.bn1(m.conv1(x))))
                    for s in stages:
                        h = cp.checkpoint(s, h, use_reentrant=True)
                    return m.fc(torch.flatten(m.avgpool(h), 1))
            else:
                def ckpt(x):
                    feats = list(m.features)
                    k = len(feats) // 4
                    h = x.detach().requires_grad_()  # a reentrant checkpoint needs an input that requires grad
                    for i in range(0, len(feats), k):
                        h = cp.checkpoint(nn.Sequential(*feats[i:i + k]), h, use_reentrant=True)
                    return m.classifier(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
            self.checkpoint_forward = ckpt
            self.loss = lambda out: F.cross_entropy(out, self.y)
        elif name in ("vit", "transformer"):
            if name == "vit":
                import torchvision
                self.model = torchvision.models.VisionTransformer(image_size=args.size, patch_size=8, num_layers=6,
                                                                  num_heads=6, hidden_dim=384, mlp_dim=1536,
                                                                  num_classes=10)
                self.x = torch.randn(args.batch, 3, args.size, args.size)
                layers = list(self.model.encoder.layers)
            else:  # a BERT-base-like encoder block stack, sequence 128, mean-pooled into a classifier
                class Encoder(nn.Module):
                    def __init__(self):
                        super().__init__()
                        layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.1, batch_first=True,
                                                           activation="gelu")
                        self.enc = nn.TransformerEncoder(layer, 6)
                        self.head = nn.Linear(512, 10)

                    def forward(self, x):
                        return self.head(self.enc(x).mean(1))

                self.model = Encoder()
                self.x = torch.randn(args.batch, 128, 512)
                layers = list(self.model.enc.layers)
            self.y = torch.randint(0, 10, (args.batch,))
            m = self.model

            if name == "vit":
                def ckpt(x):
                    h = m._process_input(x.detach().requires_grad_())
                    h = torch.cat([m.class_token.expand(x.shape[0], -1, -1), h], dim=1)
                    h = m.encoder.dropout(h + m.encoder.pos_embedding)
                    for layer in layers:
                        h = cp.checkpoint(layer, h, use_reentrant=True)
                    return m.heads(m.encoder.ln(h)[:, 0])
                self.loss = lambda out: F.cross_entropy(out, self.y)
            else:
                def ckpt(x):
                    h = x.detach().requires_grad_()  # a reentrant checkpoint needs an input that requires grad
                    for layer in layers:
                        h = cp.checkpoint(layer, h, use_reentrant=True)
                    return m.head(h.mean(1))
                self.loss = lambda out: F.cross_entropy(out, self.y)
            self.checkpoint_forward = ckpt
        elif name == "word_lm":
            # pytorch/examples' word_language_model shape: embedding, 2-layer LSTM 512, 10k-vocabulary
            # log-softmax, bptt 70, batch 40; the script keeps `output` alive through backward.
            class WordLM(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.encoder = nn.Embedding(10000, 512)
                    self.rnn = nn.LSTM(512, 512, 2, dropout=0.2)
                    self.drop = nn.Dropout(0.2)
                    self.decoder = nn.Linear(512, 10000)

                def forward(self, t):
                    h, _ = self.rnn(self.drop(self.encoder(t)))
                    return F.log_softmax(self.decoder(self.drop(h)), dim=-1)

            self.model = WordLM()
            self.x = torch.randint(0, 10000, (70, args.batch))
            self.y = torch.randint(0, 10000, (70 * args.batch,))
            self.checkpoint_forward = None
            self.keep_output = True
            self.loss = lambda out: F.nll_loss(out.view(-1, 10000), self.y)
        elif name == "tinystack":
            # what each saved tensor costs on the host: 32 x (Linear 64 + GELU) over 16 x batch rows (8 KiB
            # tensors at batch 2, 32 KiB at 8), where the codec's work is small beside the per-tensor path
            layers = []
            for _ in range(32):
                layers += [nn.Linear(64, 64), nn.GELU()]
            self.model = nn.Sequential(*layers, nn.Linear(64, 10))
            self.x = torch.randn(16 * args.batch, 64)
            self.y = torch.randint(0, 10, (16 * args.batch,))
            self.checkpoint_forward = None
            self.loss = lambda out: F.cross_entropy(out, self.y)
        else:
            raise SystemExit(f"gact-bench train: unknown model {name!r}; use one of {', '.join(MODELS)}")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)

    def arms(self) -> list[str]:
        return ["baseline", "alloc"] + [f"gact{b}" for b in BITS] + (["checkpoint"] if self.checkpoint_forward else [])


# Which arms run on gact's CPU allocator (torch's CPU tensors in gact's host arena): the gact arms, as a
# Compressor sets it by default, and `alloc`, the uncompressed baseline on it (the allocator's own share).
def uses_gact_allocator(arm: str) -> bool:
    return arm == "alloc" or arm.startswith("gact")


def comp_key(arm: str):
    """The Compressor of a gact arm: its bits (gact4 -> 4), or "auto" (gactauto)."""
    s = arm[4:]
    return int(s) if s.isdigit() else s


def make_step(w, comps):
    """step(arm) -> the bytes the store held at the end of forward (0 for other arms)."""
    import gact

    def step(arm: str) -> int:
        held = 0
        gact.use_cpu_allocator(uses_gact_allocator(arm))
        if arm.startswith("gact"):
            comp = comps[comp_key(arm)]
            with comp:
                out = w.model(w.x)
                loss = w.loss(out)
            import _gact
            held = _gact.store_stored_bytes()
        elif arm == "checkpoint":
            out = w.checkpoint_forward(w.x)
            loss = w.loss(out)
        else:  # baseline, alloc
            out = w.model(w.x)
            loss = w.loss(out)
        if not w.keep_output:
            del out
        loss.backward()
        del loss
        if w.keep_output:
            del out
        w.opt.step()
        w.opt.zero_grad(set_to_none=True)
        if arm.startswith("gact"):
            comps[comp_key(arm)].step()
        return held
    return step


def saved_bytes(w, forward) -> int:
    """Bytes of memory autograd's saves keep alive in one step: every storage a saved tensor lives in, once,
    whole (a saved view keeps all of its storage alive), parameters, buffers and the batch left out."""
    import torch
    from gact import _compat
    skip = {_compat.storage_base(t) for t in list(w.model.parameters()) + list(w.model.buffers()) + [w.x, w.y]}
    seen, total = set(), [0]

    def nbytes(t):
        st = t.untyped_storage() if _compat.HAS_UNTYPED_STORAGE else t.storage()
        return st.nbytes()

    def pack(t):
        base = _compat.storage_base(t)
        if base not in skip and base not in seen:
            seen.add(base)
            total[0] += nbytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = w.loss(forward(w.x))
    loss.backward()
    w.model.zero_grad(set_to_none=True)
    return total[0]


def gact_step_bytes(gact, comp, step, arm) -> dict:
    """One gact step's stored bytes, kept bytes and the bytes of tensors the program still held."""
    before = gact.stats()["store"]
    step(arm)
    after = gact.stats()["store"]
    kept = sum(after["skipped"][r]["bytes"] - before["skipped"][r]["bytes"]
               for r in after["skipped"] if r not in ("parameter", "input"))
    stored = after["bytes_stored"] - before["bytes_stored"]
    held = after["unstored"]["held"]["bytes"] - before["unstored"]["held"]["bytes"]
    ratio = (after["bytes_in"] - before["bytes_in"]) / stored if stored else 0.0
    # every saved tensor the Compressor saw: stored, kept for a reason (parameters and inputs too), or read for its
    # shape alone
    tensors = after["tensors_in"] - before["tensors_in"] + sum(
        after["skipped"][r]["tensors"] - before["skipped"][r]["tensors"] for r in after["skipped"]) + \
        after["unstored"]["shape"]["tensors"] - before["unstored"]["shape"]["tensors"]
    return {"stored": stored, "kept": kept, "held": held, "store_ratio": ratio, "saved_tensors": tensors}


# ---- peak memory in fresh processes -------------------------------------------------------------------

def peak_child(args) -> int:
    """Run --peak-steps steps of one arm and print this process's peak RSS and the counters as JSON."""
    import torch
    import gact
    torch.set_num_threads(args.threads)
    w = Workload(args)
    if args.peak_child == "gactauto":  # as a user of the policy writes it, with no other Compressor
        comps = {"auto": gact.Compressor(w.model, bits="auto", budget=2)}
    else:
        comps = {b: gact.Compressor(w.model, bits=b) for b in BITS} if args.peak_child.startswith("gact") else {}
    step = make_step(w, comps)
    out = {"arm": args.peak_child}
    if args.peak_child == "baseline":
        out["saved"] = saved_bytes(w, w.model)
    for _ in range(args.peak_steps):
        step(args.peak_child)
    if args.peak_child.startswith("gact"):
        out.update(gact_step_bytes(gact, comps[comp_key(args.peak_child)], step, args.peak_child))
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                out["peak_rss"] = int(line.split()[1]) * 1024
    print("GACT_PEAK " + json.dumps(out))
    return 0


def measure_peaks(args, arms) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}  # glibc's default settings
    res = {}
    bar = progress(total=len(arms), label="gact-bench train --peak")
    bar.enabled = bar.enabled and not args.json_only
    for arm in arms:
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--size", str(args.size),
               "--batch", str(args.batch), "--threads", str(args.threads), "--peak-steps", str(args.peak_steps),
               "--peak-child", arm]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("GACT_PEAK ")), None)
        if r.returncode != 0 or line is None:
            sys.exit(f"gact-bench train: the {arm} peak run failed (status {r.returncode}):\n{r.stderr[-2000:]}")
        res[arm] = json.loads(line[len("GACT_PEAK "):])
        bar.update(1, note=arm)
    bar.finish()
    base = res["baseline"]
    alloc = res.get("alloc")
    for arm, r in res.items():
        r["peak_drop"] = base["peak_rss"] - r["peak_rss"]
        if arm.startswith("gact"):
            # what the counters say this arm saved of the baseline's saved bytes, less what the program held
            r["promised"] = base["saved"] - (r["stored"] + r["kept"]) - r["held"]
            r["realized"] = r["peak_drop"] / r["promised"] if r["promised"] > 0 else 0.0
            if alloc is not None:  # compression's own share: against the baseline on the same allocator
                r["realized_same_allocator"] = ((alloc["peak_rss"] - r["peak_rss"]) / r["promised"]
                                                if r["promised"] > 0 else 0.0)
    return res


# ---- profile ----------------------------------------------------------------------------------------

def profile_breakdown(step, arm, steps=3) -> dict:
    """Wall-clock time of each part of `steps` steps of `arm`, measured by timing gact's own entry
    points (perf_counter around them; cProfile's per-call overhead tripled the Python share):
    encode = inside _gact.store_put (the codec pass and the store's bookkeeping), decode = inside
    _gact.store_get_dlpack and from_dlpack, python = the rest of the pack and unpack hooks, the
    deferred stores of normalization inputs and the op tracker's own code, store = comp.step();
    torch = everything else (torch's work, its dispatch to the TorchFunctionMode included)."""
    import _gact
    from gact import compressor, saved

    pc = time.perf_counter
    acc = {"encode": 0.0, "decode": 0.0, "hooks": 0.0, "tracker": 0.0, "inner": 0.0, "store": 0.0}
    depth = [0]
    patches = []

    def patch(obj, name, label, outermost=False):
        f = getattr(obj, name)

        def timed(*a, **k):
            if outermost and depth[0]:
                return f(*a, **k)
            depth[0] += outermost
            t0 = pc()
            try:
                return f(*a, **k)
            finally:
                acc[label] += pc() - t0
                depth[0] -= outermost
        patches.append((obj, name, f))
        setattr(obj, name, timed)

    patch(_gact, "store_put", "encode")
    patch(_gact, "store_get_dlpack", "decode")
    patch(compressor, "_from_dlpack", "decode")
    patch(compressor.Compressor, "_pack", "hooks", outermost=True)
    patch(compressor._Packed, "unpack", "hooks", outermost=True)
    patch(compressor.Compressor, "step", "store")
    tf = saved.OpTracker.__torch_function__

    def tracked(self, func, types, args=(), kwargs=None):
        if func.__class__ is saved._METHOD_WRAPPER:  # a property's getter (Tensor.data): as it is
            return tf(self, func, types, args, kwargs)
        subs = self.substitutes
        run = subs.get(func, func) if subs is not None else func

        # The frame must still name the op (the storage table decides by name: batch norm's statistics,
        # kept exact, would otherwise be quantized as values), and the stand-in is applied here.
        @functools.wraps(func)
        def inner(*a, **k):
            t1 = pc()
            try:
                return run(*a, **k)
            finally:
                acc["inner"] += pc() - t1
        t0 = pc()
        try:
            return tf(self, inner, types, args, kwargs)
        finally:
            acc["tracker"] += pc() - t0
    patches.append((saved.OpTracker, "__torch_function__", tf))
    saved.OpTracker.__torch_function__ = tracked
    try:
        t0 = pc()
        for _ in range(steps):
            step(arm)
        total = (pc() - t0) / steps
    finally:
        for obj, name, f in reversed(patches):
            setattr(obj, name, f)
    n = float(steps)
    encode, decode, store = acc["encode"] / n, acc["decode"] / n, acc["store"] / n
    # the hooks and the tracker's own code (its time less the op it ran; the deferred stores of
    # normalization inputs run there), less the C++ calls inside either
    python = (acc["hooks"] + acc["tracker"] - acc["inner"] - acc["encode"] - acc["decode"]) / n
    return {"step_s": total, "encode_s": encode, "decode_s": decode, "python_s": python,
            "store_other_s": store, "torch_s": total - encode - decode - python - store}


# ---- main -------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18", choices=MODELS)
    ap.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm per round (default 6)")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--peak", dest="peak", action="store_true", default=True,
                    help="measure each arm's peak RSS in a fresh process (the default)")
    ap.add_argument("--no-peak", dest="peak", action="store_false", help="skip the fresh-process peak runs")
    ap.add_argument("--peak-steps", type=int, default=3, help="steps of each fresh peak run (default 3)")
    ap.add_argument("--peak-child", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="print the per-step breakdown of the gact arms")
    ap.add_argument("--accuracy", action="store_true", help="also run the 3-seed end-to-end accuracy comparison")
    ap.add_argument("--wild", action="store_true",
                    help="only models no test was written around (tools/bench/wild.py): cosine and ratio at 8/4/2/auto")
    ap.add_argument("--autocast", action="store_true",
                    help="with --wild: every arm under CPU bfloat16 autocast, against the autocast run without gact")
    ap.add_argument("--only", metavar="TEXT",
                    help="with --wild: only the models whose name contains TEXT (e.g. mobilenet_v3)")
    ap.add_argument("--zoo", action="store_true",
                    help="only the fidelity zoo: gradient cosine and whole-step ratio at 8/4/2 bits per model")
    ap.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if (args.only is not None or args.autocast) and not args.wild:
        ap.error("--only and --autocast go with --wild")
    if min(args.size, args.batch, args.steps, args.rounds, args.threads, args.peak_steps) < 1:
        ap.error("--size, --batch, --steps, --rounds, --threads and --peak-steps must be at least 1")
    try:
        import gact  # noqa: F401
    except ImportError as exc:
        sys.exit(f"gact-bench train: cannot import gact ({exc}); run through tools/gact-bench or "
                 "inside `meson devenv -C <builddir>`")
    if args.peak_child:
        return peak_child(args)
    if args.wild:
        print(json.dumps({"bench": "train --wild", "wild": run_wild(args)}))
        return 0
    if args.zoo:
        print(json.dumps({"bench": "train --zoo", "zoo": run_zoo(args)}))
        return 0
    peaks = None
    if args.peak:
        import torch  # noqa: F401  (fail here, not in a child, when torch is missing)
        peaks = measure_peaks(args, Workload(args).arms() + ["gactauto"])
    ensure_malloc_env()

    import torch
    import gact

    torch.set_num_threads(args.threads)
    w = Workload(args)
    comps = {b: gact.Compressor(w.model, bits=b) for b in BITS}
    step = make_step(w, comps)
    arms = w.arms()
    gact.use_cpu_allocator(False)
    mem = {"baseline": saved_bytes(w, w.model)}
    mem["alloc"] = mem["baseline"]
    if w.checkpoint_forward:
        mem["checkpoint"] = saved_bytes(w, w.checkpoint_forward)
    detail = {}
    for b in BITS:
        step(f"gact{b}")
        d = gact_step_bytes(gact, comps[b], step, f"gact{b}")
        detail[f"gact{b}"] = d
        mem[f"gact{b}"] = d["stored"] + d["kept"]

    times = {a: [] for a in arms}
    bar = progress(total=args.rounds * len(arms) * (args.steps + 1), label="gact-bench train")
    bar.enabled = bar.enabled and not args.json_only
    for r in range(args.rounds):
        for a in arms:
            step(a)  # warm-up (and a fresh cache state for this arm)
            bar.update(1, note=f"round {r + 1}/{args.rounds}, arm {a}")
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(a)
                times[a].append(time.perf_counter() - t0)
                bar.update(1)
    bar.finish()
    prof = {f"gact{b}": profile_breakdown(step, f"gact{b}") for b in BITS} if args.profile else None
    base_prof = profile_breakdown(step, "baseline") if args.profile else None
    for comp in comps.values():
        comp.close()

    med = {a: statistics.median(v) for a, v in times.items()}
    base_t, base_m = med["baseline"], mem["baseline"]
    result = {"bench": "train", "model": args.model, "size": args.size, "batch": args.batch,
              "threads": args.threads, "steps_per_arm": args.steps * args.rounds, "torch": torch.__version__,
              "malloc_env": MALLOC_ENV, "arms": {}}
    for a in arms:
        row = {"step_time_s": med[a], "time_ratio": med[a] / base_t, "saved_bytes": mem[a],
               "memory_ratio": base_m / mem[a] if mem[a] else 0.0, "step_time_min_s": min(times[a]),
               "step_time_max_s": max(times[a])}
        if a in detail:
            row["store_ratio"] = detail[a]["store_ratio"]
            n = detail[a]["saved_tensors"]
            row["saved_tensors"] = n
            # the step time gact adds, per saved tensor it saw (host path, codec and all)
            row["us_per_saved_tensor"] = 1e6 * (med[a] - base_t) / n if n else None
        if peaks is not None:
            row["peak"] = peaks[a]
        result["arms"][a] = row
    if peaks is not None and "gactauto" in peaks:
        result["peak_only"] = {"gactauto": peaks["gactauto"]}
    if prof is not None:
        result["profile"] = dict(prof, baseline=base_prof)
    g4, g2 = result["arms"]["gact4"], result["arms"]["gact2"]
    ck = result["arms"].get("checkpoint")
    result["targets"] = {
        "time_4bit_le_1.15x": g4["time_ratio"] <= 1.15,
        "time_2bit_le_1.15x": g2["time_ratio"] <= 1.15,
        "ratio_4bit_ge_7x": g4["memory_ratio"] >= 7.0,
        "ratio_2bit_ge_12x": g2["memory_ratio"] >= 12.0,
    }
    if ck is not None:
        result["targets"]["beats_checkpoint_on_both"] = all(
            result["arms"][a]["time_ratio"] < ck["time_ratio"] and result["arms"][a]["memory_ratio"] > ck["memory_ratio"]
            for a in ("gact4", "gact2"))
    if peaks is not None:
        result["targets"]["peak_4bit_ge_80pct_of_promise"] = g4["peak"]["realized"] >= 0.8
        result["targets"]["peak_never_rises"] = all(result["arms"][f"gact{b}"]["peak"]["peak_drop"] >= 0 for b in BITS)
    if not args.json_only:
        images = ("resnet50", "resnet18", "mobilenet_v2", "efficientnet_b0", "vit")
        shape = f"{args.size}x{args.size}, " if args.model in images else ""
        print(f"\n{args.model}, {shape}batch {args.batch}, {args.threads} threads, torch {torch.__version__}, "
              f"median of {args.steps * args.rounds} steps per arm")
        print(f"{'arm':11} {'step time':>10} {'vs baseline':>12} {'saved/step':>11} {'ratio':>8} {'store ratio':>12}"
              f" {'µs/tensor':>10}"
              + (f" {'peak RSS':>10} {'drop':>9} {'promised':>9} {'realized':>9} {'same alloc':>10}" if peaks else ""))
        for a in arms:
            r = result["arms"][a]
            sr = f"{r['store_ratio']:.2f}x" if "store_ratio" in r else "-"
            us = f"{r['us_per_saved_tensor']:.1f}" if r.get("us_per_saved_tensor") is not None else "-"
            line = (f"{a:11} {1000 * r['step_time_s']:8.1f}ms {r['time_ratio']:11.3f}x "
                    f"{r['saved_bytes'] / 2**20:8.2f}MiB {r['memory_ratio']:7.2f}x {sr:>12} {us:>10}")
            if peaks:
                p = r["peak"]
                prom = f"{p['promised'] / 2**20:7.1f}Mi" if "promised" in p else "-"
                real = f"{100 * p['realized']:7.0f} %" if "realized" in p else "-"
                same = f"{100 * p['realized_same_allocator']:8.0f} %" if "realized_same_allocator" in p else "-"
                line += f" {p['peak_rss'] / 2**20:8.1f}Mi {p['peak_drop'] / 2**20:7.1f}Mi {prom:>9} {real:>9} {same:>10}"
            print(line)
        if peaks and "gactauto" in peaks:
            p = peaks["gactauto"]
            print(f"{'gactauto':11} {'(peak only: bits=auto, budget=2)':>56} {p['peak_rss'] / 2**20:8.1f}Mi "
                  f"{p['peak_drop'] / 2**20:7.1f}Mi {p['promised'] / 2**20:7.1f}Mi {100 * p['realized']:7.0f} %")
        if prof is not None:
            print("\nper-step breakdown (3 steps, wall clock at gact's entry points):")
            print(f"{'arm':9} {'step':>8} {'encode':>8} {'decode':>8} {'python':>8} {'store':>8} {'torch':>8}")
            for a, p in list(prof.items()) + [("baseline", base_prof)]:
                print(f"{a:9} " + " ".join(f"{1000 * p[k]:6.1f}ms" for k in
                                           ("step_s", "encode_s", "decode_s", "python_s", "store_other_s", "torch_s")))
        print("targets: " + "; ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in result["targets"].items()))

    if args.accuracy:
        result["accuracy"] = run_accuracy(args)
    print(json.dumps(result))
    return 0


def run_zoo(args) -> dict:
    """The fidelity zoo of tests/python/test_fidelity.py at 8/4/2 bits: gradient cosine to fp32 (mean of two
    seeds) and the whole-step ratio (what autograd saves over what gact stores or keeps)."""
    import torch
    import gact
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests", "python"))
    import test_fidelity as fid

    torch.set_num_threads(args.threads)
    out = {}
    if not args.json_only:
        print("model                       8 bits              4 bits              2 bits")
    for name in fid.ZOO:
        torch.manual_seed(0)
        m, x = fid._zoo()[name]()
        loss_fn = (lambda o: o.float().square().mean()) if name != "lstm_lm" else (lambda o: -o.mean())
        g0 = fid._grad_of(m, x, loss_fn=loss_fn)
        row = {}
        for bits in BITS:
            cos = []
            s0 = gact.stats()["store"]
            for seed in (0, 1):
                comp = gact.Compressor(m, bits=bits, seed=seed)
                cos.append(fid._cos(fid._grad_of(m, x, comp, loss_fn), g0))
                comp.close()
            s1 = gact.stats()["store"]
            kept = sum(s1["skipped"][r]["bytes"] - s0["skipped"][r]["bytes"]
                       for r in s1["skipped"] if r not in ("parameter", "input"))
            stored = s1["bytes_stored"] - s0["bytes_stored"] + kept
            row[f"{bits}bit"] = {"cosine": sum(cos) / 2, "ratio": (s1["bytes_in"] - s0["bytes_in"] + kept) / max(1, stored)}
        out[name] = row
        if not args.json_only:
            print(f"{name:24} " + " ".join(f"{row[f'{b}bit']['cosine']:9.5f} ({row[f'{b}bit']['ratio']:5.1f}x)"
                                           for b in BITS), flush=True)
    return out


def run_wild(args) -> dict:
    """Models no test was written around (tools/bench/wild.py) through the plain API at 8/4/2 bits and auto:
    gradient cosine to fp32 (mean of two seeds; auto: its second step, after the sampled one) and the
    store's ratio, with the warnings gact gave. With --autocast every arm runs under CPU bfloat16 autocast
    and the reference is the autocast run without gact."""
    import warnings
    import torch
    import gact
    import wild

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()

    torch.set_num_threads(args.threads)
    out = {}
    models = {k: v for k, v in wild.MODELS.items() if args.only is None or args.only in k}
    if not models:
        raise SystemExit(f"gact-bench train --wild: no model's name contains {args.only!r}; the models: "
                         + "; ".join(wild.MODELS))
    for name, build in models.items():
        torch.manual_seed(0)
        m, forward = build()
        m.train()

        def grad(comp=None):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(123)  # the same dropout masks and sampled boxes in every arm
            with autocast():
                with comp if comp is not None else contextlib.nullcontext():
                    out_ = forward()
                loss = wild.loss_of(out_)
            loss.float().backward()
            if comp is not None:
                comp.step()
            return torch.cat([p.grad.reshape(-1).double() for p in m.parameters() if p.grad is not None])

        try:
            g0 = grad()
        except RuntimeError as e:  # torch's own CPU bfloat16 kernels miss some ops (layer_norm's mixed dtypes, nms)
            if not args.autocast:
                raise
            out[name] = {"error": str(e).splitlines()[0]}
            if not args.json_only:
                print(f"{name:42} torch cannot run it under CPU bfloat16 autocast: {out[name]['error']}", flush=True)
            continue
        row: dict = {}
        for bits in BITS + ("auto",):
            cos = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for seed in (0, 1):
                    comp = gact.Compressor(m, bits=bits, seed=seed)
                    for _ in range(2 if bits == "auto" else 1):
                        g = grad(comp)
                    cos.append(float(g @ g0 / (g.norm() * g0.norm())) if torch.isfinite(g).all() else float("nan"))
                    ratio = comp.stats()["store"]["ratio"]
                    comp.close()
            said = sorted({str(w.message).split(";")[0] for w in caught})
            row[str(bits)] = {"cosine": sum(cos) / 2, "ratio": ratio, "warnings": said}
        out[name] = row
        if not args.json_only:
            cells = "  ".join(f"{b}: {row[str(b)]['cosine']:.4f} ({row[str(b)]['ratio']:.1f}x)" for b in BITS + ("auto",))
            print(f"{name:42} {cells}", flush=True)
            for w in sorted({w for r in row.values() for w in r["warnings"]}):
                print(f"{'':42} warned: {w}")
    return out


def run_accuracy(args) -> dict:
    """The 3-seed end-to-end comparison (models and data of tests/python/evalkit.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests", "python"))
    import evalkit as k

    out = {}
    jobs = [("digits_acc", lambda b, s: k.train_digits(b, s, epochs=6)),
            ("gcn_acc", lambda b, s: k.train_gcn(b, s)),
            ("charlm_loss", lambda b, s: k.train_charlm(b, s))]
    arms = (None, 8, 4, 2, "auto")  # auto: the plain API, bits="auto" at the default budget (2)
    bar = progress(total=len(jobs) * len(arms) * 3, label="gact-bench train --accuracy")
    bar.enabled = bar.enabled and not args.json_only
    for name, fn in jobs:
        res = {}
        for bits in arms:
            arm = "fp32" if bits is None else "auto" if bits == "auto" else f"{bits}bit"
            vals = []
            for s in (0, 1, 2):
                vals.append(fn(bits, s))
                bar.update(1, note=f"{name} {arm} seed {s}")
            res[arm] = vals
        base = res["fp32"]
        out[name] = {}
        for arm, vals in res.items():
            m, sd = k.mean_std(vals)
            dm, dsd = k.mean_std([a - b for a, b in zip(vals, base)])
            out[name][arm] = {"values": vals, "mean": m, "std": sd, "paired_delta_mean": dm, "paired_delta_std": dsd}
            if not args.json_only:
                print(f"{name:12} {arm:5}: {m:.3f} ± {sd:.3f}   paired Δ {dm:+.3f} ± {dsd:.3f}", flush=True)
    bar.finish()
    return out


if __name__ == "__main__":
    sys.exit(main())
