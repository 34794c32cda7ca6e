#!/usr/bin/python3
"""Record the allocation trace of one real PyTorch training step for gact-bench-alloc.

The step: a torchvision ResNet-50 (random init, fixed seed) forward, cross-entropy
backward and SGD update on the CPU, batch 8 of 96x96 images, one intra-op thread,
gradients set to None before the step (so the step allocates them, as PyTorch >= 2.0
does by default). One warm-up step runs first so one-time initialisation is not in
the trace.

Method: torch 1.13's profiler (profile_memory=True) reports CPU allocation sizes but
no addresses (neither `prof.profiler.kineto_results.events()` nor `prof.events()`
expose one, and the chrome-trace export carries no memory events), so its frees
cannot be paired with its allocations. Instead the process runs under
libgact_malloc_tracer.so (tools/bench/malloc_tracer.cpp, LD_PRELOAD), which pairs
frees with allocations exactly by address and records every block of at least
--min-bytes (512) made during the step through the entry points --sources selects
(default: the posix_memalign family, where PyTorch's CPU tensor storage comes from);
the script re-executes itself with LD_PRELOAD set when needed. The profiler's
allocations for the same step are matched by size against the trace, and the
result written into the trace header as a cross-check.

Output format (gzip text; tools/bench/README.md):
    # comment lines
    a <id> <bytes>      allocation of <bytes> with a new id (ids count up from 1)
    f <id>              free of a live id

    /usr/bin/python3 tools/bench/record_trace.py [--out PATH] [--tracer PATH] [--build-dir DIR]
"""

import argparse
import collections
import ctypes
import gzip
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "tools", "bench", "traces", "resnet50_cpu_step.trace.gz")
TRACER_NAME = "libgact_malloc_tracer.so"
MARKER = "GACT_RECORD_TRACE_PRELOADED"


def find_tracer(args):
    if args.tracer:
        return os.path.abspath(args.tracer)
    dirs = [args.build_dir] if args.build_dir else ["build", "build-bench"]
    for d in dirs:
        p = os.path.join(ROOT, d, "tools", TRACER_NAME)
        if os.path.isfile(p):
            return p
    sys.exit("record_trace: %s not found in %s; build it (ninja -C <builddir> tools/%s) or pass --tracer"
             % (TRACER_NAME, ", ".join(os.path.join(ROOT, d, "tools") for d in dirs), TRACER_NAME))


def ensure_preloaded(tracer):
    """Re-execute this script with the tracer preloaded (once)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if tracer in preload.split(":"):
        return
    if os.environ.get(MARKER):
        sys.exit("record_trace: LD_PRELOAD=%s did not take effect" % tracer)
    env = dict(os.environ, LD_PRELOAD=":".join(p for p in (tracer, preload) if p), **{MARKER: "1"})
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def profiler_cross_check(step, min_bytes):
    """Sizes of the step's allocations (>= min_bytes) according to torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return [n for n in sizes if n >= min_bytes]


def summarize(path):
    """(allocs, frees, live at end, peak live bytes, allocation sizes) of a written trace."""
    live, size_of, peak, na, nf, sizes = 0, {}, 0, 0, 0, []
    with open(path) as f:
        for line in f:
            if line.startswith("a "):
                _, i, n = line.split()
                size_of[i] = int(n)
                sizes.append(int(n))
                live += int(n)
                peak = max(peak, live)
                na += 1
            elif line.startswith("f "):
                live -= size_of.pop(line.split()[1])
                nf += 1
    return na, nf, len(size_of), peak, sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="gzip trace to write (default: %(default)s)")
    ap.add_argument("--tracer", help="path of %s" % TRACER_NAME)
    ap.add_argument("--build-dir", help="build directory holding tools/%s" % TRACER_NAME)
    ap.add_argument("--min-bytes", type=int, default=512, help="smallest block recorded (default 512)")
    ap.add_argument("--sources", default="aligned", choices=["aligned", "plain", "all"],
                    help="entry points recorded: aligned = posix_memalign & co. (PyTorch's CPU tensor "
                         "storage; default), plain = malloc/calloc/realloc, all = both")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=96, help="image side in pixels")
    args = ap.parse_args()

    tracer = find_tracer(args)
    ensure_preloaded(tracer)
    lib = ctypes.CDLL(tracer)  # the preloaded copy: dlopen returns the same handle
    lib.gact_tracer_start.argtypes = [ctypes.c_size_t, ctypes.c_uint]
    lib.gact_tracer_stop.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.gact_tracer_stop.restype = ctypes.c_long
    lib.gact_tracer_live.restype = ctypes.c_size_t

    import torch
    import torchvision

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    step()  # warm-up: lazy initialisation stays out of the trace
    prof_sizes = profiler_cross_check(step, args.min_bytes)
    sources = {"plain": 1, "aligned": 2, "all": 3}[args.sources]

    fd, tmp = tempfile.mkstemp(suffix=".trace")
    os.close(fd)
    tmp_b = tmp.encode()  # encoded before recording: only the step may allocate while the tracer is on
    try:
        if lib.gact_tracer_start(args.min_bytes, sources) != 0:
            sys.exit("record_trace: the tracer could not map its memory")
        step()
        live = lib.gact_tracer_live()
        n = lib.gact_tracer_stop(tmp_b, None)
        if n == -2:
            sys.exit("record_trace: the tracer's event log overflowed; the recording is incomplete")
        if n < 0:
            sys.exit("record_trace: cannot write %s: %s" % (tmp, os.strerror(ctypes.get_errno() or 5)))
        na, nf, live_end, peak, sizes = summarize(tmp)
        with open(tmp, "rb") as f:
            events = f.read()
    finally:
        os.unlink(tmp)
    if live_end != live:
        sys.exit("record_trace: trace has %d live blocks at the end, the tracer %d" % (live_end, live))
    # the profiler's allocations (sizes only) matched by size against the trace's, as multisets
    left = collections.Counter(sizes)
    matched = 0
    for sz in prof_sizes:
        if left[sz] > 0:
            left[sz] -= 1
            matched += 1
    check = ("torch.profiler cross-check (same step, sizes only): %d allocations >= %d B (%.1f MiB); "
             "%d of them matched by size in this trace (%d allocations, %.1f MiB)"
             % (len(prof_sizes), args.min_bytes, sum(prof_sizes) / 2**20, matched, na, sum(sizes) / 2**20))
    header = "\n".join([
        "# gact allocation trace v1",
        "# format: 'a <id> <bytes>' allocates <bytes> under a new id; 'f <id>' frees a live id",
        "# source: one training step (zero_grad(set_to_none=True), forward, backward, SGD step) of",
        "#   torchvision %s resnet50, batch %d x 3 x %d x %d, CPU, 1 thread, torch %s, seed 0"
        % (torchvision.__version__, args.batch, args.size, args.size, torch.__version__),
        "# method: LD_PRELOAD malloc tracer (tools/bench/malloc_tracer.cpp), entry points '%s', blocks"
        % args.sources,
        "#   >= %d B made during the step, frees paired by address; %d blocks made in the step outlive it"
        % (args.min_bytes, live_end),
        "# " + check,
        "# events: %d allocations, %d frees, peak live %d bytes" % (na, nf, peak),
    ]) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as raw:
        # mtime 0 and no file name: the same recording gives the same bytes
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(header.encode() + events)
    print("record_trace: %d events (%d allocs, %d frees, %d live at the end), peak live %.1f MiB -> %s (%d bytes)"
          % (n, na, nf, live_end, peak / 2**20, args.out, os.path.getsize(args.out)))
    print("record_trace: " + check)


if __name__ == "__main__":
    main()
