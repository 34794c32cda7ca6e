"""Command line and top-level sequence of ``tools/gpu-check``.

    tools/gpu-check --prepare                  gather .debs into .gpu-deps/ (development machine) and
                                               print the command, the paths to carry and the time limit
    tools/gpu-check [OUTDIR] [options]         detect the GPU, build, test, measure, report
    tools/gpu-check --dry-run [OUTDIR]         check arguments, tools and GPU; write the report only
    tools/gpu-check --device cpu [OUTDIR]      smoke run on the CPU: tiny models, the report's shape

The report folder ($OUT when set, else OUTDIR, default gpu-check-out/) receives three files:
report.json, report.md and gpu-check-logs.tar.gz (the logs and result files); they are
rewritten after every stage and step, and once more on SIGTERM/SIGINT, so a run cut from
outside still leaves them. The run keeps to --budget-s from its start: each stage gets the
lesser of its time box (stages.STAGE_CAPS) and what is left, in rank order. Exit status: 0
every non-skipped check passed; 1 a check failed or timed out (or, on a GPU, the Python module
could not be built); 2 bad arguments; 3 no GPU (nothing built); 4 a required tool is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from typing import Dict, List, Optional

from . import EXIT_ENV, EXIT_FAILED, EXIT_NO_GPU, EXIT_OK
from . import archive as archive_mod
from . import deps as deps_mod
from . import env as env_mod
from . import report as report_mod
from .runner import Budget, StepResult, kill_current
from .stages import (GPU_ONLY, STAGE_CAPS, STAGE_FUNCS, STAGES, Context, StageOutcome, module_verdict, provide_deps,
                     read_targets)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the default time budget of a run, seconds: well inside one 10-minute device command, and
#: short enough that a second run fits in a 15-minute lease that includes the machine's start
DEFAULT_BUDGET_S = 300.0
#: what --prepare adds to the budget for the time limit it prints: tool and GPU discovery
#: (each candidate Python imports torch), the last report and archive, and a margin
PREPARE_MARGIN_S = 100.0
#: seconds kept back from the last stage for the final report and archive
FINAL_RESERVE_S = 5.0


def _stage_list(text: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError("empty stage list")
    bad = [n for n in names if n not in STAGES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {', '.join(bad)}; choose from {','.join(STAGES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"stage listed twice in '{text}'")
    return [s for s in STAGES if s in names]      # always in rank order


def _positive(kind: type, minimum: float):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} is below the minimum {minimum}")
        return v
    return parse


def _sm(text: str) -> str:
    if not text.isdigit() or not 30 <= int(text) <= 200:
        raise argparse.ArgumentTypeError(f"'{text}' is not an SM version such as 80 or 90")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-check",
        description="Build gact with CUDA for the GPU found here, prove its kernels, allocator and torch "
                    "integration within a time budget, and write report.json, report.md and one archive of logs.",
        epilog="exit status: 0 all non-skipped checks passed, 1 a check failed or timed out, "
               "2 usage error, 3 no GPU found, 4 a required tool is missing")
    p.add_argument("outdir", nargs="?", metavar="OUTDIR",
                   help="report folder when $OUT is not set (default gpu-check-out/)")
    p.add_argument("--prepare", action="store_true",
                   help="fetch the build's Debian packages into --deps-dir with apt-get download, print the command "
                        "line, the paths to carry and the time limit for the GPU host, then exit")
    p.add_argument("--dry-run", action="store_true",
                   help="check arguments, tools and the GPU, write the report, run nothing "
                        "(exit 3 without a GPU, 0 with one)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke run without a GPU (tiny models on the CPU, the existing --build-dir): "
                        "proves the report's shape, never gact's GPU truth")
    p.add_argument("--tiny", action="store_true", help="small models and inputs (implied by --device cpu)")
    p.add_argument("--without-module", action="store_true",
                   help="run as if the Python module could not be built (what a host without Python.h gets)")
    p.add_argument("--budget-s", type=_positive(float, 10.0), default=DEFAULT_BUDGET_S, metavar="S",
                   help=f"time budget of the whole run in seconds (default {DEFAULT_BUDGET_S:.0f})")
    p.add_argument("--stages", type=_stage_list, default=list(STAGES), metavar="LIST",
                   help="comma-separated subset of " + ",".join(STAGES) + " (default: all, in this order)")
    p.add_argument("--python", metavar="PY",
                   help="interpreter with torch for the Python module and workloads "
                        "(default: the first of $VIRTUAL_ENV's, python3 on PATH, ... that imports torch)")
    p.add_argument("--deps-dir", default=os.path.join(ROOT, ".gpu-deps"), metavar="DIR",
                   help="where --prepare puts, and the check finds, the .deb files (default .gpu-deps/)")
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build-gpu"), metavar="DIR",
                   help="CUDA release build directory (default build-gpu/; with --device cpu, an existing build)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="logs and results before they are archived (default BUILD_DIR-work)")
    p.add_argument("--gpu-arch", type=_sm, metavar="SM", help="override the SM version read from the GPU")
    p.add_argument("--memory-cap-gib", type=_positive(float, 0.5), default=8.0, metavar="GIB",
                   help="GPU memory cap for the largest-batch search (default 8)")
    p.add_argument("--jobs", type=_positive(int, 1), metavar="N", help="parallel compile jobs (default: ninja's)")
    return p


def resolve_outdir(arg: Optional[str]) -> str:
    out = os.environ.get("OUT")
    return os.path.abspath(out or arg or "gpu-check-out")


def prepare_plan(args: argparse.Namespace) -> Dict[str, object]:
    """What to run on the GPU host: the command line, the ignored paths to carry, the time limit."""
    deps = os.path.abspath(args.deps_dir)
    carry = [os.path.relpath(deps, ROOT)] if deps.startswith(ROOT + os.sep) else []
    cmd = "tools/gpu-check" + ("" if args.budget_s == DEFAULT_BUDGET_S else f" --budget-s {args.budget_s:g}")
    return {"command": cmd, "carry": carry, "timeout_s": int(args.budget_s + PREPARE_MARGIN_S),
            "returns": list(archive_mod.REPORT_FILES),
            "note": "" if carry else f"{deps} is outside the repository: copy it to the host and pass --deps-dir"}


def run_prepare(args: argparse.Namespace) -> int:
    print(f"gpu-check: fetching {', '.join(deps_mod.DEB_PACKAGES)} into {args.deps_dir}")
    try:
        manifest = deps_mod.prepare(args.deps_dir)
    except RuntimeError as exc:
        print(f"gpu-check --prepare: {exc}", file=sys.stderr)
        return EXIT_FAILED
    plan = prepare_plan(args)
    size = deps_mod.dir_bytes(args.deps_dir)
    print(f"gpu-check --prepare: {args.deps_dir} holds {len(manifest.get('packages', []) or deps_mod.find_debs(args.deps_dir))} "
          f".deb files ({size / 2**20:.1f} MiB), unpacked on the host only for what meson does not find there")
    print("Run on the GPU host, from the repository root (the report goes to $OUT, else gpu-check-out/):")
    print(f"  command:   {plan['command']}")
    print(f"  carry:     {json.dumps(plan['carry'])}   (git-ignored: copied only when named)")
    print(f"  timeout_s: {plan['timeout_s']}   (budget {args.budget_s:g} s + {PREPARE_MARGIN_S:g} s for discovery "
          "and the final report)")
    print(f"  returns:   {', '.join(plan['returns'])} ({len(plan['returns'])} files in the report folder)")
    if plan["note"]:
        print(f"  note:      {plan['note']}")
    print("plan: " + json.dumps(plan))
    return EXIT_OK


class Run:
    """One check: the report being filled and the bookkeeping to write it at any moment."""

    def __init__(self, args: argparse.Namespace, outdir: str, work_dir: str, mode: str):
        self.args = args
        self.outdir = outdir
        self.work_dir = work_dir
        self.report = report_mod.new_report(mode, args.budget_s, args.stages, args.device)
        self.current: Optional[str] = None
        self.current_outcome: Optional[StageOutcome] = None
        self.stage_t0 = 0.0

    def write(self, archive: bool = False) -> None:
        if archive:
            try:
                a = archive_mod.write_archive(self.work_dir, self.outdir)
                self.report["archive"] = {"name": archive_mod.ARCHIVE_NAME, "members": a["members"],
                                          "bytes": a["bytes"], "truncated": a["truncated"]}
            except OSError as exc:
                self.report["archive"] = {"name": archive_mod.ARCHIVE_NAME, "error": str(exc)}
        self.report["overall_pass"] = report_mod.compute_overall(self.report)
        report_mod.write_report(self.report, self.outdir)

    def record_stage(self, name: str, outcome: StageOutcome, seconds: float, budget_s: float,
                     status: Optional[str] = None) -> None:
        st = self.report["stages"][name]
        steps = [s.to_json() for s in outcome.steps]
        for s in steps:   # logs live in the archive, under logs/
            if s.get("log"):
                s["log"] = os.path.relpath(s["log"], self.work_dir)
        st.update(status=status or outcome.status, seconds=round(seconds, 2), budget_s=round(budget_s, 1),
                  figures=outcome.figures, steps=steps, note=outcome.note)
        tails = [f"[{s['name']}] {s['status']}\n{s['output_tail'][-1500:]}" for s in steps
                 if s["status"] in ("fail", "timeout")]
        st["output_tail"] = "\n".join(tails)[-4000:] if tails else (steps[-1]["output_tail"][-1500:] if steps else "")

    def finish(self, status: int) -> int:
        self.report["finished"] = True
        self.report["exit_status"] = status
        self.write(archive=True)
        return status


def _summary_line(report: Dict[str, object]) -> str:
    parts = [f"{n}={report['stages'][n]['status']}" for n in report["stage_order"]]
    verdict = "SMOKE" if report["mode"] == "smoke" else ("PASS" if report["overall_pass"] else "FAIL")
    return "gpu-check: " + ", ".join(parts) + f"; overall {verdict}"


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prepare:
        return run_prepare(args)
    t_start = time.monotonic()
    budget = Budget(args.budget_s, [1.0])
    smoke = args.device == "cpu"
    outdir = resolve_outdir(args.outdir)
    work_dir = os.path.abspath(args.work_dir or (os.path.abspath(args.build_dir) + "-work"))
    for sub in ("logs", "results"):
        shutil.rmtree(os.path.join(work_dir, sub), ignore_errors=True)   # no stale results in the archive
    mode = "smoke" if smoke else ("dry-run" if args.dry_run else "full")
    run = Run(args, outdir, work_dir, mode)

    def on_signal(signum, _frame):
        kill_current()
        if run.current and run.current_outcome is not None:
            run.current_outcome.note = f"interrupted by signal {signum}"
            run.record_stage(run.current, run.current_outcome, time.monotonic() - run.stage_t0, 0.0, "timeout")
        run.finish(128 + signum)
        print(f"gpu-check: interrupted by signal {signum}; report in {outdir}", file=sys.stderr)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    e = env_mod.discover(args.python, probe_gpu=not smoke)
    gpu = dict(e.gpu)
    fake = os.environ.get("GACT_GPU_CHECK_FAKE_GPU")
    if fake and not gpu.get("present") and not smoke:
        # For developing this script on a machine without a GPU: the stages run (and the GPU
        # ones fail); overall_pass is never true for a fake GPU.
        gpu.update(present=True, model="none (GACT_GPU_CHECK_FAKE_GPU)", source="fake", sm=fake, count=0)
    if args.gpu_arch:
        gpu["sm"] = args.gpu_arch
    rep = run.report
    rep["gpu"] = gpu
    t = e.torch
    rep["cuda_version"] = e.nvcc_version or (t.get("cuda") if t else None)
    rep["torch_version"] = t.get("version") if t else None
    envj = e.to_json()
    envj["torch_cuda"] = t.get("cuda") if t else None
    envj["deps_dir"] = args.deps_dir
    envj["deps_bundled"] = sorted(deps_mod.find_debs(args.deps_dir))
    envj["outdir"] = outdir
    envj["work_dir"] = work_dir
    envj["stages_selected"] = args.stages
    envj["stage_caps_s"] = {s: STAGE_CAPS[s] for s in args.stages}
    rep["environment"] = envj
    if e.python_info.get("has_python_h") is False and not smoke:
        rep["python_module"] = {"available": False, "reason": f"{e.python} has no Python.h (Python headers missing)"}
    run.write()

    for name in args.stages:
        rep["stages"][name] = report_mod.empty_stage("skipped")
    if not smoke and not gpu.get("present"):
        for name in args.stages:
            rep["stages"][name]["note"] = "no GPU"
        print(f"gpu-check: no NVIDIA GPU found on this machine ({gpu.get('note')}); nothing was built or run "
              f"(exit {EXIT_NO_GPU}). Report: {outdir}/report.json", file=sys.stderr)
        return run.finish(EXIT_NO_GPU)
    if smoke:
        print(f"gpu-check: smoke run on the CPU with {e.python} (torch {rep['torch_version']}): tiny models, the "
              "existing build; no GPU truth is claimed")
    else:
        print(f"gpu-check: GPU {gpu.get('model')} (sm_{gpu.get('sm')}), driver {gpu.get('driver')}, "
              f"CUDA {rep['cuda_version']}, torch {rep['torch_version']} ({e.python})")
        print("gpu-check: tools: " + ", ".join(f"{k} {'ok' if v else 'MISSING'}" for k, v in e.tools.items()))
        print(f"gpu-check: Python headers (Python.h) for {e.python}: "
              f"{'found' if e.python_info.get('has_python_h') else 'MISSING: the Python module cannot be built'}")
        print(f"gpu-check: bundled .debs in {args.deps_dir}: {len(envj['deps_bundled'])} "
              f"({'used only for what the host lacks' if envj['deps_bundled'] else 'none: run --prepare on a Debian 12 machine'})")
        if e.missing_required:
            for name in args.stages:
                rep["stages"][name]["note"] = "required tool missing"
            print(f"gpu-check: missing required tool(s): {', '.join(e.missing_required)} "
                  f"(exit {EXIT_ENV})", file=sys.stderr)
            return run.finish(EXIT_ENV)
        if args.dry_run:
            for name in args.stages:
                rep["stages"][name]["note"] = "dry run"
            print(f"gpu-check: dry run: GPU present, tools found; report in {outdir}")
            return run.finish(EXIT_OK)
        if not gpu.get("sm"):
            print("gpu-check: cannot read the GPU's compute capability; pass --gpu-arch", file=sys.stderr)
            return run.finish(EXIT_ENV)

    cmd_env = dict(os.environ, PATH=e.path)
    if e.cuda_home:
        cmd_env.setdefault("CUDA_HOME", e.cuda_home)
        cmd_env.setdefault("CUDA_PATH", e.cuda_home)
    ctx = Context(root=ROOT, work_dir=work_dir, build_dir=os.path.abspath(args.build_dir),
                  prefix=os.path.abspath(args.build_dir) + "-deps", deps_dir=os.path.abspath(args.deps_dir),
                  env=e, meson_cmd=e.meson_cmd or ["meson"], python=e.python, sm=str(gpu.get("sm") or ""),
                  device=args.device, tiny=args.tiny or smoke, memory_cap_gib=args.memory_cap_gib,
                  cmd_env=cmd_env, on_step=None, jobs=args.jobs, without_module=args.without_module)
    for name in args.stages:
        rep["stages"][name] = report_mod.empty_stage("pending")
    if "build" not in args.stages:
        # Later stages use an existing build; the environment (private prefix) is still needed.
        if not smoke:
            dep = provide_deps(ctx)
            rep["environment"]["deps"] = dep.figures.get("deps", {})
        ctx.build_ok = os.path.isfile(os.path.join(ctx.build_dir, "build.ninja"))
        ctx.targets = read_targets(ctx.build_dir)
        module_verdict(ctx, "pass" if ctx.build_ok else "fail")
        rep["python_module"] = {"available": ctx.module_ok, "reason": ctx.module_reason}
        if not ctx.build_ok:
            print(f"gpu-check: no build in {ctx.build_dir}: include the build stage", file=sys.stderr)
    run.write()

    for name in args.stages:
        share = max(0.0, min(STAGE_CAPS[name], budget.remaining() - FINAL_RESERVE_S))
        run.current, run.stage_t0 = name, time.monotonic()
        run.current_outcome = StageOutcome()
        outcome = run.current_outcome
        if smoke and name in GPU_ONLY:
            outcome.note = "no GPU (smoke run on the CPU)"
            run.record_stage(name, outcome, 0.0, 0.0, "skipped")
            continue
        if share < 1.0:
            outcome.note = "no time left in the budget"
            run.record_stage(name, outcome, 0.0, share, "skipped")
            run.write()
            continue
        stage_budget = budget.child(share, [1.0])
        rep["stages"][name]["status"] = "running"
        rep["stages"][name]["budget_s"] = round(share, 1)
        run.write()

        def on_step(outcome=outcome, name=name, share=share):
            run.record_stage(name, outcome, time.monotonic() - run.stage_t0, share, "running")
            run.write()
        ctx.on_step = on_step
        print(f"gpu-check: stage {name} (time box {share:.0f} s)", flush=True)
        try:
            result = STAGE_FUNCS[name](ctx, stage_budget, outcome)
        except Exception as exc:   # a bug in the check itself: reported, the run goes on
            import traceback
            outcome.note = f"gpu-check internal error: {type(exc).__name__}: {exc}"
            outcome.steps.append(StepResult("internal", "fail", output_tail=traceback.format_exc()[-3000:]))
            result = outcome
        if name == "build":
            rep["environment"]["deps"] = result.figures.get("deps", {})
        if ctx.module_ok is not None:      # a later stage may have finished building the module
            rep["python_module"] = {"available": ctx.module_ok, "reason": ctx.module_reason}
        run.record_stage(name, result, time.monotonic() - run.stage_t0, share)
        run.current = None
        run.write(archive=True)
        print(f"gpu-check:   {name}: {rep['stages'][name]['status']} "
              f"({rep['stages'][name]['seconds']:.0f} s)", flush=True)
    run.report["total_seconds"] = round(time.monotonic() - t_start, 1)
    failed = any(rep["stages"][n]["status"] in ("fail", "timeout") for n in args.stages)
    if smoke:
        status = EXIT_FAILED if failed else EXIT_OK
    else:
        run.report["overall_pass"] = report_mod.compute_overall(run.report)
        status = EXIT_OK if run.report["overall_pass"] else EXIT_FAILED
    run.finish(status)
    print(_summary_line(run.report))
    if rep["python_module"].get("available") is False:
        print(f"gpu-check: PYTHON MODULE NOT AVAILABLE: {rep['python_module'].get('reason')}")
    print(f"gpu-check: report in {outdir}: {', '.join(archive_mod.REPORT_FILES)}")
    return status
