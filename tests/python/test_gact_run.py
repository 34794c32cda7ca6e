"""gact-run under real launch patterns (issue 15).

Each test runs tools/gact-run on a plain PyTorch script (data/gact_run_modes.py) in a
subprocess and reads the stats it leaves: the merged ``--stats`` file and the
per-process files ``STEM.rank<R>.json`` / ``STEM.pid<P>.json``. Covered: a training
loop in a thread, a launcher that starts the script in a subprocess, torchrun with two
CPU ranks over gloo, a script that never calls ``optimizer.step()``, SIGTERM, hooks that
cannot be installed (exit 3 before the script; ``--allow-uncompressed``), the flags, and
the source tree's launcher outside ``meson devenv`` (finds the build or refuses).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import _gact
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GACT_RUN = os.path.join(ROOT, "tools", "gact-run")
SCRIPT = os.path.join(HERE, "data", "gact_run_modes.py")
BUILD_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(_gact.__file__))))
TIMEOUT = 300


def env_for_run(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GACT_")}
    env.update(OMP_NUM_THREADS="1", GACT_LOG_LEVEL="error")
    env.update(extra)
    return env


def gact_run(args, cmd, env=None, **kw):
    full = [sys.executable, GACT_RUN] + args + ["--"] + cmd
    return subprocess.run(full, capture_output=True, text=True, timeout=TIMEOUT, env=env or env_for_run(), **kw)


def steps_printed(out):
    return [ln for ln in out.splitlines() if ln.startswith("step ")]


def load(path):
    with open(path) as f:
        return json.load(f)


def test_training_loop_in_a_thread_is_compressed(tmp_path):
    # torch 1.13 keeps saved-tensor hooks per thread: a loop in a threading.Thread saved
    # everything uncompressed (tensors_in 0) before gact-run pushed the hooks in new threads.
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "4", "--stats", str(stats)], [sys.executable, SCRIPT, "thread", "--steps", "4"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(steps_printed(r.stdout)) == 4
    store = load(stats)["store"]
    assert store["tensors_in"] >= 4 * 3, store
    assert store["quant_bits"]["4"] >= 4 * 2, store
    assert store["steps"] == 4 and store["leaks"] == 0, store
    # The thread has its own op tracker too: the ReLU's output is stored with an exact mask (a mask,
    # or a boundary blob for the mask and the next layer's values), not quantized as plain values
    # (that would flip the mask of small positive activations).
    assert store["roles"]["predicate"]["tensors"] + store["boundary_blobs"] >= 4, store


def test_launcher_subprocess_gets_its_own_stats_file_and_the_merge_counts_it(tmp_path):
    # Every process used to dump to the same path at exit; the launcher, exiting last,
    # left tensors_in 0. (GACT_STATS_PATH in the environment works as --stats does.)
    stats = tmp_path / "stats.json"
    r = gact_run([], [sys.executable, SCRIPT, "launcher", "--steps", "3"], env=env_for_run(GACT_STATS_PATH=str(stats)))
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.glob("stats.pid*.json"))
    assert len(files) == 2, files
    per = [load(tmp_path / f)["store"]["tensors_in"] for f in files]
    assert sorted(per)[0] == 0 and sorted(per)[1] > 0, per  # the launcher saved nothing
    doc = load(stats)
    assert doc["merged"]["files"] == 2
    assert doc["store"]["tensors_in"] == sum(per)
    assert doc["store"]["steps"] == 3
    assert len(doc["processes"]) == 2 and all(k.startswith("pid") for k in doc["processes"])
    assert all(name.split("/", 1)[0] in doc["processes"] for name in doc["allocators"])


def _torchrun_usable() -> str | None:
    """Why torchrun cannot start here, or None: torch >= 2.4 asks its TCP store for libuv, which some
    distribution builds of torch lack (Debian 13's 2.6: "use_libuv was requested but PyTorch was build
    without libuv support")."""
    try:
        from torch.distributed import TCPStore
        TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    except RuntimeError as e:
        if "libuv" in str(e):
            return f"this torch build cannot run torchrun's rendezvous: {e}"
    except (ImportError, TypeError):
        pass
    return None


def test_torchrun_two_cpu_ranks_write_rank_files(tmp_path):
    why = _torchrun_usable()
    if why:
        pytest.skip(why)
    stats = tmp_path / "stats.json"
    # --redirects/--tee: torch 1.13's torchrun cannot parse their default "0" under Python
    # 3.11 (enum.Flag iteration skips the zero member); 2/1 send stderr to files, tee stdout.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--redirects", "2", "--tee", "1", "--log_dir", str(tmp_path / "logs"), SCRIPT, "ddp", "--steps", "3"]
    r = gact_run(["--bits", "4", "--stats", str(stats)], cmd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        store = load(tmp_path / f"stats.rank{rank}.json")["store"]
        assert store["tensors_in"] >= 3 * 3, (rank, store)
        assert store["steps"] == 3 and store["leaks"] == 0, (rank, store)
    doc = load(stats)
    assert {"rank0", "rank1"} <= set(doc["processes"]), doc["merged"]
    assert doc["merged"]["labels"][:2] == ["rank0", "rank1"]
    ranks = [doc["processes"][f"rank{r}"]["store"]["tensors_in"] for r in (0, 1)]
    assert doc["store"]["tensors_in"] == sum(p["store"]["tensors_in"] for p in doc["processes"].values())
    assert ranks[0] == ranks[1] > 0
    assert doc["processes"]["rank1"]["run"]["rank"] == "1"


def test_script_without_optimizer_steps_at_each_backward(tmp_path):
    # Weights updated by hand: the compressor never stepped (steps 0), per-step keys grew
    # forever (LSTMCell:0 ... LSTMCell:N) and so did the policy's records.
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "auto", "--stats", str(stats)], [sys.executable, SCRIPT, "by-hand", "--steps", "3"])
    assert r.returncode == 0, r.stderr[-3000:]
    doc = load(stats)
    store = doc["store"]
    assert store["steps"] == 3, store
    assert store["leaks"] == 0, store
    policy = next(iter(doc["processes"].values()))["policy"]
    # the tensors of a step, from the same script at uniform bits (the process totals under auto also
    # count the policy's own passes on the sampled step, a replay in passes of one row each)
    uniform_stats = tmp_path / "uniform.json"
    r2 = gact_run(["--bits", "2", "--stats", str(uniform_stats)], [sys.executable, SCRIPT, "by-hand", "--steps", "3"])
    assert r2.returncode == 0, r2.stderr[-3000:]
    per_step = load(uniform_stats)["store"]["tensors_in"] // 3
    assert per_step > 0
    # keys reused from step to step (they once grew by a step's worth each step); a sampled step saves
    # a few tensors more under keys of its own
    assert per_step <= len(policy["tensors"]) < 2 * per_step, "the keys of one step were not reused by the next"
    # the first module trained (the cell) is the model the policy estimates on, said on stderr and in the stats
    assert "--bits auto adapts to LSTMCell" in r.stderr, r.stderr[-2000:]
    run = next(iter(doc["processes"].values()))["run"]
    assert "adapts to LSTMCell" in run["policy"], run
    assert any(t["estimates"] > 0 for t in policy["tensors"].values()), policy["tensors"]


