"""Per-process stats files of one job, and their merge into one document.

A job run by ``gact-run --stats stats.json`` has several Python processes (a launcher,
``torchrun``'s ranks, DataLoader workers started with ``spawn``); each writes its own
dump, ``stats.<proc>.json``, where ``<proc>`` is ``rank<RANK>`` in a process started by a
torch.distributed launcher (RANK is set) and ``pid<PID>`` otherwise. gact's core expands
the ``{proc}`` placeholder of GACT_STATS_PATH into that name at every dump.

:func:`merge` turns those documents into one with the same schema, so ``gact-stats``
shows it like any dump:

* ``allocators``: every process's allocators, renamed ``<proc>/<name>``;
* ``store``, ``codecs``, ``swap``: numeric figures summed over the processes, except
  ``step`` and ``steps`` (the largest) and ``ratio`` (recomputed from the summed
  ``bytes_in`` and ``bytes_stored``); peaks are sums of per-process peaks, an upper
  bound of the job's peak;
* ``processes``: per process, its file, pid, rank, what gact-run recorded about it
  (``run``), its store's key figures and its ``policy`` section;
* ``timeline``, ``snapshots``: the process's with the most events (the first in label order among
  equals: a launcher's empty timeline is not the one shown), so that
  ``gact-stats plot`` and ``export-torch`` work on the merged file as on a dump (a timeline's
  addresses and times are its process's own: they do not merge); the other processes keep
  theirs under ``processes``, and ``merged.sections_from`` names whose is on top; ``run`` and
  ``policy`` too when there is one process (every process keeps its own under ``processes``);
* ``merged``: the number of files, the labels (ranks first, then pids) and the labels of
  the processes gact-run ran uncompressed (``--allow-uncompressed``).

Standard library only, no imports from the gact package: ``gact-run`` and
``gact-stats`` load this file by its path, without importing torch or the extension.
"""

from __future__ import annotations

import json
import os
import re

PROC_PLACEHOLDER = "{proc}"
_SUMMED_SECTIONS = ("store", "codecs", "swap")
_MAX_KEYS = ("step", "steps")
_PER_PROCESS_SECTIONS = ("policy", "timeline", "snapshots")  # with run: one process's each, never summed
_STORE_KEYS = ("tensors_in", "bytes_in", "bytes_stored", "ratio", "steps", "leaks", "skipped_tensors")


def _split(stats_path: str) -> tuple[str, str]:
    stem, ext = os.path.splitext(os.path.abspath(stats_path))
    return stem, ext


def per_process_template(stats_path: str) -> str:
    """GACT_STATS_PATH for the processes of a job whose merged stats go to ``stats_path``:
    ``/dir/stats.json`` -> ``/dir/stats.{proc}.json``."""
    stem, ext = _split(stats_path)
    return stem + "." + PROC_PLACEHOLDER + ext


def _pattern(stats_path: str) -> re.Pattern:
    stem, ext = _split(stats_path)
    return re.compile(re.escape(os.path.basename(stem)) + r"\.((?:rank|pid)[0-9]+)" + re.escape(ext) + "$")


def per_process_files(stats_path: str) -> list[tuple[str, str]]:
    """``[(label, path)]`` of the per-process files next to ``stats_path``, by label."""
    directory = os.path.dirname(os.path.abspath(stats_path))
    pat = _pattern(stats_path)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for n in names:
        m = pat.match(n)
        if m:
            found.append((m.group(1), os.path.join(directory, n)))
    return sorted(found, key=lambda lp: _label_key(lp[0]))


def _label_key(label: str) -> tuple:
    kind = 0 if label.startswith("rank") else 1
    digits = label.lstrip("rankpid")
    return (kind, int(digits) if digits.isdigit() else 0, label)


