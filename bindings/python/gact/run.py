"""``gact-run``: compress the saved activations of an unmodified training script.

Usage::

    gact-run [options] -- COMMAND ...        e.g. gact-run --bits 4 --stats stats.json -- python train.py

It runs COMMAND with ``gact/_run`` first on PYTHONPATH, so every Python process the
command starts (the script, a launcher's children, ``torchrun``'s ranks) imports gact's
``sitecustomize``. That module (only when GACT_RUN=1, which gact-run sets) builds a
model-less :class:`gact.Compressor`, installs its hooks for the whole process (and for
every thread started from then on), ends a step after every
``torch.optim.Optimizer.step`` (or, in a script that never calls one, at the end of every
backward), and records in the stats what it did. When the hooks cannot be installed in a
process (gact missing, a bad GACT_* value) that process stops before the script runs, with
exit status 3, unless ``--allow-uncompressed``.

Settings travel as GACT_* environment variables (the options table), so a bad value is
rejected by the same parser as everywhere; the flags below set them.

Stats (``--stats stats.json``): every process writes its own document,
``stats.rank<R>.json`` (started by a torch.distributed launcher, RANK set) or
``stats.pid<P>.json``, at exit, on SIGUSR1 and on SIGTERM; when the command ends, gact-run
merges them into ``stats.json`` (see ``gact/_statsmerge.py``). Per-process files left by
an earlier run with the same ``--stats`` are removed first. Without ``--stats``, a
GACT_STATS_PATH in the environment is used the same way (one with ``{pid}`` or ``{proc}``
is left as it is: per-process files, no merge). gact-run waits for the
command, forwards SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 to it (SIGINT and SIGQUIT reach it
from the terminal directly) and exits with its status.

This module imports neither torch nor the extension, so it runs under any Python 3; the
command's own interpreter is the one that needs torch and gact.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys

_USAGE = "gact-run [options] -- command ...   (gact-run --help lists the options)"
EXIT_USAGE = 2
FORWARDED_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
# Signals a terminal sends to the whole foreground process group: the command gets them
# itself, so gact-run only waits for it instead of sending a second one.
TERMINAL_SIGNALS = ("SIGINT", "SIGQUIT")

# flag dest -> (GACT_* variable, check(value) -> error text or None)
_FLAGS = {
    "bits": ("GACT_BITS", lambda v: None if v in ("1", "2", "4", "8", "auto") else "use 1, 2, 4, 8 or auto"),
    "budget": ("GACT_BUDGET", lambda v: _number_in(v, 1.0, 8.0)),
    "min_bytes": ("GACT_MIN_BYTES", None),
    "seed": ("GACT_SEED", lambda v: _int_in(v, 0, 2**64 - 1)),
    "threads": ("GACT_THREADS", lambda v: _int_in(v, 0, 1024)),
    "group_size": ("GACT_GROUP_SIZE",
                   lambda v: None if v in ("64", "128", "256", "512", "1024") else "use 64, 128, 256, 512 or 1024"),
    "adapt_interval": ("GACT_ADAPT_INTERVAL", lambda v: _int_in(v, 1, 2**63 - 1)),
    "swap_budget": ("GACT_SWAP_BUDGET", None),
    "prefetch": ("GACT_PREFETCH", lambda v: _int_in(v, 0, 2**63 - 1)),
}


def _int_in(v: str, lo: int, hi: int) -> str | None:
    try:
        n = int(v, 10)
    except ValueError:
        return "not an integer"
    return None if lo <= n <= hi else f"outside [{lo}, {hi}]"


def _number_in(v: str, lo: float, hi: float) -> str | None:
    try:
        x = float(v)
    except ValueError:
        return "not a number"
    return None if lo <= x <= hi else f"outside [{lo:g}, {hi:g}]"


def _load_sibling(name: str):
    """A module of this folder by its file path (no import of the gact package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location("gact_run_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _site_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_run")


def _package_parent() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_extension(directory: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(directory), "_gact*.so")))


