"""The stages of the GPU check, ranked so that the most important truths come first.

    build       dependencies, meson setup (release, CUDA, the GPU's SM), and only the targets
                the later stages run; says whether the Python module could be built and why not
    kernels     test_codecs_gpu (device blobs and decodes = CPU, bit for bit, corrupt blobs) and
                gact-bench-codec --device cuda (GB/s beside cudaMemcpyAsync device-to-device)
    allocator   test_allocator_gpu: the caching allocator and the C ABI over real cudaMalloc
    train       train_models.py under gact.use_allocator(): ResNet-50, a ViT and BERT at fp32 /
                4 / 2 / auto / auto+swap (step time, gact's peak memory, gradient agreement),
                swap's gradients against swap=False, the largest batch under a memory cap
    sanitizers  compute-sanitizer memcheck and racecheck on the GPU programs in quick mode
    preload     the LD_PRELOAD shim under an unmodified script, in both of torch's modes
    native      train_models.py on torch's own allocator (the default): torch's peak for fp32 and bits2, and
                their largest batch under the memory cap
    unit        the rest of the build and `meson test --suite unit` on the GPU host

Each stage is ``stage_x(ctx, budget, out) -> StageOutcome`` and runs its steps as commands
under ``runner.run_command`` with a slice of the stage's time box. A stage never raises for a
failure of what it checks: failures become step statuses with the command's output tail. A
GPU program that exits 77 (meson's "skipped": no device seen) is a failure here. Logs and
result files go to the work folder (``Context.work_dir``), which ends up in one archive in
the report folder; workload scripts rewrite their result file as they go, so a step cut by
its time box still yields what it had measured.
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

#: the stages in rank order, each with its time box in seconds; a stage gets the lesser of
#: its box and what the run has left, so the later ones are the first to go short
STAGE_CAPS = {"build": 150.0, "kernels": 45.0, "allocator": 20.0, "train": 110.0, "sanitizers": 60.0,
              "preload": 40.0, "native": 80.0, "unit": 90.0}
STAGES = list(STAGE_CAPS)
#: stages that need a GPU (skipped in a CPU smoke run)
GPU_ONLY = ("kernels", "allocator", "sanitizers", "preload", "native", "unit")

#: the targets the stages run, by meson target name (ninja builds only these before `unit`)
BUILD_TARGETS = ("test_codecs_gpu", "test_allocator_gpu", "gact-bench-codec", "gact", "gact_preload", "_gact",
                 "_gact_torch")
#: targets a run goes on without: _gact_torch (built where the c10 headers of the host's torch compile) gives
#: use_allocator() torch's own out-of-memory error; without it the error is a RuntimeError
OPTIONAL_TARGETS = ("_gact_torch",)
#: GPU programs whose tests provoke CUDA API errors on purpose (memcheck then reports memory errors only)
PROVOKES_API_ERRORS = ("test_allocator_gpu",)
#: a GPU program's exit status that meson counts as skipped
EXIT_SKIPPED = 77
#: what compute-sanitizer says on a GPU it cannot instrument
SANITIZER_UNSUPPORTED = re.compile(r"device not supported|not supported on this (device|platform)", re.I)
#: environment of the torch workloads: no downloads, deterministic cuBLAS when asked for
WORKLOAD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Context:
    """What every stage needs: paths, the chosen tools, the environment for commands, options."""

    root: str                    # repository root
    work_dir: str                # logs/ and results/ (archived into the report folder)
    build_dir: str               # build-gpu (absolute)
    prefix: str                  # private prefix for dependencies (absolute)
    deps_dir: str                # .gpu-deps (absolute)
    env: object                  # env.Environment
    meson_cmd: List[str]
    python: str
    sm: str
    device: str = "cuda"         # "cpu": the smoke run (--device cpu)
    tiny: bool = False
    memory_cap_gib: float = 8.0
    cmd_env: Dict[str, str] = field(default_factory=dict)
    native_file: Optional[str] = None
    build_ok: Optional[bool] = None
    meson_summary: Dict[str, str] = field(default_factory=dict)
    targets: Dict[str, str] = field(default_factory=dict)    # meson target name -> built file
    module_ok: Optional[bool] = None
    module_reason: str = ""
    without_module: bool = False
    on_step: Optional[Callable[[], None]] = None
    jobs: Optional[int] = None

    def log(self, name: str) -> str:
        return os.path.join(self.work_dir, "logs", name + ".log")

    def result(self, name: str) -> str:
        path = os.path.join(self.work_dir, "results", name + ".json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def built(self, name: str) -> Optional[str]:
        """The file of target `name` when it exists on disk."""
        p = self.targets.get(name)
        return p if p and os.path.exists(p) else None


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


def ensure_built(ctx: Context, out: StageOutcome, budget: Budget, names: Sequence[str]) -> None:
    """Build what this stage needs and the build stage did not get to (its time box ran out),
    with at most 70 % of the stage's time; a no-op when everything is there."""
    missing = [n for n in names if n in ctx.targets and not ctx.built(n)]
    if not missing or ctx.device == "cpu":
        return
    ninja = ctx.env.tools.get("ninja") or "ninja"
    rel = [os.path.relpath(ctx.targets[n], ctx.build_dir) for n in missing]
    step = out.add(run_command(f"finish building {', '.join(missing)}", [ninja, "-C", ctx.build_dir, "-k", "0"] + rel,
                               0.7 * budget.remaining(), ctx.log("build-more-" + "-".join(missing)),
                               env=ctx.cmd_env, cwd=ctx.root), ctx)
    if "_gact" in missing:
        module_verdict(ctx, step.status)


