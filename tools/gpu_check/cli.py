"""Command line and top-level sequence of ``tools/gpu-check``.

    tools/gpu-check --prepare                  gather .debs into .gpu-deps/ (development machine)
    tools/gpu-check [OUTDIR] [options]         detect the GPU, build, test, benchmark, report
    tools/gpu-check --dry-run [OUTDIR]         check arguments, tools and GPU; write the report only

The report goes to $OUT when set, else OUTDIR (default gpu-check-out/). It is rewritten after
every stage and step, and once more on SIGTERM/SIGINT, so a run cut from outside still leaves
one. Exit status: 0 every non-skipped check passed; 1 a check failed or timed out; 2 bad
arguments; 3 no GPU (nothing built); 4 a required tool is missing.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Dict, List, Optional

from . import EXIT_ENV, EXIT_FAILED, EXIT_NO_GPU, EXIT_OK
from . import deps as deps_mod
from . import env as env_mod
from . import report as report_mod
from .runner import Budget, StepResult, kill_current
from .stages import STAGE_FUNCS, STAGE_WEIGHTS, STAGES, Context, StageOutcome, provide_deps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stage_list(text: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError("empty stage list")
    bad = [n for n in names if n not in STAGES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {', '.join(bad)}; choose from {','.join(STAGES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"stage listed twice in '{text}'")
    return [s for s in STAGES if s in names]      # always in pipeline order


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
        description="Build gact with CUDA for the GPU found here, run its GPU tests, torch integration "
                    "and benchmarks within a time budget, and write report.json + report.md.",
        epilog="exit status: 0 all non-skipped checks passed, 1 a check failed or timed out, "
               "2 usage error, 3 no GPU found, 4 a required tool is missing")
    p.add_argument("outdir", nargs="?", metavar="OUTDIR",
                   help="report folder when $OUT is not set (default gpu-check-out/)")
    p.add_argument("--prepare", action="store_true",
                   help="fetch the build's Debian packages into --deps-dir with apt-get download, then exit")
    p.add_argument("--dry-run", action="store_true",
                   help="check arguments, tools and the GPU, write the report, run nothing "
                        "(exit 3 without a GPU, 0 with one)")
    p.add_argument("--budget-s", type=_positive(float, 10.0), default=480.0, metavar="S",
                   help="global time budget in seconds, split among the stages (default 480)")
    p.add_argument("--stages", type=_stage_list, default=list(STAGES), metavar="LIST",
                   help="comma-separated subset of " + ",".join(STAGES) + " (default: all)")
    p.add_argument("--python", metavar="PY",
                   help="interpreter with torch for the Python module and workloads "
                        "(default: the first python3 that imports torch)")
    p.add_argument("--deps-dir", default=os.path.join(ROOT, ".gpu-deps"), metavar="DIR",
                   help="where --prepare puts, and the check finds, the .deb files (default .gpu-deps/)")
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build-gpu"), metavar="DIR",
                   help="CUDA release build directory (default build-gpu/)")
    p.add_argument("--gpu-arch", type=_sm, metavar="SM", help="override the SM version read from the GPU")
    p.add_argument("--memory-cap-gib", type=_positive(float, 0.5), default=4.0, metavar="GIB",
                   help="GPU memory cap for the largest-batch search (default 4)")
    p.add_argument("--jobs", type=_positive(int, 1), metavar="N", help="parallel compile jobs (default: ninja's)")
    p.add_argument("--codec-bench-args", default="--json", metavar="ARGS",
                   help="arguments for gact-bench-codec (default --json)")
    return p


def resolve_outdir(arg: Optional[str]) -> str:
    out = os.environ.get("OUT")
    return os.path.abspath(out or arg or "gpu-check-out")


class Run:
    """One check: the report being filled and the bookkeeping to write it at any moment."""

    def __init__(self, args: argparse.Namespace, outdir: str):
        self.args = args
        self.outdir = outdir
        mode = "dry-run" if args.dry_run else "full"
        self.report = report_mod.new_report(mode, args.budget_s, args.stages)
        self.current: Optional[str] = None
        self.current_outcome: Optional[StageOutcome] = None
        self.stage_t0 = 0.0

    def write(self) -> None:
        self.report["overall_pass"] = report_mod.compute_overall(self.report)
        report_mod.write_report(self.report, self.outdir)

    def record_stage(self, name: str, outcome: StageOutcome, seconds: float, budget_s: float,
                     status: Optional[str] = None) -> None:
        st = self.report["stages"][name]
        steps = [s.to_json() for s in outcome.steps]
        st.update(status=status or outcome.status, seconds=round(seconds, 2), budget_s=round(budget_s, 1),
                  figures=outcome.figures, steps=steps, note=outcome.note)
        tails = [f"[{s['name']}] {s['status']}\n{s['output_tail'][-1500:]}" for s in steps
                 if s["status"] in ("fail", "timeout")]
        st["output_tail"] = "\n".join(tails)[-4000:] if tails else (steps[-1]["output_tail"][-1500:] if steps else "")

    def finish(self, status: int) -> int:
        self.report["finished"] = True
        self.report["exit_status"] = status
        self.write()
        return status


def _summary_line(report: Dict[str, object]) -> str:
    parts = [f"{n}={report['stages'][n]['status']}" for n in report["stage_order"]]
    return "gpu-check: " + ", ".join(parts) + f"; overall {'PASS' if report['overall_pass'] else 'FAIL'}"


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prepare:
        print(f"gpu-check: fetching {', '.join(deps_mod.DEB_PACKAGES)} into {args.deps_dir}")
        try:
            deps_mod.prepare(args.deps_dir)
        except RuntimeError as exc:
            print(f"gpu-check --prepare: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print("gpu-check: done; carry the folder to the GPU host (it is git-ignored): run with carry ['.gpu-deps']")
        return EXIT_OK

    outdir = resolve_outdir(args.outdir)
    run = Run(args, outdir)
    t_start = time.monotonic()
    budget = Budget(args.budget_s, [STAGE_WEIGHTS[s] for s in args.stages])

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

    e = env_mod.discover(args.python)
    gpu = dict(e.gpu)
    fake = os.environ.get("GACT_GPU_CHECK_FAKE_GPU")
    if fake and not gpu.get("present"):
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
    envj["stages_selected"] = args.stages
    rep["environment"] = envj
    run.write()

    for name in args.stages:
        rep["stages"][name] = report_mod.empty_stage("skipped")
    if not gpu.get("present"):
        for name in args.stages:
            rep["stages"][name]["note"] = "no GPU"
        print(f"gpu-check: no NVIDIA GPU found on this machine ({gpu.get('note')}); nothing was built or run "
              f"(exit {EXIT_NO_GPU}). Report: {outdir}/report.json", file=sys.stderr)
        return run.finish(EXIT_NO_GPU)
    print(f"gpu-check: GPU {gpu.get('model')} (sm_{gpu.get('sm')}), driver {gpu.get('driver')}, "
          f"CUDA {rep['cuda_version']}, torch {rep['torch_version']} ({e.python})")
    print("gpu-check: tools: " + ", ".join(f"{k} {'ok' if v else 'MISSING'}" for k, v in e.tools.items()))
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

    meson_cmd = e.meson_cmd
    cmd_env = dict(os.environ, PATH=e.path)
    if e.cuda_home:
        cmd_env.setdefault("CUDA_HOME", e.cuda_home)
        cmd_env.setdefault("CUDA_PATH", e.cuda_home)
    ctx = Context(root=ROOT, outdir=outdir, build_dir=os.path.abspath(args.build_dir),
                  prefix=os.path.abspath(args.build_dir) + "-deps", deps_dir=os.path.abspath(args.deps_dir),
                  env=e, meson_cmd=meson_cmd, python=e.python, sm=str(gpu["sm"]),
                  memory_cap_gib=args.memory_cap_gib, codec_bench_args=args.codec_bench_args.split(),
                  cmd_env=cmd_env, on_step=None, jobs=args.jobs)
    for name in args.stages:
        rep["stages"][name] = report_mod.empty_stage("pending")
    if "build" not in args.stages:
        # Later stages use an existing build; the environment (private prefix) is still needed.
        dep = provide_deps(ctx)
        rep["environment"]["deps"] = dep.figures.get("deps", {})
        ctx.build_ok = os.path.isfile(os.path.join(ctx.build_dir, "build.ninja"))
        if not ctx.build_ok:
            print(f"gpu-check: no build in {ctx.build_dir}: include the build stage", file=sys.stderr)
    run.write()

    for name in args.stages:
        share = budget.take()
        stage_budget = budget.child(share, [1.0])
        run.current, run.stage_t0 = name, time.monotonic()
        run.current_outcome = StageOutcome()
        rep["stages"][name]["status"] = "running"
        rep["stages"][name]["budget_s"] = round(share, 1)
        run.write()
        outcome = run.current_outcome

        def on_step(outcome=outcome, name=name, share=share):
            run.record_stage(name, outcome, time.monotonic() - run.stage_t0, share, "running")
            run.write()
        ctx.on_step = on_step
        print(f"gpu-check: stage {name} (budget {share:.0f} s)", flush=True)
        try:
            result = STAGE_FUNCS[name](ctx, stage_budget, outcome)
        except Exception as exc:   # a bug in the check itself: reported, the run goes on
            import traceback
            outcome.note = f"gpu-check internal error: {type(exc).__name__}: {exc}"
            outcome.steps.append(StepResult("internal", "fail", output_tail=traceback.format_exc()[-3000:]))
            result = outcome
        if name == "build":
            rep["environment"]["deps"] = result.figures.get("deps", {})
        run.record_stage(name, result, time.monotonic() - run.stage_t0, share)
        run.current = None
        run.write()
        print(f"gpu-check:   {name}: {rep['stages'][name]['status']} "
              f"({rep['stages'][name]['seconds']:.0f} s)", flush=True)
    run.report["total_seconds"] = round(time.monotonic() - t_start, 1)
    run.report["overall_pass"] = report_mod.compute_overall(run.report)
    status = EXIT_OK if run.report["overall_pass"] else EXIT_FAILED
    run.finish(status)
    print(_summary_line(run.report))
    print(f"gpu-check: report in {outdir}/report.json and report.md")
    return status
