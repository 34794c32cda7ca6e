"""The GPU check's report: one versioned JSON document and a Markdown summary of it.

The document (``report.json``) is rewritten atomically (temp file + rename) after every
stage, so a run killed from outside still leaves the last complete state. Its shape:

    { "schema_version": 1, "tool": "gact gpu-check", "mode": "full" | "dry-run",
      "date": "<UTC ISO-8601>", "finished": bool, "budget_s": float,
      "gpu": { "present": bool, "model", "driver", "compute_cap", "sm", "memory_total_mib", ... },
      "cuda_version": str | null, "torch_version": str | null,
      "environment": { "tools": {...}, "missing_required": [...], "deps": {...}, ... },
      "stage_order": [ "build", ... ],
      "stages": { "<name>": { "status", "seconds", "budget_s", "figures", "output_tail",
                               "steps": [ {...}, ... ], "note" } },
      "overall_pass": bool, "exit_status": int | null }

Invariant: every stage named in ``stage_order`` has an entry in ``stages`` whose status is
one of STAGE_STATUSES; ``overall_pass`` is true only when no stage is fail, timeout,
pending or running. ``validate()`` checks this and the required keys; the writer refuses
to write a document that fails it (a bug in the check, never in the thing checked).
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from typing import Dict, Iterable, List, Mapping

SCHEMA_VERSION = 1
STAGE_STATUSES = ("pass", "fail", "skipped", "timeout", "pending", "running")
REQUIRED_KEYS = ("schema_version", "tool", "mode", "date", "finished", "gpu", "cuda_version",
                 "torch_version", "environment", "stage_order", "stages", "overall_pass",
                 "exit_status", "budget_s")
REQUIRED_GPU_KEYS = ("present", "model", "driver")
REQUIRED_STAGE_KEYS = ("status", "seconds", "figures", "output_tail", "steps")


def utc_now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def new_report(mode: str, budget_s: float, stage_order: Iterable[str]) -> Dict[str, object]:
    """An empty report: every stage pending, overall_pass false, not finished."""
    order = list(stage_order)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "gact gpu-check",
        "mode": mode,
        "date": utc_now_iso(),
        "finished": False,
        "budget_s": float(budget_s),
        "gpu": {"present": False, "model": None, "driver": None},
        "cuda_version": None,
        "torch_version": None,
        "environment": {},
        "stage_order": order,
        "stages": {name: empty_stage() for name in order},
        "overall_pass": False,
        "exit_status": None,
    }


def empty_stage(status: str = "pending", note: str = "") -> Dict[str, object]:
    return {"status": status, "seconds": 0.0, "budget_s": None, "figures": {}, "output_tail": "",
            "steps": [], "note": note}


def compute_overall(report: Mapping[str, object]) -> bool:
    """True when a GPU was present, and every stage passed or was skipped (at least one passed)."""
    gpu = report.get("gpu") or {}
    if not isinstance(gpu, Mapping) or not gpu.get("present") or gpu.get("source") == "fake":
        return False
    stages = report.get("stages") or {}
    statuses = [s.get("status") for s in stages.values()] if isinstance(stages, Mapping) else []
    if any(st not in ("pass", "skipped") for st in statuses):
        return False
    if report.get("mode") == "dry-run":
        return not (report.get("environment") or {}).get("missing_required")
    return "pass" in statuses


def validate(report: Mapping[str, object]) -> List[str]:
    """Problems that make `report` not a valid document of this schema ([] when valid)."""
    problems: List[str] = []
    for k in REQUIRED_KEYS:
        if k not in report:
            problems.append(f"missing key '{k}'")
    if problems:
        return problems
    if report["schema_version"] != SCHEMA_VERSION:
        problems.append(f"schema_version is {report['schema_version']!r}, expected {SCHEMA_VERSION}")
    if report["mode"] not in ("full", "dry-run"):
        problems.append(f"mode is {report['mode']!r}")
    gpu = report["gpu"]
    if not isinstance(gpu, Mapping):
        problems.append("gpu is not an object")
    else:
        for k in REQUIRED_GPU_KEYS:
            if k not in gpu:
                problems.append(f"gpu lacks '{k}'")
    stages = report["stages"]
    order = report["stage_order"]
    if not isinstance(stages, Mapping) or not isinstance(order, list):
        problems.append("stages must be an object and stage_order a list")
        return problems
    for name in order:
        st = stages.get(name)
        if not isinstance(st, Mapping):
            problems.append(f"stage '{name}' is listed in stage_order but has no entry")
            continue
        for k in REQUIRED_STAGE_KEYS:
            if k not in st:
                problems.append(f"stage '{name}' lacks '{k}'")
        if st.get("status") not in STAGE_STATUSES:
            problems.append(f"stage '{name}' has status {st.get('status')!r}, not one of {STAGE_STATUSES}")
    if not isinstance(report["overall_pass"], bool):
        problems.append("overall_pass is not a boolean")
    elif report["overall_pass"] and not compute_overall(report):
        problems.append("overall_pass is true but a stage did not pass (or no GPU)")
    try:
        json.dumps(report, allow_nan=False)
    except (TypeError, ValueError) as exc:
        problems.append(f"not serialisable as strict JSON: {exc}")
    return problems


def _atomic_write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_report(report: Dict[str, object], outdir: str) -> Dict[str, str]:
    """Write report.json and report.md into `outdir` (atomically each).

    @returns the two paths.
    @throws ValueError listing the problems when the document does not validate.
    """
    problems = validate(report)
    if problems:
        raise ValueError("gpu-check report is invalid: " + "; ".join(problems))
    jpath = os.path.join(outdir, "report.json")
    mpath = os.path.join(outdir, "report.md")
    _atomic_write(jpath, json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n")
    _atomic_write(mpath, render_markdown(report))
    return {"json": jpath, "md": mpath}


# ---- Markdown -------------------------------------------------------------------------------

def _fmt(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    if isinstance(v, (dict, list)):
        s = json.dumps(v)
        return s if len(s) <= 60 else s[:57] + "..."
    return str(v).replace("|", "\\|").replace("\n", " ")


def _key_figures(figures: Mapping[str, object], limit: int = 6) -> str:
    parts = []
    for k, v in figures.items():
        if isinstance(v, (dict, list)):
            continue
        parts.append(f"{k}={_fmt(v)}")
        if len(parts) >= limit:
            break
    return ", ".join(parts)


_CODEC_ID_COLUMNS = ("device", "dtype", "codec", "bits", "group_size", "threads", "numel")


def _codec_columns(row: Mapping[str, object], limit: int = 12) -> List[str]:
    """Identity columns first, then GB/s figures, then ratios (to references), then the rest."""
    keys = [k for k in row if not isinstance(row[k], (dict, list))]
    ident = [k for k in _CODEC_ID_COLUMNS if k in keys]
    gbps = [k for k in keys if k.endswith("_gbps")]
    ratios = [k for k in keys if "_vs_" in k]
    rest = [k for k in keys if k not in ident and k not in gbps and k not in ratios]
    return (ident + gbps + ratios + rest)[:limit]


def _model_table(models: Mapping[str, object]) -> List[str]:
    lines = ["| model | arm | status | samples/s | vs baseline | peak MiB (torch) | vs baseline | "
             "store ratio | max batch @ cap | vs baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mname, m in models.items():
        if not isinstance(m, Mapping):
            continue
        for aname, a in (m.get("arms") or {}).items():
            if not isinstance(a, Mapping):
                continue
            lines.append("| " + " | ".join([
                mname, aname, _fmt(a.get("status")), _fmt(a.get("samples_per_s")),
                _fmt(a.get("throughput_vs_baseline")), _fmt(a.get("peak_mib")),
                _fmt(a.get("peak_vs_baseline")), _fmt(a.get("store_ratio")),
                _fmt(a.get("max_batch")), _fmt(a.get("max_batch_vs_baseline"))]) + " |")
    return lines


def render_markdown(report: Mapping[str, object]) -> str:
    """A human summary: header, one row per stage, one row per step, benchmark tables, failures."""
    gpu = report.get("gpu") or {}
    out: List[str] = []
    verdict = "PASS" if report.get("overall_pass") else ("INCOMPLETE" if not report.get("finished") else "FAIL")
    out.append(f"# gact GPU check: {verdict}")
    out.append("")
    out.append(f"- date: {report.get('date')} ({report.get('mode')}, budget {_fmt(report.get('budget_s'))} s"
               f"{'' if report.get('finished') else ', not finished'})")
    if gpu.get("present"):
        out.append(f"- GPU: {gpu.get('model')} (sm_{gpu.get('sm')}, {_fmt(gpu.get('memory_total_mib'))} MiB), "
                   f"driver {gpu.get('driver')}")
    else:
        out.append(f"- GPU: none found ({gpu.get('note', '')})")
    out.append(f"- CUDA: {report.get('cuda_version')}; torch: {report.get('torch_version')}")
    env = report.get("environment") or {}
    if env.get("missing_required"):
        out.append(f"- missing tools: {', '.join(env['missing_required'])}")
    if env.get("deps"):
        out.append("- build dependencies: " + ", ".join(f"{k}: {v.get('source') if isinstance(v, Mapping) else v}"
                                                       for k, v in env["deps"].items()))
    if report.get("exit_status") is not None:
        out.append(f"- exit status: {report.get('exit_status')}")
    out.append("")
    out.append("| stage | status | seconds | budget s | figures |")
    out.append("|---|---|---|---|---|")
    stages = report.get("stages") or {}
    for name in report.get("stage_order") or []:
        st = stages.get(name) or {}
        out.append(f"| {name} | {st.get('status')} | {_fmt(st.get('seconds'))} | {_fmt(st.get('budget_s'))} | "
                   f"{_key_figures(st.get('figures') or {}) or _fmt(st.get('note') or '')} |")
    step_rows = []
    for name in report.get("stage_order") or []:
        for step in (stages.get(name) or {}).get("steps") or []:
            note = step.get("note") or _key_figures(step.get("figures") or {}, 4)
            step_rows.append(f"| {name} | {step.get('name')} | {step.get('status')} | {_fmt(step.get('seconds'))} | "
                             f"{_fmt(note)} |")
    if step_rows:
        out.append("")
        out.append("| stage | step | status | seconds | note |")
        out.append("|---|---|---|---|---|")
        out.extend(step_rows)
    bench = (stages.get("bench") or {}).get("figures") or {}
    codec = bench.get("codec")
    if isinstance(codec, Mapping) and codec:
        out.append("")
        out.append(f"## Codec throughput (gact-bench-codec) beside device-to-device copy "
                   f"({_fmt(codec.get('d2d_copy_gbps'))} GB/s)")
        out.append("")
        rows = codec.get("rows")
        if isinstance(rows, list) and rows:
            cols = _codec_columns(rows[0])
            out.append("| " + " | ".join(cols) + " |")
            out.append("|" + "---|" * len(cols))
            for r in rows:
                out.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
        else:
            out.append("```")
            out.append(json.dumps({k: v for k, v in codec.items() if k != "rows"}, indent=1)[:3000])
            out.append("```")
    models = bench.get("models")
    if isinstance(models, Mapping) and models:
        out.append("")
        out.append(f"## Training steps (memory cap {_fmt(bench.get('memory_cap_mib'))} MiB for the batch search)")
        out.append("")
        out.extend(_model_table(models))
    failed = [(n, s) for n in (report.get("stage_order") or [])
              for s in ((stages.get(n) or {}).get("steps") or []) if s.get("status") in ("fail", "timeout")]
    if failed:
        out.append("")
        out.append("## Failed or timed-out steps")
        for n, s in failed:
            out.append("")
            out.append(f"### {n} / {s.get('name')}: {s.get('status')}")
            if s.get("command"):
                out.append(f"`{s['command']}`")
            out.append("```")
            out.append((s.get("output_tail") or "")[-2500:])
            out.append("```")
    return "\n".join(out) + "\n"
