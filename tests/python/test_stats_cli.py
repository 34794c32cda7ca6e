"""Tests of the gact-stats command line (tools/gact-stats).

The CLI runs as a subprocess, as a user runs it, on hand-made documents whose
figures are known, on malformed ones (each must give exit status 2 and one
line on stderr, never a traceback), and on real dumps: one written by the
allocator benchmark (gact-bench-alloc --stats-out, the caching allocator over
the host backend) and one from the Python package's gact.stats().
"""

import copy
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "tools", "gact-stats")
MIB = 1 << 20


def run_cli(*args):
    return subprocess.run(["/usr/bin/python3", CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def make_doc():
    """A complete dump with round figures: one allocator, two tags, store and swap sections."""
    return {
        "schema_version": 1, "gact_version": "0.1.0", "pid": 4242, "time_unix_ms": 1767225600000,
        "allocators": {"host": {
            "allocated_bytes.all.current": 1 * MIB, "allocated_bytes.all.peak": 4 * MIB,
            "allocated_bytes.all.allocated": 10 * MIB, "allocated_bytes.all.freed": 9 * MIB,
            "reserved_bytes.all.current": 2 * MIB, "reserved_bytes.all.peak": 5 * MIB,
            "active_bytes.all.current": 1 * MIB, "active_bytes.all.peak": 4 * MIB,
            "segment.all.current": 1, "segment.all.peak": 3,
            "allocation.all.current": 2, "allocation.all.peak": 9,
            "num_alloc_retries": 0, "num_ooms": 1, "num_sync_all_streams": 0,
            "num_device_alloc": 3, "num_device_free": 2,
            "tags": {"activation": {"current_bytes": 512 * 1024, "peak_bytes": 3 * MIB, "current_count": 1,
                                    "peak_count": 6, "total_allocs": 10},
                     "weight": {"current_bytes": 512 * 1024, "peak_bytes": 512 * 1024, "current_count": 1,
                                "peak_count": 1, "total_allocs": 1}},
            "fragmentation": {"peak": 0.2, "free": 0.25},
            "errors": {"double_free": 0, "unknown_pointer": 2},
            "backend": "host", "options": {"small_size": MIB, "name": "host"}}},
        "store": {"tensors_in": 10, "bytes_in": 40 * MIB, "bytes_stored": 5 * MIB, "ratio": 8.0},
        "swap": {"bytes_out": 1000, "bytes_back": 500},
    }


def assert_clean_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gact-stats: ")
    for f in fragments:
        assert f in lines[0], (f, lines[0])


# ---------------------------------------------------------------------------
# show


def test_show_prints_key_figures_per_allocator_tag_and_store(tmp_path):
    r = run_cli("show", write(tmp_path, "a.json", make_doc()))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "allocator host (backend host)" in out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.strip()}
    assert lines["allocated"][1:] == ["1.00", "MiB", "4.00", "MiB"]
    assert lines["reserved"][1:] == ["2.00", "MiB", "5.00", "MiB"]
    assert lines["segments"][1:] == ["1", "3"]
    assert "OOMs 1" in out and "retries 0" in out
    assert "20.0 %" in out and "25.0 %" in out          # fragmentation peak and free
    assert "unknown_pointer 2" in out
    assert lines["activation"][1:5] == ["512.00", "KiB", "3.00", "MiB"]
    assert "weight" in lines
    # tags are ordered by peak bytes, largest first
    assert out.index("activation") < out.index("weight")
    assert "8.00x" in out and "40.00 MiB" in out
    assert "swap" in lines and "bytes_out" in lines


def test_show_hides_zero_figures_of_other_sections_unless_all(tmp_path):
    doc = make_doc()
    doc["swap"]["failures"] = 0
    doc["store"]["leaks"] = 0
    doc["policy"] = {"solves": 0}
    p = write(tmp_path, "a.json", doc)
    out = run_cli("show", p).stdout
    assert "failures" not in out and "leaks" not in out and "solves" not in out
    assert "bytes_out" in out
    assert "(1 other figure is 0; --all shows it)" in out      # store.leaks, swap.failures
    assert "(1 figure is 0; --all shows it)" in out            # policy: nothing else
    doc["policy"]["retries"] = 0
    assert "(all 2 figures are 0; --all shows them)" in run_cli("show", write(tmp_path, "b.json", doc)).stdout
    out_all = run_cli("show", "--all", p).stdout
    rows = {ln.split()[0]: ln.split()[1:] for ln in out_all.splitlines() if ln.strip()}
    assert rows["failures"] == ["0"] and rows["leaks"] == ["0"] and rows["solves"] == ["0"]
    assert "--all shows" not in out_all


def test_show_json_carries_the_dump_figures(tmp_path):
    doc = make_doc()
    r = run_cli("show", "--json", write(tmp_path, "a.json", doc))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    h = s["allocators"]["host"]
    assert h["allocated"] == {"current": MIB, "peak": 4 * MIB}
    assert h["reserved"] == {"current": 2 * MIB, "peak": 5 * MIB}
    assert h["num_ooms"] == 1 and h["num_device_alloc"] == 3
    assert h["fragmentation"] == {"peak": 0.2, "free": 0.25}
    assert h["tags"]["activation"]["peak_count"] == 6
    assert s["store"] == {"tensors_in": 10, "bytes_in": 40 * MIB, "bytes_stored": 5 * MIB, "ratio": 8.0}


def test_show_accepts_a_dump_with_only_allocators_and_derives_a_missing_ratio(tmp_path):
    doc = {"schema_version": 1, "allocators": {"cuda:0": {"allocated_bytes.all.current": 0}}}
    r = run_cli("show", write(tmp_path, "a.json", doc))
    assert r.returncode == 0, r.stderr
    assert "allocator cuda:0" in r.stdout and "store" not in r.stdout
    doc["store"] = {"bytes_in": 300, "bytes_stored": 100}
    r = run_cli("show", "--json", write(tmp_path, "b.json", doc))
    assert json.loads(r.stdout)["store"]["ratio"] == 3.0
    doc["allocators"]["cuda:0"]["backend"] = {"name": "cuda", "kind": 1, "free_bytes": 5, "total_bytes": 9}
    r = run_cli("show", write(tmp_path, "d.json", doc))
    assert "allocator cuda:0 (backend cuda)" in r.stdout
    # top-level keys outside the documented sections (a later timeline, say) are tolerated
    doc["timeline"] = [{"action": "alloc", "size": 512}]
    doc["hostname"] = "node1"
    r = run_cli("show", write(tmp_path, "e.json", doc))
    assert r.returncode == 0, r.stderr
    r = run_cli("show", write(tmp_path, "c.json", {"schema_version": 1, "allocators": {}}))
    assert r.returncode == 0 and "no allocators" in r.stdout


# ---------------------------------------------------------------------------
# diff


def test_diff_reports_signed_deltas_and_ratios_of_changed_figures(tmp_path):
    a = make_doc()
    b = copy.deepcopy(a)
    hb = b["allocators"]["host"]
    hb["allocated_bytes.all.current"] = 3 * MIB          # +2 MiB, x3
    hb["reserved_bytes.all.current"] = 1 * MIB           # -1 MiB, x0.5
    hb["num_ooms"] = 4
    hb["tags"]["activation"]["total_allocs"] = 25
    b["store"]["bytes_stored"] = 4 * MIB
    pa, pb = write(tmp_path, "a.json", a), write(tmp_path, "b.json", b)

    r = run_cli("diff", pa, pb, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    ch = {tuple(c["key"]): c for c in d["changes"]}
    assert set(ch) == {
        ("allocators", "host", "allocated_bytes.all.current"),
        ("allocators", "host", "reserved_bytes.all.current"),
        ("allocators", "host", "num_ooms"),
        ("allocators", "host", "tags", "activation", "total_allocs"),
        ("store", "bytes_stored"),
    }
    for c in d["changes"]:
        assert c["delta"] == c["b"] - c["a"]
        assert c["ratio"] == pytest.approx(c["b"] / c["a"])
    assert ch[("allocators", "host", "reserved_bytes.all.current")]["delta"] == -MIB
    assert ch[("allocators", "host", "num_ooms")]["bytes"] is False

    r = run_cli("diff", pa, pb)
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "+2.00 MiB" in rows["allocated_bytes.all.current"] and "x3" in rows["allocated_bytes.all.current"]
    assert "-1.00 MiB" in rows["reserved_bytes.all.current"] and "x0.5" in rows["reserved_bytes.all.current"]
    assert "+3" in rows["num_ooms"]
    assert "+15" in rows["tags.activation.total_allocs"]
    assert "-1.00 MiB" in rows["bytes_stored"]


def test_diff_of_identical_dumps_and_of_disjoint_allocators(tmp_path):
    a = make_doc()
    pa = write(tmp_path, "a.json", a)
    r = run_cli("diff", pa, pa)
    assert r.returncode == 0 and "no figure changed" in r.stdout
    d = json.loads(run_cli("diff", pa, pa, "--json", "--all").stdout)
    assert d["changes"] and all(c["delta"] == 0 for c in d["changes"])

    b = copy.deepcopy(a)
    b["allocators"]["pinned"] = {"allocated_bytes.all.current": 7}
    del b["store"]
    d = json.loads(run_cli("diff", pa, write(tmp_path, "b.json", b), "--json").stdout)
    assert d["only_in_b"] == ["allocators.pinned"]
    assert d["only_in_a"] == ["store"]
    new = [c for c in d["changes"] if c["key"][:2] == ["allocators", "pinned"]]
    assert new == [{"key": ["allocators", "pinned", "allocated_bytes.all.current"], "a": None, "b": 7,
                    "delta": None, "ratio": None, "bytes": True}]


# ---------------------------------------------------------------------------
# malformed input: exit status 2, one line, no traceback

VALID = json.dumps(make_doc())


def _mutate(fn):
    d = make_doc()
    fn(d)
    return json.dumps(d)


MALFORMED = {
    "empty": ("", "empty"),
    "not-json": ("schema_version = 1\n", "not valid JSON"),
    "binary": (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8"),
    "top-level-list": ("[1, 2]", "top level is a JSON list"),
    "no-schema": (json.dumps({"allocators": {}}), "no schema_version"),
    "future-schema": (_mutate(lambda d: d.update(schema_version=3)), "schema_version 3"),
    "string-schema": (_mutate(lambda d: d.update(schema_version="1")), "expected an integer"),
    "no-allocators": (_mutate(lambda d: d.pop("allocators")), '"allocators" is missing'),
    "allocators-list": (_mutate(lambda d: d.update(allocators=[])), '"allocators" is a JSON list'),
    "allocator-number": (_mutate(lambda d: d["allocators"].update(host=3)), "allocator 'host'"),
    "figure-string": (_mutate(lambda d: d["allocators"]["host"].update({"num_ooms": "many"})),
                      "allocators.host.num_ooms"),
    "figure-bool": (_mutate(lambda d: d["allocators"]["host"].update({"segment.all.peak": True})),
                    "allocators.host.segment.all.peak"),
    "tags-list": (_mutate(lambda d: d["allocators"]["host"].update(tags=[1])), "allocators.host.tags"),
    "tag-figure-string": (_mutate(lambda d: d["allocators"]["host"]["tags"]["weight"].update(peak_bytes="x")),
                          "tags.weight.peak_bytes"),
    "fragmentation-string": (_mutate(lambda d: d["allocators"]["host"]["fragmentation"].update(peak="high")),
                             "fragmentation.peak"),
    "store-ratio-string": (_mutate(lambda d: d["store"].update(ratio="8x")), "store.ratio"),
    "section-list": (_mutate(lambda d: d.update(swap=[1, 2])), "section 'swap'"),
    "nan": (VALID.replace('"ratio": 8.0', '"ratio": NaN'), "NaN"),
    "infinite": ('{"schema_version": 1, "allocators": {"h": {"num_ooms": 1e999}}}', "not a finite number"),
    "trailing-garbage": (VALID + "}", "not valid JSON"),
    "deep-nesting": ("[" * 100000 + "]" * 100000, ""),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_dump_is_one_line_error_with_status_2(tmp_path, case):
    content, fragment = MALFORMED[case]
    p = tmp_path / "bad.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    assert_clean_error(run_cli("show", "--json", p), fragment)
    # the second side of a diff (the first is read by the same code as `show`)
    assert_clean_error(run_cli("diff", write(tmp_path, "good.json", make_doc()), p), fragment)


@pytest.mark.parametrize("cut", [1, 17, 250, len(VALID) // 2, len(VALID) - 1])
def test_truncated_dump_is_reported_as_truncated(tmp_path, cut):
    p = write(tmp_path, "cut.json", VALID[:cut])
    assert_clean_error(run_cli("show", p), "truncated")


def test_missing_file_directory_and_bad_usage(tmp_path):
    assert_clean_error(run_cli("show", tmp_path / "nope.json"), "cannot read", "nope.json")
    assert_clean_error(run_cli("show", tmp_path), "cannot read")
    r = run_cli("frobnicate")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run_cli("diff", write(tmp_path, "a.json", make_doc()))
    assert r.returncode == 2 and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------
# real dumps


def _bench_alloc():
    """The gact-bench-alloc executable of the build this test runs in, if any."""
    cand = [os.environ.get("GACT_BENCH_ALLOC", "")]
    cand += [os.path.join(ROOT, d, "tools", "gact-bench-alloc") for d in ("build", "build-bench")]
    for c in cand:
        if c and os.access(c, os.X_OK):
            return c
    return None


def _check_real_dump(tmp_path, path):
    r = run_cli("show", path)
    assert r.returncode == 0, r.stderr
    s = json.loads(run_cli("show", "--json", path).stdout)
    assert s["allocators"], "a real dump has at least one allocator"
    for name, a in s["allocators"].items():
        assert name in r.stdout
        for fig in ("allocated", "reserved"):
            assert a[fig]["current"] is not None and a[fig]["peak"] >= a[fig]["current"] >= 0
        assert a["reserved"]["peak"] >= a["allocated"]["peak"]
    d = json.loads(run_cli("diff", path, path, "--json").stdout)
    assert d["changes"] == []
    return s


def test_real_dump_from_the_caching_allocator(tmp_path):
    exe = _bench_alloc()
    if exe is None:
        pytest.skip("gact-bench-alloc is not built (set GACT_BENCH_ALLOC or build tools/ in build/)")
    out = tmp_path / "bench.json"
    r = subprocess.run([exe, "--quick", "--only", "random", "--ops", "4000", "--stats-out", str(out)], capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 3:
        pytest.skip("gact-bench-alloc was built without the caching allocator: " + r.stderr.strip())
    assert r.returncode == 0, r.stderr
    s = _check_real_dump(tmp_path, out)
    doc = json.loads(out.read_text())
    a = doc["allocators"][next(iter(doc["allocators"]))]
    # everything was freed at the end of the workload, so nothing is allocated
    assert a["allocated_bytes.all.current"] == 0
    assert a["allocation.all.peak"] > 0
    assert s["allocators"][next(iter(s["allocators"]))]["allocated"]["peak"] > 0


def test_real_dump_from_the_python_package(tmp_path):
    try:
        import gact
        import torch
    except ImportError as exc:
        pytest.skip("the gact Python package is not importable here: %s" % exc)
    if not callable(getattr(gact, "stats", None)) or not hasattr(gact, "Compressor"):
        pytest.skip("the gact package has no module-level stats() or Compressor yet")

    def dump(name):
        doc = gact.stats()
        return write(tmp_path, name, json.loads(doc) if isinstance(doc, str) else doc)

    before = dump("before.json")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    comp = gact.Compressor(model, bits=4)
    try:
        with comp:
            loss = model(torch.randn(64, 256)).square().mean()
        loss.backward()
        comp.step()
        after = dump("after.json")
    finally:
        comp.close()
    _check_real_dump(tmp_path, before)
    s = _check_real_dump(tmp_path, after)
    assert "store" in s and s["store"]["bytes_in"] > 0
    d = json.loads(run_cli("diff", before, after, "--json").stdout)
    grew = {tuple(c["key"]): c for c in d["changes"]}
    assert ("store", "bytes_in") in grew and grew[("store", "bytes_in")]["delta"] > 0


def test_cli_uses_only_the_standard_library():
    """gact-stats must run on a machine without torch or numpy: import it with a bare path."""
    code = ("import sys, importlib.util, importlib.machinery;"
            "sys.path=[p for p in sys.path if 'site-packages' not in p and 'dist-packages' not in p];"
            "l=importlib.machinery.SourceFileLoader('gs', %r);"
            "s=importlib.util.spec_from_loader('gs', l); m=importlib.util.module_from_spec(s); l.exec_module(m);"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch','numpy')))" % CLI)
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_cli_is_executable_with_the_system_interpreter():
    assert os.access(CLI, os.X_OK)
    with open(CLI) as f:
        assert f.readline().strip() == "#!/usr/bin/python3"
