"""Tests of the event timeline and of the gact-stats commands that render it
(plot, summary, export-torch), and of the progress helper tools/gact_progress.py.

The real dump comes from a small training run with the Python package in a
subprocess (so that tracing, which is process-wide, stays out of the other
suites): an MLP trained for three steps under gact.Compressor with gact.trace()
on, then gact.dump_stats(). Its timeline is checked against the dump's own
counters; the PNG is checked for its size and for real content; the pickle for
the structure memory_viz reads (segments with blocks and states, device traces
with actions). Malformed dumps must give one line on stderr and status 2.
"""

import copy
import importlib.machinery
import importlib.util
import io
import json
import os
import pickle
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, "tools", "gact-stats")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gact_progress  # noqa: E402

TRAIN = r"""
import sys, torch, gact
gact.trace(200000, snapshot_every=1)
torch.manual_seed(0)
torch.set_num_threads(2)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                            torch.nn.GELU(), torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
comp = gact.Compressor(model, bits=4)
for step in range(3):
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    with comp:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step(); opt.zero_grad()
    comp.step()
gact.dump_stats(sys.argv[1])
"""

STATES = {"active_allocated", "active_pending_free", "inactive"}
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot"}


def run_cli(*args):
    return subprocess.run(["/usr/bin/python3", CLI, *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def assert_clean_error(r, fragment):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gact-stats: "), r.stderr
    assert "Traceback" not in r.stderr
    assert fragment in lines[0], (fragment, lines[0])


def _train_dump(tmp_path_factory, **env):
    path = tmp_path_factory.mktemp("trace") / "train.json"
    r = subprocess.run(["/usr/bin/python3", "-c", TRAIN, str(path)], capture_output=True, text=True,
                       env=dict(os.environ, **env), timeout=300)
    assert r.returncode == 0, r.stderr
    return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def real_dump(tmp_path_factory):
    """A training run's dump with the defaults: torch's CPU tensors in the host arena too."""
    return _train_dump(tmp_path_factory)


@pytest.fixture(scope="module")
def gact_only_dump(tmp_path_factory):
    """The same run with torch's tensors left to torch's allocator: the arena holds gact's memory only."""
    return _train_dump(tmp_path_factory, GACT_CPU_ALLOCATOR="0")


def test_dump_with_timeline_loads_back_and_agrees_with_the_counters(real_dump):
    _, doc = real_dump
    assert doc["schema_version"] == 2
    tl = doc["timeline"]
    assert tl["capacity"] == 200000 and tl["dropped"] == 0
    events = tl["events"]
    assert tl["recorded"] == len(events) > 0
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert all(b["t_ns"] >= a["t_ns"] for a, b in zip(events, events[1:]))
    # Per allocator and tag, allocations minus frees equal the tag's current bytes; the
    # number of alloc events equals the allocator's accumulated allocation count.
    for name, a in doc["allocators"].items():
        mine = [e for e in events if e["source"] == name]
        for tag, t in a.get("tags", {}).items():
            level = sum(e["size"] if e["action"] == "alloc" else -e["size"]
                        for e in mine if e["tag"] == tag and e["action"] in ("alloc", "free"))
            assert level == t["current_bytes"], (name, tag)
        assert sum(e["action"] == "alloc" for e in mine) == a["allocation.all.allocated"]
        seg = sum(e["size"] if e["action"] == "segment_alloc" else -e["size"]
                  for e in mine if e["action"] in ("segment_alloc", "segment_free"))
        assert seg == a["reserved_bytes.all.current"]
        listed = sum(s["total_size"] for s in a["segments"])
        assert listed == a["reserved_bytes.all.current"]
    # The store: puts minus releases equal the bytes stored now; one put per tensor stored, and a
    # release + put pair per upgrade (a ReLU's mask replaced by the boundary blob that serves it too).
    store = doc["store"]
    puts = [e for e in events if e["action"] == "store_put"]
    assert len(puts) == store["tensors_in"] + store["upgrades"] > 0
    assert sum(e["size"] for e in puts) >= store["bytes_stored"]
    held = sum(e["size"] * (1 if e["action"] == "store_put" else -1)
               for e in events if e["action"] in ("store_put", "store_release"))
    assert held == store["bytes_stored_current"]
    assert all(e["bits"] == 4 and e["fp32_bytes"] >= 4 * e["size"] for e in puts if e["bits"] == 4)
    assert sum(e["action"] == "store_get" for e in events) == store["decodes"]  # a live image is not decoded again
    assert sum(e["action"] == "step" for e in events) == 3
    assert len(doc["snapshots"]) == 3
    assert all("store" in s and s["allocators"] for s in doc["snapshots"])


def test_summary_shows_pools_tags_fragmentation_and_ratio(real_dump):
    path, doc = real_dump
    r = run_cli("summary", path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("Allocated memory", "Reserved memory", "Non-releasable memory", "from small pool",
                   "fragmentation at peak", "by tag", "activation", "compression ratio", "timeline:"):
        assert needle in out, needle
    assert "x%.2f" % doc["store"]["ratio"] in out


def test_plot_writes_a_png_of_the_requested_size_with_content(gact_only_dump, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np
    path, _ = gact_only_dump
    out = tmp_path / "memory.png"
    r = run_cli("plot", path, "-o", out, "--size", "1000x700")
    assert r.returncode == 0, r.stderr
    assert "activation" in r.stdout
    img = mpimg.imread(str(out))
    assert img.shape[:2] == (700, 1000)
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 50  # areas, lines, text: far from a blank image
    # the activation area's colour (#55a868) covers a visible part of the picture (gact's memory only)
    green = np.all(np.abs(rgb.astype(int) - [0x55, 0xa8, 0x68]) < 40, axis=1).mean()
    assert green > 0.005


def _structural_check(snap):
    assert set(snap) >= {"segments", "device_traces"}
    for s in snap["segments"]:
        for k in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                  "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"):
            assert k in s, k
        assert s["segment_type"] in ("small", "large")
        addr, total = s["address"], 0
        for b in s["blocks"]:
            assert set(b) >= {"address", "size", "requested_size", "state", "frames"}
            assert b["state"] in STATES
            assert b["address"] == addr  # blocks tile the segment in address order
            addr += b["size"]
            total += b["size"]
        assert total == s["total_size"]
        assert s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert isinstance(snap["device_traces"], list)
    for trace in snap["device_traces"]:
        for e in trace:
            assert e["action"] in ACTIONS
            for k in ("addr", "size", "stream", "frames", "time_us"):
                assert k in e, k


def test_export_torch_unpickles_to_the_memory_viz_schema(real_dump, tmp_path):
    path, doc = real_dump
    out = tmp_path / "snapshot.pickle"
    r = run_cli("export-torch", path, "-o", out)
    assert r.returncode == 0, r.stderr
    with open(out, "rb") as f:
        snap = pickle.load(f)
    _structural_check(snap)
    allocated = sum(a["allocated_bytes.all.current"] for a in doc["allocators"].values())
    assert sum(s["allocated_size"] for s in snap["segments"]) == allocated
    reserved = sum(a["reserved_bytes.all.current"] for a in doc["allocators"].values())
    assert sum(s["total_size"] for s in snap["segments"]) == reserved
    actions = [e["action"] for t in snap["device_traces"] for e in t]
    n_alloc = sum(e["action"] == "alloc" for e in doc["timeline"]["events"])
    n_free = sum(e["action"] == "free" for e in doc["timeline"]["events"])
    assert actions.count("alloc") == n_alloc > 0
    assert actions.count("free_requested") == actions.count("free_completed") == n_free


def test_export_torch_rebuilds_segments_from_the_timeline_alone(real_dump, tmp_path):
    """Without the segment listing, the segments come from the events; with nothing dropped
    they must match the allocator's own listing."""
    path, doc = real_dump
    r = run_cli("export-torch", path, "-o", tmp_path / "a.pickle")
    assert r.returncode == 0, r.stderr
    stripped = copy.deepcopy(doc)
    for a in stripped["allocators"].values():
        a.pop("segments", None)
    p2 = tmp_path / "stripped.json"
    p2.write_text(json.dumps(stripped))
    r = run_cli("export-torch", p2, "-o", tmp_path / "b.pickle")
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "a.pickle", "rb") as f:
        a = pickle.load(f)
    with open(tmp_path / "b.pickle", "rb") as f:
        b = pickle.load(f)
    _structural_check(b)

    def shape(snap):
        return sorted((s["address"], s["total_size"],
                       tuple((x["address"], x["size"], x["state"]) for x in s["blocks"] if x["state"] != "inactive"))
                      for s in snap["segments"])

    assert shape(a) == shape(b)
    assert any(s["blocks"] for s in a["segments"])


def _good_doc():
    return {
        "schema_version": 2, "allocators": {"host": {"allocated_bytes.all.current": 1024,
                                                     "reserved_bytes.all.current": 2 << 20,
                                                     "tags": {"activation": {"current_bytes": 1024}}}},
        "timeline": {"capacity": 16, "recorded": 2, "dropped": 0, "events": [
            {"t_ns": 10, "seq": 0, "action": "segment_alloc", "addr": 4096, "size": 2 << 20, "stream": 0,
             "tag": "other", "source": "host"},
            {"t_ns": 20, "seq": 1, "action": "alloc", "addr": 4096, "size": 1024, "stream": 0,
             "tag": "activation", "source": "host", "requested": 1000}]},
        "snapshots": [],
    }


def _mut(fn):
    d = _good_doc()
    fn(d)
    return json.dumps(d)


MALFORMED = {
    "truncated": (json.dumps(_good_doc())[:-40], "truncated"),
    "timeline-list": (_mut(lambda d: d.update(timeline=[])), "timeline is a JSON list"),
    "events-missing": (_mut(lambda d: d["timeline"].pop("events")), "events is missing"),
    "bad-action": (_mut(lambda d: d["timeline"]["events"][1].update(action="malloc")), "action is 'malloc'"),
    "negative-size": (_mut(lambda d: d["timeline"]["events"][1].update(size=-5)), "size is -5"),
    "string-addr": (_mut(lambda d: d["timeline"]["events"][0].update(addr="0x10")), "addr is '0x10'"),
    "out-of-order": (_mut(lambda d: d["timeline"]["events"][1].update(seq=0)), "out of order"),
    "event-not-object": (_mut(lambda d: d["timeline"]["events"].append(3)), "events[2] is a JSON int"),
    "no-capacity": (_mut(lambda d: d["timeline"].pop("capacity")), "capacity is missing"),
    "snapshots-object": (_mut(lambda d: d.update(snapshots={})), "snapshots is not an array"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("cmd", ["plot", "summary", "export-torch"])
def test_malformed_timeline_is_one_line_error_with_status_2(tmp_path, case, cmd):
    content, fragment = MALFORMED[case]
    p = tmp_path / "bad.json"
    p.write_text(content)
    args = [cmd, p] + (["-o", tmp_path / "out"] if cmd != "summary" else [])
    assert_clean_error(run_cli(*args), fragment)
    assert not (tmp_path / "out").exists()


def test_plot_and_export_need_a_timeline(tmp_path):
    d = _good_doc()
    del d["timeline"]
    p = tmp_path / "no-timeline.json"
    p.write_text(json.dumps(d))
    assert_clean_error(run_cli("plot", p, "-o", tmp_path / "m.png"), "GACT_TRACE")
    assert_clean_error(run_cli("export-torch", p, "-o", tmp_path / "s.pickle"), "GACT_TRACE")
    r = run_cli("summary", p)  # a summary needs no timeline
    assert r.returncode == 0 and "Allocated memory" in r.stdout
    d = _good_doc()
    d["timeline"]["events"] = []
    p.write_text(json.dumps(d))
    assert_clean_error(run_cli("plot", p, "-o", tmp_path / "m.png"), "no events")
    assert_clean_error(run_cli("plot", tmp_path / "missing.json", "-o", tmp_path / "m.png"), "cannot read")
    r = run_cli("plot", p, "-o", tmp_path / "m.png", "--size", "12x12")
    assert r.returncode == 2 and "--size" in r.stderr and "Traceback" not in r.stderr


def test_hand_made_timeline_levels_are_anchored_on_the_final_counters(tmp_path):
    """With the oldest events dropped, the curves start at final - sum(kept changes)."""
    d = _good_doc()
    d["timeline"]["dropped"] = 7
    d["allocators"]["host"]["tags"]["activation"]["current_bytes"] = 5120  # 4096 from dropped events
    p = tmp_path / "d.json"
    p.write_text(json.dumps(d))
    loader = importlib.machinery.SourceFileLoader("gact_stats_cli", CLI)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("gact_stats_cli", loader))
    loader.exec_module(mod)
    doc = mod.load_dump(str(p))
    s = mod.Series(doc, mod.load_timeline(doc, str(p)))
    # one level per event, plus the final level repeated a little after the last event
    assert s.by_tag["activation"] == [4096, 5120, 5120]
    assert s.reserved == [2 << 20] * 3  # the segment_alloc is the only change: started at 0
    r = run_cli("plot", p, "-o", tmp_path / "m.png")
    assert r.returncode == 0, r.stderr


def test_segments_from_the_timeline_fixed_ones_stay_apart_expandable_pages_join_into_runs():
    """Two fixed segments that happen to lie side by side stay two; an expandable allocator's pages, mapped in
    pieces and unmapped in the middle, form runs that its blocks tile."""
    loader = importlib.machinery.SourceFileLoader("gact_stats_cli", CLI)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("gact_stats_cli", loader))
    loader.exec_module(mod)
    M = 1 << 20

    def ev(action, src, addr, size, stream=0):
        return {"action": action, "source": src, "addr": addr, "size": size, "stream": stream, "tag": "other",
                "requested": size}

    events = [ev("segment_alloc", "fixed", 0, 2 * M), ev("segment_alloc", "fixed", 2 * M, 2 * M),
              ev("alloc", "fixed", 0, M), ev("alloc", "fixed", 2 * M, 2 * M),
              ev("segment_alloc", "exp", 100 * M, 4 * M), ev("segment_alloc", "exp", 104 * M, 4 * M),
              ev("alloc", "exp", 100 * M, 6 * M), ev("segment_alloc", "exp", 108 * M, 4 * M),
              ev("segment_free", "exp", 108 * M, 2 * M)]
    out = mod._segments_from_timeline(events, {"exp"})
    assert [(s["address"], s["total_size"]) for s in out["fixed"]] == [(0, 2 * M), (2 * M, 2 * M)]
    assert [(s["address"], s["total_size"]) for s in out["exp"]] == [(100 * M, 8 * M), (110 * M, 2 * M)]
    run = out["exp"][0]["blocks"]
    assert [(b["address"], b["size"], b["state"]) for b in run] == [(100 * M, 6 * M, "active_allocated"),
                                                                      (106 * M, 2 * M, "inactive")]


# ---- tools/gact_progress.py ---------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_progress_plain_lines_with_eta_when_not_a_terminal(monkeypatch):
    monkeypatch.delenv("GACT_PROGRESS", raising=False)
    clock, out = _Clock(), _Stream(tty=False)
    with gact_progress.progress(total=10, label="steps", stream=out, interval=5.0, clock=clock) as p:
        for _ in range(10):
            clock.t += 2.0  # each item costs 2 s
            p.update(1)
    lines = out.getvalue().splitlines()
    # first update, then at most one line per 5 s, then the final line
    assert lines[0] == "steps: 1/10 (10%), 2.0s elapsed, ETA 18.0s"
    assert lines[-1] == "steps: 10/10 (100%), 20.0s elapsed"
    assert 3 <= len(lines) <= 6
    assert "\r" not in out.getvalue()


def test_progress_bar_redraws_in_place_on_a_terminal(monkeypatch):
    monkeypatch.delenv("GACT_PROGRESS", raising=False)
    clock, out = _Clock(), _Stream(tty=True)
    p = gact_progress.progress(total=4, label="rounds", stream=out, width=8, clock=clock)
    clock.t = 3.0
    p.update(1, note="arm gact4")
    assert out.getvalue() == "\rrounds  [##......] 1/4 (25%)  3.0s elapsed  ETA 9.0s  arm gact4"
    clock.t = 12.0
    p.update(3)
    p.finish()
    assert out.getvalue().endswith("[########] 4/4 (100%)  12.0s elapsed  arm gact4\n")


def test_progress_unknown_total_silenced_and_iterate(monkeypatch):
    clock, out = _Clock(), _Stream(tty=False)
    p = gact_progress.progress(total=None, label="events", stream=out, clock=clock)
    clock.t = 2.0
    p.update(10)
    assert out.getvalue() == "events: 10 done, 5/s, 2.0s elapsed\n"
    monkeypatch.setenv("GACT_PROGRESS", "0")
    quiet = _Stream(tty=True)
    assert list(gact_progress.progress.iterate(range(3), stream=quiet)) == [0, 1, 2]
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError):
        gact_progress.progress(total=-1)
    assert gact_progress.format_duration(185) == "3m05s"
    assert gact_progress.format_duration(7440) == "2h04m"
