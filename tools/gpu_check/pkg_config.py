#!/usr/bin/env python3
"""A small pkg-config for hosts that have none (meson and ninja from pip, no system packages).

Meson's dependency() asks a pkg-config binary for versions, compile and link flags. When
the GPU host has no pkg-config, gpu-check points meson at this script through a native
file (``[binaries] pkg-config = [python, this file]``). It implements the subset meson uses:
``--version``, ``--modversion``, ``--exists``, ``--cflags``, ``--libs`` (``--static``),
``--variable=NAME``, ``--define-variable=NAME=VALUE``, ``--print-variables``, ``--list-all``,
with ``Requires`` followed recursively, ``${var}`` expansion (``pcfiledir`` predefined) and
the search path from PKG_CONFIG_PATH then PKG_CONFIG_LIBDIR (or the usual system dirs).
System include/lib dirs are dropped from the output as pkg-config does, unless
PKG_CONFIG_ALLOW_SYSTEM_CFLAGS / _LIBS is set. Standard library only, Python 3.9+.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Dict, List, Optional, Tuple

VERSION = "0.29.2"
DEFAULT_DIRS = ["/usr/local/lib/x86_64-linux-gnu/pkgconfig", "/usr/local/lib/pkgconfig",
                "/usr/local/share/pkgconfig", "/usr/lib/x86_64-linux-gnu/pkgconfig",
                "/usr/lib/pkgconfig", "/usr/share/pkgconfig"]
SYSTEM_INCLUDE = {"/usr/include"}
SYSTEM_LIBS = {"/usr/lib", "/lib", "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64"}


class PcError(Exception):
    pass


def search_dirs() -> List[str]:
    dirs = [d for d in os.environ.get("PKG_CONFIG_PATH", "").split(os.pathsep) if d]
    libdir = os.environ.get("PKG_CONFIG_LIBDIR")
    dirs += [d for d in libdir.split(os.pathsep) if d] if libdir is not None else DEFAULT_DIRS
    return dirs


def find_pc(name: str) -> Optional[str]:
    for d in search_dirs():
        p = os.path.join(d, name + ".pc")
        if os.path.isfile(p):
            return p
    return None


def _expand(value: str, variables: Dict[str, str], depth: int = 0) -> str:
    if depth > 20:
        raise PcError(f"variable expansion too deep in '{value}'")

    def sub(m: "re.Match[str]") -> str:
        return _expand(variables.get(m.group(1), ""), variables, depth + 1)
    return re.sub(r"\$\{([A-Za-z0-9_.]+)\}", sub, value)


def parse_pc(path: str, overrides: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(variables, fields) of one .pc file, every ${...} expanded. @throws PcError on a malformed line."""
    variables: Dict[str, str] = {"pcfiledir": os.path.dirname(os.path.abspath(path))}
    fields: Dict[str, str] = {}
    overrides = overrides or {}
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.match(r"([A-Za-z0-9_.]+)\s*([=:])\s*(.*)$", line)
            if not m:
                raise PcError(f"{path}:{n}: cannot parse '{line}'")
            key, kind, val = m.groups()
            if kind == "=":
                variables[key] = overrides.get(key, _expand(val, variables))
            else:
                fields[key.lower()] = _expand(val, variables)
    return variables, fields


def _requires(field: str) -> List[str]:
    names, toks = [], re.split(r"[\s,]+", field.strip())
    i = 0
    while i < len(toks):
        t = toks[i]
        if not t:
            i += 1
            continue
        if t in (">=", "<=", "=", ">", "<", "!="):
            i += 2
            continue
        names.append(t)
        i += 1
    return names


