#!/usr/bin/python3
"""gact demo: train a CNN on scikit-learn's bundled digits with and without compression.

    tools/dev demo [--epochs N] [--bits 4,2] [--stats PATH] [--seed S]

(`tools/dev demo` runs this inside `meson devenv -C build`, so `import gact` finds the
built package.) The same small CNN, from the same initial weights and with the same
batches, is trained once in fp32 and once per bit width with its saved activations
compressed by ``gact.Compressor``. While it trains the demo shows progress (a bar with an
ETA on a terminal, a plain line every few seconds otherwise). At the end it prints a
side-by-side table and writes gact's statistics document, with the demo's table added
under the key ``demo``, to ``--stats`` (default ``gact-demo-stats.json`` in the current
directory; render it with ``tools/gact-stats PATH``).

Columns:
  saved/step  bytes autograd keeps for backward per step: for fp32, measured by
              pass-through saved-tensor hooks (distinct tensors, parameters and the
              input batch left out, as they stay in memory either way); for gact, the
              blobs the store wrote plus the bytes it kept uncompressed (tensors under
              the size threshold, integer tensors such as max-pool indices), from the
              store's counters
  ratio       fp32 saved/step over this row's saved/step
  step time   median time of a training step, and its ratio to fp32 (on the CPU,
              compression costs time: this is the price of the memory)
  accuracy    on the 899 held-out digits
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import gact
except ImportError as exc:
    sys.exit(f"demo: cannot import gact ({exc}); run it as `tools/dev demo`, or inside "
             "`meson devenv -C build` after building")


class DigitsCNN(nn.Module):
    """Two 3x3 conv layers (the first with BatchNorm), max-pool, two dense layers."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_digits(seed: int):
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 2
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


class SavedBytes:
    """Pass-through saved-tensor hooks summing the distinct bytes autograd saves,
    leaving out the model's parameters and buffers and the given inputs."""

    def __init__(self, model: nn.Module, inputs):
        self.ptrs = {t.storage().data_ptr() for t in list(model.parameters()) + list(model.buffers()) + list(inputs)}
        self.seen = set()
        self.bytes = 0

    def pack(self, t):
        ptr = t.storage().data_ptr()
        key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ptr not in self.ptrs and key not in self.seen:
            self.seen.add(key)
            self.bytes += t.numel() * t.element_size()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class Progress:
    """A bar with an ETA on a terminal; otherwise one plain line every `every` seconds."""

    def __init__(self, total: int, label: str, stream=sys.stderr, every: float = 3.0):
        self.total, self.label, self.stream, self.every = total, label, stream, every
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.last = self.start
        self.done = 0

    def update(self, done: int, loss: float):
        self.done = done
        now = time.perf_counter()
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        if self.tty:
            width = 28
            fill = int(width * done / self.total)
            bar = "#" * fill + "-" * (width - fill)
            self.stream.write(f"\r  {self.label:<7} [{bar}] {done:4d}/{self.total} steps  "
                              f"loss {loss:6.3f}  ETA {eta:4.1f}s ")
            self.stream.flush()
        elif now - self.last >= self.every or done == self.total:
            self.last = now
            self.stream.write(f"  {self.label}: step {done}/{self.total}, loss {loss:.3f}, "
                              f"{elapsed:.1f}s elapsed, ETA {eta:.1f}s\n")
            self.stream.flush()

    def finish(self, note: str):
        elapsed = time.perf_counter() - self.start
        if self.tty:
            self.stream.write("\r" + " " * 78 + "\r")
        self.stream.write(f"  {self.label}: {self.total} steps in {elapsed:.1f}s, {note}\n")
        self.stream.flush()