def _cannot_run(ctx: Context, out: StageOutcome, torch: bool = False) -> bool:
    """True (with the stage's note set) when there is no build, or `torch` is wanted and missing."""
    if not ctx.build_ok:
        out.note = "skipped: no successful build"
    elif torch and not ctx.env.torch:
        out.note = f"skipped: torch is not importable by {ctx.python}"
    else:
        return False
    return True


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
    for key in ("CUDA host code", "CUDA kernels", "Python module", "sanitizers", "CUDA runtime RUNPATH"):
        m = re.findall(rf"^\s*{re.escape(key)}\s*:\s*(\S+)", text, flags=re.M)
        if m:
            out[key] = m[-1]
    return out


def read_targets(build_dir: str) -> Dict[str, str]:
    """Meson target name -> its first output file, from the build's introspection data."""
    doc = _read_json(os.path.join(build_dir, "meson-info", "intro-targets.json"))
    out: Dict[str, str] = {}
    if isinstance(doc, list):
        for t in doc:
            if isinstance(t, dict) and t.get("filename"):
                name = str(t.get("name"))
                if name.startswith("_gact."):
                    name = "_gact"          # the extension module's target carries the ABI suffix
                out.setdefault(name, str(t["filename"][0]))
    return out


def gpu_program(ctx: Context, name: str, exe: Optional[str], args: Sequence[str], timeout: float, logname: str,
                extra_env: Optional[Mapping[str, str]] = None) -> StepResult:
    """Run a GPU test program; exit 77 ("no device") is a failure on a GPU host."""
    if not exe:
        return StepResult(name, "fail", note="not built (see the build stage)")
    step = run_command(name, [exe] + list(args), timeout, ctx.log(logname), env=dict(ctx.cmd_env, **(extra_env or {})),
                       cwd=ctx.root)
    if step.returncode == EXIT_SKIPPED:
        step.status = "fail"
        step.note = ("exited 77 (skipped): the program saw no CUDA device; on a GPU host a skipped GPU test "
                     "is a failure, not a pass")
    return step


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
    not_found = list(res.get("not_found") or [])
    ok = res["ok"] or not_found == ["pybind11"]     # pybind11 is needed by the Python module only
    step = StepResult("dependencies", "pass" if ok else "fail", time.monotonic() - t0,
                      output_tail=res.get("probe_log", "")[-3000:], note="; ".join(res.get("notes", [])),
                      figures={"deps": res.get("deps", {}), "not_found": not_found})
    return step


def module_verdict(ctx: Context, compiled: object) -> None:
    """Set ctx.module_ok / module_reason after a build step whose status is `compiled`
    (True/"pass", "timeout", or False/"fail")."""
    if ctx.without_module:
        ctx.module_ok, ctx.module_reason = False, "not used (--without-module)"
    elif ctx.env.python_info.get("has_python_h") is False:
        ctx.module_ok = False
        ctx.module_reason = (f"{ctx.python} has no Python.h: the Python headers are missing on this host, so the "
                             "_gact module cannot be built")
    elif ctx.meson_summary.get("Python module", "").upper() in ("NO", "FALSE"):
        ctx.module_ok = False
        ctx.module_reason = "meson did not configure the Python module (pybind11 or the Python installation not found)"
    elif "_gact" not in ctx.targets:
        ctx.module_ok, ctx.module_reason = False, "the Python module is not in this build"
    elif not ctx.built("_gact"):
        ctx.module_ok = False
        ctx.module_reason = ("the build ran out of its time box before the Python module" if compiled == "timeout"
                             else "the Python module did not compile (see the build log)")
    else:
        ctx.module_ok, ctx.module_reason = True, ""