def find_extension_dir(source_root: str | None, build_dir: str | None, env: dict[str, str]) -> str | None:
    """The folder holding the built ``_gact`` module, or None when there is none.

    Installed (``source_root`` None): the folder the package was installed into. From the
    source tree: ``--build-dir``'s ``bindings/python``, else a PYTHONPATH entry that holds
    it (``meson devenv``; not one that holds a gact package too), else
    ``<source_root>/build/bindings/python``."""
    if source_root is None:
        parent = _package_parent()
        if _has_extension(parent):
            return parent
        spec = importlib.util.find_spec("_gact")  # locates it without loading it
        return os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    candidates = []
    if build_dir is not None:
        candidates.append(os.path.join(os.path.abspath(build_dir), "bindings", "python"))
    else:
        # (a build folder on PYTHONPATH, as `meson devenv` puts it; not a folder holding a gact package
        # beside its module: that is an installed gact, see installed_package)
        candidates += [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                       if p and not os.path.isfile(os.path.join(p, "gact", "run.py"))]
        candidates.append(os.path.join(source_root, "build", "bindings", "python"))
    for c in candidates:
        if _has_extension(c):
            return os.path.abspath(c)
    return None


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def installed_package(source_root: str) -> str | None:
    """The folder of a gact package importable from sys.path outside ``source_root``, with its _gact module
    beside it (an installed gact: pip's, or a venv's), or None."""
    import importlib.machinery

    paths = [p for p in sys.path if p and not _inside(p, source_root)]
    spec = importlib.machinery.PathFinder.find_spec("gact", paths)
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = os.path.abspath(list(spec.submodule_search_locations)[0])
    if _inside(pkg, source_root) or not os.path.isfile(os.path.join(pkg, "run.py")):
        return None
    parent = os.path.dirname(pkg)
    if _has_extension(parent) or importlib.machinery.PathFinder.find_spec("_gact", paths) is not None:
        return pkg
    return None


def build_env(args: argparse.Namespace, base: dict[str, str], ext_dir: str | None = None) -> dict[str, str]:
    """The environment of the wrapped command."""
    env = dict(base)
    path = [_site_dir(), _package_parent()]
    if ext_dir is not None and ext_dir not in path:
        path.append(ext_dir)
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["GACT_RUN"] = "1"
    for dest, (var, _) in _FLAGS.items():
        v = getattr(args, dest, None)
        if v is not None:
            env[var] = str(v)
    if getattr(args, "swap", False):
        env["GACT_SWAP"] = "1"
    if getattr(args, "allow_uncompressed", False):
        env["GACT_RUN_ALLOW_UNCOMPRESSED"] = "1"
    else:
        env.pop("GACT_RUN_ALLOW_UNCOMPRESSED", None)
    if getattr(args, "stats", None) is not None:
        merge = _load_sibling("_statsmerge")
        env["GACT_STATS_PATH"] = merge.per_process_template(args.stats)
    return env


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    own, cmd = [], list(argv)
    # also `gact-run --bits 2 python x.py`: options up to the first word that is not one
    flags_without_value = ("--help", "-h", "--swap", "--allow-uncompressed")
    while cmd and cmd[0].startswith("-"):
        own.append(cmd.pop(0))
        if "=" not in own[-1] and cmd and own[-1] not in flags_without_value:
            own.append(cmd.pop(0))
    return own, cmd


def parse_args(argv: list[str], source_tree: bool = False) -> argparse.Namespace:
    own, cmd = _split_argv(argv)
    p = argparse.ArgumentParser(prog="gact-run", usage=_USAGE, description=__doc__.split("\n\n")[0],
                                epilog="Exit status: the command's; 2 bad usage or no gact build found; "
                                       "3 gact's hooks could not be installed in a process (nothing run).")
    p.add_argument("--bits", help="1, 2, 4, 8 or auto (GACT_BITS; default 4)")
    p.add_argument("--budget", help="average bits with --bits auto, in [1, 8] (GACT_BUDGET)")
    p.add_argument("--stats", help="merged stats JSON of every process, written when the command ends; "
                                   "each process also writes STEM.rank<R>.json or STEM.pid<P>.json")
    p.add_argument("--min-bytes", dest="min_bytes", help="saved tensors below this size stay uncompressed")
    p.add_argument("--seed", help="seed of the stochastic rounding (GACT_SEED)")
    p.add_argument("--threads", help="CPU threads of the codec executor, 0 = all (GACT_THREADS)")
    p.add_argument("--group-size", dest="group_size", help="elements per quantization group: 64..1024, "
                                                           "a power of two (GACT_GROUP_SIZE)")
    p.add_argument("--adapt-interval", dest="adapt_interval",
                   help="steps between re-estimations with --bits auto (GACT_ADAPT_INTERVAL)")
    p.add_argument("--swap", action="store_true", help="offload compressed activations to pinned host memory")
    p.add_argument("--swap-budget", dest="swap_budget",
                   help="with --swap: device-resident bytes kept before offloading (GACT_SWAP_BUDGET)")
    p.add_argument("--prefetch", help="with --swap: blobs fetched back ahead of backward (GACT_PREFETCH)")
    p.add_argument("--allow-uncompressed", dest="allow_uncompressed", action="store_true",
                   help="where gact's hooks cannot be installed, run uncompressed (said in the stats) "
                        "instead of stopping with exit status 3")
    if source_tree:
        p.add_argument("--build-dir", dest="build_dir",
                       help="meson build folder holding the _gact module (default: <source>/build)")
    args = p.parse_args(own)
    for dest, (var, check) in _FLAGS.items():
        v = getattr(args, dest)
        if v is not None and check is not None:
            why = check(v)
            if why is not None:
                p.error(f"--{dest.replace('_', '-')} {v!r}: {why}")
    if not cmd:
        p.error("no command given (put it after --)")
    args.command = cmd
    return args


