"""gact's options table (allocator/options.def) as seen from Python.

Every setting has one name, a default, a ``GACT_*`` environment variable (read
once when gact starts) and a keyword. :func:`options` returns the
current values; :func:`configure` changes them, validated by the C++ parser, so
a bad value raises ``ValueError`` naming the setting and what is accepted.
"""

from __future__ import annotations

import os
from typing import Any

import _gact as _C


class OptionsTable(dict):
    """``{name: current value}``, plus the table's rows in :attr:`rows`
    (name, type, env, keyword, default, help), in table order."""

    rows: list[dict]

    def describe(self) -> str:
        """The table as aligned text: name, current value, environment variable, help."""
        lines = []
        for r in self.rows:
            lines.append(f"{r['name']:<15} {str(self.get(r['name'])):<10} {r['env']:<22} {r['help']}")
        return "\n".join(lines)


def options() -> OptionsTable:
    """The options table with current values (see :class:`OptionsTable`)."""
    t = OptionsTable(_C.options_current())
    t.rows = list(_C.options_table())
    return t


def configure(**settings: Any) -> OptionsTable:
    """Set options by keyword, e.g. ``gact.configure(bits=2, min_bytes="8K")``.

    Values are converted to text and parsed by the same parser as the environment
    variables. Returns the updated table. What each change does:

    * ``stats_path`` (the path is checked now; ``""`` turns dumps off), ``trace``
      (a fresh ring of that many events; 0 = off), ``log_level`` and ``memory_limit``
      (the host arena's cap) act at once;
    * ``bits``, ``budget``, ``group_size``, ``min_bytes``, ``seed``, ``swap``,
      ``swap_budget``, ``prefetch`` and ``adapt_interval`` are the defaults of
      Compressors built afterwards;
    * ``threads`` sizes the codec executor when gact starts: a different value raises
      (set GACT_THREADS before ``import gact``).

    Raises:
        ValueError: for an unknown keyword, a bad value or a change that cannot apply
            (the message names the setting).
    """
    for k, v in settings.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, os.PathLike):
            v = os.fspath(v)
        elif v is None and k == "stats_path":
            v = ""
        _C.options_set(k, str(v))
    return options()
