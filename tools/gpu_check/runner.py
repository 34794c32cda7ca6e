"""The global time budget, its split among stages and steps, and commands run under a timeout.

A run has one deadline (start + --budget-s). Each stage, when it starts, gets a share of
the time left in proportion to its weight among the stages still to run, so time a fast
stage did not use rolls over to the later ones:

    share(stage i) = remaining * w_i / sum(w_j for stages j >= i)      (remaining = deadline - now)

A stage splits its share among its steps the same way (``Budget.child``). Every command runs
in its own process group with stdout+stderr to a log file; when it overruns its share the
whole group gets SIGTERM, then SIGKILL after a grace period, and the step is marked
``timeout``. Invariant: no command is started with a timeout beyond the global deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

#: how much of the end of a command's output the report keeps
TAIL_CHARS = 4000
#: seconds between SIGTERM and SIGKILL when a command overruns
KILL_GRACE_S = 5.0
#: a step is not started with less than this many seconds (it is marked skipped instead)
MIN_STEP_S = 1.0


class Budget:
    """A deadline shared by a sequence of weighted parts.

    ``take(weight)`` returns the seconds the next part may use and forgets its weight, so the
    parts after it share what it leaves. ``child(seconds, weights)`` makes a nested budget
    for the steps of one stage (never past the parent's deadline).
    """

    def __init__(self, seconds: float, weights: Sequence[float], clock=time.monotonic):
        if seconds <= 0:
            raise ValueError(f"budget must be positive seconds, got {seconds!r}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"budget weights must be positive, got {list(weights)!r}")
        self._clock = clock
        self.total_s = float(seconds)
        self.deadline = clock() + float(seconds)
        self._weights: List[float] = list(weights)

    def remaining(self) -> float:
        """Seconds left before the deadline (never negative)."""
        return max(0.0, self.deadline - self._clock())

    def take(self) -> float:
        """Seconds for the next part: its weight's share of what is left. Consumes that weight.

        @throws IndexError when every part has already taken its share.
        """
        if not self._weights:
            raise IndexError("every part of this budget has already taken its share")
        w = self._weights.pop(0)
        total = w + sum(self._weights)
        return self.remaining() * w / total

    def child(self, seconds: float, weights: Sequence[float]) -> "Budget":
        """A budget for the steps of one part, ending no later than this one."""
        b = Budget(max(seconds, 1e-3), weights, self._clock)
        b.deadline = min(b.deadline, self.deadline)
        return b


@dataclass
class StepResult:
    """What one command did. ``status`` is one of pass / fail / timeout / skipped."""

    name: str
    status: str
    seconds: float = 0.0
    command: Optional[List[str]] = None
    returncode: Optional[int] = None
    timeout_s: Optional[float] = None
    output_tail: str = ""
    log: Optional[str] = None
    note: str = ""
    figures: Dict[str, object] = field(default_factory=dict)

    def to_json(self) -> Dict[str, object]:
        d: Dict[str, object] = {
            "name": self.name, "status": self.status, "seconds": round(self.seconds, 2),
            "returncode": self.returncode, "output_tail": self.output_tail,
        }
        if self.command is not None:
            d["command"] = " ".join(_quote(c) for c in self.command)
        if self.timeout_s is not None:
            d["timeout_s"] = round(self.timeout_s, 1)
        if self.log:
            d["log"] = self.log
        if self.note:
            d["note"] = self.note
        if self.figures:
            d["figures"] = self.figures
        return d


def _quote(s: str) -> str:
    import shlex
    return shlex.quote(s)


def read_tail(path: str, chars: int = TAIL_CHARS) -> str:
    """The last `chars` characters of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars * 4))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return data[-chars:]


# The process group of the command now running, so a SIGTERM to gpu-check can end it too.
_current_pgid: Optional[int] = None


def kill_current() -> None:
    """Terminate the command now running (if any) and its children."""
    if _current_pgid is not None:
        _kill_group(_current_pgid, signal.SIGKILL)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_command(name: str, cmd: Sequence[str], timeout_s: float, log_path: str,
                env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                ok_returncodes: Sequence[int] = (0,)) -> StepResult:
    """Run `cmd` with stdout+stderr to `log_path`, killed (whole process group) after `timeout_s`.

    @returns a StepResult with status pass (return code in `ok_returncodes`), fail (other
             code, or the command could not start) or timeout; skipped when `timeout_s` is
             below MIN_STEP_S (no time left).
    """
    global _current_pgid
    cmd = [str(c) for c in cmd]
    if timeout_s < MIN_STEP_S:
        return StepResult(name, "skipped", command=cmd, timeout_s=timeout_s,
                          note=f"no time left in the budget ({timeout_s:.1f} s)")
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(_quote(c) for c in cmd) + "\n").encode())
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(env) if env is not None else None, cwd=cwd,
                                    start_new_session=True)
        except OSError as exc:
            return StepResult(name, "fail", time.monotonic() - t0, cmd, None, timeout_s,
                              output_tail=f"could not start {cmd[0]}: {exc}", log=log_path)
        _current_pgid = proc.pid
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = proc.returncode
        finally:
            # Children that outlived the leader (e.g. a test runner's workers) go too.
            _kill_group(proc.pid, signal.SIGKILL)
            _current_pgid = None
    seconds = time.monotonic() - t0
    if timed_out:
        with open(log_path, "ab") as log:
            log.write(f"\n[gpu-check] killed after {timeout_s:.1f} s (its share of the budget)\n".encode())
        status = "timeout"
    else:
        status = "pass" if rc in ok_returncodes else "fail"
    return StepResult(name, status, seconds, cmd, rc, timeout_s, read_tail(log_path), log_path)


def aggregate_status(statuses: Sequence[str]) -> str:
    """One status for a stage from its steps: fail > timeout > pass > skipped (empty: skipped)."""
    s = set(statuses)
    for st in ("fail", "timeout", "pass"):
        if st in s:
            return st
    return "skipped"
