#!/usr/bin/env python3
"""gact/tests/cuda/check_preload_settings.py — bad settings under the LD_PRELOAD shim (issue 15).

A bad GACT_* value used to make every cudaMalloc return out-of-memory, so the program
never learned what was wrong. Now the shim checks the settings when it is loaded and
stops the program before main, with exit status 2 and a message naming the variable.
Runs the unmodified plain_cuda_program with each bad setting (its main must not run:
nothing on stdout), and with accepted spellings (uppercase level names) that must run
normally.

Usage: check_preload_settings.py PROGRAM   (env: LD_PRELOAD=.../libgact_preload.so)
"""
import os
import subprocess
import sys
import tempfile

failures = []


def run(program, extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GACT_")}
    env["GACT_LOG_LEVEL"] = "error"
    env.update(extra)
    return subprocess.run([program], env=env, capture_output=True, text=True, timeout=120)


def main():
    program = sys.argv[1]
    if "gact_preload" not in os.environ.get("LD_PRELOAD", ""):
        print("LD_PRELOAD must name libgact_preload.so", file=sys.stderr)
        return 2
    missing_dir = os.path.join(tempfile.gettempdir(), "gact-no-such-dir-%d" % os.getpid(), "s.json")
    bad = [
        ({"GACT_BITS": "7"}, "GACT_BITS", "'7'"),
        ({"GACT_LOG_LEVEL": "loud"}, "GACT_LOG_LEVEL", "'loud'"),
        ({"GACT_MEMORY_LIMIT": "12Q"}, "GACT_MEMORY_LIMIT", "'12Q'"),
        ({"GACT_THREADS": "4294967298"}, "GACT_THREADS", "4294967298"),
        ({"GACT_STATS_PATH": missing_dir}, "GACT_STATS_PATH", "does not exist"),
    ]
    for extra, name, detail in bad:
        r = run(program, extra)
        if r.returncode != 2 or name not in r.stderr or detail not in r.stderr or r.stdout:
            failures.append(f"{extra}: expected exit 2 before main with a message naming {name}; got "
                            f"rc {r.returncode}, stdout {r.stdout[:200]!r}, stderr {r.stderr[-400:]!r}")
    for extra in ({"GACT_LOG_LEVEL": "ERROR"}, {"GACT_LOG_LEVEL": "Warning"}, {"GACT_BITS": "AUTO"}):
        r = run(program, extra)
        if r.returncode != 0 or '"ok": true' not in r.stdout:
            failures.append(f"{extra}: an accepted spelling must run the program; got rc {r.returncode}, "
                            f"stderr {r.stderr[-400:]!r}")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    if not failures:
        print(f"preload settings: {len(bad)} bad settings stopped the program with their name")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
