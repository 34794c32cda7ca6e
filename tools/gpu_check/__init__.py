"""gact's GPU check: build, test and benchmark the CUDA half of gact on a real GPU.

``tools/gpu-check`` is the entry point; this package holds its logic, split by concern:

- ``cli``       argument parsing and the top-level sequence (detect, prepare deps, stages, report)
- ``env``       discovery of tools (meson, ninja, nvcc, compute-sanitizer, python + torch) and the GPU
- ``deps``      ``--prepare`` (Debian .deb files fetched with apt-get) and their unpacking into
                a private prefix with pkg-config files meson can use on a host without them
- ``pkg_config`` a small stdlib pkg-config used when the host has no pkg-config binary
- ``runner``    the global time budget, its split among stages, and commands run with a timeout
- ``report``    the versioned JSON report and its Markdown summary, written after every stage
- ``stages``    the four stages: build, tests, torch, bench

The torch workloads (``torch_allocator_step.py``, ``preload_train.py``, ``bench_models.py``,
with models in ``workload_models.py``) are standalone scripts run by the target's Python;
only they import torch. Everything else is the Python 3.9+ standard library.
"""

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_NO_GPU", "EXIT_ENV"]

#: every non-skipped check passed
EXIT_OK = 0
#: at least one check failed or timed out
EXIT_FAILED = 1
#: bad command line (argparse's own status)
EXIT_USAGE = 2
#: no usable NVIDIA GPU on this machine (nothing was built or run)
EXIT_NO_GPU = 3
#: a GPU is present but a required tool (meson, ninja, nvcc, a C++ compiler) is missing
EXIT_ENV = 4
