"""gact's GPU check: build, test and benchmark the CUDA half of gact on a real GPU.

``tools/gpu-check`` is the entry point; this package holds its logic, split by concern:

- ``cli``       argument parsing, ``--prepare``'s plan and the top-level sequence (detect, stages, report)
- ``env``       discovery of tools (meson, ninja, nvcc, compute-sanitizer, python + torch) and the GPU
- ``deps``      ``--prepare`` (Debian .deb files fetched with apt-get) and their unpacking into
                a private prefix with pkg-config files meson can use on a host without them
- ``pkg_config`` a small stdlib pkg-config used when the host has no pkg-config binary
- ``runner``    the global time budget and commands run with a timeout
- ``report``    the versioned JSON report, its ranked findings and Markdown summary
- ``archive``   the one tar.gz of logs and results beside the report (3 files in the report folder)
- ``stages``    the stages, ranked: build, kernels, allocator, train, sanitizers, preload, native, unit

The torch workloads (``train_models.py``, ``preload_train.py``, with models in
``workload_models.py``) are standalone scripts run by the target's Python; only they import
torch. Everything else is the Python 3.9+ standard library.
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