def _forward_signals(proc: subprocess.Popen) -> None:
    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    for name in FORWARDED_SIGNALS:
        signal.signal(getattr(signal, name), forward)
    for name in TERMINAL_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _merge_stats(stats: str) -> None:
    merge = _load_sibling("_statsmerge")
    docs = []
    for label, path in merge.per_process_files(stats):
        try:
            with open(path) as f:
                docs.append((label, path, json.load(f)))
        except (OSError, ValueError) as e:
            print(f"gact-run: skipping {path}: {e}", file=sys.stderr)
    if not docs:
        print(f"gact-run: no process wrote stats; {stats} not written", file=sys.stderr)
        return
    merged = merge.merge(docs)
    try:
        merge.write_json(os.path.abspath(stats), merged)
    except OSError as e:
        print(f"gact-run: cannot write {stats}: {e.strerror or e}", file=sys.stderr)
        return
    labels = ", ".join(label for label, _, _ in docs)
    print(f"gact-run: stats of {len(docs)} process{'es' if len(docs) != 1 else ''} ({labels}) merged into {stats}",
          file=sys.stderr)


def _exit_like(returncode: int) -> int:
    """The exit status to return for the command's: a command killed by a signal kills us
    with the same signal (so a caller sees what happened), else its code."""
    if returncode >= 0:
        return returncode
    sig = -returncode
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    except (OSError, ValueError):
        pass
    return 128 + sig


def main(argv: list[str] | None = None, source_root: str | None = None) -> int:
    """Run gact-run; ``source_root`` is the source tree when started as ``tools/gact-run``."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv), source_tree=source_root is not None)
    inherited = os.environ.get("GACT_STATS_PATH")
    if args.stats is None and inherited and "{pid}" not in inherited and "{proc}" not in inherited:
        args.stats = inherited  # the same path for every process would keep only the last one's
    ext_dir = find_extension_dir(source_root, getattr(args, "build_dir", None), dict(os.environ))
    if ext_dir is None and source_root is not None and getattr(args, "build_dir", None) is None:
        # the source tree's launcher without a build in the tree (say after `pip install .`, which builds
        # elsewhere): the installed gact runs the command, and says so
        pkg = installed_package(source_root)
        if pkg is not None:
            print(f"gact-run: no build in {os.path.join(source_root, 'build')}; using the installed gact in {pkg}",
                  file=sys.stderr)
            spec = importlib.util.spec_from_file_location("gact_run_installed", os.path.join(pkg, "run.py"))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod.main(argv, source_root=None)
    if ext_dir is not None and source_root is not None and getattr(args, "build_dir", None) is None:
        pkg = installed_package(source_root)
        if pkg is not None:
            print(f"gact-run: using the build in {ext_dir} of this source tree, not the installed gact in {pkg}",
                  file=sys.stderr)
    if ext_dir is None:
        if source_root is not None:
            where = (os.path.join(os.path.abspath(args.build_dir), "bindings", "python") if args.build_dir
                     else os.path.join(source_root, "build", "bindings", "python") + " or on PYTHONPATH")
            print(f"gact-run: no built gact module (_gact*.so) in {where}; build it with `tools/dev setup` "
                  "(or pass --build-dir DIR); nothing was run", file=sys.stderr)
        else:
            print(f"gact-run: the gact package in {_package_parent()} has no _gact module; reinstall gact; "
                  "nothing was run", file=sys.stderr)
        return EXIT_USAGE
    env = build_env(args, dict(os.environ), ext_dir)
    if args.stats is not None:
        for _, stale in _load_sibling("_statsmerge").per_process_files(args.stats):
            try:
                os.remove(stale)
            except OSError:
                pass
    try:
        proc = subprocess.Popen(args.command, env=env)
    except OSError as e:
        print(f"gact-run: cannot run {args.command[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127
    _forward_signals(proc)
    while True:
        try:
            returncode = proc.wait()
            break
        except KeyboardInterrupt:  # SIGINT is ignored above; kept for a signal that slipped in first
            continue
    if args.stats is not None:
        _merge_stats(args.stats)
    return _exit_like(returncode)


if __name__ == "__main__":
    sys.exit(main())
