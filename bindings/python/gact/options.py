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


def _allocator_decided() -> bool:
    """Whether the CPU allocator choice was made already (a Compressor, or use_cpu_allocator)."""
    from . import allocator as _allocator
    return _allocator._cpu_choice is not None


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
      (set GACT_THREADS before ``import gact``);
    * ``torch_pool`` is read at the first CUDA tensor stored (whose pool the device blobs live in):
      a different value after it raises.

    Raises:
        ValueError: for an unknown keyword, a bad value or a change that cannot apply
            (the message names the setting).
    """
    for k, v in settings.items():
        if isinstance(v, float) and k != "budget" and not v.is_integer():
            # ("1.5" would be parsed as a size and rounded: memory_limit=1.5 became 2 bytes)
            raise ValueError(f"gact.configure: {k}={v!r} is not a whole number; use an integer"
                             + (" or a size such as '8G'" if k in ("memory_limit", "min_bytes", "swap_budget") else ""))
        if isinstance(v, float) and k != "budget":
            v = int(v)
        if k == "cpu_allocator" and _allocator_decided():
            from . import allocator as _allocator  # (imports options)
            want = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
            if want != _allocator.cpu_allocator_installed():
                who = "gact's" if _allocator.cpu_allocator_installed() else "torch's"
                raise ValueError(f"gact.configure: cpu_allocator={v!r} comes too late: the CPU allocator was chosen "
                                 f"already ({who}, by the first Compressor or use_cpu_allocator); call "
                                 f"gact.use_cpu_allocator({bool(want)}) to switch now")
        if k == "torch_pool":
            from . import allocator as _allocator  # (imports options)
            pool = _allocator.device_pool
            text = str(v).lower() if not isinstance(v, bool) else ("true" if v else "false")
            want = {"1": True, "true": True, "yes": True, "on": True,
                    "0": False, "false": False, "no": False, "off": False}.get(text)  # (None: options_set rejects it)
            # too late only where the option decided: torch's pool in use and False asked, or gact's own pool
            # chosen because the option was off and True asked (other reasons for gact's pool stand either way)
            late = (pool == "torch" and want is False) or \
                (pool == "gact" and want is True and _allocator._device_pool_reason == "the torch_pool option is off")
            if late:
                raise ValueError(f"gact.configure: torch_pool={v!r} comes too late: the first CUDA tensor stored "
                                 f"put the compressed activations in {pool}'s pool already; set it (or "
                                 f"GACT_TORCH_POOL) before the first training step on the GPU")
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, os.PathLike):
            v = os.fspath(v)
        elif v is None and k == "stats_path":
            v = ""
        _C.options_set(k, str(v))
    return options()
