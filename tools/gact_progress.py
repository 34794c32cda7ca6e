"""gact_progress: progress bars with ETA for gact's long-running tools.

On a terminal the bar redraws in place (at most 10 times a second)::

    train rounds  [########............]  4/10  40%  12.3s elapsed  ETA 18.5s  arm gact4

When the stream is not a terminal (a log file, CI, a pipe) it prints plain lines
instead, at most one every `interval` seconds plus the last one, so logs stay short::

    train rounds: 4/10 (40%), 12.3s elapsed, ETA 18.5s, arm gact4

Usage (standard library only; import it from a script in tools/ or tools/bench/)::

    sys.path.insert(0, <the tools/ folder>)
    from gact_progress import progress
    with progress(total=len(jobs), label="accuracy") as bar:
        for job in jobs:
            run(job)
            bar.update(1, note=job.name)       # note: optional text after the figures
    for x in progress.iterate(items, label="steps"):   # wraps an iterable with a known len()
        ...

`total=None` (unknown) shows a count and the rate without a bar or ETA. The ETA is
elapsed * (total - done) / done, i.e. it assumes the remaining items cost what the
finished ones did on average. GACT_PROGRESS=0 silences it; GACT_PROGRESS=lines
forces plain lines even on a terminal. Output goes to stderr by default so that a
tool's stdout (tables, JSON) stays clean.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """'8.2s', '3m05s', '2h04m' ('?' for a negative or non-finite value)."""
    if seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    if seconds < 60:
        return "%.1fs" % seconds
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return "%dm%02ds" % (m, s)
    h, m = divmod(m, 60)
    return "%dh%02dm" % (h, m)


class progress:
    """A progress indicator; see the module docstring. Use as a context manager, or call
    finish() yourself."""

    def __init__(self, total: int | None = None, label: str = "", stream=None, interval: float = 10.0,
                 width: int = 24, clock=time.monotonic):
        if total is not None and total < 0:
            raise ValueError("progress: total must be >= 0 or None, not %r" % (total,))
        self.total = total
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval
        self.width = width
        self.clock = clock
        self.done = 0
        self.note = ""
        self.start = clock()
        self._last_draw = None
        self._drawn_len = 0
        self._finished = False
        mode = os.environ.get("GACT_PROGRESS", "auto").strip().lower()
        isatty = getattr(self.stream, "isatty", lambda: False)
        try:
            tty = bool(isatty())
        except (OSError, ValueError):
            tty = False
        self.enabled = mode not in ("0", "off", "no", "false")
        self.tty = tty and mode != "lines"

    # ---- what is shown ---------------------------------------------------------------
    def eta(self) -> float | None:
        """Seconds left, or None when unknown (no total, nothing done yet)."""
        if self.total is None or self.done <= 0:
            return None
        elapsed = self.clock() - self.start
        return elapsed * max(self.total - self.done, 0) / self.done

    def _figures(self) -> str:
        elapsed = self.clock() - self.start
        parts = []
        if self.total is not None:
            pct = 100.0 * self.done / self.total if self.total else 100.0
            parts.append("%d/%d (%.0f%%)" % (self.done, self.total, pct))
        else:
            parts.append("%d done" % self.done)
            if elapsed > 0 and self.done:
                parts.append("%.3g/s" % (self.done / elapsed))
        parts.append("%s elapsed" % format_duration(elapsed))
        eta = self.eta()
        if eta is not None and self.done < (self.total or 0):
            parts.append("ETA %s" % format_duration(eta))
        if self.note:
            parts.append(self.note)
        return ", ".join(parts)

    def line(self) -> str:
        """The plain-text form (as printed when not on a terminal)."""
        return ("%s: " % self.label if self.label else "") + self._figures()

    def bar(self) -> str:
        """The terminal form: label, bar, figures."""
        if self.total:
            filled = int(self.width * min(self.done, self.total) / self.total)
            bar = "[" + "#" * filled + "." * (self.width - filled) + "] "
        else:
            bar = ""
        return ("%s  " % self.label if self.label else "") + bar + self._figures().replace(", ", "  ")

    # ---- updates -----------------------------------------------------------------------
    def update(self, n: int = 1, note: str | None = None) -> None:
        """Count `n` more items done (and replace the note when one is given)."""
        self.done += n
        if note is not None:
            self.note = note
        self._draw(final=False)

    def set_note(self, note: str) -> None:
        self.note = note
        self._draw(final=False)

    def finish(self) -> None:
        """Draw the final state once (a newline after a terminal bar)."""
        if self._finished:
            return
        self._finished = True
        self._draw(final=True)

    def _draw(self, final: bool) -> None:
        if not self.enabled:
            return
        now = self.clock()
        gap = 0.1 if self.tty else self.interval
        if not final and self._last_draw is not None and now - self._last_draw < gap:
            return
        self._last_draw = now
        try:
            if self.tty:
                text = self.bar()
                pad = " " * max(self._drawn_len - len(text), 0)
                self.stream.write("\r" + text + pad + ("\n" if final else ""))
                self._drawn_len = len(text)
            else:
                self.stream.write(self.line() + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False  # a closed or broken stream never stops the tool

    def __enter__(self) -> "progress":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    @classmethod
    def iterate(cls, iterable, total: int | None = None, **kw):
        """Yield from `iterable`, counting each item (total defaults to len(iterable))."""
        if total is None:
            try:
                total = len(iterable)
            except TypeError:
                total = None
        with cls(total=total, **kw) as p:
            for x in iterable:
                yield x
                p.update(1)
