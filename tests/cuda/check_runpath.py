#!/usr/bin/env python3
"""Where each binary of the build finds libcudart.so.13, read from its ELF dynamic section.

A binary that links the real CUDA runtime must find it through its own RUNPATH (the
toolkit's library folder), not through the loader cache or LD_LIBRARY_PATH, which a GPU
host may lack; a test linked against the fake runtime (tests/fake_cudart) must find the
fake first. Issue 14: without a RUNPATH, test_codecs, test_store, test_codecs_gpu,
gact-bench-codec, _gact and libgact.so did not start on such a host.

    check_runpath.py --toolkit-libdir DIR --fake-dir DIR --real BIN... --fake BIN...
                     [--build-root DIR]

--real / --fake name binaries that must resolve the runtime to the toolkit / to the fake.
With --build-root, every other ELF file under it that needs libcudart.so.13 must resolve
it to one of the two as well. Exit status 0 when all do; each problem is one line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

SONAME = "libcudart.so.13"


def dynamic_section(path: str) -> Dict[str, List[str]]:
    """NEEDED, RUNPATH and RPATH entries of an ELF file (empty lists when absent)."""
    out = subprocess.run(["readelf", "-d", "-W", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, check=False).stdout
    d: Dict[str, List[str]] = {"NEEDED": [], "RUNPATH": [], "RPATH": []}
    for tag, value in re.findall(r"\((NEEDED|RUNPATH|RPATH)\)\s+[^\[]*\[([^\]]*)\]", out):
        d[tag].extend(value.split(":") if tag != "NEEDED" else [value])
    return d


def resolve(path: str, dyn: Dict[str, List[str]]) -> Optional[str]:
    """The folder the loader takes libcudart.so.13 from for `path` through its own search path."""
    origin = os.path.dirname(os.path.abspath(path))
    for entry in dyn["RPATH"] + dyn["RUNPATH"]:
        d = entry.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
        if os.path.exists(os.path.join(d, SONAME)):
            return os.path.realpath(d)
    return None


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def walk_elves(root: str) -> List[str]:
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith("meson-") and not x.endswith(".p")]
        for f in files:
            p = os.path.join(d, f)
            if os.access(p, os.X_OK) or ".so" in f:
                if is_elf(p) and not os.path.islink(p):
                    found.append(p)
    return found


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--toolkit-libdir", required=True)
    ap.add_argument("--fake-dir", required=True)
    ap.add_argument("--real", nargs="*", default=[])
    ap.add_argument("--fake", nargs="*", default=[])
    ap.add_argument("--build-root")
    a = ap.parse_args(argv)
    toolkit = os.path.realpath(a.toolkit_libdir)
    fake = os.path.realpath(a.fake_dir)
    want = {os.path.realpath(p): toolkit for p in a.real}
    want.update({os.path.realpath(p): fake for p in a.fake})
    problems: List[str] = []
    if not os.path.exists(os.path.join(toolkit, SONAME)):
        problems.append(f"{toolkit} holds no {SONAME}: the toolkit folder given is wrong")
    checked = 0
    for p in sorted(set(want) | set(os.path.realpath(x) for x in (walk_elves(a.build_root) if a.build_root else []))):
        dyn = dynamic_section(p)
        if SONAME not in dyn["NEEDED"]:
            if p in want:
                problems.append(f"{p}: does not need {SONAME} (NEEDED: {', '.join(dyn['NEEDED'])})")
            continue
        checked += 1
        got = resolve(p, dyn)
        name = os.path.relpath(p, a.build_root) if a.build_root else p
        if got is None:
            problems.append(f"{name}: no RUNPATH entry holds {SONAME} (RUNPATH {dyn['RUNPATH']}, RPATH {dyn['RPATH']}): "
                            "it would depend on the loader cache")
        elif p in want and got != want[p]:
            problems.append(f"{name}: finds {SONAME} in {got}, expected {want[p]}")
        elif got not in (toolkit, fake):
            problems.append(f"{name}: finds {SONAME} in {got}, neither the toolkit nor the fake runtime")
        else:
            print(f"ok  {name}: {SONAME} from {'the fake runtime' if got == fake else got}")
    for line in problems:
        print("FAIL " + line)
    print(f"{checked} binaries need {SONAME}; {len(problems)} problem(s)")
    return 1 if problems or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
