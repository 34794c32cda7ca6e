#!/usr/bin/env python3
"""gact/tests/cuda/check_preload.py — the LD_PRELOAD shim test.

Runs the unmodified plain_cuda_program (linked against the fake libcudart)
twice: once without the shim, as the reference, and once with the LD_PRELOAD
and GACT_STATS_PATH this test was given by meson (the environment of this
script; the reference run drops both). Then checks that

  * the program works identically in both runs (its own data checks pass, and
    cudaMemGetInfo reports all memory free again at the end);
  * the stats dump written at exit accounts for every allocation the program
    made through cudaMalloc and cudaMallocAsync: counts and requested bytes,
    all of them freed again;
  * the runtime saw only gact's segments (far fewer cudaMalloc calls, no
    uncaptured cudaMallocAsync), and the pointers gact did not allocate (one
    from the runtime directly, one allocated under stream capture) were handed
    to the runtime's cudaFree / cudaFreeAsync.

Usage: check_preload.py PROGRAM   (env: LD_PRELOAD=.../libgact_preload.so GACT_STATS_PATH=...)
"""
import json
import os
import subprocess
import sys

failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def run(program, env):
    proc = subprocess.run([program], env=env, capture_output=True, text=True, timeout=120)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        print(f"{program} exited with {proc.returncode}; stdout: {proc.stdout}", file=sys.stderr)
        sys.exit(1)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    program = sys.argv[1]
    preload = os.environ.get("LD_PRELOAD", "")
    stats_path = os.environ.get("GACT_STATS_PATH", "")
    if "gact_preload" not in preload or not stats_path:
        print("LD_PRELOAD must name libgact_preload.so and GACT_STATS_PATH must be set", file=sys.stderr)
        return 2

    plain_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GACT_STATS_PATH")}
    ref = run(program, plain_env)
    expect(ref["ok"] and ref["hooks"], "reference run: the program's own checks pass on the fake runtime")
    expect(ref["free2"] == ref["free0"], "reference run: all memory free again at the end")
    expect(ref["fake_counts"]["cudaMalloc"] == ref["malloc_calls"], "reference run: every cudaMalloc reached the runtime")

    if os.path.exists(stats_path):
        os.remove(stats_path)
    got = run(program, dict(os.environ))
    expect(got["ok"], "preloaded run: the program's own checks pass")
    for key in ("malloc_calls", "malloc_bytes", "malloc_async_calls", "malloc_async_bytes", "foreign_frees", "captured"):
        expect(got[key] == ref[key], f"preloaded run does the same work as the reference ({key})")

    with open(stats_path) as f:
        doc = json.load(f)
    shim = doc["preload"]
    alloc = doc["allocators"]["preload:cuda:0"]
    n_allocs = got["malloc_calls"] + got["malloc_async_calls"]
    n_bytes = got["malloc_bytes"] + got["malloc_async_bytes"]

    # Every allocation the program made, as the shim counted it ...
    expect(shim["malloc_calls"] == got["malloc_calls"], "shim counted every cudaMalloc")
    expect(shim["malloc_bytes"] == got["malloc_bytes"], "shim counted every cudaMalloc byte")
    expect(shim["malloc_async_calls"] == got["malloc_async_calls"], "shim counted every cudaMallocAsync")
    expect(shim["malloc_async_bytes"] == got["malloc_async_bytes"], "shim counted every cudaMallocAsync byte")
    # ... and as gact's allocator recorded it, all freed by the end.
    expect(alloc["allocation.all.allocated"] == n_allocs, f"allocator saw {n_allocs} allocations")
    expect(alloc["requested_bytes.all.allocated"] == n_bytes, f"allocator saw {n_bytes} requested bytes")
    expect(alloc["allocation.all.freed"] == n_allocs, "every allocation was freed")
    expect(alloc["allocation.all.current"] == 0, "no allocation left at exit")
    expect(alloc["requested_bytes.all.current"] == 0, "no requested bytes left at exit")
    expect(shim["free_calls"] == got["malloc_calls"], "every cudaFree of a gact pointer was deferred")
    expect(shim["free_async_calls"] == got["malloc_async_calls"], "every cudaFreeAsync of a gact pointer was served")
    expect(shim["deferred_pending_blocks"] == 0, "the deferred frees were flushed at exit")
    expect(shim["deferred_flushes"] >= 1 and shim["deferred_device_syncs"] >= 1,
           "deferred frees were recycled only after a device synchronization")

    expect(not got["immediate_reuse"], "a block freed by cudaFree is not reused before a device synchronization")

    # Pointers gact did not allocate went to the runtime.
    expect(shim["foreign_frees"] == got["foreign_frees"] == 2, "foreign pointers were passed to the runtime's free")
    expect(shim["capture_passthrough"] == got["captured"] == 1, "the allocation under capture was passed through")
    expect(got["fake_async_delta_under_capture"] == 1, "the runtime served the allocation under capture")
    fake = got["fake_counts"]
    expect(fake["cudaMallocAsync"] == 1, "the runtime saw only the captured cudaMallocAsync")
    expect(fake["cudaMalloc"] == alloc["num_device_alloc"], "the runtime's cudaMalloc calls are gact's segments")
    expect(fake["cudaMalloc"] < ref["fake_counts"]["cudaMalloc"] + ref["malloc_async_calls"],
           "gact served the program's allocations from fewer segments")

    # cudaMemGetInfo is consistent with the pool: cached and deferred bytes count as free.
    expect(got["free2"] == got["free0"], "cudaMemGetInfo: everything free again while gact still caches it")
    held = got["free0"] - got["free1"]
    first = got["malloc_bytes"] - 2 * 8192  # free1 is taken before the last two 8 KiB cudaMallocs
    n_first = got["malloc_calls"] - 2
    expect(first <= held <= first + 512 * n_first,
           f"cudaMemGetInfo after the cudaMallocs: {held} bytes in use for {first} requested "
           "(rounded to 512 B per block)")

    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        return 1
    print(f"preload shim: {n_allocs} allocations, {n_bytes} bytes, all accounted for; "
          f"{fake['cudaMalloc']} runtime cudaMalloc calls instead of {ref['fake_counts']['cudaMalloc']}+"
          f"{ref['malloc_async_calls']} async")
    return 0


if __name__ == "__main__":
    sys.exit(main())