def label_of(path: str) -> str:
    """``rank0`` / ``pid123`` from a per-process file name, else the file's base name."""
    m = re.search(r"\.((?:rank|pid)[0-9]+)\.[^./]*$|\.((?:rank|pid)[0-9]+)$", os.path.basename(path))
    if m:
        return m.group(1) or m.group(2)
    return os.path.basename(path)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sum_trees(values: list, key: str = ""):
    """Combine the same figure of several processes: numbers summed (``step``/``steps``: the
    largest), objects key by key, equal strings kept (else ``"mixed"``), lists joined."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        keys: list = []
        for v in present:
            keys.extend(k for k in v if k not in keys)
        out = {k: _sum_trees([v.get(k) for v in present], k) for k in keys}
        if _is_number(out.get("bytes_in")) and _is_number(out.get("bytes_stored")) and "ratio" in out:
            out["ratio"] = out["bytes_in"] / out["bytes_stored"] if out["bytes_stored"] else None
        return out
    if all(_is_number(v) for v in present):
        return max(present) if key in _MAX_KEYS else sum(present)
    if all(isinstance(v, list) for v in present):
        return [x for v in present for x in v]
    if all(v == present[0] for v in present):
        return present[0]
    return "mixed"


def merge(docs: list[tuple[str, str, dict]]) -> dict:
    """One document from ``[(label, path, doc)]`` (see the module docstring), in label order
    (ranks by number, then pids)."""
    docs = sorted(docs, key=lambda lpd: _label_key(lpd[0]))
    out: dict = {"schema_version": max((d.get("schema_version", 1) for _, _, d in docs), default=2)}
    versions = {d.get("gact_version") for _, _, d in docs}
    out["gact_version"] = versions.pop() if len(versions) == 1 else "mixed"
    out["pid"] = None
    times = [d.get("time_unix_ms") for _, _, d in docs if _is_number(d.get("time_unix_ms"))]
    out["time_unix_ms"] = max(times) if times else None
    out["allocators"] = {}
    names: list = []
    for label, _, d in docs:
        for name, a in (d.get("allocators") or {}).items():
            out["allocators"][label + "/" + name] = a
        for n in ((d.get("tags") or {}).get("names") or []):
            if n not in names:
                names.append(n)
    out["tags"] = {"names": names}
    for sec in _SUMMED_SECTIONS:
        parts = [d.get(sec) for _, _, d in docs if isinstance(d.get(sec), (dict, list))]
        if parts:
            out[sec] = _sum_trees(parts, sec)
    processes = {}
    for label, path, d in docs:
        store = d.get("store") if isinstance(d.get("store"), dict) else {}
        p = {"file": path, "pid": d.get("pid"), "store": {k: store.get(k) for k in _STORE_KEYS if k in store}}
        if isinstance(d.get("run"), dict):
            p["run"] = d["run"]
        for sec in _PER_PROCESS_SECTIONS:
            if isinstance(d.get(sec), (dict, list)):
                p[sec] = d[sec]
        processes[label] = p
    out["processes"] = processes
    sections_from = {}
    # run and policy on top only for one process (several processes' cannot merge: summing bit choices
    # means nothing); a timeline or snapshots on top whatever the count, so that plot and export-torch work
    on_top = ("timeline", "snapshots") + (("run", "policy") if len(docs) == 1 else ())
    for sec in on_top:
        # (the timeline or snapshots with the most events, the first in label order among equals: a launcher's
        # empty timeline came first and `plot` found nothing to draw on the merged file of a spawned job)
        best = None
        for label, _, d in docs:
            v = d.get(sec)
            if isinstance(v, (dict, list)) and (best is None or _events(sec, v) > best[0]):
                best = (_events(sec, v), label, v)
        if best is not None:
            out[sec] = best[2]
            sections_from[sec] = best[1]
            if sec in ("timeline", "snapshots"):  # large: on top only, not twice
                processes[best[1]].pop(sec, None)
    out["merged"] = {"files": len(docs), "labels": [label for label, _, _ in docs],
                     "uncompressed": [label for label, p in processes.items()
                                      if p.get("run", {}).get("compressed") is False],
                     "sections_from": sections_from}
    return out


def _events(sec: str, v) -> int:
    """How much a process's ``sec`` holds: a timeline's events, a snapshot list's entries; 0 for the other
    sections (the first process's is taken)."""
    if sec == "timeline" and isinstance(v, dict):
        ev = v.get("events")
        return len(ev) if isinstance(ev, list) else 0
    if sec == "snapshots":
        return len(v)
    return 0


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` through a temp file and a rename (a reader never sees half)."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
