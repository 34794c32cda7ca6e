"""gact-stats on hostile and large input, and its merged view (issue 15).

A 10**400 integer is a one-line error (it was a traceback); control characters in
names come out escaped (they reached the terminal raw); `plot` draws a bounded number
of points and markers however many events (100k events took 39 s and 1 GB); the
policy's group size is shown in elements (it was shown as bytes); several per-process
dumps merge into one document (`merge`, `show A B`).
"""

import copy
import importlib.machinery
import importlib.util
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "tools", "gact-stats")
MIB = 1 << 20


def run_cli(*args):
    return subprocess.run(["/usr/bin/python3", CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def load_cli():
    loader = importlib.machinery.SourceFileLoader("gact_stats_hardening", CLI)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("gact_stats_hardening", loader))
    loader.exec_module(mod)
    return mod


def doc(pid=4242, tensors=10, bytes_in=40 * MIB, bytes_stored=5 * MIB, steps=3, alloc_name="host"):
    return {
        "schema_version": 2, "gact_version": "0.1.0", "pid": pid, "time_unix_ms": 1767225600000,
        "allocators": {alloc_name: {"allocated_bytes.all.current": MIB, "allocated_bytes.all.peak": 4 * MIB,
                                    "reserved_bytes.all.current": 2 * MIB, "reserved_bytes.all.peak": 5 * MIB,
                                    "tags": {"activation": {"current_bytes": MIB, "peak_bytes": 3 * MIB}}}},
        "store": {"tensors_in": tensors, "bytes_in": bytes_in, "bytes_stored": bytes_stored,
                  "ratio": bytes_in / bytes_stored, "steps": steps, "step": steps - 1,
                  "quant_bits": {"4": tensors}, "skipped": {"small": {"tensors": 1, "bytes": 100}}},
        "codecs": {"cpu_executor_isa": "avx2", "quant": {"encodes": tensors}},
        "policy": {"group_size": 256, "budget_avg_bits": 2.0, "tensors": {"fc:0": {"bits": 2, "numel": 4096}}},
    }


def write(tmp_path, name, d):
    p = tmp_path / name
    p.write_text(d if isinstance(d, str) else json.dumps(d))
    return p


def one_line_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gact-stats: "), r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.parametrize("where", ["store", "allocator", "header", "event"])
def test_an_integer_beyond_64_bits_is_a_one_line_error(tmp_path, where):
    d = doc()
    huge = 10 ** 400
    if where == "store":
        d["store"]["bytes_in"] = huge
    elif where == "allocator":
        d["allocators"]["host"]["allocated_bytes.all.peak"] = huge
    elif where == "header":
        d["time_unix_ms"] = huge
    else:
        d["timeline"] = {"capacity": 1, "dropped": 0, "events": [
            {"t_ns": huge, "seq": 0, "action": "step", "addr": 0, "size": 0, "stream": 0, "tag": "other",
             "source": "host"}]}
    p = write(tmp_path, "huge.json", d)
    for cmd in (["show", p], ["summary", p], ["plot", p, "-o", tmp_path / "x.png"]):
        one_line_error(run_cli(*cmd), "64")


def test_control_characters_in_names_are_escaped(tmp_path):
    d = doc(alloc_name="\x1b[31mred\x1b[0m")
    d["allocators"]["\x1b[31mred\x1b[0m"]["tags"]["\x1b]0;title\x07evil\ninjected"] = {"current_bytes": 1}
    d["store"]["\x9b2J"] = 1
    p = write(tmp_path, "esc.json", d)
    d["allocators"]["\x1b[31mred\x1b[0m"]["allocated_bytes.all.peak"] += 512
    changed = write(tmp_path, "esc2.json", d)
    for cmd in (["show", p], ["summary", p], ["diff", p, changed]):
        r = run_cli(*cmd)
        assert r.returncode == 0, r.stderr
        for raw in ("\x1b", "\x07", "\x9b"):
            assert raw not in r.stdout, (cmd, r.stdout)
        assert "\\x1b[31mred" in r.stdout
    r = run_cli("show", p)
    assert not any(ln.startswith("injected") for ln in r.stdout.splitlines()), "a newline in a name split a line"
    d2 = doc()
    d2["store"]["ratio"] = "\x1b[2J"  # a bad value: its repr in the error is escaped too
    r = run_cli("show", write(tmp_path, "bad.json", d2))
    assert r.returncode == 2 and "\x1b" not in r.stderr


def test_show_prints_the_policy_group_size_in_elements(tmp_path):
    r = run_cli("show", write(tmp_path, "p.json", doc()))
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("group_size")]
    assert line.split() == ["group_size", "256"], line