def stage_build(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if ctx.device == "cpu":
        # The smoke run uses the build folder as it is (the suite's own build).
        ok = os.path.isfile(os.path.join(ctx.build_dir, "build.ninja"))
        ctx.build_ok = ok
        ctx.targets = read_targets(ctx.build_dir) if ok else {}
        out.add(StepResult("existing build", "pass" if ok else "fail",
                           note=f"smoke run: {ctx.build_dir} as it is" if ok else f"no build in {ctx.build_dir}"), ctx)
        module_verdict(ctx, ok)
        out.figures["python_module"] = {"available": ctx.module_ok, "reason": ctx.module_reason}
        return out
    b = budget.child(budget.remaining(), [0.5, 1.0, 6.0])
    b.take()
    dep_step = out.add(provide_deps(ctx), ctx)
    out.figures["deps"] = dep_step.figures.get("deps", {})
    if dep_step.status != "pass":
        ctx.build_ok = False
        out.add(_skip("meson setup", "dependencies missing"))
        out.add(_skip("compile", "dependencies missing"))
        return out
    opts = ["-Dbuildtype=release", "-Dcuda=enabled", f"-Dgpu_arch={ctx.sm}", f"-Dpython_exe={ctx.python}",
            "-Dwerror=false"]
    if (ctx.env.python_info.get("has_python_h") is False or "pybind11" in dep_step.figures.get("not_found", [])
            or ctx.without_module):
        opts.append("-Dpython=disabled")
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
    ctx.targets = read_targets(ctx.build_dir)
    wanted = [os.path.relpath(ctx.targets[t], ctx.build_dir) for t in BUILD_TARGETS if t in ctx.targets]
    ninja = ctx.env.tools.get("ninja") or "ninja"
    jobs = ["-j", str(ctx.jobs)] if ctx.jobs else []
    # -k 0: a target that fails (the module, say) does not stop the others
    comp = out.add(run_command("compile", [ninja, "-C", ctx.build_dir, "-k", "0"] + jobs + wanted, b.take(),
                               ctx.log("build-compile"), env=ctx.cmd_env, cwd=ctx.root), ctx)
    m = re.findall(r"\[(\d+)/(\d+)\]", comp.output_tail)
    if m:
        out.figures["ninja_steps"] = int(m[-1][1])
    out.figures["compile_s"] = round(comp.seconds, 1)
    out.figures["targets"] = {t: bool(ctx.built(t)) for t in BUILD_TARGETS}
    if not ctx.built("_gact_torch"):
        # why: meson's message when it did not configure it (the c10 check failed), else the compile log
        why = [ln.strip() for ln in read_tail(setup.log or "", 20000).splitlines() if "_gact_torch" in ln]
        out.figures["gact_torch"] = {"built": False, "why": (why[-1] if why else
                                                             "configured but not compiled (see the build log)")[:500]}
    module_verdict(ctx, comp.status)
    required = [t for t in BUILD_TARGETS if t not in OPTIONAL_TARGETS]
    if comp.status != "pass" and all(ctx.built(t) for t in required if t != "_gact"):
        if ctx.module_ok is False:
            comp.status = "pass"       # only the module failed: reported below
            comp.note = "every target but the Python module built"
        elif ctx.module_ok:
            comp.status = "pass"       # only an optional target failed
            comp.note = "every required target built; not built: " + ", ".join(
                t for t in OPTIONAL_TARGETS if not ctx.built(t))
    ctx.build_ok = True   # configured: a later stage finishes building what it needs (ensure_built)
    module = StepResult("Python module", "pass" if ctx.module_ok else "fail",
                        note=ctx.module_reason or f"{ctx.built('_gact')}")
    out.add(module, ctx)
    out.figures["python_module"] = {"available": ctx.module_ok, "reason": ctx.module_reason}
    return out


# ---- kernels and allocator ------------------------------------------------------------------

def codec_test_figures(text: str) -> Dict[str, object]:
    """'N checks, M failures' and 'corrupt blobs: a/b agree' of test_codecs_gpu's output."""
    f: Dict[str, object] = {}
    m = re.findall(r"(\d+) checks, (\d+) failures", text)
    if m:
        f["checks"], f["failures"] = int(m[-1][0]), int(m[-1][1])
    m = re.findall(r"corrupt blobs: (\d+)/(\d+) agree", text)
    if m:
        f["corrupt_blobs_agree"] = f"{m[-1][0]}/{m[-1][1]}"
    return f


def last_json_object(text: str) -> Optional[dict]:
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                return doc
    return None


def codec_bench_figures(doc: Mapping[str, object]) -> Dict[str, object]:
    """The CUDA half of gact-bench-codec --json, reduced to what the report ranks first."""
    cuda = doc.get("cuda") if isinstance(doc.get("cuda"), Mapping) else {}
    if not cuda:
        return {"error": "gact-bench-codec printed no 'cuda' section"}
    if cuda.get("error"):
        return {"error": str(cuda["error"])}
    rows = [r for r in cuda.get("rows") or [] if isinstance(r, Mapping)]
    quant = [r for r in rows if r.get("codec") == "quant"]
    target = float(cuda.get("target_vs_d2d_copy") or 0.8)
    f: Dict[str, object] = {
        "device": cuda.get("device"), "numel": cuda.get("numel"), "d2d_copy_gbps": cuda.get("d2d_copy_gbps"),
        "target_vs_d2d_copy": target,
        "rows": [{k: r.get(k) for k in ("dtype", "codec", "bits", "encode_gbps", "decode_gbps", "encode_vs_d2d_copy",
                                        "decode_vs_d2d_copy", "blob_matches_cpu", "decode_matches_cpu")} for r in rows],
        "differ_from_cpu": [f"{r.get('dtype')}/{r.get('codec')}/{r.get('bits')}" for r in rows
                            if not (r.get("blob_matches_cpu") and r.get("decode_matches_cpu"))],
    }
    if quant:
        enc = [float(r["encode_vs_d2d_copy"]) for r in quant]
        dec = [float(r["decode_vs_d2d_copy"]) for r in quant]
        f.update(quant_encode_vs_copy_min=round(min(enc), 3), quant_decode_vs_copy_min=round(min(dec), 3),
                 quant_meets_target=bool(min(enc) >= target and min(dec) >= target))
    return f


def stage_kernels(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out):
        return out
    ensure_built(ctx, out, budget, ["test_codecs_gpu", "gact-bench-codec"])
    b = budget.child(budget.remaining(), [1.2, 1.0])
    step = out.add(gpu_program(ctx, "test_codecs_gpu (GPU = CPU, bit for bit)", ctx.built("test_codecs_gpu"), [],
                               b.take(), "kernels-test-codecs-gpu"), ctx)
    step.figures.update(codec_test_figures(read_tail(step.log or "", 20000)))
    out.figures["bit_exact"] = dict(step.figures, status=step.status, note=step.note)
    bench = gpu_program(ctx, "gact-bench-codec --device cuda", ctx.built("gact-bench-codec"),
                        ["--device", "cuda", "--json", "--reps", "5"] + (["--cuda-numel", "1048576"] if ctx.tiny else []),
                        b.take(), "kernels-bench-codec")
    doc = last_json_object(read_tail(bench.log or "", 200000)) if bench.log else None
    if doc is not None:
        with open(ctx.result("bench_codec"), "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
        figs = codec_bench_figures(doc)
        out.figures["codec_bench"] = figs
        if figs.get("error"):
            bench.status, bench.note = "fail", str(figs["error"])
        elif figs.get("differ_from_cpu"):
            bench.status = "fail"
            bench.note = "the device's blob or decode differs from the CPU's for " + ", ".join(figs["differ_from_cpu"])
        else:
            bench.figures = {k: figs.get(k) for k in ("d2d_copy_gbps", "quant_encode_vs_copy_min",
                                                       "quant_decode_vs_copy_min", "quant_meets_target")}
    elif bench.status == "pass":
        bench.status, bench.note = "fail", "gact-bench-codec --json printed no JSON document"
    out.add(bench, ctx)
    return out


def doctest_figures(text: str) -> Dict[str, object]:
    m = re.findall(r"test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed", text)
    return {"test_cases": int(m[-1][0]), "passed": int(m[-1][1]), "failed": int(m[-1][2])} if m else {}


def stage_allocator(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out):
        return out
    ensure_built(ctx, out, budget, ["test_allocator_gpu"])
    step = out.add(gpu_program(ctx, "test_allocator_gpu (real cudaMalloc, C ABI)", ctx.built("test_allocator_gpu"),
                               [], budget.remaining(), "allocator-test"), ctx)
    step.figures.update(doctest_figures(read_tail(step.log or "", 20000)))
    out.figures = dict(step.figures)
    return out


# ---- torch workloads ------------------------------------------------------------------------

def _python_step(ctx: Context, name: str, script: str, args: Sequence[str], timeout: float, logname: str,
                 result: str, devenv: bool, extra_env: Optional[Mapping[str, str]] = None) -> StepResult:
    """Run a workload script with the target Python; its result file decides pass/fail."""
    cmd = [ctx.python, os.path.join(HERE, script), "--result", result] + list(args)
    if devenv:
        cmd = ctx.meson_cmd + ["devenv", "-C", ctx.build_dir, "--workdir", HERE] + cmd
    env = dict(ctx.cmd_env)
    env.update(extra_env or {})
    try:
        os.unlink(result)
    except OSError:
        pass
    step = run_command(name, cmd, timeout, ctx.log(logname), env=env, cwd=HERE if not devenv else ctx.root)
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


def _train_args(ctx: Context, timeout: float, allocator: str) -> List[str]:
    args = ["--device", ctx.device, "--allocator", allocator, "--deadline-s", f"{max(5.0, timeout - 12.0):.0f}",
            "--memory-cap-gib", str(ctx.memory_cap_gib)]
    if ctx.tiny:
        args += ["--tiny", "--steps", "1", "--warmup", "1"]
    if not ctx.module_ok:
        args += ["--no-module", "--module-note", f"the Python module is not available: {ctx.module_reason}"]
        if allocator == "gact" and ctx.built("gact"):
            args += ["--library", ctx.built("gact") or ""]
    return args


def stage_train(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out, torch=True):
        return out
    ensure_built(ctx, out, budget, ["_gact", "gact"])
    t = budget.remaining()
    allocator = "gact" if ctx.device == "cuda" else "torch"
    if allocator == "gact" and not ctx.module_ok and not ctx.built("gact"):
        out.note = "skipped: neither the Python module nor libgact.so was built"
        return out
    step = _python_step(ctx, "training through gact (use_allocator + Compressor)", "train_models.py",
                        _train_args(ctx, t, allocator), t, "train", ctx.result("train"), devenv=bool(ctx.module_ok),
                        extra_env=WORKLOAD_ENV)
    figs = dict(step.figures)
    step.figures = {k: figs.get(k) for k in ("device", "torch", "allocator", "gact_allocations_on_device",
                                            "gact_num_ooms", "max_batch_oom_errors", "oom_errors_are_torchs")
                    if k in figs}
    out.figures = {k: figs.get(k) for k in ("models", "swap_check", "max_batch", "memory_cap_mib", "arms",
                                           "python_module", "allocator", "max_batch_oom_errors", "profile",
                                           "nonfinite", "graph_walk")
                   if k in figs}
    if not ctx.module_ok:
        out.note = f"Python module not available ({ctx.module_reason}): only the fp32 arms ran"
    out.add(step, ctx)
    # the 2-bit arm again with gact's device pool in expandable segments (GACT_EXPANDABLE_SEGMENTS=1, off by
    # default until a GPU has measured it): its peaks and its largest batch under the same cap, beside the above
    t = budget.remaining()
    if t > 60.0 and allocator == "gact" and ctx.module_ok:
        args = _train_args(ctx, t, allocator) + ["--arms", "bits2", "--no-swap-check", "--max-batch-arms",
                                                 "bits2", "--search-s", "10", "--search-reserve-s", "25"]
        step = _python_step(ctx, "training through gact, expandable segments", "train_models.py", args, t,
                            "train-expandable", ctx.result("train_expandable"), devenv=True,
                            extra_env=dict(WORKLOAD_ENV, GACT_EXPANDABLE_SEGMENTS="1"))
        figs = dict(step.figures)
        step.figures = {k: figs.get(k) for k in ("gact_num_ooms", "max_batch_oom_errors") if k in figs}
        out.figures["models_expandable"] = figs.get("models", {})
        out.figures["max_batch_expandable"] = figs.get("max_batch", {})
        out.add(step, ctx)
    return out


def stage_native(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out, torch=True):
        return out
    t = budget.remaining()
    # the default a user gets (torch's allocator, the blobs in torch's pool): its peaks, and its largest batch
    # under the cap (a shorter search than the train stage's: fp32 and 2 bits)
    args = _train_args(ctx, t, "torch") + ["--arms", "fp32,bits2", "--no-swap-check", "--max-batch-arms",
                                           "fp32,bits2" if ctx.device == "cuda" else "", "--search-s", "10",
                                           "--search-reserve-s", "25"]
    step = _python_step(ctx, "training on torch's own allocator (torch's peak)", "train_models.py", args, t,
                        "native", ctx.result("native"), devenv=bool(ctx.module_ok), extra_env=WORKLOAD_ENV)
    figs = dict(step.figures)
    step.figures = {k: figs.get(k) for k in ("device", "torch") if k in figs}
    out.figures = {k: figs.get(k) for k in ("max_batch", "memory_cap_mib", "max_batch_pool", "max_batch_oom_errors")
                   if k in figs}
    out.figures["models"] = figs.get("models", {})
    out.add(step, ctx)
    # the same compressed arm with the blobs in gact's own device pool beside torch's (GACT_TORCH_POOL=0): what
    # the one pool by default saves, in memory reserved from the device at the peak
    t = budget.remaining()
    if t > 15.0 and ctx.module_ok:
        args = _train_args(ctx, t, "torch") + ["--arms", "bits2", "--no-swap-check", "--max-batch-arms", ""]
        step = _python_step(ctx, "training on torch's allocator, blobs in gact's own pool", "train_models.py", args,
                            t, "native-gact-pool", ctx.result("native_gact_pool"), devenv=True,
                            extra_env=dict(WORKLOAD_ENV, GACT_TORCH_POOL="0"))
        figs = dict(step.figures)
        step.figures = {}
        out.figures["models_gact_pool"] = figs.get("models", {})
        out.add(step, ctx)
    return out


# ---- sanitizers -----------------------------------------------------------------------------

def sanitizer_step(ctx: Context, cs: str, tool: str, target: str, timeout: float) -> StepResult:
    """One compute-sanitizer run in quick mode; 'device not supported' is a skip."""
    name = f"compute-sanitizer {tool} {target}"
    exe = ctx.built(target)
    if not exe:
        return StepResult(name, "fail", note="not built (see the build stage)")
    cmd = [cs, "--tool", tool, "--error-exitcode", "86"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    if tool == "memcheck" and target in PROVOKES_API_ERRORS:
        # its tests provoke CUDA API errors on purpose (a host pointer freed, out-of-memory cases) and
        # check that they are reported; memcheck is asked for memory errors only
        cmd += ["--report-api-errors", "no"]
    step = run_command(name, cmd + [exe], timeout, ctx.log(f"sanitizer-{tool}-{target}"),
                       env=dict(ctx.cmd_env, GACT_GPU_TEST_QUICK="1"), cwd=ctx.root)
    text = read_tail(step.log or "", 20000)
    m = re.findall(r"ERROR SUMMARY:\s*(\d+) error", text)
    if m:
        step.figures["errors"] = int(m[-1])
    if step.status != "pass" and SANITIZER_UNSUPPORTED.search(text):
        step.status = "skipped"
        step.note = "compute-sanitizer does not support this device"
    elif step.returncode == EXIT_SKIPPED:
        step.status = "fail"
        step.note = "the program saw no CUDA device under the sanitizer (exit 77)"
    elif step.returncode == 86:
        step.note = f"{tool} reported errors"
    return step


def stage_sanitizers(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out):
        return out
    cs = ctx.env.tools.get("compute-sanitizer")
    runs = [("memcheck", "test_codecs_gpu"), ("racecheck", "test_codecs_gpu"), ("memcheck", "test_allocator_gpu")]
    if not cs:
        for tool, target in runs:
            out.add(_skip(f"compute-sanitizer {tool} {target}", "compute-sanitizer not found in the CUDA toolkit"), ctx)
        return out
    ensure_built(ctx, out, budget, ["test_codecs_gpu", "test_allocator_gpu"])
    # the codec program launches kernels (racecheck is the slowest); the allocator program launches none
    b = budget.child(budget.remaining(), [1.5, 1.8, 0.7])
    for tool, target in runs:
        step = out.add(sanitizer_step(ctx, cs, tool, target, b.take()), ctx)
        out.figures[f"{tool}/{target}"] = {"status": step.status, **step.figures}
        if step.status == "skipped" and "does not support" in step.note:
            for t2, g2 in runs[runs.index((tool, target)) + 1:]:
                out.add(_skip(f"compute-sanitizer {t2} {g2}", step.note), ctx)
                b.take()
            break
    return out


# ---- preload shim ---------------------------------------------------------------------------

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
               peaks=peaks)
    if allocs <= 0:
        problems.append("the dump counts no allocation")
    if errors:
        problems.append(f"{errors} allocator error(s): " + ", ".join(f"{k}={v}" for k, v in counters.items()
                                                                     if v and k not in BENIGN_ERROR_COUNTERS))
    if expect_calls:
        pre = doc.get("preload")
        if not isinstance(pre, dict):
            problems.append("no preload section in the dump (was the shim loaded?)")
        else:
            res["preload"] = {k: v for k, v in pre.items() if isinstance(v, (int, float, str, bool))}
            if not int(pre.get(expect_calls, 0) or 0):
                problems.append(f"preload.{expect_calls} is 0: the shim took no call of this kind")
            if int(pre.get("failed_allocs", 0) or 0):
                problems.append(f"preload.failed_allocs = {pre.get('failed_allocs')}")
    res["ok"] = not problems
    return res


def stage_preload(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out, torch=True):
        return out
    ensure_built(ctx, out, budget, ["gact_preload"])
    b = budget.child(budget.remaining(), [1.0, 1.0])
    shim = ctx.built("gact_preload")
    for label, extra, calls in (("no caching", {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "malloc_calls"),
                                ("cudaMallocAsync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
                                 "malloc_async_calls")):
        slug = "nocache" if label == "no caching" else "async"
        t_s = b.take()
        name = f"LD_PRELOAD shim ({label})"
        if not shim:
            out.add(StepResult(name, "fail", note="libgact_preload.so not built"), ctx)
            continue
        dump = ctx.result(f"stats_preload_{slug}")
        try:
            os.unlink(dump)
        except OSError:
            pass
        env = dict(extra, LD_PRELOAD=shim, GACT_STATS_PATH=dump)
        step = _python_step(ctx, name, "preload_train.py", [], t_s, f"preload-{slug}", ctx.result(f"preload_{slug}"),
                            devenv=False, extra_env=env)
        verdict = check_stats_dump(dump, expect_calls=calls)
        step.figures["stats_dump"] = verdict
        if step.status == "pass" and not verdict["ok"]:
            step.status = "fail"
            step.note = "; ".join(verdict["problems"])  # type: ignore[arg-type]
        out.add(step, ctx)
    return out


# ---- unit -----------------------------------------------------------------------------------

def stage_unit(ctx: Context, budget: Budget, out: StageOutcome) -> StageOutcome:
    if _cannot_run(ctx, out):
        return out
    b = budget.child(budget.remaining(), [2.0, 1.0])
    ninja = ctx.env.tools.get("ninja") or "ninja"
    comp = out.add(run_command("compile the rest", [ninja, "-C", ctx.build_dir, "-k", "0"], b.take(),
                               ctx.log("unit-compile"), env=ctx.cmd_env, cwd=ctx.root), ctx)
    if comp.status != "pass":
        out.add(_skip("meson test --suite unit", "the rest of the build did not complete"), ctx)
        return out
    cmd = ctx.meson_cmd + ["test", "-C", ctx.build_dir, "--no-rebuild", "--print-errorlogs", "--suite", "unit",
                           "--logbase", "gpucheck-unit"]
    step = run_command("meson test --suite unit", cmd, b.take(), ctx.log("unit-tests"), env=ctx.cmd_env, cwd=ctx.root)
    step.figures.update(_meson_test_counts(read_tail(step.log or "", 20000)))
    out.figures = dict(step.figures)
    out.add(step, ctx)
    return out


STAGE_FUNCS = {"build": stage_build, "kernels": stage_kernels, "allocator": stage_allocator, "train": stage_train,
               "sanitizers": stage_sanitizers, "preload": stage_preload, "native": stage_native, "unit": stage_unit}
assert list(STAGE_FUNCS) == STAGES
