#!/usr/bin/python3
"""Replay an allocation trace through idealized allocator designs and print each one's fragmentation.

What it answers: how far a design can bring `1 - peak allocated / peak reserved` on a trace
(gact-bench-alloc measures the real allocator; this script measures designs before anyone builds
them). Every design is best fit over address-ordered free blocks with coalescing, as gact's
caching allocator is, one stream; requests are rounded to 512 bytes.

    segments     gact's caching allocator (PyTorch's layout): requests <= 1 MiB in 2 MiB segments,
                 (1, 10) MiB in 20 MiB segments, >= 10 MiB a segment of their own rounded to 2 MiB;
                 a large block keeps a remainder of 1 MiB or less unsplit (counted as allocated)
    expandable   one virtual range per pool (small and large pools, as above), physical pages of
                 --page bytes (CUDA's granularity is 2 MiB) mapped as the top of the range grows: no
                 segment is ever too small, a request that fits nowhere extends the free tail
    expandable1  the same with one range for every size
    ideal-unmap  expandable1, and before any page is mapped (at the top or in a hole) every page no live
                 block touches is unmapped (its physical memory reused): the best a remapping design
                 could do; "unmapped/pass" is what that costs in the last pass (MiB unmapped and
                 mapped again elsewhere, a steady-state step's remapping)
    mapped-first ideal-unmap, but a request goes to the best mapped free block that holds it where there is
                 one (no remapping), and only otherwise to the best fit over free address space

    tools/gact-bench fragsim [--trace PATH] [--page BYTES] [--passes N]

Measured on the committed ResNet-50 step (tools/bench/README.md): only ideal-unmap reaches 5 %, by remapping
about a third of the step's peak every step.
"""

import argparse
import gzip
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TRACE = os.path.join(ROOT, "tools", "bench", "traces", "resnet50_cpu_step.trace.gz")
MIB = 1 << 20


def read_trace(path):
    """[(op, id, bytes)], op 'a' or 'f' (the format of tools/bench/record_trace.py)."""
    opener = gzip.open if path.endswith(".gz") else open
    ops = []
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            p = line.split()
            if p[0] == "a" and len(p) == 3:
                ops.append(("a", int(p[1]), int(p[2])))
            elif p[0] == "f" and len(p) == 2:
                ops.append(("f", int(p[1]), 0))
            else:
                raise ValueError(f"{path}:{n}: not 'a <id> <bytes>' or 'f <id>': {line.strip()!r}")
    return ops


def round512(n):
    return (n + 511) // 512 * 512


class Range:
    """Blocks [start, size, free] in address order over address space from `base`; best fit, coalescing.
    `grow(n)`: where a request no free block fits goes (None: it does not fit here)."""

    def __init__(self, base=0):
        self.blocks = []
        self.base = base

    def best_fit(self, n):
        best = None
        for i, b in enumerate(self.blocks):
            if b[2] and b[1] >= n and (best is None or b[1] < self.blocks[best][1]):
                best = i
        return best

    def take(self, i, n, split=True):
        """Allocate n bytes from free block i; returns (address, size handed out)."""
        b = self.blocks[i]
        if split and b[1] > n:
            self.blocks.insert(i + 1, [b[0] + n, b[1] - n, True])
            b[1] = n
        b[2] = False
        return b[0], b[1]

    def free(self, addr):
        i = next(k for k, b in enumerate(self.blocks) if b[0] == addr)
        b = self.blocks[i]
        b[2] = True
        if i + 1 < len(self.blocks) and self.blocks[i + 1][2]:
            b[1] += self.blocks.pop(i + 1)[1]
        if i > 0 and self.blocks[i - 1][2]:
            self.blocks[i - 1][1] += self.blocks.pop(i)[1]


class Segments:
    """gact's caching allocator: fixed segments, each its own Range."""

    def __init__(self, small=1 * MIB, small_seg=2 * MIB, large_seg=20 * MIB, min_large=10 * MIB, round_large=2 * MIB):
        self.small, self.small_seg, self.large_seg = small, small_seg, large_seg
        self.min_large, self.round_large = min_large, round_large
        self.pools = {True: [], False: []}  # small?: [Range]
        self.reserved = 0
        self.next_base = 0

    def allocate(self, n):
        small = n <= self.small
        best = None
        for r in self.pools[small]:
            i = r.best_fit(n)
            if i is not None and (best is None or r.blocks[i][1] < best[0].blocks[best[1]][1]):
                best = (r, i)
        if best is None:
            seg = self.small_seg if small else self.large_seg if n < self.min_large else \
                (n + self.round_large - 1) // self.round_large * self.round_large
            r = Range(self.next_base)
            self.next_base += seg + MIB
            r.blocks.append([r.base, seg, True])
            self.pools[small].append(r)
            self.reserved += seg
            best = (r, 0)
        r, i = best
        remaining = r.blocks[i][1] - n
        addr, size = r.take(i, n, split=remaining >= 512 if small else remaining > self.small)
        return (r, addr), size

    def free(self, where):
        r, addr = where
        r.free(addr)