def test_script_with_autograd_grad_alone_steps_at_each_call(tmp_path):
    """A loop that takes its gradients from torch.autograd.grad and updates the weights by hand never calls
    backward: gact-run once counted its whole run as one step (ended at exit)."""
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "4", "--stats", str(stats)], [sys.executable, SCRIPT, "grad-only", "--steps", "5"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(steps_printed(r.stdout)) == 5
    store = load(stats)["store"]
    assert store["steps"] == 5 and store["leaks"] == 0, store
    assert store["quant_bits"]["4"] >= 5 * 2, store


@pytest.mark.parametrize("mode, steps", [("by-hand", 1), ("by-hand", 4), ("by-data", 4), ("accumulate", 5)])
def test_steps_are_counted_as_the_script_takes_them(tmp_path, mode, steps):
    """A loop by hand (weights updated in place, or through .data after zero_grad(), as pytorch/examples' word LM
    does) counts one step per backward. Gradient accumulation counts one per optimizer step, except before the
    first, where nothing tells its micro-batches from a loop by hand: each of those counts (README)."""
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "4", "--stats", str(stats)], [sys.executable, SCRIPT, mode, "--steps", str(steps)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(steps_printed(r.stdout)) == steps
    store = load(stats)["store"]
    expected = steps + 3 if mode == "accumulate" else steps  # (4 micro-batches: 3 more before the first step)
    assert store["steps"] == expected and store["leaks"] == 0, store


def test_bits_auto_adapts_to_the_first_module_trained(tmp_path):
    # --bits auto once ran every tensor at the budget's widest width for the whole run (no model, no
    # estimate). Now the first module trained becomes the Compressor's model: the policy estimates on it
    # (the probe) and decides, within the budget, and says so.
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "auto", "--budget", "3", "--stats", str(stats)],
                 [sys.executable, SCRIPT, "thread", "--steps", "4"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(steps_printed(r.stdout)) == 4
    assert "--bits auto adapts to Sequential" in r.stderr, r.stderr[-2000:]
    doc = load(stats)
    proc = next(iter(doc["processes"].values()))
    assert "adapts to Sequential" in proc["run"]["policy"], proc["run"]
    policy = proc["policy"]
    last = policy["last_decision"]
    assert last is not None and policy["budget_avg_bits"] == 3.0, policy  # it decided, at the user's budget
    assert last["stored_bytes"] <= last["budget_bytes"], last
    # sensitivities measured on the model's tensors, keyed by its modules (the loss, outside it: <none>)
    estimated = {k for k, t in policy["tensors"].items() if t["estimates"] > 0}
    assert estimated and all(k.split(":")[0] in {"0", "1", "2", "3", "4"} for k in estimated), policy["tensors"]
    assert doc["store"]["leaks"] == 0, doc["store"]


def test_sigterm_still_dumps_and_gact_run_dies_of_it(tmp_path):
    stats = tmp_path / "stats.json"
    p = subprocess.Popen([sys.executable, GACT_RUN, "--stats", str(stats), "--", sys.executable, SCRIPT, "forever"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_run())
    try:
        for line in p.stdout:
            if line.strip() == "ready":
                break
        p.send_signal(signal.SIGTERM)
        p.wait(TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM, p.stderr.read()[-2000:]
    store = load(stats)["store"]
    assert store["tensors_in"] >= 3 * 3 and store["steps"] >= 3, store


def test_hooks_that_cannot_be_installed_stop_before_the_script(tmp_path):
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    stats = tmp_path / "stats.json"
    r = gact_run(["--stats", str(stats)], cmd, env=env_for_run(GACT_GROUP_SIZE="100"))
    assert r.returncode == 3, r.stderr
    assert "GACT_GROUP_SIZE: '100'" in r.stderr and "--allow-uncompressed" in r.stderr
    assert not marker.exists(), "the script ran uncompressed"
    assert not stats.exists()

    r = gact_run(["--allow-uncompressed", "--stats", str(stats)], cmd, env=env_for_run(GACT_GROUP_SIZE="100"))
    assert r.returncode == 0, r.stderr
    assert marker.exists()
    assert "UNCOMPRESSED" in r.stderr
    doc = load(stats)
    (proc,) = doc["processes"].values()
    assert proc["run"]["compressed"] is False and "GACT_GROUP_SIZE" in proc["run"]["reason"]
    assert doc["merged"]["uncompressed"] == list(doc["processes"])


def test_flags_reach_every_process(tmp_path):
    r = gact_run(["--threads", "1", "--group-size", "128", "--adapt-interval", "7", "--swap", "--prefetch", "3",
                  "--seed", "5"], [sys.executable, SCRIPT, "options"])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    opts = got["options"]
    assert (opts["threads"], opts["group_size"], opts["adapt_interval"], opts["prefetch"], opts["seed"]) == \
        (1, 128, 7, 3, 5)
    assert opts["swap"] is True and got["swap"] is True and got["group_size"] == 128
    bad = gact_run(["--group-size", "100"], [sys.executable, "-c", "print('ran')"])
    assert bad.returncode == 2 and "--group-size '100'" in bad.stderr and "ran" not in bad.stdout


def test_source_tree_launcher_outside_devenv_finds_the_build_or_refuses(tmp_path):
    env = env_for_run()
    env.pop("PYTHONPATH", None)
    args = [] if os.path.realpath(BUILD_DIR) == os.path.realpath(os.path.join(ROOT, "build")) else \
        ["--build-dir", BUILD_DIR]
    stats = tmp_path / "stats.json"
    r = gact_run(args + ["--bits", "4", "--stats", str(stats)], [sys.executable, SCRIPT, "thread", "--steps", "2"],
                 env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert load(stats)["store"]["tensors_in"] > 0

    marker = tmp_path / "ran"
    empty = tmp_path / "empty-build"
    empty.mkdir()
    r = gact_run(["--build-dir", str(empty)], [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                 env=env)
    assert r.returncode == 2 and "no built gact module" in r.stderr, r.stderr
    assert not marker.exists()


def test_source_tree_launcher_without_a_build_uses_the_installed_gact(tmp_path):
    """Issue 32: after `pip install .` (which builds elsewhere) the clone's tools/gact-run found no build and
    exited 2. A gact importable outside the tree now runs the command, and gact-run says which it used."""
    import shutil

    tree = tmp_path / "clone"  # a source tree without build/
    shutil.copytree(os.path.join(ROOT, "tools"), tree / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(ROOT, "bindings", "python", "gact"), tree / "bindings" / "python" / "gact",
                    ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"  # an installed gact: the package and its _gact module side by side
    shutil.copytree(os.path.join(ROOT, "bindings", "python", "gact"), site / "gact",
                    ignore=shutil.ignore_patterns("__pycache__"))
    os.symlink(os.path.abspath(_gact.__file__), site / os.path.basename(_gact.__file__))
    env = env_for_run(PYTHONPATH=str(site))
    stats = tmp_path / "stats.json"
    probe = "import gact, _gact; print('GACT', gact.__file__); print('EXT', _gact.__file__)"
    r = subprocess.run([sys.executable, str(tree / "tools" / "gact-run"), "--bits", "4", "--stats", str(stats), "--",
                        sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"using the installed gact in {site / 'gact'}" in r.stderr, r.stderr
    assert f"GACT {site / 'gact' / '__init__.py'}" in r.stdout, r.stdout
    # without an installed gact it still refuses, naming the build it looked for
    r = subprocess.run([sys.executable, str(tree / "tools" / "gact-run"), "--", sys.executable, "-c", "pass"],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env_for_run(PYTHONPATH=""),
                       cwd=str(tmp_path))
    assert r.returncode == 2 and "no built gact module" in r.stderr, r.stderr


def test_gan_loop_with_two_optimizers_ends_steps_without_leaks(tmp_path):
    """Issue 32: under gact-run a GAN's discriminator step ended gact's step while the generator's graph was
    alive: 'handles still alive at the end of step N' every step, leaks in the stats, no memory lost. The
    step now ends when its graphs are done (at the generator's step)."""
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "4", "--stats", str(stats), "--min-bytes", "0"], [sys.executable, SCRIPT, "gan", "--steps", "4"],
                 env=env_for_run(GACT_LOG_LEVEL="warn"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(steps_printed(r.stdout)) == 4
    assert "still alive" not in r.stderr, r.stderr[-2000:]
    store = load(stats)["store"]
    assert store["leaks"] == 0 and store["steps"] >= 3, store
    assert store["tensors_in"] >= 4 * 4, store


def test_one_optimizer_with_a_graph_kept_alive_still_ends_every_step(tmp_path):
    """The wait for a step's graphs is for scripts with several optimizers: where only one steps, every
    optimizer step after the first ends the step, as before, and what the script keeps alive is a leak."""
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "4", "--stats", str(stats), "--min-bytes", "0"],
                 [sys.executable, SCRIPT, "keep-graph", "--steps", "6"])
    assert r.returncode == 0, r.stderr[-3000:]
    store = load(stats)["store"]
    assert store["steps"] == 5, store  # the first optimizer step waits (it may be a GAN's first), then each ends
    assert store["leaks"] > 0, store


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_multiprocessing_trackers_are_left_alone_and_workers_are_not(tmp_path, method):
    """A script that starts a process with the spawn context also starts multiprocessing's resource tracker, a
    Python process of its own: gact was installed there too, imported torch for nothing and wrote a third stats file
    after gact-run had merged the other two. The tracker is left alone now; the workers, which run the script's code
    (spawned, or forked by the forkserver, which is installed for them), are compressed."""
    script = tmp_path / "spawns.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        import sys
        import torch

        def work(q):
            y = torch.tanh(torch.randn(256, 256, requires_grad=True))
            q.put(("gact" in sys.modules, type(y.grad_fn._saved_result).__name__))

        if __name__ == "__main__":
            ctx = mp.get_context(sys.argv[1])
            q = ctx.Queue()
            p = ctx.Process(target=work, args=(q,))
            p.start()
            print("worker", q.get())
            p.join()
            m = torch.nn.Linear(64, 64)
            opt = torch.optim.SGD(m.parameters(), 0.1)
            loss = torch.relu(m(torch.randn(32, 64))).pow(2).mean()
            loss.backward()
            opt.step()
    """))
    stats = tmp_path / "stats.json"
    r = gact_run(["--bits", "4", "--stats", str(stats)], [sys.executable, str(script), method])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "worker (True, 'Tensor')" in r.stdout, r.stdout  # (gact loaded there, its hooks installed)
    files = sorted(tmp_path.glob("stats.pid*.json"))
    argvs = [load(f)["run"]["argv"] for f in files]
    if method == "spawn":  # (the forkserver, a `python -c` process too, writes its own)
        assert ["-c"] not in argvs, argvs  # (no tracker's file: `python -c CMD` leaves argv ['-c'])
        assert len(files) == 2, argvs  # the script and its worker
        assert load(stats)["merged"]["files"] == 2
    assert load(stats)["store"]["tensors_in"] > 0
