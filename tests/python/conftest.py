"""pytest configuration for gact's Python suites.

Runs inside ``meson devenv -C <builddir>``, which puts the built ``gact`` package on
PYTHONPATH. The suites share two cores with everything else on the machine, so torch
is held to GACT_TEST_THREADS threads (default 1: on two shared cores a second
torch thread mostly spins, measured 28 ms of CPU per digits-CNN step with one thread
and 328 ms with two), and each test starts from a fixed
torch seed so its measured values, and the thresholds set from them, are reproducible.
A missing ``gact`` package is an error at collection, never a silent skip.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import gact  # noqa: F401
except ImportError as exc:  # pragma: no cover - reported once, clearly
    raise pytest.UsageError(
        "cannot import the gact package (run pytest inside `meson devenv -C <builddir>` "
        f"after building): {exc}") from exc

torch.set_num_threads(int(os.environ.get("GACT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _fixed_torch_seed():
    torch.manual_seed(0)
    yield
