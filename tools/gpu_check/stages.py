"""The four stages of the GPU check: build, tests, torch, bench.

Each stage is a function ``stage_x(ctx, budget) -> StageOutcome`` that runs its steps as
commands under ``runner.run_command`` with a slice of the stage's budget, and turns their
output into figures. A stage never raises for a failure of the thing it checks: failures
become step statuses with the command's output tail. Stages after a failed build are
skipped (they have nothing to run). Workload scripts write their results as JSON files
(``--result``), rewritten as they go, so a step cut by its timeout still yields the
figures it had reached.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from . import deps as deps_mod
from .runner import Budget, StepResult, aggregate_status, read_tail, run_command

HERE = os.path.dirname(os.path.abspath(__file__))

#: relative weights of the stages in the global budget: the build may use half of it, since
#: nothing else runs without it; what a stage leaves unused goes to the later ones
STAGE_WEIGHTS = {"build": 6.0, "tests": 2.0, "torch": 1.5, "bench": 2.5}
STAGES = list(STAGE_WEIGHTS)


@dataclass
class Context:
    """What every stage needs: paths, the chosen tools, the environment for commands, options."""

    root: str                    # repository root
    outdir: str                  # where report.json and logs/ go
    build_dir: str               # build-gpu (absolute)
    prefix: str                  # private prefix for dependencies (absolute)
    deps_dir: str                # .gpu-deps (absolute)
    env: object                  # env.Environment
    meson_cmd: List[str]
    python: str
    sm: str
    memory_cap_gib: float = 4.0
    codec_bench_args: List[str] = field(default_factory=lambda: ["--json"])
    cmd_env: Dict[str, str] = field(default_factory=dict)
    native_file: Optional[str] = None
    build_ok: Optional[bool] = None
    meson_summary: Dict[str, str] = field(default_factory=dict)
    on_step: Optional[Callable[[], None]] = None
    jobs: Optional[int] = None

    def log(self, name: str) -> str:
        return os.path.join(self.outdir, "logs", name + ".log")


@dataclass
class StageOutcome:
    steps: List[StepResult] = field(default_factory=list)
    figures: Dict[str, object] = field(default_factory=dict)
    note: str = ""

    @property
    def status(self) -> str:
        return aggregate_status([s.status for s in self.steps])

    def add(self, step: StepResult, ctx: Optional[Context] = None) -> StepResult:
        self.steps.append(step)
        if ctx is not None and ctx.on_step:
            ctx.on_step()
        return step


def _skip(name: str, note: str) -> StepResult:
    return StepResult(name, "skipped", note=note)


def _read_json(path: str) -> Optional[object]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _meson_test_counts(text: str) -> Dict[str, int]:
    """Totals of a `meson test` summary ("Ok: 3", "Fail: 0", ...)."""
    counts: Dict[str, int] = {}
    for key in ("Ok", "Expected Fail", "Fail", "Unexpected Pass", "Skipped", "Timeout"):
        m = re.findall(rf"^{key}:\s+(\d+)\s*$", text, flags=re.M)
        if m:
            counts[key.lower().replace(" ", "_")] = int(m[-1])
    return counts


def parse_meson_summary(text: str) -> Dict[str, str]:
    """'CUDA kernels: YES' style lines of meson's summary() (section gact)."""
    out: Dict[str, str] = {}
    for key in ("CUDA host code", "CUDA kernels", "Python module", "sanitizers"):
        m = re.findall(rf"^\s*{re.escape(key)}\s*:\s*(\S+)", text, flags=re.M)
        if m:
            out[key] = m[-1]
    return out


# ---- build ----------------------------------------------------------------------------------

def provide_deps(ctx: Context) -> StepResult:
    """Make sure meson finds every dependency (see deps.provide); sets ctx.cmd_env."""
    t0 = time.monotonic()
    try:
        res = deps_mod.provide(ctx.meson_cmd, ctx.prefix, ctx.deps_dir, ctx.cmd_env, ctx.env.python_info,
                               ctx.env.tools.get("pkg-config"), log=lambda *_: None)
    except Exception as exc:  # a bug or an unreadable .deb: reported, never fatal for the report
        return StepResult("dependencies", "fail", time.monotonic() - t0,
                          output_tail=f"{type(exc).__name__}: {exc}")
    ctx.cmd_env = res["env"]
    ctx.native_file = res.get("native_file")
    step = StepResult("dependencies", "pass" if res["ok"] else "fail", time.monotonic() - t0,
                      output_tail=res.get("probe_log", "")[-3000:], note="; ".join(res.get("notes", [])),
                      figures={"deps": res.get("deps", {})})
    return step


