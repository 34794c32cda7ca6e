"""The Python API under misuse and signals (issue 15): gact.configure() changes act (or
are refused), SIGUSR1 and SIGTERM dumps from import on, a later SIGUSR1 handler chained
by install_dump_triggers(), a bad GACT_STATS_PATH reported at import naming it, NUL
paths rejected, non-integers refused by trace(), non-bytes refused by the codecs, and
gact's out-of-memory error as a Python class.

Signal and start-up behaviour is checked in subprocesses (a fresh interpreter each)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import _gact
import gact

TIMEOUT = 120


def py(code, env_extra=None, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GACT_")}
    env.update(OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, **kw)


WAIT_FOR = """
import os, time
def wait_for(path):
    for _ in range(1000):
        if os.path.exists(path):
            return True
        time.sleep(0.01)
    return False
"""


def test_sigusr1_right_after_import_dumps_and_a_later_handler_is_chained(tmp_path):
    # The handler used to be installed lazily (first tensor stored): SIGUSR1 right after
    # `import gact` killed the process.
    path = tmp_path / "s.json"
    r = py(WAIT_FOR + f"""
import signal, json, gact
os.kill(os.getpid(), signal.SIGUSR1)
assert wait_for({str(path)!r}), "no dump after SIGUSR1"
os.remove({str(path)!r})
calls = []
signal.signal(signal.SIGUSR1, lambda *a: calls.append(1))  # replaces gact's handler
gact.install_dump_triggers()                               # gact's comes back, chained
os.kill(os.getpid(), signal.SIGUSR1)
assert wait_for({str(path)!r}), "no dump after re-arming"
for _ in range(100):
    if calls: break
    time.sleep(0.01)
print(json.dumps({{"calls": len(calls)}}))
""", {"GACT_STATS_PATH": str(path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1])["calls"] == 1


def test_sigterm_dumps_then_ends_the_process_as_sigterm(tmp_path):
    path = tmp_path / "s.{pid}.json"
    r = py("""
import os, signal, time, torch, gact
comp = gact.Compressor(None, bits=4)
x = torch.randn(64, 256, requires_grad=True)
with comp:
    y = (x.tanh() * 2).sum()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
print("not reached")
""", {"GACT_STATS_PATH": str(path)})
    assert r.returncode == -signal.SIGTERM, r.stderr[-2000:]
    assert "not reached" not in r.stdout
    (dump,) = list(tmp_path.glob("s.*.json"))
    doc = json.loads(dump.read_text())
    assert dump.name == f"s.{doc['pid']}.json"
    assert doc["store"]["tensors_in"] >= 1


def test_bad_stats_path_fails_the_import_naming_the_variable(tmp_path):
    r = py("import gact", {"GACT_STATS_PATH": str(tmp_path / "missing" / "s.json")})
    assert r.returncode != 0
    assert "GACT_STATS_PATH: '" in r.stderr and "does not exist" in r.stderr


def test_configure_log_level_acts_at_once():
    r = py("""
import sys, _gact, gact
gact.configure(log_level="off")
_gact.pop_tag()                      # an unbalanced pop: a warning, when warnings show
sys.stderr.write("--mark--\\n"); sys.stderr.flush()
gact.configure(log_level="WARN")
_gact.pop_tag()
""")
    assert r.returncode == 0, r.stderr
    before, after = r.stderr.split("--mark--")
    assert "pop_tag" not in before
    assert "pop_tag" in after


def test_configure_stats_path_trace_and_memory_limit_act_at_once(tmp_path):
    # They showed the new values in options() and changed nothing. (A subprocess: tracing
    # and limits are process-wide.)
    path = tmp_path / "s.json"
    r = py(WAIT_FOR + f"""
import json, signal, torch, gact
out = {{}}
gact.configure(stats_path={str(path)!r})
os.kill(os.getpid(), signal.SIGUSR1)
out["dumped"] = wait_for({str(path)!r})
try:
    gact.configure(stats_path={str(tmp_path / "missing" / "s.json")!r})
except ValueError as e:
    out["bad_path"] = str(e)
gact.configure(trace=1234)
out["capacity"] = gact.stats()["timeline"]["capacity"]
gact.configure(memory_limit="1M")
out["limit"] = gact.stats()["allocators"]["host"]["options"]["memory_limit"]
import _gact
x = torch.randn(1024, 1024)
try:  # the store itself (through a saved-tensor hook, torch 1.13 wraps it in a RuntimeError)
    _gact.store_put(x.data_ptr(), "float32", tuple(x.shape), tuple(x.stride()), -1, 0, x.data_ptr(), 1, 8, 256, 0)
except gact.OutOfMemoryError as e:
    out["oom"] = [type(e).__name__, isinstance(e, MemoryError)]
