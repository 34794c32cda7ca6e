"""Console entry points of an installed gact: ``gact-run`` and ``gact-stats``.

Neither command needs torch or the extension, and importing the ``gact`` package would
load both (and, with GACT_STATS_PATH set, arm the stats dumps in the launcher itself).
So these entry points only locate the installed package and run its ``run.py`` and
``_stats_cli.py`` (tools/gact-stats, installed there) by their paths.
"""

import importlib.util
import os
import sys


def _load(filename):
    spec = importlib.util.find_spec("gact")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("gact: the gact package is not installed in this interpreter (%s)" % sys.executable)
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    mspec = importlib.util.spec_from_file_location("gact_cli_" + filename.split(".")[0], path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def run():
    """gact-run: see gact/run.py."""
    sys.exit(_load("run.py").main())


def stats():
    """gact-stats: see tools/gact-stats."""
    sys.exit(_load("_stats_cli.py").main())