def big_timeline(n_events, step_every):
    events, seq, t, live, addr = [], 0, 0, [], 1 << 20
    for i in range(n_events):
        t += 1000 + (i * 7919) % 3000
        e = {"t_ns": t, "seq": seq, "addr": 0, "size": 0, "stream": 0, "tag": "activation", "source": "host"}
        if i % step_every == 0:
            e.update(action="step", step=i // step_every)
        elif i % 5 in (1, 2) or not live:
            addr += 4096
            size = 4096 * (1 + i % 7)
            live.append((addr, size))
            e.update(action="alloc", addr=addr, size=size, requested=size)
        elif i % 5 == 3:
            e.update(action="store_put", size=100, key=1, bits=4, fp32_bytes=800)
        else:
            a, size = live.pop()
            e.update(action="free", addr=a, size=size)
        events.append(e)
        seq += 1
    cur = sum(size for _, size in live)
    d = doc()
    d["allocators"]["host"]["tags"] = {"activation": {"current_bytes": cur}}
    d["store"]["bytes_stored_current"] = 0
    d["timeline"] = {"capacity": n_events, "recorded": n_events, "dropped": 0, "events": events}
    return d


def test_plot_draws_a_bounded_number_of_points_keeping_the_peak(tmp_path):
    gs = load_cli()
    d = big_timeline(60_000, step_every=10)
    tl = gs.load_timeline(d, "big.json")
    s = gs.Series(d, tl)
    t, by_tag, reserved, stored, fp32 = s.decimated(1400)
    assert len(t) <= 6 * 1400 < len(s.t)
    assert all(len(v) == len(t) for v in list(by_tag.values()) + [reserved, stored, fp32])
    assert max(by_tag["activation"]) == max(s.by_tag["activation"]), "the peak was dropped"
    assert t[-1] == s.t[-1] and by_tag["activation"][-1] == s.by_tag["activation"][-1]
    assert t == sorted(t)
    steps = [x for x, _ in s.steps]
    assert len(steps) == 6000
    assert len(gs._one_per_pixel(steps, t[-1], 1400)) <= 1401
    out = tmp_path / "big.png"
    r = run_cli("plot", write(tmp_path, "big.json", d), "-o", out, "--size", "800x500")
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 5000
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_merge_and_show_of_per_process_dumps(tmp_path):
    a = write(tmp_path, "stats.rank0.json", doc(pid=10, tensors=10, bytes_in=40 * MIB, bytes_stored=5 * MIB, steps=3))
    b = write(tmp_path, "stats.rank1.json", doc(pid=11, tensors=6, bytes_in=24 * MIB, bytes_stored=3 * MIB, steps=3))
    c = write(tmp_path, "stats.pid12.json", doc(pid=12, tensors=0, bytes_in=0, bytes_stored=1, steps=0))
    out = tmp_path / "stats.json"
    r = run_cli("merge", c, a, b, "-o", out)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["merged"]["labels"] == ["rank0", "rank1", "pid12"]
    assert m["store"]["tensors_in"] == 16 and m["store"]["bytes_in"] == 64 * MIB
    assert m["store"]["steps"] == 3 and m["store"]["step"] == 2
    assert m["store"]["ratio"] == pytest.approx(64 * MIB / (8 * MIB + 1))
    assert m["store"]["quant_bits"]["4"] == 16 and m["store"]["skipped"]["small"]["tensors"] == 3
    assert m["codecs"]["cpu_executor_isa"] == "avx2" and m["codecs"]["quant"]["encodes"] == 16
    assert set(m["allocators"]) == {"rank0/host", "rank1/host", "pid12/host"}
    assert m["processes"]["rank1"]["pid"] == 11 and m["processes"]["rank1"]["policy"]["group_size"] == 256
    assert "policy" not in m  # per process only: summing bit choices means nothing

    r = run_cli("show", out)
    assert r.returncode == 0, r.stderr
    assert "merged from 3 processes" in r.stdout.splitlines()[0]
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.strip().startswith(("rank", "pid"))}
    assert rows["rank0"][1:3] == ["10", "10"] and rows["pid12"][2] == "0"
    direct = run_cli("show", a, b, c)
    assert direct.returncode == 0 and "merged from 3 processes" in direct.stdout
    js = json.loads(run_cli("show", "--json", a, b).stdout)
    assert js["store"]["tensors_in"] == 16

    bad = copy.deepcopy(doc())
    bad["schema_version"] = 99
    one_line_error(run_cli("merge", a, write(tmp_path, "stats.rank2.json", bad), "-o", out), "schema_version 99")