class Expandable:
    """One growing Range per pool (or one for all), physical pages mapped as its top grows; with `unmap`,
    before a growth every mapped page no live block touches is given back."""

    def __init__(self, page, split_small=True, unmap=False, small=1 * MIB, mapped_first=False):
        self.page, self.unmap, self.small = page, unmap, small
        self.mapped_first = mapped_first
        self.split_small = split_small
        self.ranges = {True: Range(0), False: Range(1 << 50)}
        self.mapped = {True: set(), False: set()}
        self.unmapped = 0  # pages unmapped so far

    @property
    def reserved(self):
        return (len(self.mapped[True]) + len(self.mapped[False])) * self.page

    def pages(self, a, n):
        return range(a // self.page, (a + n + self.page - 1) // self.page)

    def allocate(self, n):
        pool = self.split_small and n <= self.small
        r, mapped = self.ranges[pool], self.mapped[pool]
        i = None
        if self.mapped_first:
            for k, b in enumerate(r.blocks):
                if b[2] and b[1] >= n and (i is None or b[1] < r.blocks[i][1]) and set(self.pages(b[0], n)) <= mapped:
                    i = k
        if i is None:
            i = r.best_fit(n)
        if i is None:  # extend the free tail, or start a new block at the top
            if r.blocks and r.blocks[-1][2]:
                r.blocks[-1][1] = n
                i = len(r.blocks) - 1
            else:
                top = r.blocks[-1][0] + r.blocks[-1][1] if r.blocks else r.base
                r.blocks.append([top, n, True])
                i = len(r.blocks) - 1
        needed = set(self.pages(r.blocks[i][0], n))
        if self.unmap and not needed <= mapped:
            live = needed  # (the block's own pages stay: it is about to use them)
            for b in r.blocks:
                if not b[2]:
                    live.update(self.pages(b[0], b[1]))
            self.unmapped += len(mapped - live)
            mapped &= live
        addr, size = r.take(i, n)
        mapped.update(self.pages(addr, size))  # (a block in an unmapped hole is mapped again)
        return (pool, addr), size

    def free(self, where):
        pool, addr = where
        self.ranges[pool].free(addr)


def replay(ops, make, passes):
    """Peak allocated, peak requested and peak reserved bytes of `passes` replays through one allocator, and the
    bytes unmapped in the last pass; blocks live at the end of a pass are freed before the next (as
    gact-bench-alloc does)."""
    a = make()
    live = {}
    allocated = requested = 0
    peak_alloc = peak_req = peak_res = 0
    unmapped = 0
    for _ in range(passes):
        unmapped = -getattr(a, "unmapped", 0)
        for op, i, n in ops:
            if op == "a":
                where, size = a.allocate(round512(max(n, 1)))
                live[i] = (where, size, n)
                allocated += size
                requested += n
            else:
                where, size, n = live.pop(i)
                a.free(where)
                allocated -= size
                requested -= n
            peak_alloc = max(peak_alloc, allocated)
            peak_req = max(peak_req, requested)
            peak_res = max(peak_res, a.reserved)
        for where, size, n in live.values():
            a.free(where)
            allocated -= size
            requested -= n
        live.clear()
        unmapped = (unmapped + getattr(a, "unmapped", 0)) * getattr(a, "page", 0)
    return peak_alloc, peak_req, peak_res, unmapped


DESIGNS = {
    "segments": lambda page: Segments(),
    "expandable": lambda page: Expandable(page),
    "expandable1": lambda page: Expandable(page, split_small=False),
    "ideal-unmap": lambda page: Expandable(page, split_small=False, unmap=True),
    "mapped-first": lambda page: Expandable(page, split_small=False, unmap=True, mapped_first=True),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="allocation trace, plain or gzip (default: ResNet-50 step)")
    ap.add_argument("--page", type=int, default=2 * MIB, help="physical page of the expandable designs (bytes)")
    ap.add_argument("--passes", type=int, default=2, help="replays of the trace (default 2)")
    ap.add_argument("--only", default=",".join(DESIGNS), help="comma list of designs")
    args = ap.parse_args(argv)
    if args.page < 512 or args.page % 512:
        ap.error("--page must be a positive multiple of 512")
    if args.passes < 1:
        ap.error("--passes must be at least 1")
    names = [d for d in args.only.split(",") if d]
    bad = [d for d in names if d not in DESIGNS]
    if bad:
        ap.error(f"unknown design(s) {', '.join(bad)}; choose from {', '.join(DESIGNS)}")
    ops = read_trace(args.trace)
    print(f"{os.path.basename(args.trace)}: {sum(1 for o in ops if o[0] == 'a')} allocations, "
          f"{args.passes} passes, page {args.page / MIB:g} MiB")
    print(f"{'design':<12} {'allocated':>10} {'reserved':>10} {'1-alloc/res':>12} {'1-req/res':>10} {'unmapped/pass':>14}")
    for name in names:
        pa, pq, pr, um = replay(ops, lambda: DESIGNS[name](args.page), args.passes)
        print(f"{name:<12} {pa / MIB:9.1f}M {pr / MIB:9.1f}M {100 * (1 - pa / pr):11.1f}% {100 * (1 - pq / pr):9.1f}% "
              f"{um / MIB:13.1f}M")
    return 0


if __name__ == "__main__":
    sys.exit(main())
