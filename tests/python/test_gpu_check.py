"""Tests of tools/gpu-check's logic that runs without a GPU (CI, development machines).

- ``--dry-run`` on a machine without a GPU exits with the distinct no-GPU status (3), says so
  on stderr, and leaves a valid report; bad arguments are usage errors (2).
- The report writer produces a document with the schema's required keys and refuses an
  invalid one; overall_pass follows the stage statuses.
- .deb extraction (dpkg-deb and the pure-Python ar + tar path) on a tiny package built here
  with ``dpkg-deb --build``; the private-prefix pkg-config files read by the stdlib
  pkg-config stand-in.
- The budget split and the timeout: a ``sleep`` cut by a 1 s timeout is marked timeout and
  its process group is gone.
- Issue 14: the CPU smoke run (``--device cpu``) leaves exactly report.json, report.md and
  one archive in the report folder, with the ranked stages and the training figures; without
  the Python module it says so and still runs the fp32 arms; ``--prepare`` prints the command,
  the paths to carry and a time limit inside one device command; a GPU program exiting 77
  fails; compute-sanitizer's "Device not supported" is a skip.

Run by ``tools/dev test`` (pytest in tests/python) or directly:
``/usr/bin/python3 -m pytest tests/python/test_gpu_check.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
SCRIPT = os.path.join(TOOLS, "gpu-check")
sys.path.insert(0, TOOLS)

from gpu_check import EXIT_NO_GPU, EXIT_OK, EXIT_USAGE  # noqa: E402
from gpu_check import archive, cli, deps, pkg_config, report, runner, stages  # noqa: E402


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    r = subprocess.run([smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return r.returncode == 0 and b"GPU" in r.stdout


def _run_script(args, tmp_path, timeout=180):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, SCRIPT] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=env, cwd=str(tmp_path), timeout=timeout)


# ---- command line ---------------------------------------------------------------------------

@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the no-GPU path cannot be observed")
def test_dry_run_without_gpu_exits_3_and_writes_valid_report(tmp_path):
    out = tmp_path / "rep"
    r = _run_script(["--dry-run", str(out), "--python", sys.executable], tmp_path)
    assert r.returncode == EXIT_NO_GPU, r.stderr
    assert "no NVIDIA GPU found" in r.stderr
    doc = json.loads((out / "report.json").read_text())
    assert report.validate(doc) == []
    assert doc["mode"] == "dry-run" and doc["finished"] is True
    assert doc["gpu"]["present"] is False and doc["gpu"]["note"]
    assert doc["overall_pass"] is False and doc["exit_status"] == EXIT_NO_GPU
    assert doc["stage_order"] == ["build", "kernels", "allocator", "train", "sanitizers", "preload", "native", "unit"]
    assert all(doc["stages"][s]["status"] == "skipped" for s in doc["stage_order"])
    assert doc["environment"]["python"] == sys.executable
    assert "report.json" in os.listdir(out) and "report.md" in os.listdir(out)
    assert "none found" in (out / "report.md").read_text()


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_out_env_wins_over_outdir_argument(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "from_env"))
    r = subprocess.run([sys.executable, SCRIPT, "--dry-run", str(tmp_path / "from_arg"), "--stages", "build",
                        "--python", sys.executable], env=env, cwd=str(tmp_path),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=180)
    assert r.returncode == EXIT_NO_GPU
    assert (tmp_path / "from_env" / "report.json").exists()
    assert not (tmp_path / "from_arg").exists()
    doc = json.loads((tmp_path / "from_env" / "report.json").read_text())
    assert doc["stage_order"] == ["build"]


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "abc"], "not a number"),
    (["--budget-s", "1"], "below the minimum"),
    (["--stages", "build,fly"], "unknown stage"),
    (["--stages", "train,train"], "listed twice"),
    (["--gpu-arch", "sm90"], "not an SM version"),
    (["--no-such-option"], "unrecognized arguments"),
    (["a", "b"], "unrecognized arguments"),
])
def test_bad_arguments_are_usage_errors(tmp_path, args, message):
    r = _run_script(args, tmp_path, timeout=60)
    assert r.returncode == EXIT_USAGE
    assert message in r.stderr
    assert "usage: gpu-check" in r.stderr
    assert not (tmp_path / "gpu-check-out").exists()


def test_stage_list_keeps_rank_order():
    from gpu_check.cli import build_parser
    ns = build_parser().parse_args(["--stages", "unit,train,build"])
    assert ns.stages == ["build", "train", "unit"]


# ---- report ---------------------------------------------------------------------------------

def _full_report():
    rep = report.new_report("full", 300, ["build", "tests"])
    rep["gpu"] = {"present": True, "model": "NVIDIA H200", "driver": "570.1", "sm": "90", "memory_total_mib": 143771}
    rep["cuda_version"], rep["torch_version"] = "13.0", "2.5.1"
    for name in ("build", "tests"):
        rep["stages"][name].update(status="pass", seconds=1.5, figures={"x": 1.0})
    return rep


def test_report_writer_produces_schema_document(tmp_path):
    rep = _full_report()
    rep["stages"]["tests"]["steps"] = [runner.StepResult("meson test", "fail", 2.0, ["meson", "test"], 1,
                                                         10.0, "FAILED here").to_json()]
    rep["stages"]["tests"]["status"] = "fail"
    rep["overall_pass"] = report.compute_overall(rep)
    paths = report.write_report(rep, str(tmp_path))
    doc = json.loads(open(paths["json"]).read())
    for key in report.REQUIRED_KEYS:
        assert key in doc
    for key in report.REQUIRED_GPU_KEYS:
        assert key in doc["gpu"]
    for s in doc["stage_order"]:
        for key in report.REQUIRED_STAGE_KEYS:
            assert key in doc["stages"][s]
    assert doc["schema_version"] == report.SCHEMA_VERSION
    assert doc["overall_pass"] is False
    md = open(paths["md"]).read()
    assert "NVIDIA H200" in md and "| tests | fail |" in md and "FAILED here" in md
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_report_writes_nonfinite_figures_as_null_and_fails(tmp_path):
    """Issue 29: a NaN loss or cosine made the writer raise ("not serialisable as strict JSON: nan") and
    left report.md INCOMPLETE. It is written as null, named in the first truth, and fails the run."""
    rep = _full_report()
    rep["overall_pass"] = report.compute_overall(rep)
    assert rep["overall_pass"] is True
    rep["stages"]["train"] = dict(rep["stages"].get("train") or rep["stages"]["tests"])
    rep["stages"]["train"]["figures"] = {"vit": {"bits4": {"loss": float("nan"), "cos": [1.0, float("inf")]}}}
    paths = report.write_report(rep, str(tmp_path))
    doc = json.loads(open(paths["json"]).read())
    assert doc["stages"]["train"]["figures"]["vit"]["bits4"] == {"loss": None, "cos": [1.0, None]}
    assert doc["nonfinite_figures"] == ["stages.train.figures.vit.bits4.cos.1", "stages.train.figures.vit.bits4.loss"]
    assert doc["overall_pass"] is False
    assert doc["truths"][0].startswith("NON-FINITE FIGURES (2")
    assert "NON-FINITE FIGURES" in open(paths["md"]).read()


def test_overall_pass_follows_stage_statuses():
    rep = _full_report()
    assert report.compute_overall(rep) is True
    rep["stages"]["tests"]["status"] = "skipped"
    assert report.compute_overall(rep) is True          # skipped does not fail
    for bad in ("fail", "timeout", "pending", "running"):
        rep["stages"]["tests"]["status"] = bad
        assert report.compute_overall(rep) is False, bad
    rep["stages"]["tests"]["status"] = "pass"
    rep["gpu"]["present"] = False
    assert report.compute_overall(rep) is False         # nothing proven without a GPU
    rep["gpu"]["present"] = True
    for s in rep["stages"].values():
        s["status"] = "skipped"
    assert report.compute_overall(rep) is False         # nothing ran


def test_writer_refuses_invalid_documents(tmp_path):
    rep = _full_report()
    del rep["torch_version"]
    with pytest.raises(ValueError, match="torch_version"):
        report.write_report(rep, str(tmp_path))
    rep = _full_report()
    rep["stages"]["build"]["status"] = "great"
    assert any("great" in p for p in report.validate(rep))
    rep = _full_report()
    rep["stages"]["tests"]["status"] = "fail"
    rep["overall_pass"] = True
    assert any("overall_pass" in p for p in report.validate(rep))
    rep = _full_report()
    rep["stages"]["build"]["figures"] = {"x": float("nan")}
    assert any("strict JSON" in p for p in report.validate(rep))
    assert not (tmp_path / "report.json").exists()


# ---- budget and timeouts --------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_budget_shares_are_proportional_and_roll_over():
    clock = FakeClock()
    b = runner.Budget(100.0, [4, 2, 2, 2], clock=clock)
    assert b.take() == pytest.approx(40.0)
    clock.t += 10.0                                  # first stage used 10 of its 40 s
    assert b.take() == pytest.approx(90.0 * 2 / 6)   # the 30 s left over is shared by the rest
    clock.t += 30.0
    assert b.take() == pytest.approx(60.0 * 2 / 4)
    clock.t += 100.0                                 # past the deadline
    assert b.take() == 0.0
    with pytest.raises(IndexError):
        b.take()
    with pytest.raises(ValueError):
        runner.Budget(0, [1])
    with pytest.raises(ValueError):
        runner.Budget(10, [1, 0])


def test_child_budget_never_outlives_parent():
    clock = FakeClock()
    parent = runner.Budget(10.0, [1], clock=clock)
    child = parent.child(50.0, [1, 1])
    assert child.remaining() == pytest.approx(10.0)
    assert child.take() == pytest.approx(5.0)


def test_sleep_cut_by_timeout_is_marked_timeout(tmp_path):
    log = str(tmp_path / "sleep.log")
    marker = tmp_path / "child-alive"
    # The shell's child would touch the marker after 4 s if it survived the kill of the group.
    cmd = ["sh", "-c", f"(sleep 4; touch {marker}) & sleep 30"]
    res = runner.run_command("sleep", cmd, 1.0, log)
    assert res.status == "timeout"
    assert res.returncode is not None and res.returncode != 0
    assert "killed after 1.0 s" in res.output_tail
    time.sleep(4.5)
    assert not marker.exists(), "a child of the timed-out command survived"


def test_run_command_pass_fail_and_no_time_left(tmp_path):
    ok = runner.run_command("true", ["sh", "-c", "echo hello"], 10.0, str(tmp_path / "a.log"))
    assert ok.status == "pass" and ok.returncode == 0 and "hello" in ok.output_tail
    bad = runner.run_command("false", ["sh", "-c", "echo oops; exit 7"], 10.0, str(tmp_path / "b.log"))
    assert bad.status == "fail" and bad.returncode == 7 and "oops" in bad.output_tail
    missing = runner.run_command("missing", ["/nonexistent/tool"], 10.0, str(tmp_path / "c.log"))
    assert missing.status == "fail" and "could not start" in missing.output_tail
    skipped = runner.run_command("late", ["true"], 0.5, str(tmp_path / "d.log"))
    assert skipped.status == "skipped" and "no time left" in skipped.note
    assert runner.aggregate_status(["pass", "skipped"]) == "pass"
    assert runner.aggregate_status(["pass", "timeout"]) == "timeout"
    assert runner.aggregate_status(["timeout", "fail"]) == "fail"
    assert runner.aggregate_status([]) == "skipped"


# ---- .deb extraction and the private prefix -------------------------------------------------

def _build_tiny_deb(tmp_path, compression):
    pkg = tmp_path / "pkgroot"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text(
        "Package: gact-tiny\nVersion: 1:2.3.4+ds-1\nArchitecture: all\nMaintainer: t <t@example.org>\n"
        "Depends: libc6 (>= 2.34)\nDescription: tiny test package\n")
    inc = pkg / "usr" / "include" / "tiny"
    inc.mkdir(parents=True)
    (inc / "tiny.h").write_text("#define TINY 42\n")
    lib = pkg / "usr" / "lib" / deps.MULTIARCH
    lib.mkdir(parents=True)
    (lib / "libtiny.so.1.0").write_bytes(b"\x7fELF not really")
    os.symlink("libtiny.so.1.0", lib / "libtiny.so")
    deb = tmp_path / f"tiny-{compression}.deb"
    subprocess.run(["dpkg-deb", f"-Z{compression}", "--root-owner-group", "--build", str(pkg), str(deb)],
                   check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return deb


@pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="dpkg-deb is not installed: cannot build a test .deb")
@pytest.mark.parametrize("compression", ["xz", "gzip", "none"])
@pytest.mark.parametrize("use_dpkg", [True, False])
def test_extract_deb(tmp_path, compression, use_dpkg):
    deb = _build_tiny_deb(tmp_path, compression)
    dest = tmp_path / "root"
    method = deps.extract_deb(str(deb), str(dest), use_dpkg=use_dpkg)
    assert method == ("dpkg-deb" if use_dpkg else "python")
    assert (dest / "usr/include/tiny/tiny.h").read_text() == "#define TINY 42\n"
    link = dest / "usr/lib" / deps.MULTIARCH / "libtiny.so"
    assert link.is_symlink() and os.readlink(link) == "libtiny.so.1.0"
    assert link.read_bytes() == b"\x7fELF not really"
    ctl = deps.deb_control(str(deb))
    assert ctl["Package"] == "gact-tiny" and ctl["Version"] == "1:2.3.4+ds-1"
    assert deps.upstream_version(ctl["Version"]) == "2.3.4"


def test_ar_parser_rejects_damaged_input(tmp_path):
    with pytest.raises(ValueError, match="not an ar archive"):
        deps.ar_members(b"PK\x03\x04 zip file")
    with pytest.raises(ValueError, match="header"):
        deps.ar_members(b"!<arch>\n" + b"x" * 60)
    good_header = b"data.tar.gz/    " + b"0" * 32 + b"100       " + b"`\n"
    with pytest.raises(ValueError, match="truncated"):
        deps.ar_members(b"!<arch>\n" + good_header + b"short")


def test_safe_rel_refuses_paths_leaving_the_prefix():
    assert deps._safe_rel("./usr/include/a.h") == os.path.join("usr", "include", "a.h")
    assert deps._safe_rel("../etc/passwd") is None
    assert deps._safe_rel("usr/../../x") is None
    assert deps._safe_rel("/abs/path") == os.path.join("abs", "path")
    assert deps._safe_rel("./") is None


def test_prefix_pc_files_read_by_the_stdlib_pkg_config(tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    pcdir = tmp_path / "pc"
    versions = {"spdlog": "1.10.0", "fmt": "9.1.0", "doctest": "2.4.9"}
    deps.write_prefix_pcs(str(root), str(pcdir), ["spdlog", "fmt", "doctest"], versions, header_only=False)
    monkeypatch.setenv("PKG_CONFIG_PATH", str(pcdir))
    monkeypatch.setenv("PKG_CONFIG_LIBDIR", str(tmp_path / "empty"))
    inc, lib = f"-I{root}/usr/include", f"-L{root}/usr/lib/{deps.MULTIARCH}"

    def pc(*args):
        capsys.readouterr()
        rc = pkg_config.main(list(args))
        return rc, capsys.readouterr().out.strip()
    assert pc("--modversion", "spdlog") == (0, "1.10.0")
    rc, cflags = pc("--cflags", "spdlog")
    assert rc == 0 and cflags.split().count(inc) == 1 and "-DSPDLOG_COMPILED_LIB" in cflags
    rc, libs = pc("--libs", "spdlog")
    assert rc == 0 and libs.index("-lspdlog") < libs.index("-lfmt") and lib in libs   # Requires: fmt followed
    assert pc("--exists", "doctest")[0] == 0
    assert pc("--exists", "nlohmann_json")[0] == 1
    assert pc("--variable=pcfiledir", "fmt") == (0, str(pcdir))
    deps.write_prefix_pcs(str(root), str(pcdir), ["spdlog", "fmt"], versions, header_only=True)
    rc, cflags = pc("--cflags", "spdlog")
    assert "-DFMT_HEADER_ONLY" in cflags and "-DSPDLOG_COMPILED_LIB" not in cflags
    assert "-lspdlog" not in pc("--libs", "spdlog")[1]


def test_pkg_config_expands_variables_and_drops_system_dirs(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.pc").write_text("prefix=/usr\nincludedir=${prefix}/include/a\nlibdir=${prefix}/lib\n"
                                   "Name: a\nDescription: d\nVersion: 1.2\nCflags: -I${includedir} -I/usr/include\n"
                                   "Libs: -L${libdir} -la\nRequires.private: b >= 1.0\n")
    (tmp_path / "b.pc").write_text("Name: b\nDescription: d\nVersion: 3\nCflags: -DB=1\nLibs: -lb\n")
    monkeypatch.setenv("PKG_CONFIG_PATH", str(tmp_path))
    monkeypatch.setenv("PKG_CONFIG_LIBDIR", str(tmp_path / "none"))
    monkeypatch.delenv("PKG_CONFIG_ALLOW_SYSTEM_CFLAGS", raising=False)
    monkeypatch.delenv("PKG_CONFIG_ALLOW_SYSTEM_LIBS", raising=False)
    capsys.readouterr()
    assert pkg_config.main(["--cflags", "a"]) == 0
    assert capsys.readouterr().out.split() == ["-I/usr/include/a", "-DB=1"]    # private Requires: cflags only
    assert pkg_config.main(["--libs", "a"]) == 0
    assert capsys.readouterr().out.split() == ["-la"]
    assert pkg_config.main(["--libs", "--static", "a"]) == 0
    assert capsys.readouterr().out.split() == ["-la", "-lb"]
    assert pkg_config.main(["--define-variable=prefix=/opt/x", "--variable=includedir", "a"]) == 0
    assert capsys.readouterr().out.strip() == "/opt/x/include/a"


# ---- stage helpers --------------------------------------------------------------------------

def test_stats_dump_verdict(tmp_path):
    good = {"schema_version": 1, "allocators": {"cuda:0": {"allocation.all.allocated": 12,
                                                            "allocated_bytes.all.allocated": 4096,
                                                            "errors": {"unknown_pointer": 0, "double_free": 0}}}}
    p = tmp_path / "good.json"
    p.write_text(json.dumps(good))
    v = stages.check_stats_dump(str(p))
    assert v["ok"] and v["allocations"] == 12 and v["errors"] == 0
    bad = json.loads(json.dumps(good))
    bad["allocators"]["cuda:0"]["errors"]["double_free"] = 2
    p.write_text(json.dumps(bad))
    v = stages.check_stats_dump(str(p))
    assert not v["ok"] and any("error" in s for s in v["problems"])
    benign = json.loads(json.dumps(good))
    benign["allocators"]["cuda:0"]["errors"]["zero_size"] = 3       # nullptr for 0 bytes, as cudaMalloc
    p.write_text(json.dumps(benign))
    v = stages.check_stats_dump(str(p))
    assert v["ok"] and v["error_counters"]["zero_size"] == 3
    pre = dict(good, preload={"malloc_calls": 0, "malloc_async_calls": 40, "failed_allocs": 0})
    p.write_text(json.dumps(pre))
    assert stages.check_stats_dump(str(p), expect_calls="malloc_async_calls")["ok"]
    v = stages.check_stats_dump(str(p), expect_calls="malloc_calls")
    assert not v["ok"] and "preload.malloc_calls" in v["problems"][0]
    pre["preload"]["failed_allocs"] = 1
    p.write_text(json.dumps(pre))
    assert not stages.check_stats_dump(str(p), expect_calls="malloc_async_calls")["ok"]
    p.write_text(json.dumps(good))
    assert "no preload section" in stages.check_stats_dump(str(p), expect_calls="malloc_calls")["problems"][0]
    empty = {"schema_version": 1, "allocators": {"cuda:0": {"allocation.all.allocated": 0}}}
    p.write_text(json.dumps(empty))
    assert not stages.check_stats_dump(str(p))["ok"]
    assert "no stats dump" in stages.check_stats_dump(str(tmp_path / "missing.json"))["problems"][0]


def test_meson_output_parsers():
    text = "Ok:                 7\nExpected Fail:      0\nFail:               1\nSkipped:            2\nTimeout:            0\n"
    assert stages._meson_test_counts(text) == {"ok": 7, "expected_fail": 0, "fail": 1, "skipped": 2, "timeout": 0}
    summ = "gact\n    CUDA host code: YES\n    CUDA kernels  : YES\n    Python module : NO\n"
    assert stages.parse_meson_summary(summ) == {"CUDA host code": "YES", "CUDA kernels": "YES", "Python module": "NO"}
    assert stages.codec_test_figures("corrupt blobs: 99/100 agree\n5496 checks, 2 failures\n") == {
        "checks": 5496, "failures": 2, "corrupt_blobs_agree": "99/100"}
    assert stages.doctest_figures("[doctest] test cases: 6 | 5 passed | 1 failed | 0 skipped") == {
        "test_cases": 6, "passed": 5, "failed": 1}
    assert stages.last_json_object('noise\n{"a": 1}\n{broken\n') == {"a": 1}


def test_sm_from_capability():
    from gpu_check import env
    assert env.sm_from_capability("9.0") == "90"
    assert env.sm_from_capability("8.6") == "86"
    assert env.sm_from_capability("") is None and env.sm_from_capability("nine") is None
    g = env.describe_gpu({"gpus": [{"name": "NVIDIA H200", "driver": "570", "compute_cap": "9.0",
                                    "memory_total_mib": 143771}]}, None)
    assert g["present"] and g["sm"] == "90" and g["source"] == "nvidia-smi"
    g = env.describe_gpu({"error": "nvidia-smi not found"}, {"version": "2.5", "cuda_available": False})
    assert not g["present"] and "nvidia-smi not found" in g["note"]


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
@pytest.mark.skipif(not (shutil.which("meson") and shutil.which("ninja")), reason="meson and ninja are needed")
def test_sigterm_mid_stage_leaves_a_finished_report(tmp_path):
    """The report is written as the run goes; a SIGTERM marks the running stage and finishes it."""
    import signal
    out = tmp_path / "rep"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["GACT_GPU_CHECK_FAKE_GPU"] = "90"    # let the stages start on a machine without a GPU
    proc = subprocess.Popen([sys.executable, SCRIPT, str(out), "--stages", "build", "--python", sys.executable,
                             "--build-dir", str(tmp_path / "build-gpu"), "--deps-dir", str(tmp_path / "deps")],
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        doc = None
        while time.monotonic() < deadline:
            try:
                doc = json.loads((out / "report.json").read_text())
            except (OSError, ValueError):
                doc = None
            if doc and doc["stages"]["build"]["status"] == "running":
                break
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        if doc is None or doc["stages"]["build"]["status"] != "running":
            pytest.skip("the tools on this machine made the build stage end before it could be interrupted: "
                        + (proc.communicate()[1].decode()[-500:] if proc.poll() is not None else ""))
        assert doc["finished"] is False and doc["gpu"]["source"] == "fake"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + signal.SIGTERM
    doc = json.loads((out / "report.json").read_text())
    assert report.validate(doc) == []
    assert doc["finished"] is True and doc["exit_status"] == 128 + signal.SIGTERM
    assert doc["stages"]["build"]["status"] == "timeout"
    assert "interrupted by signal" in doc["stages"]["build"]["note"]
    assert doc["overall_pass"] is False


def _bench_doc(match=True):
    rows = [{"dtype": "float32", "codec": "quant", "bits": b, "encode_gbps": e, "decode_gbps": d,
             "encode_vs_d2d_copy": e / 2000.0, "decode_vs_d2d_copy": d / 2000.0, "blob_matches_cpu": match or b != 2,
             "decode_matches_cpu": True} for b, e, d in ((2, 1700.0, 2400.0), (4, 1500.0, 2200.0))]
    rows.append({"dtype": "float32", "codec": "raw", "bits": 0, "encode_gbps": 1000.0, "decode_gbps": 1000.0,
                 "encode_vs_d2d_copy": 0.5, "decode_vs_d2d_copy": 0.5, "blob_matches_cpu": True,
                 "decode_matches_cpu": True})
    return {"cuda": {"device": "NVIDIA H200", "numel": 67108864, "d2d_copy_gbps": 2000.0, "target_vs_d2d_copy": 0.8,
                     "rows": rows}}


def test_codec_bench_figures_rank_the_kernel_truths():
    f = stages.codec_bench_figures(_bench_doc())
    assert f["quant_encode_vs_copy_min"] == 0.75 and f["quant_decode_vs_copy_min"] == 1.1
    assert f["quant_meets_target"] is False and f["differ_from_cpu"] == []     # raw's 0.5 is not a quant figure
    assert stages.codec_bench_figures(_bench_doc(match=False))["differ_from_cpu"] == ["float32/quant/2"]
    assert "no CUDA device" in stages.codec_bench_figures({"cuda": {"error": "no CUDA device"}})["error"]
    assert "no 'cuda' section" in stages.codec_bench_figures({"results": []})["error"]


def test_report_ranks_kernels_training_swap_and_batch_first(tmp_path):
    rep = _full_report()
    rep["stage_order"] = ["kernels", "train"]
    rep["stages"] = {"kernels": report.empty_stage("pass"), "train": report.empty_stage("pass")}
    rep["stages"]["kernels"]["figures"] = {"bit_exact": {"status": "pass", "checks": 5496, "failures": 0,
                                                         "corrupt_blobs_agree": "2000/2000"},
                                           "codec_bench": stages.codec_bench_figures(_bench_doc())}
    arms = {"fp32": {"status": "pass", "step_ms": 100.0, "gact_peak_mib": 8000.0, "grad_cosine": 1.0},
            "bits2": {"status": "pass", "step_ms": 150.0, "step_time_vs_fp32": 1.5, "gact_peak_mib": 2000.0,
                      "gact_peak_vs_fp32": 0.25, "store_ratio": 14.0, "grad_cosine": 0.97,
                      "encoded_vs_saved": 1.0, "decoded_vs_saved": 1.0},
            "auto_swap": {"status": "skipped", "note": "out of time"}}
    rep["stages"]["train"]["figures"] = {
        "models": {"resnet50": {"source": "torchvision.models.resnet50(weights=None)", "arms": arms}},
        "swap_check": {"resnet50": {"status": "pass", "verdict": "equal", "bitwise_equal": True,
                                    "rel_l2_swap_vs_no_swap": 0.0, "rel_l2_fp32_run_to_run": 0.0}},
        "max_batch": {"resnet50": {"fp32": {"max_batch": 96}, "bits2": {"max_batch": 384, "vs_fp32": 4.0}}},
        "memory_cap_mib": 8192, "max_batch_oom_errors": {"torch.OutOfMemoryError": 7}}
    rep["python_module"] = {"available": True, "reason": ""}
    md = open(report.write_report(rep, str(tmp_path))["md"]).read()
    doc = json.loads((tmp_path / "report.json").read_text())
    t = doc["truths"]
    assert t[0].startswith("kernels bit-exact with the CPU: yes (test_codecs_gpu: 5496 checks, 0 failures")
    assert t[1].startswith("kernel throughput vs cudaMemcpyAsync D2D (2,000 GB/s): quant encode >= 0.75x")
    assert "NOT met" in t[1] and "every blob and decode equal to the CPU's" in t[1]
    assert t[2].startswith("training through gact.use_allocator() + Compressor: 2/3 arms pass; resnet50 2-bit: "
                           "step 1.50x of fp32, gact peak 0.25x")
    assert t[3] == "swap's gradients against swap=False: resnet50 equal"
    assert t[4] == "largest batch under 8192 MiB under use_allocator(): resnet50 fp32 96 -> bits2 384 (4.00x)"
    assert t[5] == "out-of-memory errors of the batch search: torch.OutOfMemoryError x7"
    # the same arm's search with gact's pool in expandable segments, beside the fixed segments' figure
    rep["stages"]["train"]["figures"]["max_batch_expandable"] = {"resnet50": {"bits2": {"max_batch": 448}},
                                                                 "note": "a string, skipped"}
    assert report.truths(rep)[5] == ("largest batch at 2 bits under use_allocator() with expandable segments "
                                     "(GACT_EXPANDABLE_SEGMENTS=1; fixed segments in brackets): resnet50 448 (384)")
    del rep["stages"]["train"]["figures"]["max_batch_expandable"]
    rep["stages"]["train"]["figures"]["max_batch_oom_errors"] = {"builtins.RuntimeError": 2}
    assert "NOT all torch's OutOfMemoryError" in report.truths(rep)[5]
    # the default path's search (native stage: torch's allocator, the blobs in torch's pool), said beside it
    rep["stage_order"].append("native")
    rep["stages"]["native"] = report.empty_stage("pass")
    rep["stages"]["native"]["figures"] = {
        "max_batch": {"resnet50": {"fp32": {"max_batch": 80}, "bits2": {"max_batch": 480, "vs_fp32": 6.0}}},
        "memory_cap_mib": 8192, "max_batch_pool": "torch", "max_batch_oom_errors": {"torch.OutOfMemoryError": 3}}
    t = report.truths(rep)
    assert t[5] == ("largest batch under 8192 MiB on torch's allocator (the default), blobs in torch's pool: "
                    "resnet50 fp32 80 -> bits2 480 (6.00x)")
    assert t[6].startswith("out-of-memory errors of the batch search: builtins.RuntimeError x2, "
                           "torch.OutOfMemoryError x3")
    md2 = open(report.write_report(rep, str(tmp_path / "2"))["md"]).read()
    assert "on torch's allocator, the default; blobs in torch's pool)" in md2
    assert "| resnet50 | bits2 | 480 | 6.0 |" in md2 or "| resnet50 | bits2 | 480 | 6.00 |" in md2
    assert md.index("## Findings") < md.index("## Kernels beside") < md.index("## Training steps") \
        < md.index("## Swap") < md.index("## Largest batch") < md.index("## Stages")
    assert "| float32 | quant | 2 | 1,700 | 0.85 | 2,400 | 1.20 | yes | yes |" in md
    assert "| resnet50 | bits2 | pass | 150 | 1.50 | 2,000 | 0.25 | – | 14.00 | 0.97 | – |" in md
    assert "| resnet50 | auto_swap | skipped |" in md and "out of time" in md
    assert "Bytes encoded / decoded per byte saved (1.00 / 1.00: each saved tensor encoded and decoded once): " \
        "resnet50 bits2 1.00 / 1.00." in md


def test_module_missing_is_said_first_and_fails_a_gpu_run(tmp_path):
    rep = _full_report()
    rep["python_module"] = {"available": False, "reason": "/venv/bin/python has no Python.h"}
    assert report.compute_overall(rep) is False
    rep["overall_pass"] = False
    md = open(report.write_report(rep, str(tmp_path))["md"]).read()
    assert "**Python module: NOT AVAILABLE** (/venv/bin/python has no Python.h)" in md
    assert json.loads((tmp_path / "report.json").read_text())["truths"][0].startswith(
        "PYTHON MODULE NOT AVAILABLE: /venv/bin/python has no Python.h")


# ---- issue 14: what a short GPU slot needs ----------------------------------------------

def _fake_ctx(tmp_path, **kw):
    from gpu_check.env import Environment
    return stages.Context(root=str(tmp_path), work_dir=str(tmp_path / "work"), build_dir=str(tmp_path / "b"),
                          prefix=str(tmp_path / "p"), deps_dir=str(tmp_path / "d"), env=Environment(), meson_cmd=["meson"],
                          python=sys.executable, sm="90", cmd_env=dict(os.environ), **kw)


def _script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


def test_gpu_program_exiting_77_is_a_failure_not_a_pass(tmp_path):
    ctx = _fake_ctx(tmp_path)
    skipped = stages.gpu_program(ctx, "prog", _script(tmp_path, "skip", "echo no device; exit 77"), [], 10, "skip")
    assert skipped.status == "fail" and "exited 77" in skipped.note
    ok = stages.gpu_program(ctx, "prog", _script(tmp_path, "ok", "echo fine"), [], 10, "ok")
    assert ok.status == "pass"
    assert stages.gpu_program(ctx, "prog", None, [], 10, "none").status == "fail"


def test_sanitizer_device_not_supported_is_a_skip_and_quick_mode_is_set(tmp_path):
    ctx = _fake_ctx(tmp_path)
    prog = _script(tmp_path, "prog", "exit 0")
    ctx.targets = {"test_codecs_gpu": prog}
    unsupported = _script(tmp_path, "cs1", "echo '========= Error: Device not supported'; exit 1")
    s = stages.sanitizer_step(ctx, unsupported, "memcheck", "test_codecs_gpu", 10)
    assert s.status == "skipped" and "does not support" in s.note
    errors = _script(tmp_path, "cs2", 'echo "quick=$GACT_GPU_TEST_QUICK args=$*"; echo "========= ERROR SUMMARY: 3 errors"; exit 86')
    s = stages.sanitizer_step(ctx, errors, "racecheck", "test_codecs_gpu", 10)
    assert s.status == "fail" and s.figures["errors"] == 3 and "racecheck reported errors" in s.note
    text = open(s.log).read()
    assert "quick=1" in text and "--tool racecheck" in text and "--racecheck-report all" in text and prog in text
    clean = _script(tmp_path, "cs3", 'echo "========= ERROR SUMMARY: 0 errors"; "$5"')
    s = stages.sanitizer_step(ctx, clean, "memcheck", "test_codecs_gpu", 10)
    assert s.status == "pass" and s.figures["errors"] == 0


def test_prepare_prints_command_carry_and_a_limit_that_fits_a_device_slot(tmp_path, monkeypatch, capsys):
    deps_dir = os.path.join(ROOT, ".gpu-deps")
    monkeypatch.setattr(deps, "prepare", lambda d: {"packages": ["a.deb"] * 7})
    monkeypatch.setattr(deps, "dir_bytes", lambda d: 1258291)
    assert cli.main(["--prepare", "--deps-dir", deps_dir]) == EXIT_OK
    out = capsys.readouterr().out
    plan = json.loads([ln for ln in out.splitlines() if ln.startswith("plan: ")][0][len("plan: "):])
    assert plan["command"] == "tools/gpu-check" and plan["carry"] == [".gpu-deps"]
    assert plan["returns"] == ["report.json", "report.md", "gpu-check-logs.tar.gz"]
    assert "  command:   tools/gpu-check" in out and '  carry:     [".gpu-deps"]' in out
    assert f"  timeout_s: {plan['timeout_s']}" in out
    # One device command is at most 600 s; the run keeps well under 6 minutes so a rerun fits in 15.
    assert cli.DEFAULT_BUDGET_S <= 330 and plan["timeout_s"] <= 420
    assert sum(stages.STAGE_CAPS[s] for s in ("build", "kernels", "allocator", "train")) <= cli.DEFAULT_BUDGET_S + 30
    ns = cli.build_parser().parse_args(["--budget-s", "200"])
    assert cli.prepare_plan(ns)["command"] == "tools/gpu-check --budget-s 200"


def test_archive_keeps_the_end_of_long_logs(tmp_path):
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "results").mkdir()
    (work / "logs" / "build-compile.log").write_text("x" * 1000 + "the error at the end\n")
    (work / "results" / "train.json").write_text('{"ok": true}')
    (work / "results" / "ignored.txt").write_text("not a result")
    a = archive.write_archive(str(work), str(tmp_path / "out"), max_member_bytes=100)
    assert os.listdir(tmp_path / "out") == ["gpu-check-logs.tar.gz"]
    assert a["members"] == ["logs/build-compile.log", "results/train.json"]
    assert a["truncated"] == ["logs/build-compile.log"]
    import tarfile
    with tarfile.open(a["path"]) as tar:
        log = tar.extractfile("logs/build-compile.log").read().decode()
    assert log.startswith("[gpu-check: the first") and log.endswith("the error at the end\n")


def _build_dir():
    try:
        import _gact
    except ImportError:
        return None
    d = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_gact.__file__))))
    return d if os.path.isfile(os.path.join(d, "build.ninja")) else None


@pytest.mark.skipif(_build_dir() is None, reason="run inside `meson devenv -C build` (needs the built _gact)")
@pytest.mark.parametrize("without_module", [False, True])
def test_cpu_smoke_run_leaves_three_files_with_the_ranked_report(tmp_path, without_module):
    out = tmp_path / "out"
    args = [str(out), "--device", "cpu", "--build-dir", _build_dir(), "--work-dir", str(tmp_path / "work"),
            "--python", sys.executable] + (["--without-module"] if without_module else [])
    r = _run_script(args, tmp_path, timeout=600)
    assert r.returncode == EXIT_OK, r.stdout[-2000:] + r.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert files == sorted(archive.REPORT_FILES) and len(files) <= 8
    assert all(os.path.isfile(out / f) for f in files)           # no folders to lose
    doc = json.loads((out / "report.json").read_text())
    assert report.validate(doc) == [] and doc["mode"] == "smoke" and doc["overall_pass"] is False
    assert doc["stage_order"] == stages.STAGES
    assert {s: doc["stages"][s]["status"] for s in ("build", "train")} == {"build": "pass", "train": "pass"}, \
        (out / "report.md").read_text()[-3000:]
    assert all(doc["stages"][s]["status"] == "skipped" for s in stages.GPU_ONLY)
    assert sorted(doc["archive"]["members"]) == ["logs/train.log", "results/train.json"]
    models = doc["stages"]["train"]["figures"]["models"]
    assert sorted(models) == ["bert", "resnet50", "vit"]
    for mo in models.values():
        assert list(mo["arms"]) == ["fp32", "bits4", "bits2", "auto", "auto_swap"]
        assert mo["arms"]["fp32"]["status"] == "pass" and mo["arms"]["fp32"]["grad_cosine"] == 1.0
    md = (out / "report.md").read_text()
    assert md.startswith("# gact GPU check: SMOKE")
    if without_module:
        assert doc["python_module"]["available"] is False and "--without-module" in doc["python_module"]["reason"]
        assert "**Python module: NOT AVAILABLE**" in md
        assert all(mo["arms"]["bits2"]["status"] == "skipped" and "not available" in mo["arms"]["bits2"]["note"]
                   for mo in models.values())
        assert doc["stages"]["train"]["figures"]["swap_check"] == {}
    else:
        assert doc["python_module"]["available"] is True
        for m, mo in models.items():
            assert all(a["status"] == "pass" for a in mo["arms"].values()), json.dumps(mo)[:3000]
            assert 0.0 < mo["arms"]["bits4"]["grad_cosine"] < 1.0 and mo["arms"]["bits2"]["store_ratio"] > 4
        # the profile of one compressed step (kernels and device waits are a GPU's; none on the CPU)
        prof = doc["stages"]["train"]["figures"]["profile"]
        assert prof["status"] == "pass" and prof["model"] == "resnet50", prof
        assert prof["saved_tensors"] > 50 and prof["unpacks"] > 0 and prof["host_us_per_saved_tensor"] > 0
        assert prof["sync_count"] == 0 and prof["encode_kernels_ms"] == 0.0 and prof["allocations"] is None
        assert any(line.startswith("profile of one resnet50 step at 4 bits: gact host ") for line in doc["truths"])
        # whether saved.py's correlation walk runs in C++ in the module gpu-check built (the test's own build)
        import gact.saved
        walk = "C++" if gact.saved._graph_reaches is not None else "Python"
        assert doc["stages"]["train"]["figures"]["graph_walk"] == walk
        assert any(line.startswith("profile of one") and line.endswith(f"correlation walk in {walk}")
                   for line in doc["truths"])
        assert all(c["verdict"] == "equal" for c in doc["stages"]["train"]["figures"]["swap_check"].values())
        # what the counters promise at the fp32 peak, and what stays uncompressed, by reason (on a GPU the
        # device peaks give "realized" beside it; the CPU smoke run measures no peak)
        for m, mo in models.items():
            assert mo["arms"]["fp32"]["saved_mib"] > 0, m
            b2 = mo["arms"]["bits2"]
            assert 0 < b2["promised_mib"] < mo["arms"]["fp32"]["saved_mib"], (m, b2)
            assert set(b2["per_step_mib"]) == {"stored", "kept", "held"} and b2["per_step_mib"]["stored"] > 0
            assert isinstance(b2["kept_mib_by_reason"], dict)
        # auto against uniform 2 bits, by gradient error, for every model
        assert any(line.startswith("bits='auto' (budget 2) against uniform 2 bits, gradient relative error: resnet50 ")
                   for line in doc["truths"]), doc["truths"]
        # the NaN/Inf contract ran first, and its line is in the report
        nf = doc["stages"]["train"]["figures"]["nonfinite"]
        assert nf["failures"] == [] and nf["cases"] == 13 and nf["device_nonfinite"] == 0, nf
        assert any(line.startswith("NaN/Inf in saved tensors come back exactly") and ": yes (13 cases" in line
                   for line in doc["truths"])


def test_the_report_compares_torchs_pool_with_gacts_own_per_model():
    """The native stage runs the 2-bit arm twice, the blobs in torch's pool (the default) and in gact's own pool
    (GACT_TORCH_POOL=0): the report puts the device memory reserved at each one's peak side by side."""
    rep = {"stages": {"native": {"status": "pass", "figures": {
        "models": {"gpt2": {"arms": {"fp32": {"device_reserved_peak_mib": 16000.0},
                                     "bits2": {"device_reserved_peak_mib": 5200.0, "device_pool": "torch"}}},
                   "bert": {"arms": {"bits2": {"status": "fail"}}}},
        "models_gact_pool": {"gpt2": {"arms": {"bits2": {"device_reserved_peak_mib": 9650.0,
                                                         "device_pool": "gact"}}}}}}}}
    parts = report.pool_comparison(rep)
    assert parts == ["gpt2 5,200 MiB (torch) against 9,650 MiB (gact), fp32 16,000 MiB"]
    assert report.pool_comparison({"stages": {}}) == []