def _collect(name: str, key: str, static: bool, seen: set, overrides: Dict[str, str]) -> List[str]:
    if name in seen:
        return []
    seen.add(name)
    path = find_pc(name)
    if not path:
        raise PcError(f"Package {name} was not found in the pkg-config search path.")
    _, fields = parse_pc(path, overrides)
    out = fields.get(key, "").split()
    if key == "libs" and static:
        out += fields.get("libs.private", "").split()
    req = _requires(fields.get("requires", ""))
    if key == "cflags" or static:
        req += _requires(fields.get("requires.private", ""))
    for r in req:
        out += _collect(r, key, static, seen, overrides)
    return out


def _filter(flags: List[str], key: str) -> List[str]:
    res: List[str] = []
    for fl in flags:
        if key == "cflags" and not os.environ.get("PKG_CONFIG_ALLOW_SYSTEM_CFLAGS") and \
                fl.startswith("-I") and os.path.normpath(fl[2:]) in SYSTEM_INCLUDE:
            continue
        if key == "libs" and not os.environ.get("PKG_CONFIG_ALLOW_SYSTEM_LIBS") and \
                fl.startswith("-L") and os.path.normpath(fl[2:]) in SYSTEM_LIBS:
            continue
        if fl in res and (fl.startswith("-I") or fl.startswith("-L") or fl.startswith("-D")):
            continue
        res.append(fl)
    return res


def main(argv: List[str]) -> int:
    opts: List[str] = []
    pkgs: List[str] = []
    overrides: Dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--define-variable="):
            k, _, v = a[len("--define-variable="):].partition("=")
            overrides[k] = v
        elif a.startswith("--"):
            opts.append(a)
        elif a in (">=", "<=", "=", ">", "<", "!="):
            i += 1           # a version constraint on the previous package: not checked
        else:
            pkgs.append(a)
        i += 1
    if "--version" in opts:
        print(VERSION)
        return 0
    if "--list-all" in opts:
        for d in search_dirs():
            for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                if fn.endswith(".pc"):
                    try:
                        _, fields = parse_pc(os.path.join(d, fn))
                    except (PcError, OSError):
                        continue
                    print(f"{fn[:-3]} {fields.get('name', '')} - {fields.get('description', '')}")
        return 0
    if not pkgs:
        print("Must specify package names on the command line", file=sys.stderr)
        return 1
    static = "--static" in opts
    try:
        for p in pkgs:
            if not find_pc(p):
                raise PcError(f"Package {p} was not found in the pkg-config search path.\n"
                              f"Perhaps you should add the directory containing `{p}.pc'\n"
                              "to the PKG_CONFIG_PATH environment variable")
        lines: List[str] = []
        var = next((o for o in opts if o.startswith("--variable=")), None)
        if "--exists" in opts:
            return 0
        if "--modversion" in opts:
            for p in pkgs:
                lines.append(parse_pc(find_pc(p), overrides)[1].get("version", ""))
        elif var:
            for p in pkgs:
                lines.append(parse_pc(find_pc(p), overrides)[0].get(var.split("=", 1)[1], ""))
        elif "--print-variables" in opts:
            for p in pkgs:
                lines.extend(sorted(parse_pc(find_pc(p), overrides)[0]))
        else:
            flags: List[str] = []
            if "--cflags" in opts or "--cflags-only-I" in opts:
                seen: set = set()
                for p in pkgs:
                    flags += _collect(p, "cflags", static, seen, overrides)
                flags = _filter(flags, "cflags")
                if "--cflags-only-I" in opts:
                    flags = [f for f in flags if f.startswith("-I")]
            if "--libs" in opts or "--libs-only-L" in opts or "--libs-only-l" in opts:
                seen = set()
                libs: List[str] = []
                for p in pkgs:
                    libs += _collect(p, "libs", static, seen, overrides)
                libs = _filter(libs, "libs")
                if "--libs-only-L" in opts:
                    libs = [f for f in libs if f.startswith("-L")]
                if "--libs-only-l" in opts:
                    libs = [f for f in libs if f.startswith("-l")]
                flags += libs
            lines.append(" ".join(flags))
        print("\n".join(lines))
        return 0
    except (PcError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
