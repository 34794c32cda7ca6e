"""``gact-run``: compress the saved activations of an unmodified training script.

Usage::

    gact-run [--bits N|auto] [--budget B] [--stats PATH] [--min-bytes N] [--seed S] -- python train.py ...

It runs the command with ``gact/_run`` first on PYTHONPATH, so every Python
process the command starts imports gact's ``sitecustomize``. That module (only
when GACT_RUN=1, which gact-run sets) builds a model-less
:class:`gact.Compressor`, installs its hooks for the whole process, steps it
after every ``torch.optim.Optimizer.step``, and dumps the stats document to
GACT_STATS_PATH at exit. Settings travel as GACT_* environment variables (the
options table), so a bad value is rejected by the same parser as everywhere.

This module imports neither torch nor the extension, so it runs under any
Python 3; the command's own interpreter is the one that needs torch and gact.
"""

from __future__ import annotations

import argparse
import os
import sys

_USAGE = "gact-run [--bits N|auto] [--budget B] [--stats PATH] [--min-bytes N] [--seed S] -- command ..."


def _site_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_run")


def _package_parent() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_env(args: argparse.Namespace, base: dict[str, str]) -> dict[str, str]:
    """The environment of the wrapped command."""
    env = dict(base)
    path = [_site_dir(), _package_parent()]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["GACT_RUN"] = "1"
    if args.bits is not None:
        env["GACT_BITS"] = str(args.bits)
    if args.budget is not None:
        env["GACT_BUDGET"] = str(args.budget)
    if args.stats is not None:
        env["GACT_STATS_PATH"] = os.path.abspath(args.stats)
    if args.min_bytes is not None:
        env["GACT_MIN_BYTES"] = str(args.min_bytes)
    if args.seed is not None:
        env["GACT_SEED"] = str(args.seed)
    return env


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        i = argv.index("--")
        own, cmd = argv[:i], argv[i + 1 :]
    else:
        own, cmd = [], argv
        # allow `gact-run --bits 2 python x.py` too: options up to the first non-option word
        while cmd and cmd[0].startswith("--"):
            own.append(cmd.pop(0))
            if "=" not in own[-1] and cmd and own[-1] != "--help":
                own.append(cmd.pop(0))
    p = argparse.ArgumentParser(prog="gact-run", usage=_USAGE, description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", help="1, 2, 4, 8 or auto (default: GACT_BITS, else 4)")
    p.add_argument("--budget", help="average bits with --bits auto, in [1, 8]")
    p.add_argument("--stats", help="write the stats JSON here at exit")
    p.add_argument("--min-bytes", dest="min_bytes", help="saved tensors below this size stay uncompressed")
    p.add_argument("--seed", help="seed of the stochastic rounding")
    args = p.parse_args(own)
    if args.bits is not None and args.bits not in ("1", "2", "4", "8", "auto"):
        p.error(f"--bits {args.bits!r}: use 1, 2, 4, 8 or auto")
    if args.budget is not None:
        try:
            b = float(args.budget)
        except ValueError:
            p.error(f"--budget {args.budget!r} is not a number")
        if not 1.0 <= b <= 8.0:
            p.error(f"--budget {args.budget!r} is outside [1, 8]")
    if not cmd:
        p.error("no command given (put it after --)")
    args.command = cmd
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    env = build_env(args, dict(os.environ))
    try:
        os.execvpe(args.command[0], args.command, env)
    except OSError as e:
        print(f"gact-run: cannot run {args.command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
