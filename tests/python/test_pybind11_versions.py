"""The bindings compile against pybind11 3.x as well as the 2.x this machine ships (issue 29).

GPU hosts install pybind11 3.x from pip; its ``py::make_tuple`` returns typed tuples
(``py::typing::Tuple<...>``), so a lambda whose branches return two different tuples no
longer compiles there. The project's shared folder holds pybind11 3.1's headers
(``../shared/third_party/pybind11-3.1/include``); this test re-runs the build's own
compile command for every binding source with those headers first on the include path
(as ``-isystem``, the way a dependency's headers are included) and ``-fsyntax-only``.
A user's clone has no ``../shared``: the test skips there.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

import _gact

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_gact.__file__))))
PYBIND11_3 = os.path.join(os.path.dirname(ROOT), "shared", "third_party", "pybind11-3.1", "include")

# Fails the compile unless the 3.x headers are the ones included.
_VERSION_GUARD = """#include <pybind11/detail/common.h>
static_assert(PYBIND11_VERSION_MAJOR == 3, "pybind11 3.x headers were not the ones included");
"""


def _binding_commands():
    path = os.path.join(BUILD_DIR, "compile_commands.json")
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: the build directory has no compile database")
    cmds = []
    for c in json.load(open(path)):
        src = os.path.normpath(os.path.join(c["directory"], c["file"]))
        if os.path.dirname(src) == os.path.join(ROOT, "bindings", "python") and src.endswith(".cpp"):
            cmds.append((src, c))
    return cmds


def _syntax_only(cmd: dict, guard: str) -> list[str]:
    """The build's command, minus its outputs, with the 3.x headers searched first."""
    args = shlex.split(cmd["command"]) if "command" in cmd else list(cmd["arguments"])
    if args and args[0] == "ccache":
        args = args[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MQ", "-MT"):
            skip = True
            continue
        if a in ("-c", "-MD", "-g") or a.startswith("-O"):
            continue
        out.append(a)
    return [out[0], "-isystem", PYBIND11_3, "-include", guard, "-O0", "-fsyntax-only"] + out[1:]


@pytest.mark.skipif(not os.path.isdir(PYBIND11_3), reason="no ../shared/third_party/pybind11-3.1 beside the clone")
def test_bindings_compile_against_pybind11_3(tmp_path):
    guard = tmp_path / "pybind11_3_guard.hpp"
    guard.write_text(_VERSION_GUARD)
    cmds = _binding_commands()
    assert any(src.endswith("module.cpp") for src, _ in cmds), "module.cpp is not in the compile database"
    for src, c in cmds:
        r = subprocess.run(_syntax_only(c, str(guard)), cwd=c["directory"], capture_output=True, text=True)
        assert r.returncode == 0, f"{os.path.relpath(src, ROOT)} does not compile with pybind11 3.x:\n{r.stderr[-4000:]}"