def train(arm: str, bits, data, args) -> dict:
    """Train one arm; returns its row of the table (and the store counters it used)."""
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    comp = gact.Compressor(model, bits=bits, seed=args.seed) if bits is not None else None
    gen = torch.Generator().manual_seed(args.seed)
    n, batch = len(y_tr), args.batch
    steps_per_epoch = n // batch
    total = args.epochs * steps_per_epoch
    progress = Progress(total, arm)
    before = gact.stats()["store"]
    saved_fp32 = None
    times = []
    done = 0
    for _ in range(args.epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(steps_per_epoch):
            idx = perm[i * batch:(i + 1) * batch]
            xb, yb = x_tr[idx], y_tr[idx]
            if comp is None and saved_fp32 is None:
                # Measure the uncompressed saved bytes once, on a step that is not timed.
                counter = SavedBytes(model, (xb,))
                with counter.hooks():
                    F.cross_entropy(model(xb), yb).backward()
                model.zero_grad(set_to_none=True)
                saved_fp32 = counter.bytes
            t0 = time.perf_counter()
            if comp is not None:
                with comp:
                    loss = F.cross_entropy(model(xb), yb)
            else:
                loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if comp is not None:
                comp.step()
            times.append(time.perf_counter() - t0)
            done += 1
            progress.update(done, float(loss))
    model.eval()
    with torch.no_grad():
        acc = 100.0 * float((model(x_te).argmax(1) == y_te).float().mean())
    row = {"arm": arm, "bits": bits if bits is not None else 32, "steps": total,
           "step_time_s": statistics.median(times), "accuracy": acc}
    if comp is None:
        row["saved_bytes_per_step"] = saved_fp32
    else:
        comp.close()
        after = gact.stats()["store"]
        stored = after["bytes_stored"] - before["bytes_stored"]
        # Kept as is: every skipped tensor except parameters and the input batch, which the
        # fp32 count leaves out too (small tensors, integer tensors such as pooling indices).
        kept = sum(after["skipped"][r]["bytes"] - before["skipped"].get(r, {}).get("bytes", 0)
                   for r in after["skipped"] if r not in ("parameter", "input"))
        row["saved_bytes_per_step"] = (stored + kept) / total
        row["store_ratio"] = ((after["bytes_in"] - before["bytes_in"]) / stored) if stored else 0.0
        row["leaks"] = after["leaks"] - before["leaks"]
    progress.finish(f"test accuracy {acc:.2f}%")
    return row


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=6, help="passes over the 898 training digits (default 6)")
    ap.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    ap.add_argument("--bits", default="4,2", help="comma-separated bit widths to compare with fp32 (default 4,2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, batch order and gact's noise")
    ap.add_argument("--stats", default="gact-demo-stats.json", help="where to write the stats JSON")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the model is small, and on a shared "
                    "machine a second thread mostly spins)")
    args = ap.parse_args(argv)
    try:
        bit_list = [int(b) for b in args.bits.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--bits {args.bits!r}: expected comma-separated integers from 1, 2, 4, 8")
    for b in bit_list:
        if b not in (1, 2, 4, 8):
            ap.error(f"--bits: {b} is not one of 1, 2, 4, 8")
    if args.epochs < 1 or args.batch < 1:
        ap.error("--epochs and --batch must be at least 1")
    torch.set_num_threads(args.threads)

    data = load_digits(args.seed)
    print(f"gact {gact.__version__} demo: a CNN on scikit-learn's digits ({len(data[1])} train, "
          f"{len(data[3])} test), {args.epochs} epochs, batch {args.batch}, torch {torch.__version__} "
          f"on the CPU with {args.threads} threads", flush=True)
    rows = [train("fp32", None, data, args)]
    for b in bit_list:
        rows.append(train(f"{b}-bit", b, data, args))

    base = rows[0]
    print()
    header = f"{'':8} {'saved/step':>11} {'ratio':>7} {'step time':>10} {'vs fp32':>8} {'accuracy':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["ratio"] = base["saved_bytes_per_step"] / r["saved_bytes_per_step"] if r["saved_bytes_per_step"] else 0.0
        r["step_time_ratio"] = r["step_time_s"] / base["step_time_s"]
        print(f"{r['arm']:8} {fmt_bytes(r['saved_bytes_per_step']):>11} {r['ratio']:6.2f}x "
              f"{1000 * r['step_time_s']:8.1f}ms {r['step_time_ratio']:7.2f}x {r['accuracy']:8.2f}%")
    print()
    for r in rows[1:]:
        print(f"{r['arm']}: activations {r['ratio']:.1f}x smaller than fp32, accuracy "
              f"{r['accuracy'] - base['accuracy']:+.2f} points")

    doc = gact.stats()
    doc["demo"] = {"model": "DigitsCNN", "epochs": args.epochs, "batch": args.batch, "seed": args.seed,
                   "threads": args.threads, "rows": rows}
    tmp = args.stats + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, args.stats)
    leaks = sum(r.get("leaks", 0) for r in rows)
    print(f"stats written to {args.stats} (view: tools/gact-stats show {args.stats})"
          + (f"; WARNING: {leaks} leaked handles" if leaks else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
