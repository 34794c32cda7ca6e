"""Tests of the gact-bench dispatcher (tools/gact-bench), run by meson test.

    python3 test_gact_bench.py SOURCE_ROOT BUILD_DIR

Checks that a built benchmark executable is found and run with its arguments
passed through (its exit status is returned), that the Python-script fallback
runs tools/bench/<name>.py, and that an unknown benchmark, a missing one, a
missing build directory and bad options are each one line on stderr with exit
status 2. Always --no-build: ninja must not be re-entered from inside meson test.
"""

import os
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        sys.stderr.write("FAILED: %s\n" % what)


def run(tool, *args, cwd=None):
    return subprocess.run([sys.executable, tool, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def one_line_error(r, fragment, what):
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2, "%s: exit status %d, expected 2 (stderr %r)" % (what, r.returncode, r.stderr))
    check(len(lines) >= 1 and lines[0].startswith("gact-bench: ") and fragment in lines[0],
          "%s: stderr %r lacks %r" % (what, r.stderr, fragment))
    check("Traceback" not in r.stderr, "%s: traceback" % what)


def main():
    root, build = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    tool = os.path.join(root, "tools", "gact-bench")

    # the alloc benchmark is built in this build dir: --help goes through, status 0
    r = run(tool, "--build-dir", build, "--no-build", "alloc", "--help")
    check(r.returncode == 0 and "usage: gact-bench-alloc" in r.stdout, "alloc --help: %r %r" % (r.returncode, r.stderr))
    # its own bad-usage status (2) and message come back unchanged
    r = run(tool, "--build-dir=" + build, "--no-build", "alloc", "--max-size", "4Q")
    check(r.returncode == 2 and "gact-bench-alloc: --max-size" in r.stderr, "alloc bad arg passed through: %r" % r.stderr)
    r = run(tool, "--build-dir", build, "--list")
    check(any(ln.startswith("alloc") and "gact-bench-alloc" in ln for ln in r.stdout.splitlines()),
          "--list shows the alloc executable: %r" % r.stdout)

    one_line_error(run(tool, "--build-dir", build, "--no-build", "frobnicate"), "unknown benchmark 'frobnicate'",
                   "unknown benchmark")
    one_line_error(run(tool, "--build-dir", os.path.join(build, "no-such-dir"), "alloc"), "does not exist",
                   "missing build dir")
    one_line_error(run(tool, "--frob"), "unknown option", "unknown option")
    one_line_error(run(tool, "--build-dir", build), "no benchmark named", "no benchmark")

    # the Python fallback and a benchmark that is in neither form, on a copy of the tool in a
    # scratch tree whose tools/bench/ holds one script (train.py)
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "tools", "bench"))
        os.makedirs(os.path.join(tmp, "empty-build"))
        with open(tool) as src, open(os.path.join(tmp, "tools", "gact-bench"), "w") as dst:
            dst.write(src.read())
        with open(os.path.join(tmp, "tools", "bench", "train.py"), "w") as f:
            f.write("import sys\nprint('train bench args', sys.argv[1:])\nsys.exit(5)\n")
        scratch_tool = os.path.join(tmp, "tools", "gact-bench")
        scratch_build = os.path.join(tmp, "empty-build")
        r = run(scratch_tool, "--build-dir", scratch_build, "--no-build", "swap", "--x")
        one_line_error(r, "benchmark 'swap' is not available", "missing benchmark")
        # meson devenv needs a configured build dir; the real one serves, the script comes
        # from the scratch tree, and its exit status is returned
        r = run(scratch_tool, "--build-dir", build, "--no-build", "train", "--steps", "3")
        check(r.returncode == 5 and "train bench args ['--steps', '3']" in r.stdout,
              "python fallback: status %d, out %r, err %r" % (r.returncode, r.stdout, r.stderr[-500:]))

    if failures:
        return 1
    print("gact-bench: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