def test_merged_stats_keep_the_timeline_and_one_process_sections(tmp_path):
    """Issue 32: a merged file had no timeline, policy or run: `plot` said "has no timeline" and
    `export-torch` wrote 0 entries. The first process with a timeline puts it on top (the others keep theirs
    per process); one process also puts its run and policy there."""
    tl = big_timeline(400, step_every=20)
    a = write(tmp_path, "stats.rank0.json", doc(pid=10))
    b_doc = copy.deepcopy(tl)
    b_doc["pid"] = 11
    b = write(tmp_path, "stats.rank1.json", b_doc)
    c_doc = copy.deepcopy(tl)
    c_doc["pid"] = 12
    c = write(tmp_path, "stats.rank2.json", c_doc)
    out = tmp_path / "stats.json"
    assert run_cli("merge", a, b, c, "-o", out).returncode == 0
    m = json.loads(out.read_text())
    assert m["timeline"] == tl["timeline"] and m["merged"]["sections_from"]["timeline"] == "rank1"
    assert "timeline" not in m["processes"]["rank1"] and m["processes"]["rank2"]["timeline"] == tl["timeline"]
    assert "policy" not in m and m["processes"]["rank0"]["policy"]["group_size"] == 256
    png = tmp_path / "m.png"
    r = run_cli("plot", out, "-o", png)
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 1000
    trace = tmp_path / "m.pickle"
    r = run_cli("export-torch", out, "-o", trace)
    assert r.returncode == 0, r.stderr
    import pickle
    with open(trace, "rb") as f:
        snap = pickle.load(f)
    assert sum(len(t) for t in snap["device_traces"]) > 100  # the timeline's entries, not an empty trace

    one = tmp_path / "one.json"
    d = copy.deepcopy(tl)
    d["run"] = {"compressed": True, "pid": 13}
    assert run_cli("merge", write(tmp_path, "one.pid13.json", d), "-o", one).returncode == 0
    m1 = json.loads(one.read_text())
    assert m1["run"]["compressed"] is True and m1["policy"]["group_size"] == 256 and "timeline" in m1
    assert "merged from 1 process," in run_cli("show", one).stdout.splitlines()[0]

    # A spawned job: the launcher's timeline is empty and comes first in label order; the worker's, with its
    # events, is the one on top (plot had drawn nothing, export-torch written 0 entries)
    empty = copy.deepcopy(tl)
    empty["pid"] = 5
    empty["timeline"]["events"] = []
    sp = tmp_path / "spawn.json"
    assert run_cli("merge", write(tmp_path, "spawn.pid5.json", empty), write(tmp_path, "spawn.pid6.json", c_doc),
                   "-o", sp).returncode == 0
    ms = json.loads(sp.read_text())
    assert ms["merged"]["sections_from"]["timeline"] == "pid6" and len(ms["timeline"]["events"]) > 100
    assert ms["processes"]["pid5"]["timeline"]["events"] == []
    r = run_cli("plot", sp, "-o", tmp_path / "sp.png")
    assert r.returncode == 0, r.stderr


def test_diff_pairs_allocators_by_role_and_device_not_pid(tmp_path):
    """Issue 32: `diff` of two gact-run outputs listed every allocator and process as "only in A / only in
    B" (keyed by pid) before the store section."""
    outs = []
    for pid, stored in ((101, 5 * MIB), (202, 4 * MIB)):
        src = write(tmp_path, f"s{pid}.pid{pid}.json", doc(pid=pid, bytes_stored=stored))
        out = tmp_path / f"s{pid}.json"
        assert run_cli("merge", src, "-o", out).returncode == 0
        outs.append(out)
    r = run_cli("diff", *outs)
    assert r.returncode == 0, r.stderr
    assert "only in" not in r.stdout, r.stdout
    assert "bytes_stored" in r.stdout and "pid" not in r.stdout.replace("gact stats diff", ""), r.stdout
    # a merged single process against a plain dump: the host allocator pairs with the dump's
    r = run_cli("diff", outs[0], write(tmp_path, "plain.json", doc(pid=303, bytes_stored=3 * MIB)))
    assert r.returncode == 0 and "allocators.host" not in r.stdout.split("\n")[1], r.stdout