def stage_build(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    b = budget.child(budget.remaining(), [0.5, 1.0, 6.0])
    b.take()
    dep_step = out.add(provide_deps(ctx), ctx)
    out.figures["deps"] = dep_step.figures.get("deps", {})
    if dep_step.status != "pass":
        ctx.build_ok = False
        out.add(_skip("meson setup", "dependencies missing"))
        out.add(_skip("compile", "dependencies missing"))
        return out
    opts = ["-Dbuildtype=release", "-Dcuda=enabled", f"-Dgpu_arch={ctx.sm}", f"-Dpython_exe={ctx.python}"]
    if ctx.env.python_info.get("has_python_h") is False:
        # Without Python.h the extension cannot build; the C++ suites still can.
        opts.append("-Dpython=disabled")
        out.note = f"{ctx.python} has no Python.h: the Python module is not built (torch stage will fail)"
    if ctx.native_file:
        opts += ["--native-file", ctx.native_file]
    reconf = []
    if os.path.isfile(os.path.join(ctx.build_dir, "meson-private", "coredata.dat")):
        reconf = ["--reconfigure"]
    elif os.path.isdir(ctx.build_dir):
        shutil.rmtree(ctx.build_dir)      # left by a failed setup: meson would refuse it
    setup = out.add(run_command("meson setup", ctx.meson_cmd + ["setup", ctx.build_dir] + reconf + opts,
                                b.take(), ctx.log("build-setup"), env=ctx.cmd_env, cwd=ctx.root), ctx)
    ctx.meson_summary = parse_meson_summary(read_tail(setup.log or "", 20000))
    out.figures.update({"gpu_arch": ctx.sm, "meson_options": " ".join(opts), "summary": ctx.meson_summary})
    if setup.status != "pass":
        ctx.build_ok = False
        out.add(_skip("compile", "meson setup failed"))
        return out
    ninja = ctx.env.tools.get("ninja") or "ninja"
    jobs = ["-j", str(ctx.jobs)] if ctx.jobs else []
    comp = out.add(run_command("compile", [ninja, "-C", ctx.build_dir] + jobs, b.take(), ctx.log("build-compile"),
                               env=ctx.cmd_env, cwd=ctx.root), ctx)
    m = re.findall(r"\[(\d+)/(\d+)\]", comp.output_tail)
    if m:
        out.figures["ninja_steps"] = int(m[-1][1])
    out.figures["compile_s"] = round(comp.seconds, 1)
    ctx.build_ok = comp.status == "pass"
    return out


# ---- tests ----------------------------------------------------------------------------------

def _meson_test(ctx: Context, name: str, args: Sequence[str], timeout: float, logbase: str,
                extra_env: Optional[Mapping[str, str]] = None) -> StepResult:
    cmd = ctx.meson_cmd + ["test", "-C", ctx.build_dir, "--no-rebuild", "--print-errorlogs",
                           "--logbase", logbase] + list(args)
    env = dict(ctx.cmd_env, **(extra_env or {}))
    step = run_command(name, cmd, timeout, ctx.log("tests-" + logbase), env=env, cwd=ctx.root)
    counts = _meson_test_counts(read_tail(step.log or "", 20000))
    step.figures.update(counts)
    if step.status == "pass" and counts.get("ok", 0) == 0:
        step.status = "fail"
        step.note = "meson test ran no test"
    return step


def count_suite(ctx: Context, suite: str) -> Optional[int]:
    """How many tests `suite` has in the build (None if meson cannot list them)."""
    import subprocess
    try:
        r = subprocess.run(ctx.meson_cmd + ["test", "-C", ctx.build_dir, "--no-rebuild", "--list", "--suite", suite],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                           env=ctx.cmd_env, cwd=ctx.root, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "No suitable tests" in r.stdout or "No tests defined" in r.stdout:
        return 0
    if r.returncode != 0:
        return None
    return len([ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith(("WARNING", "ninja"))])


def stage_tests(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if not ctx.build_ok:
        out.note = "skipped: no successful build"
        return out
    b = budget.child(budget.remaining(), [6.0, 2.0, 2.0])   # the suites first; the sanitizers share the rest
    n_gpu = count_suite(ctx, "gpu")
    out.figures["gpu_suite_tests"] = n_gpu
    step = out.add(_meson_test(ctx, "meson test (gpu + unit)", ["--suite", "gpu", "--suite", "unit"], b.take(),
                               "gpucheck-tests"), ctx)
    if n_gpu == 0:
        step.status = "fail"
        step.note = (step.note + "; " if step.note else "") + "the 'gpu' suite has no tests in this build"
    out.figures["tests"] = dict(step.figures)
    cs = ctx.env.tools.get("compute-sanitizer")
    for tool in ("memcheck", "racecheck"):
        t = b.take()
        if not cs:
            out.add(_skip(f"compute-sanitizer {tool}", "compute-sanitizer not found in the CUDA toolkit"), ctx)
            continue
        if not n_gpu:
            out.add(_skip(f"compute-sanitizer {tool}", "no gpu suite to run under it"), ctx)
            continue
        wrapper = f"{shlex.quote(cs)} --tool {tool} --error-exitcode 86"
        if tool == "racecheck":
            wrapper += " --racecheck-report all"
        # GACT_GPU_TEST_QUICK: GPU test programs may run a reduced matrix under a sanitizer.
        s = out.add(_meson_test(ctx, f"compute-sanitizer {tool}",
                                ["--suite", "gpu", "--wrapper", wrapper, "--timeout-multiplier", "20"], t,
                                "gpucheck-" + tool, {"GACT_GPU_TEST_QUICK": "1"}), ctx)
        out.figures[tool] = dict(s.figures)
    return out


# ---- torch ----------------------------------------------------------------------------------

def find_file(build_dir: str, name: str, preferred: Sequence[str] = ()) -> Optional[str]:
    """`name` under `build_dir`: the first of `preferred` (relative) that exists, else a search."""
    for p in preferred:
        full = os.path.join(build_dir, p)
        if os.path.exists(full):
            return full
    for d, dirs, files in os.walk(build_dir):
        dirs[:] = [x for x in dirs if not x.startswith("meson-") and not x.endswith(".p")]
        if name in files:
            return os.path.join(d, name)
    return None


#: allocator counters under "errors" that are not failures: a 0-byte request is answered with
#: nullptr, as cudaMalloc does, and torch may legitimately make one
BENIGN_ERROR_COUNTERS = ("zero_size",)


def check_stats_dump(path: str, expect_calls: Optional[str] = None) -> Dict[str, object]:
    """Read a GACT_STATS_PATH dump and judge it.

    ok when the document parses, has schema_version, counts at least one allocation across
    its allocators, has zero error counters (invalid_free, double_free, invalid_size,
    tag_underflow, ...; zero_size is reported apart), and, for a preload dump, the shim took
    calls of the kind `expect_calls` names ("malloc_calls" or "malloc_async_calls") and none
    of its allocations failed.
    @returns {'ok', 'problems', 'allocations', 'errors', 'error_counters', 'preload', ...}.
    """
    doc = _read_json(path)
    res: Dict[str, object] = {"path": path, "ok": False, "problems": []}
    problems: List[str] = res["problems"]  # type: ignore[assignment]
    if not isinstance(doc, dict):
        problems.append("no stats dump written" if not os.path.exists(path) else "stats dump is not a JSON object")
        return res
    res["schema_version"] = doc.get("schema_version")
    if "schema_version" not in doc:
        problems.append("stats dump lacks schema_version")
    allocators = doc.get("allocators")
    if not isinstance(allocators, dict) or not allocators:
        problems.append("stats dump has no allocators section")
        allocators = {}
    allocs, bytes_alloc, errors = 0, 0, 0
    counters: Dict[str, int] = {}
    peaks: Dict[str, object] = {}
    for name, a in allocators.items():
        if not isinstance(a, dict):
            continue
        allocs += int(a.get("allocation.all.allocated", 0) or 0)
        bytes_alloc += int(a.get("allocated_bytes.all.allocated", 0) or 0)
        e = a.get("errors", 0)
        items = e.items() if isinstance(e, dict) else [("errors", e)]
        for k, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                counters[k] = counters.get(k, 0) + int(v)
                if k not in BENIGN_ERROR_COUNTERS:
                    errors += int(v)
        peaks[name] = a.get("allocated_bytes.all.peak")
    res.update(allocations=allocs, allocated_bytes_total=bytes_alloc, errors=errors, error_counters=counters,
               peak_bytes=peaks, allocators=sorted(allocators))
    if allocs <= 0 and bytes_alloc <= 0:
        problems.append("no allocation counted (allocation.all.allocated and allocated_bytes.all.allocated are 0)")
    if errors:
        problems.append(f"{errors} allocator error(s) counted: {counters}")
    if expect_calls is not None:
        pre = doc.get("preload")
        if not isinstance(pre, dict):
            problems.append("stats dump has no preload section (the shim did not run)")
        else:
            res["preload"] = {k: v for k, v in pre.items() if isinstance(v, (int, float))}
            if int(pre.get(expect_calls, 0) or 0) <= 0:
                problems.append(f"the shim intercepted no call counted in preload.{expect_calls}")
            if int(pre.get("failed_allocs", 0) or 0) > 0:
                problems.append(f"{pre.get('failed_allocs')} allocation(s) failed in the shim")
    res["ok"] = not problems
    return res


def _python_step(ctx: Context, name: str, script: str, args: Sequence[str], timeout: float, logname: str,
                 result: str, devenv: bool, extra_env: Optional[Mapping[str, str]] = None) -> StepResult:
    cmd = [ctx.python, os.path.join(HERE, script), "--result", result] + list(args)
    if devenv:
        cmd = ctx.meson_cmd + ["devenv", "-C", ctx.build_dir] + cmd
    env = dict(ctx.cmd_env)
    env.update(extra_env or {})
    try:
        os.unlink(result)
    except OSError:
        pass
    step = run_command(name, cmd, timeout, ctx.log(logname), env=env, cwd=ctx.root)
    # Shown with the variables this step adds, so the command can be rerun by hand.
    step.command = [f"{k}={v}" for k, v in (extra_env or {}).items()] + list(step.command or cmd)
    res = _read_json(result)
    if isinstance(res, dict):
        step.figures.update(res.get("figures", {}))
        if not res.get("ok", False):
            if step.status == "pass":
                step.status = "fail"
            step.note = str(res.get("error") or "the workload reported failure")[:500]
    elif step.status == "pass":
        step.status = "fail"
        step.note = "the workload wrote no result"
    return step


def stage_torch(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if not ctx.build_ok:
        out.note = "skipped: no successful build"
        return out
    t = ctx.env.torch
    if not t:
        out.note = f"skipped: torch is not importable by {ctx.python}"
        return out
    b = budget.child(budget.remaining(), [1.0, 1.0, 1.0])
    res_dir = os.path.join(ctx.outdir, "results")
    os.makedirs(res_dir, exist_ok=True)
    out.add(_python_step(ctx, "use_allocator training step", "torch_allocator_step.py", [], b.take(),
                         "torch-use-allocator", os.path.join(res_dir, "torch_use_allocator.json"), devenv=True), ctx)
    shim = find_file(ctx.build_dir, "libgact_preload.so", ["bindings/libgact_preload.so"])
    for label, extra, calls in (("no caching", {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "malloc_calls"),
                                ("cudaMallocAsync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
                                 "malloc_async_calls")):
        slug = "nocache" if label == "no caching" else "async"
        t_s = b.take()
        name = f"LD_PRELOAD shim ({label})"
        if not shim:
            out.add(StepResult(name, "fail", note="libgact_preload.so not found in the build"), ctx)
            continue
        dump = os.path.join(res_dir, f"stats_preload_{slug}.json")
        try:
            os.unlink(dump)
        except OSError:
            pass
        env = dict(extra, LD_PRELOAD=shim, GACT_STATS_PATH=dump)
        step = _python_step(ctx, name, "preload_train.py", [], t_s, f"torch-preload-{slug}",
                            os.path.join(res_dir, f"preload_{slug}.json"), devenv=False, extra_env=env)
        verdict = check_stats_dump(dump, expect_calls=calls)
        step.figures["stats_dump"] = verdict
        if step.status == "pass" and not verdict["ok"]:
            step.status = "fail"
            step.note = "; ".join(verdict["problems"])  # type: ignore[arg-type]
        out.add(step, ctx)
    out.figures = {s.name: {k: v for k, v in s.figures.items() if not isinstance(v, dict) or k == "stats_dump"}
                   for s in out.steps}
    return out


# ---- bench ----------------------------------------------------------------------------------

def _bandwidth_figures(doc: object, prefix: str = "") -> Dict[str, float]:
    """Numbers in a benchmark JSON whose key names a bandwidth (GB/s), by dotted path."""
    found: Dict[str, float] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and re.search(r"gb.?s|gbps|bandwidth", str(k), re.I):
                found[p] = float(v)
            else:
                found.update(_bandwidth_figures(v, p))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:64]):
            found.update(_bandwidth_figures(v, f"{prefix}[{i}]"))
    return found


def add_copy_ratios(codec: Dict[str, object], copy_gbps: float) -> None:
    """Put each codec GB/s figure beside the device-to-device copy bandwidth: '<x>_vs_d2d_copy'."""
    codec["d2d_copy_gbps"] = copy_gbps
    for row in codec.get("rows") or []:  # type: ignore[union-attr]
        for k, v in list(row.items()):
            if k.endswith("_gbps") and isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k[:-len("_gbps")] + "_vs_d2d_copy"] = round(v / copy_gbps, 3)
    bw = codec.get("bandwidths_gbps")
    if isinstance(bw, dict):
        codec["vs_d2d_copy"] = {k: round(v / copy_gbps, 3) for k, v in bw.items()}


def stage_bench(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if not ctx.build_ok:
        out.note = "skipped: no successful build"
        return out
    b = budget.child(budget.remaining(), [1.0, 5.0])
    res_dir = os.path.join(ctx.outdir, "results")
    os.makedirs(res_dir, exist_ok=True)
    t = b.take()
    exe = find_file(ctx.build_dir, "gact-bench-codec", ["tools/gact-bench-codec", "tools/bench/gact-bench-codec"])
    codec: Dict[str, object] = {}
    if not exe:
        out.add(StepResult("gact-bench-codec", "fail", note="gact-bench-codec not found in the build"), ctx)
    else:
        step = run_command("gact-bench-codec", [exe] + ctx.codec_bench_args, t, ctx.log("bench-codec"),
                           env=ctx.cmd_env, cwd=ctx.root)
        doc = None
        try:
            with open(step.log or "", encoding="utf-8", errors="replace") as f:
                text = f.read().split("\n", 1)[-1]        # first line is the command
            i = text.find("{")
            doc = json.loads(text[i:text.rfind("}") + 1]) if i >= 0 else None
        except (OSError, ValueError):
            doc = None
        if doc is None and step.status == "pass":
            step.status = "fail"
            step.note = "gact-bench-codec --json printed no JSON document"
        if doc is not None:
            with open(os.path.join(res_dir, "bench_codec.json"), "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1)
            rows = doc.get("results") if isinstance(doc, dict) else None
            if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
                codec["rows"] = rows[:96]
                codec.update({k: doc[k] for k in ("device", "numel", "memcpy_gbps") if k in doc})
            else:
                codec["bandwidths_gbps"] = _bandwidth_figures(doc)
        out.add(step, ctx)
    t = b.take()
    if not ctx.env.torch:
        out.add(_skip("model training benchmarks", f"torch is not importable by {ctx.python}"), ctx)
    else:
        result = os.path.join(res_dir, "bench_models.json")
        step = _python_step(ctx, "model training benchmarks", "bench_models.py",
                            ["--deadline-s", f"{max(5.0, t - 15.0):.0f}", "--memory-cap-gib", str(ctx.memory_cap_gib)],
                            t, "bench-models", result, devenv=True)
        res = _read_json(result)
        if isinstance(res, dict):
            figs = res.get("figures", {})
            out.figures["models"] = figs.get("models", {})
            out.figures["memory_cap_mib"] = figs.get("memory_cap_mib")
            out.figures["cap_accounting"] = figs.get("cap_accounting")
            copy = figs.get("d2d_copy_gbps")
            if copy:
                add_copy_ratios(codec, copy)
        step.figures = {k: v for k, v in step.figures.items() if k != "models"}
        out.add(step, ctx)
    out.figures["codec"] = codec
    return out


STAGE_FUNCS = {"build": stage_build, "tests": stage_tests, "torch": stage_torch, "bench": stage_bench}
