"""What `pip install .` needs, checked without building (issue 15).

The full install from a fresh clone takes as long as a build, so it is a manual check
(tools/check-install). These fast checks guard the mistakes it found: a torch
requirement that Debian 12's torch (1.13.0a0, a pre-release) does not satisfy, a module
of the package that is not installed (gact/policy.py was missing), and console entry
points that must not import the package (and with it torch and the extension).
"""

import ast
import os
import re
import tomllib

import torch
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "bindings", "python")


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_installed_torch_satisfies_the_requirement():
    reqs = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    (req,) = [r for r in reqs if r.name == "torch"]
    # pip admits a pre-release when the specifier names one: prereleases=None does the same.
    assert req.specifier.contains(torch.__version__, prereleases=None), (str(req), torch.__version__)
    assert req.specifier.contains("1.13.0a0") and not req.specifier.contains("1.12.1")


def test_every_module_of_the_package_is_installed():
    with open(os.path.join(PKG, "meson.build")) as f:
        build = f.read()
    listed = set(re.findall(r"'(gact/[^']+\.py|gact_cli\.py)'", build))
    present = set()
    for dirpath, _, files in os.walk(os.path.join(PKG, "gact")):
        for name in files:
            if name.endswith(".py"):
                present.add(os.path.relpath(os.path.join(dirpath, name), PKG))
    assert present - listed == set(), "not installed by bindings/python/meson.build"
    assert "gact_cli.py" in listed
    assert "rename: '_stats_cli.py'" in build  # gact-stats inside the package


def test_console_entry_points_do_not_import_the_package():
    scripts = pyproject()["project"]["scripts"]
    assert set(scripts) == {"gact-run", "gact-stats"}
    with open(os.path.join(PKG, "gact_cli.py")) as f:
        tree = ast.parse(f.read())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for target in scripts.values():
        module, func = target.split(":")
        assert module == "gact_cli" and func in functions, target
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])}
    assert not imported & {"gact", "torch", "_gact"}, imported
