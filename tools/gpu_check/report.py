"""The GPU check's report: one versioned JSON document and a Markdown summary of it.

The document (``report.json``) is rewritten atomically (temp file + rename) after every
stage, so a run killed from outside still leaves the last complete state. Its shape:

    { "schema_version": 2, "tool": "gact gpu-check", "mode": "full" | "dry-run" | "smoke",
      "device": "cuda" | "cpu", "date": "<UTC ISO-8601>", "finished": bool, "budget_s": float,
      "gpu": { "present": bool, "model", "driver", "compute_cap", "sm", "memory_total_mib", ... },
      "cuda_version": str | null, "torch_version": str | null,
      "python_module": { "available": bool | null, "reason": str },
      "environment": { "tools": {...}, "missing_required": [...], "deps": {...}, ... },
      "stage_order": [ "build", "kernels", ... ],
      "stages": { "<name>": { "status", "seconds", "budget_s", "figures", "output_tail",
                               "steps": [ {...}, ... ], "note" } },
      "truths": [ "<one line per finding, most important first>" ],
      "archive": { "name", "members", "bytes" } | null,
      "overall_pass": bool, "exit_status": int | null }

Invariant: every stage named in ``stage_order`` has an entry in ``stages`` whose status is
one of STAGE_STATUSES; ``overall_pass`` is true only for a full run on a real GPU where no
stage is fail, timeout, pending or running and the Python module was available.
``validate()`` checks this and the required keys; the writer refuses to write a document
that fails it (a bug in the check, never in the thing checked).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import tempfile
from typing import Any, Dict, Iterable, List, Mapping

SCHEMA_VERSION = 2
MODES = ("full", "dry-run", "smoke")
STAGE_STATUSES = ("pass", "fail", "skipped", "timeout", "pending", "running")
REQUIRED_KEYS = ("schema_version", "tool", "mode", "device", "date", "finished", "gpu", "cuda_version",
                 "torch_version", "python_module", "environment", "stage_order", "stages", "truths", "archive",
                 "overall_pass", "exit_status", "budget_s")
REQUIRED_GPU_KEYS = ("present", "model", "driver")
REQUIRED_STAGE_KEYS = ("status", "seconds", "figures", "output_tail", "steps")


def utc_now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def new_report(mode: str, budget_s: float, stage_order: Iterable[str], device: str = "cuda") -> Dict[str, object]:
    """An empty report: every stage pending, overall_pass false, not finished."""
    order = list(stage_order)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "gact gpu-check",
        "mode": mode,
        "device": device,
        "date": utc_now_iso(),
        "finished": False,
        "budget_s": float(budget_s),
        "gpu": {"present": False, "model": None, "driver": None},
        "cuda_version": None,
        "torch_version": None,
        "python_module": {"available": None, "reason": ""},
        "environment": {},
        "stage_order": order,
        "stages": {name: empty_stage() for name in order},
        "truths": [],
        "archive": None,
        "overall_pass": False,
        "exit_status": None,
    }


def empty_stage(status: str = "pending", note: str = "") -> Dict[str, object]:
    return {"status": status, "seconds": 0.0, "budget_s": None, "figures": {}, "output_tail": "",
            "steps": [], "note": note}


def compute_overall(report: Mapping[str, object]) -> bool:
    """True for a run on a real GPU where every stage passed or was skipped (at least one passed)
    and, in a full run, the Python module was available (else torch's checks did not run)."""
    gpu = report.get("gpu") or {}
    if report.get("mode") == "smoke":
        return False
    if not isinstance(gpu, Mapping) or not gpu.get("present") or gpu.get("source") == "fake":
        return False
    stages = report.get("stages") or {}
    statuses = [s.get("status") for s in stages.values()] if isinstance(stages, Mapping) else []
    if any(st not in ("pass", "skipped") for st in statuses):
        return False
    if report.get("mode") == "dry-run":
        return not (report.get("environment") or {}).get("missing_required")
    if (report.get("python_module") or {}).get("available") is False:
        return False
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
    if report["mode"] not in MODES:
        problems.append(f"mode is {report['mode']!r}")
    if report["device"] not in ("cuda", "cpu"):
        problems.append(f"device is {report['device']!r}")
    gpu = report["gpu"]
    if not isinstance(gpu, Mapping):
        problems.append("gpu is not an object")
    else:
        for k in REQUIRED_GPU_KEYS:
            if k not in gpu:
                problems.append(f"gpu lacks '{k}'")
    if not isinstance(report["truths"], list) or not all(isinstance(t, str) for t in report["truths"]):
        problems.append("truths must be a list of strings")
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
        problems.append("overall_pass is true but a stage did not pass (or no GPU, or no Python module)")
    try:
        json.dumps(report, allow_nan=False)
    except (TypeError, ValueError) as exc:
        problems.append(f"not serialisable as strict JSON: {exc}")
    return problems


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "w"):
    """Write `path` through a temporary file in its folder, renamed over it when the block ends
    without an exception (removed otherwise); readable by all (0644)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _atomic_write(path: str, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def null_nonfinite(doc: object, path: str = "", found: List[str] | None = None) -> List[str]:
    """Replace every NaN or infinite float inside `doc` (dicts and lists, in place) by None: strict JSON
    has no such numbers. @returns the paths of the replaced values ("stages.train.figures.vit.bits4.loss")."""
    found = [] if found is None else found
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in list(items):
        where = f"{path}.{k}" if path else str(k)
        if isinstance(v, float) and not math.isfinite(v):
            doc[k] = None
            found.append(where)
        elif isinstance(v, (dict, list)):
            null_nonfinite(v, where, found)
    return found


def write_report(report: Dict[str, object], outdir: str) -> Dict[str, str]:
    """Write report.json and report.md into `outdir` (atomically each), truths refreshed first. A NaN or
    infinite figure is written as null and named in ``nonfinite_figures`` (the first truth says so).

    @returns the two paths.
    @throws ValueError listing the problems when the document does not validate.
    """
    bad = null_nonfinite(report)
    if bad:
        report["nonfinite_figures"] = sorted(set(report.get("nonfinite_figures") or []) | set(bad))
        report["overall_pass"] = False  # a NaN where a figure should be is a failure, whatever else passed
    report["truths"] = truths(report)
    problems = validate(report)
    if problems:
        raise ValueError("gpu-check report is invalid: " + "; ".join(problems))
    jpath = os.path.join(outdir, "report.json")
    mpath = os.path.join(outdir, "report.md")
    _atomic_write(jpath, json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n")
    _atomic_write(mpath, render_markdown(report))
    return {"json": jpath, "md": mpath}


# ---- the findings, ranked -------------------------------------------------------------------

def pool_comparison(report: Mapping[str, Any]) -> List[str]:
    """Per model: the device memory reserved at the peak (torch's cache plus any pool of gact's) of the native
    stage's 2-bit arm with the blobs in torch's pool and in gact's own pool, beside fp32's."""
    nf = _figs(report, "native")
    one, two = nf.get("models") or {}, nf.get("models_gact_pool") or {}
    parts = []
    for m, mo in one.items():
        arms = (mo or {}).get("arms") or {} if isinstance(mo, Mapping) else {}
        other = (((two.get(m) or {}).get("arms") or {}).get("bits2") or {}) if isinstance(two, Mapping) else {}
        a, b = (arms.get("bits2") or {}).get("device_reserved_peak_mib"), other.get("device_reserved_peak_mib")
        if a is None or b is None:
            continue
        base = (arms.get("fp32") or {}).get("device_reserved_peak_mib")
        pools = [(arms.get("bits2") or {}).get("device_pool"), other.get("device_pool")]
        parts.append(f"{m} {_fmt(a)} MiB ({pools[0] or '?'}) against {_fmt(b)} MiB ({pools[1] or '?'})"
                     + (f", fp32 {_fmt(base)} MiB" if base is not None else ""))
    return parts


def _max_batch_lines(mb: Mapping) -> List[str]:
    """One "model fp32 N -> arm M (Kx), ..." per model of a batch search's figures."""
    lines = []
    for m, arms_mb in mb.items():
        if isinstance(arms_mb, Mapping) and isinstance(arms_mb.get("fp32"), Mapping):
            base = arms_mb["fp32"].get("max_batch")
            rest = ", ".join(f"{n} {r.get('max_batch')} ({_fmt(r.get('vs_fp32'))}x)" for n, r in arms_mb.items()
                             if n != "fp32" and isinstance(r, Mapping) and r.get("max_batch"))
            lines.append(f"{m} fp32 {base}" + (f" -> {rest}" if rest else ""))
    return lines