print(json.dumps(out))
""")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["dumped"], "configure(stats_path=...) did not arm the dumps"
    assert out["bad_path"].startswith("stats_path: '") and "does not exist" in out["bad_path"]
    assert out["capacity"] == 1234
    assert out["limit"] == 1 << 20
    assert out["oom"] == ["OutOfMemoryError", True], "the store's out-of-memory is gact.OutOfMemoryError"
    assert gact.OutOfMemoryError is _gact.OutOfMemoryError and "OutOfMemoryError" in gact.__all__


def test_configure_threads_cannot_change_after_start():
    current = gact.options()["threads"]
    with pytest.raises(ValueError, match="threads: .*fixed when gact starts.*GACT_THREADS"):
        gact.configure(threads=current + 1)
    gact.configure(threads=current)  # the same value is fine
    with pytest.raises(ValueError, match="GACT_THREADS|threads: '4294967298'"):
        gact.configure(threads=4294967298)


def test_dump_stats_rejects_a_nul_byte(tmp_path):
    cut = tmp_path / "a"
    with pytest.raises(ValueError, match="NUL byte"):
        gact.dump_stats(str(cut) + "\0b.json")
    assert not cut.exists()


@pytest.mark.parametrize("bad", [1.5, "100", True, None])
def test_trace_rejects_non_integers(bad):
    with pytest.raises(TypeError, match="gact.trace: capacity must be an integer"):
        gact.trace(bad)
    with pytest.raises(TypeError, match="snapshot_every must be an integer"):
        gact.trace(0, snapshot_every=bad)


def test_codecs_refuse_what_is_not_bytes():
    blob = gact.codecs.encode(torch.randn(300), bits=4)
    for bad in (10**10, 7, "abc", [1, 2, 3], None, 2.5):
        with pytest.raises(TypeError, match="expected a blob as bytes, bytearray or memoryview"):
            gact.codecs.decode(bad)
        with pytest.raises(TypeError, match="gact.codecs.Blob: expected a blob"):
            gact.codecs.Blob(bad)
    for ok in (bytes(blob), bytearray(blob), memoryview(bytes(blob)), blob):
        assert torch.equal(gact.codecs.decode(ok), gact.codecs.decode(blob))
        assert gact.codecs.Blob(ok).shape == torch.Size([300])
    with pytest.raises(gact.CorruptBlobError):
        gact.codecs.Blob(b"\0" * 64)


def test_signals_to_a_forked_child_act_in_that_child_only(tmp_path):
    """Issue 33 row 3: a forked child shared its parent's signal pipe, so SIGTERM to the child dumped
    the parent's stats and killed the parent (exit 143), and SIGUSR1 to it wrote the parent's dump.
    Now SIGTERM ends the child alone; SIGUSR1 to a child dumps the child's own stats to a path of its
    own ({pid}), and never over the parent's file."""
    shared = tmp_path / "shared.json"
    per_pid = tmp_path / "s.{pid}.json"
    r = py(WAIT_FOR + f"""
import multiprocessing as mp, signal, json, gact, torch
def child(q):
    q.put(os.getpid())
    time.sleep(60)
ctx = mp.get_context("fork")
out = {{}}
for template, sig in (({str(shared)!r}, signal.SIGTERM), ({str(shared)!r}, signal.SIGUSR1),
                      ({str(per_pid)!r}, signal.SIGUSR1), ({str(per_pid)!r}, signal.SIGTERM)):
    gact.configure(stats_path=template)
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    pid = q.get(timeout=60)
    time.sleep(0.2)
    os.kill(pid, sig)
    if sig == signal.SIGUSR1:
        own = template.replace("{{pid}}", str(pid))
        got = wait_for(own) if own != template else False
        p.terminate()
    p.join(60)
    time.sleep(0.3)
    out[f"{{template}} {{int(sig)}}"] = [p.exitcode, got if sig == signal.SIGUSR1 else None,
                                        os.path.exists({str(shared)!r}),
                                        os.path.exists(template.replace("{{pid}}", str(os.getpid())))]
print(json.dumps(out))
""")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    term, usr1 = int(signal.SIGTERM), int(signal.SIGUSR1)
    # SIGTERM ends the child as SIGTERM would; the parent lives on and writes nothing
    assert out[f"{shared} {term}"] == [-term, None, False, False]
    assert out[f"{per_pid} {term}"][0] == -term and out[f"{per_pid} {term}"][3] is False
    # SIGUSR1: no dump over the parent's shared file; the child's own file with {pid}
    assert out[f"{shared} {usr1}"][1:3] == [False, False]
    assert out[f"{per_pid} {usr1}"][1] is True and out[f"{per_pid} {usr1}"][3] is False


def test_settings_that_would_be_silently_wrong_are_refused():
    """Issue 33 row 10: memory_limit=1.5 became 2 bytes; codecs.encode(bits=True) was accepted as 1 bit;
    configure(cpu_allocator=...) after the choice was made was accepted and did nothing."""
    with pytest.raises(ValueError, match="memory_limit=1.5 is not a whole number"):
        gact.configure(memory_limit=1.5)
    with pytest.raises(ValueError, match="bits=True must be an integer"):
        gact.codecs.encode(torch.randn(300), bits=True)
    gact.Compressor(torch.nn.Linear(2, 2))  # the choice is made (a test process has made it already)
    installed = gact.cpu_allocator_installed()
    with pytest.raises(ValueError, match="cpu_allocator=.* comes too late"):
        gact.configure(cpu_allocator=not installed)
    gact.configure(cpu_allocator=installed)  # what is in force: accepted