def _figs(report: Mapping[str, object], stage: str) -> Mapping[str, object]:
    st = (report.get("stages") or {}).get(stage) or {}
    return st.get("figures") or {} if isinstance(st, Mapping) else {}


def _status(report: Mapping[str, object], stage: str) -> str:
    return str(((report.get("stages") or {}).get(stage) or {}).get("status", "not run"))


def truths(report: Mapping[str, object]) -> List[str]:
    """One line per finding, in the order the check ranks them (what a reader needs first)."""
    out: List[str] = []
    bad = report.get("nonfinite_figures") or []
    if bad:
        out.append(f"NON-FINITE FIGURES ({len(bad)}, written as null; each is a failure): " + ", ".join(bad[:12]) +
                   (" ..." if len(bad) > 12 else ""))
    mod = report.get("python_module") or {}
    if mod.get("available") is False:
        out.append(f"PYTHON MODULE NOT AVAILABLE: {mod.get('reason')}. The stages that need it (the Compressor arms "
                   "of train, the swap check) did not run; everything else did.")
    k = _figs(report, "kernels")
    bit = k.get("bit_exact") or {}
    if bit and "checks" in bit:
        out.append(f"kernels bit-exact with the CPU: {'yes' if bit.get('status') == 'pass' else 'NO'} "
                   f"(test_codecs_gpu: {bit.get('checks')} checks, {bit.get('failures', '?')} failures, "
                   f"corrupt blobs agreeing {bit.get('corrupt_blobs_agree', '?')})")
    elif bit:
        out.append(f"kernels bit-exact with the CPU: NOT SHOWN (test_codecs_gpu {bit.get('status')}: "
                   f"{bit.get('note') or 'no result line'})")
    cb = k.get("codec_bench") or {}
    if cb.get("error"):
        out.append(f"kernel throughput: not measured ({cb['error']})")
    elif cb:
        same = "every blob and decode equal to the CPU's" if not cb.get("differ_from_cpu") else \
            f"DIFFERENT from the CPU: {', '.join(cb['differ_from_cpu'])}"
        out.append(f"kernel throughput vs cudaMemcpyAsync D2D ({_fmt(cb.get('d2d_copy_gbps'))} GB/s): quant encode "
                   f">= {_fmt(cb.get('quant_encode_vs_copy_min'))}x, decode >= {_fmt(cb.get('quant_decode_vs_copy_min'))}x "
                   f"of copy (target {_fmt(cb.get('target_vs_d2d_copy'))}: "
                   f"{'met' if cb.get('quant_meets_target') else 'NOT met'}); {numel_text(cb.get('numel'))}{same}")
    a = _figs(report, "allocator")
    if a:
        out.append(f"allocator over real cudaMalloc: {_status(report, 'allocator')} "
                   f"({a.get('passed', '?')}/{a.get('test_cases', '?')} test cases)")
    t = _figs(report, "train")
    models = t.get("models") or {}
    if models:
        arms = [(m, n, r) for m, mo in models.items() if isinstance(mo, Mapping)
                for n, r in (mo.get("arms") or {}).items() if isinstance(r, Mapping)]
        passed = sum(1 for _, _, r in arms if r.get("status") == "pass")
        line = f"training through {'gact.use_allocator() + ' if report.get('device') == 'cuda' else ''}Compressor: " \
               f"{passed}/{len(arms)} arms pass"
        parts = []
        for m, n, r in arms:
            if n == "bits2" and r.get("status") == "pass":
                peak = f", gact peak {_fmt(r['gact_peak_vs_fp32'])}x" if r.get("gact_peak_vs_fp32") else ""
                real = r.get("gact_realized", r.get("torch_realized"))
                if real is not None:
                    peak += f" (realized {_fmt(real)} of the {_fmt(r.get('promised_mib'))} MiB the counters promise)"
                if r.get("device_pool"):
                    peak += f", blobs in {r['device_pool']}'s pool"
                kept = {k: v for k, v in (r.get("kept_mib_by_reason") or {}).items()
                        if k not in ("parameter", "input") and isinstance(v, (int, float)) and v > 0}
                if kept:
                    peak += ", kept uncompressed per step: " + ", ".join(
                        f"{k} {_fmt(float(v))} MiB" for k, v in list(kept.items())[:3])
                parts.append(f"{m} 2-bit: step {_fmt(r.get('step_time_vs_fp32'))}x of fp32{peak}, "
                             f"grad cosine {_fmt(r.get('grad_cosine'))}")
        out.append(line + ("; " + "; ".join(parts) if parts else ""))
        cmp = []
        for m, mo in models.items():
            arms_m = (mo.get("arms") or {}) if isinstance(mo, Mapping) else {}
            a, u = arms_m.get("auto") or {}, arms_m.get("bits2") or {}
            if a.get("status") == "pass" and u.get("status") == "pass" and \
                    isinstance(a.get("grad_rel_l2"), (int, float)) and isinstance(u.get("grad_rel_l2"), (int, float)):
                cmp.append((m, a["grad_rel_l2"], u["grad_rel_l2"]))
        if cmp:
            worse = [m for m, a, u in cmp if a > u]
            out.append("bits='auto' (budget 2) against uniform 2 bits, gradient relative error: " + ", ".join(
                f"{m} {_fmt(float(a))} vs {_fmt(float(u))}" for m, a, u in cmp) +
                (" (auto never worse: yes)" if not worse else f" (auto WORSE on {', '.join(worse)})"))
    nf = t.get("nonfinite") or {}
    if isinstance(nf, Mapping) and nf:
        if nf.get("error"):
            out.append(f"NaN/Inf in saved tensors: NOT CHECKED ({nf['error']})")
        else:
            fails = nf.get("failures") or []
            out.append(f"NaN/Inf in saved tensors come back exactly, their neighbours compressed, a masked policy's "
                       f"gradients finite (mask fills of finfo.min exact too): {'yes' if not fails else 'NO'} "
                       f"({nf.get('cases')} cases, {nf.get('device_nonfinite')} device encodes reported NaN/Inf or a "
                       f"mask fill)" +
                       ("" if not fails else ": " + "; ".join(str(x) for x in fails[:4])))
    pr = t.get("profile") or {}
    if isinstance(pr, Mapping) and pr.get("status") == "pass":
        out.append(f"profile of one {pr.get('model')} step at 4 bits: gact host {_fmt(pr.get('host_us_per_saved_tensor'))} "
                   f"us per saved tensor ({pr.get('saved_tensors')} saved; pack {_fmt(pr.get('pack_us'))}, unpack "
                   f"{_fmt(pr.get('unpack_us'))} us), encode/decode kernels {_fmt(pr.get('encode_kernels_ms'))} / "
                   f"{_fmt(pr.get('decode_kernels_ms'))} ms of {_fmt(pr.get('all_kernels_ms'))} ms on the device, "
                   f"{pr.get('sync_count')} waits for the device, {pr.get('allocations')} allocations" +
                   (f"; correlation walk in {t['graph_walk']}" if t.get("graph_walk") else ""))
    elif isinstance(pr, Mapping) and pr.get("status") == "fail":
        out.append(f"profile: FAILED ({pr.get('error')})")
    sw = t.get("swap_check") or {}
    if sw:
        out.append("swap's gradients against swap=False: " + ", ".join(
            f"{m} {r.get('verdict') or r.get('status')}" for m, r in sw.items() if isinstance(r, Mapping)))
    nat = _figs(report, "native")
    for figs, where in ((t, "under use_allocator()"), (nat, "on torch's allocator (the default)")):
        lines = _max_batch_lines(figs.get("max_batch") or {})
        if lines:
            pool = figs.get("max_batch_pool")
            out.append(f"largest batch under {_fmt(figs.get('memory_cap_mib'))} MiB {where}"
                       + (f", blobs in {pool}'s pool" if pool and where.startswith("on torch") else "") + ": "
                       + "; ".join(lines))
    mbx = t.get("max_batch_expandable") or {}
    if mbx:
        fixed = t.get("max_batch") or {}
        out.append("largest batch at 2 bits under use_allocator() with expandable segments "
                   "(GACT_EXPANDABLE_SEGMENTS=1; fixed segments in brackets): " + "; ".join(
                       f"{m} {(r.get('bits2') or {}).get('max_batch')} "
                       f"({((fixed.get(m) or {}).get('bits2') or {}).get('max_batch')})"
                       for m, r in mbx.items() if isinstance(r, Mapping)))
    ooms = dict(t.get("max_batch_oom_errors") or {})
    for k, v in (nat.get("max_batch_oom_errors") or {}).items():
        ooms[k] = ooms.get(k, 0) + v
    if isinstance(ooms, Mapping) and ooms:
        theirs = all(str(k).endswith("OutOfMemoryError") for k in ooms)
        out.append("out-of-memory errors of the batch search: " + ", ".join(f"{k} x{v}" for k, v in ooms.items()) +
                   ("" if theirs else " (NOT all torch's OutOfMemoryError: retry loops and cuDNN's fallback miss them)"))
    for stage in ("sanitizers", "preload", "native", "unit"):
        st = _status(report, stage)
        if st not in ("pending", "not run"):
            out.append(f"{stage}: {st}")
    return out


def numel_text(n: object) -> str:
    return f"at {n} elements, " if n else ""


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


def _table(header: List[str], rows: List[List[object]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return lines


def render_markdown(report: Mapping[str, object]) -> str:
    """A human summary: verdict, the ranked findings, benchmark tables, stages and steps, failures."""
    gpu = report.get("gpu") or {}
    out: List[str] = []
    if report.get("mode") == "smoke":
        verdict = "SMOKE (CPU, no GPU: the report's shape, not gact's GPU truth)"
    else:
        verdict = "PASS" if report.get("overall_pass") else ("INCOMPLETE" if not report.get("finished") else "FAIL")
    out.append(f"# gact GPU check: {verdict}")
    out.append("")
    out.append(f"- date: {report.get('date')} ({report.get('mode')} on {report.get('device')}, budget "
               f"{_fmt(report.get('budget_s'))} s{'' if report.get('finished') else ', not finished'})")
    if gpu.get("present"):
        out.append(f"- GPU: {gpu.get('model')} (sm_{gpu.get('sm')}, {_fmt(gpu.get('memory_total_mib'))} MiB), "
                   f"driver {gpu.get('driver')}")
    else:
        out.append(f"- GPU: none found ({gpu.get('note', '')})")
    out.append(f"- CUDA: {report.get('cuda_version')}; torch: {report.get('torch_version')}")
    mod = report.get("python_module") or {}
    if mod.get("available") is True:
        out.append("- Python module: built")
    elif mod.get("available") is False:
        out.append(f"- **Python module: NOT AVAILABLE** ({mod.get('reason')})")
    env = report.get("environment") or {}
    if env.get("missing_required"):
        out.append(f"- missing tools: {', '.join(env['missing_required'])}")
    if env.get("deps"):
        out.append("- build dependencies: " + ", ".join(f"{k}: {v.get('source') if isinstance(v, Mapping) else v}"
                                                       for k, v in env["deps"].items()))
    if report.get("exit_status") is not None:
        out.append(f"- exit status: {report.get('exit_status')}")
    arch = report.get("archive") or {}
    if arch:
        out.append(f"- logs and results: {arch.get('name')} ({len(arch.get('members') or [])} files)")
    tr = report.get("truths") or []
    if tr:
        out.append("")
        out.append("## Findings, most important first")
        out.append("")
        out += [f"{i}. {t}" for i, t in enumerate(tr, 1)]
    kf = _figs(report, "kernels")
    cb = kf.get("codec_bench") or {}
    if cb.get("rows"):
        out.append("")
        out.append(f"## Kernels beside device-to-device copy ({_fmt(cb.get('d2d_copy_gbps'))} GB/s, "
                   f"{cb.get('numel')} elements)")
        out.append("")
        out += _table(["dtype", "codec", "bits", "encode GB/s", "vs copy", "decode GB/s", "vs copy", "blob = CPU",
                       "decode = CPU"],
                      [[r.get("dtype"), r.get("codec"), r.get("bits"), r.get("encode_gbps"), r.get("encode_vs_d2d_copy"),
                        r.get("decode_gbps"), r.get("decode_vs_d2d_copy"), r.get("blob_matches_cpu"),
                        r.get("decode_matches_cpu")] for r in cb["rows"]])
    tf = _figs(report, "train")
    models = tf.get("models") or {}
    native = (_figs(report, "native").get("models") or {})
    if models:
        out.append("")
        out.append("## Training steps (one fixed batch per model)")
        out.append("")
        rows = []
        for m, mo in models.items():
            if not isinstance(mo, Mapping):
                continue
            for n, r in (mo.get("arms") or {}).items():
                nat = ((native.get(m) or {}).get("arms") or {}).get(n) or {}
                rows.append([m, n, r.get("status"), r.get("step_ms"), r.get("step_time_vs_fp32"), r.get("gact_peak_mib"),
                             r.get("gact_peak_vs_fp32"), nat.get("torch_peak_mib"), r.get("store_ratio"),
                             r.get("grad_cosine"), r.get("note") or r.get("error")])
        out += _table(["model", "arm", "status", "step ms", "vs fp32", "gact peak MiB", "vs fp32",
                       "torch peak MiB (native)", "store ratio", "grad cosine", "note"], rows)
        srcs = ", ".join(f"{m}: {mo.get('source')}" for m, mo in models.items() if isinstance(mo, Mapping))
        out.append("")
        out.append(f"Models: {srcs}.")
        traffic = [f"{m} {n} {_fmt(r.get('encoded_vs_saved'))} / {_fmt(r.get('decoded_vs_saved'))}"
                   for m, mo in models.items() if isinstance(mo, Mapping)
                   for n, r in (mo.get("arms") or {}).items()
                   if isinstance(r, Mapping) and r.get("encoded_vs_saved") is not None]
        if traffic:
            out.append("")
            out.append("Bytes encoded / decoded per byte saved (1.00 / 1.00: each saved tensor encoded and decoded "
                       "once): " + "; ".join(traffic) + ".")
    pools = pool_comparison(report)
    if pools:
        out.append("")
        out.append("Device memory reserved at the peak on torch's allocator (native), 2 bits, the blobs in torch's "
                   "pool (the default) against gact's own pool beside it: " + "; ".join(pools) + ".")
    sw = tf.get("swap_check") or {}
    if sw:
        out.append("")
        out.append("## Swap: gradients with swap=True against swap=False (bits=2, deterministic algorithms)")
        out.append("")
        out += _table(["model", "verdict", "bitwise equal", "rel. L2 difference", "fp32 run-to-run"],
                      [[m, r.get("verdict") or r.get("error"), r.get("bitwise_equal"), r.get("rel_l2_swap_vs_no_swap"),
                        r.get("rel_l2_fp32_run_to_run")] for m, r in sw.items() if isinstance(r, Mapping)])
    for figs, how in ((tf, "through gact's allocator (use_allocator)"),
                      (_figs(report, "native"), "on torch's allocator, the default; blobs in "
                       f"{_figs(report, 'native').get('max_batch_pool') or 'torch'}'s pool")):
        mb = figs.get("max_batch") or {}
        if any(isinstance(v, Mapping) and "fp32" in v for v in mb.values()):
            out.append("")
            out.append(f"## Largest batch under a {_fmt(figs.get('memory_cap_mib'))} MiB cap (everything on the device, "
                       f"{how})")
            out.append("")
            out += _table(["model", "arm", "max batch", "vs fp32", "first failing", "cut by deadline"],
                          [[m, n, r.get("max_batch"), r.get("vs_fp32"), r.get("first_failing_batch"),
                            r.get("cut_by_deadline")]
                           for m, arms in mb.items() if isinstance(arms, Mapping)
                           for n, r in arms.items() if isinstance(r, Mapping)])
    out.append("")
    out.append("## Stages")
    out.append("")
    out.append("| stage | status | seconds | time box s | figures |")
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
