"""gact-run's sitecustomize: compress saved activations in an unmodified script.

Python imports this module at start-up because gact-run puts its folder first on
PYTHONPATH, so it runs in every Python process of the command. It does nothing unless
GACT_RUN=1, nor in multiprocessing's trackers (_MP_HELPERS). Then it:

1. chains to the sitecustomize this one shadows (Debian ships one), if any;
2. builds a model-less ``gact.Compressor`` from the GACT_* options and installs its
   saved-tensor hooks for the whole process (``Compressor.install_global``), and for every
   thread started from then on (torch 1.13 keeps saved-tensor hooks per thread), through
   ``threading.setprofile`` (``Compressor.install_thread``), chained to a profiler set
   there before;
3. ends a step after every ``torch.optim.Optimizer.step`` (torch's global optimizer
   post-hook on 2.x, a wrapper on each optimizer class's ``step`` on 1.13); in a script
   that never calls one (weights updated by hand), at the end of every backward
   (``torch.autograd.backward``, or ``torch.autograd.grad`` in a loop that uses it alone)
   that leaves no graph alive. Once an optimizer step has been seen, backward no longer
   ends steps;
4. with ``--bits auto``, gives the Compressor the first module the script trains (the
   outermost forward with grad enabled and trainable parameters, unwrapped from
   DistributedDataParallel/DataParallel), so that its policy estimates on it;
5. records what it did in the stats document's ``run`` section (pid, rank, argv,
   ``compressed``, ``policy``); the stats themselves are dumped by gact's core to GACT_STATS_PATH
   (``stats.{proc}.json``: one file per process) at exit, on SIGUSR1 and on SIGTERM.

When the hooks cannot be installed (torch or gact missing, a bad GACT_* value) the
process stops here, before the script runs, with exit status 3 and the reason on stderr;
with GACT_RUN_ALLOW_UNCOMPRESSED=1 (``--allow-uncompressed``) it runs uncompressed and
its stats say so (``run.compressed`` false, ``run.reason``).

Importing torch here costs start-up time in every Python process the command starts;
that is the price of needing no change to the script.
"""

import os
import sys

EXIT_NO_HOOKS = 3


def _chain_shadowed_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.machinery
    import importlib.util

    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == here:
        return
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # the shadowed module's own failure must not stop the run
        print(f"gact-run: the shadowed sitecustomize ({spec.origin}) failed: {e}", file=sys.stderr)


def _run_info(compressed, reason=None, policy=None):
    info = {"launcher": "gact-run", "pid": os.getpid(), "rank": os.environ.get("RANK"),
            "argv": list(sys.argv), "compressed": compressed}
    if reason is not None:
        info["reason"] = reason
    if policy is not None:
        info["policy"] = policy
    return info


class _Steps:
    """When a step ends: after an optimizer step, or at the end of a backward in a script
    that has not called one. ``dirty``: something ran since the last step ended (a module's
    forward, or a backward that did not end the step)."""

    def __init__(self, comp):
        self.comp = comp
        self.seen_optimizer = False
        self.dirty = False
        self.in_step = False
        self.backward_depth = 0
        self.deferred = set()  # ids of the optimizers that stepped while the step's graphs were alive
        self.optimizers = set()  # ids of every optimizer that has stepped
        self.ended_by_optimizer = 0  # steps an optimizer step has ended

    def end(self):
        if self.in_step:
            return
        self.in_step = True  # the policy's own passes (a probe's backward) must not step again
        try:
            self.comp.step()
        finally:
            self.in_step = False
            self.dirty = False

    def after_optimizer_step(self, optimizer=None, *_args, **_kwargs):
        first = not self.seen_optimizer
        self.seen_optimizer = True
        if not (self.dirty or not first or self.deferred):
            return
        # Several optimizers (a GAN's discriminator and generator, teacher and student): the step ends
        # when its graphs are done, so the discriminator's step does not end it while the generator's
        # graph, which its own backward still reads, is alive. An optimizer that steps a second time
        # while it waits ends it anyway (a graph kept across iterations is then counted as a leak). A
        # script that has shown one optimizer only (after the first step) ends every step at it, as before.
        key = id(optimizer)
        if optimizer is not None:
            self.optimizers.add(key)
        several = len(self.optimizers) > 1 or self.ended_by_optimizer == 0
        if optimizer is not None and several and key not in self.deferred and self.comp._live_count() > 0:
            self.deferred.add(key)
            return
        self.deferred.clear()
        self.ended_by_optimizer += 1
        self.end()

    def forward_started(self, *_args):
        self.dirty = True

    def wrap_backward(self, backward):
        """``torch.autograd.backward`` (``Tensor.backward`` calls it) or ``torch.autograd.grad``, which a script
        that updates its weights by hand may use alone."""
        import functools

        @functools.wraps(backward)
        def stepped_backward(*args, **kwargs):
            self.backward_depth += 1
            try:
                out = backward(*args, **kwargs)
            finally:
                self.backward_depth -= 1
            if self.backward_depth == 0 and not self.in_step:
                # (before any optimizer step, a backward ends the step only once every graph of it is done:
                # a GAN's first discriminator backward leaves the generator's graph alive)
                if self.seen_optimizer or self.comp._live_count() > 0:
                    self.dirty = True
                else:
                    self.end()
            return out

        return stepped_backward


def _install_optimizer_hook(torch, _compat, after_step):
    import functools

    if _compat.HAS_OPTIMIZER_POST_HOOK:
        import torch.optim.optimizer as om

        om.register_optimizer_step_post_hook(after_step)
        return
    original_init = torch.optim.Optimizer.__init__

    def wrap_step(cls):
        step = cls.__dict__.get("step")
        if step is None or getattr(step, "_gact_wrapped", False):
            return

        @functools.wraps(step)
        def stepped(self, *args, **kwargs):
            out = step(self, *args, **kwargs)
            after_step(self)
            return out

        stepped._gact_wrapped = True
        stepped.hooked = True  # torch 1.13's profiler wrapper checks this and leaves it alone
        cls.step = stepped

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        for cls in type(self).__mro__:
            if cls is torch.optim.Optimizer:
                break
            if "step" in cls.__dict__:
                wrap_step(cls)
                break

    torch.optim.Optimizer.__init__ = init


def _install_thread_hooks(push):
    """Push the saved-tensor hooks in every thread started from now on: ``threading`` calls
    the function set with ``threading.setprofile`` first thing in a new thread; it pushes
    the hooks, then hands the thread to the profiler that was set before (or none)."""
    import threading

    previous = threading.getprofile() if hasattr(threading, "getprofile") else None

    def thread_start(frame, event, arg):
        sys.setprofile(previous)
        push()
        if previous is not None:
            return previous(frame, event, arg)
        return None

    threading.setprofile(thread_start)


def _install():
    import atexit
    import json

    import torch

    import _gact
    import gact
    from gact import _compat

    comp = gact.Compressor(None)
    comp.install_global()
    gact._run_compressor = comp  # for inspection by the script or tests
    _install_thread_hooks(comp.install_thread)

    steps = _Steps(comp)
    gact._run_steps = steps
    _install_optimizer_hook(torch, _compat, steps.after_optimizer_step)
    torch.autograd.backward = steps.wrap_backward(torch.autograd.backward)
    torch.autograd.grad = steps.wrap_backward(torch.autograd.grad)
    if _compat.HAS_GLOBAL_MODULE_HOOKS:
        torch.nn.modules.module.register_module_forward_pre_hook(lambda _m, _inp: steps.forward_started())
    else:
        steps.dirty = True  # no way to see a forward: every optimizer step ends a step

    def close_last_step():
        if steps.dirty and not steps.seen_optimizer:
            steps.end()

    atexit.register(close_last_step)
    policy_note = None
    if comp.policy is not None:
        bits = comp.policy.default_bits
        budget = comp.policy.controller.stats()["budget_avg_bits"]
        if _compat.HAS_GLOBAL_MODULE_HOOKS:
            policy_note = (f"--bits auto: adapts to the first module the script trains; until its first forward "
                           f"ends every tensor gets {bits} bits (the widest width within budget {budget:g})")
            _adopt_first_trained_module(torch, comp, policy_note)
        else:
            # Without the script's model the policy has no sensitivities to estimate: say so once, here,
            # rather than running fixed widths under the name of an adaptive policy.
            policy_note = (f"--bits auto without a model: every tensor gets {bits} bits (the widest width within "
                           f"budget {budget:g}); to adapt, make gact.Compressor(model, bits='auto') in the script")
        print(f"gact-run: {policy_note}", file=sys.stderr)
    _gact.stats_set_section("run", json.dumps(_run_info(True, policy=policy_note)))


def _adopt_first_trained_module(torch, comp, note):
    """--bits auto: give the Compressor the first module whose outermost forward runs with grad enabled
    and trainable parameters (the model inside a DistributedDataParallel or DataParallel wrapper), so
    that its policy can estimate; said on stderr and in the stats' ``run.policy``."""
    import json
    import threading

    import _gact
    from gact import _compat

    local = threading.local()
    handles = []

    def pre(_m, _inputs):
        local.depth = getattr(local, "depth", 0) + 1

    def post(m, _inputs, _output):
        local.depth = getattr(local, "depth", 1) - 1
        if local.depth != 0 or comp.model is not None or not torch.is_grad_enabled():
            return
        model = m.module if isinstance(m, torch.nn.DataParallel) else _compat.unwrap_ddp(m)
        if not any(p.requires_grad for p in model.parameters()):
            return
        for h in handles:
            h.remove()
        comp.set_model(model)
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        adopted = (f"--bits auto adapts to {type(model).__name__} ({n} trainable parameters), the first module "
                   f"trained; its policy estimates from the next step")
        print(f"gact-run: {adopted}", file=sys.stderr)
        _gact.stats_set_section("run", json.dumps(_run_info(True, policy=f"{note}. {adopted}")))

    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(pre))
    handles.append(torch.nn.modules.module.register_module_forward_hook(post))


def _run_uncompressed(reason):
    """--allow-uncompressed: say so on stderr and in this process's stats."""
    import json

    print(f"gact-run: running UNCOMPRESSED (--allow-uncompressed): {reason}", file=sys.stderr)
    info = _run_info(False, reason)
    try:
        import _gact

        _gact.stats_set_section("run", json.dumps(info))
        _gact.install_dump_triggers()
        return
    except Exception:  # noqa: BLE001 - no gact at all: write a minimal document ourselves
        pass
    path = os.environ.get("GACT_STATS_PATH")
    if not path:
        return
    rank = os.environ.get("RANK", "")
    proc = "rank" + rank if rank.isdigit() else "pid%d" % os.getpid()
    path = path.replace("{pid}", str(os.getpid())).replace("{proc}", proc)

    def write():
        import time

        doc = {"schema_version": 2, "gact_version": None, "pid": os.getpid(),
               "time_unix_ms": int(time.time() * 1000), "allocators": {}, "run": info}
        try:
            with open(path, "w") as f:
                json.dump(doc, f, indent=2)
        except OSError as e:
            print(f"gact-run: cannot write {path}: {e}", file=sys.stderr)

    import atexit

    atexit.register(write)


#: the commands multiprocessing starts its trackers with (``python -c "from multiprocessing.resource_tracker import
#: main;main(5)"``): they never train, and in them gact would import torch for nothing and leave a stats file of its
#: own, written after gact-run merged the others (a script that started one spawn worker: 3 files, 2 merged). Not the
#: forkserver, whose forked children are workers that train.
_MP_HELPERS = ("from multiprocessing.resource_tracker import", "from multiprocessing.semaphore_tracker import")


def _multiprocessing_helper():
    """Whether this process is one of multiprocessing's trackers (_MP_HELPERS: the command given to -c), not a worker
    that runs the script's code (a spawned Process, a DataLoader worker, torch.multiprocessing.spawn's ranks).
    (sys.orig_argv: Python 3.10 on; before, every process is installed.)"""
    argv = list(getattr(sys, "orig_argv", None) or [])
    if "-c" not in argv or argv.index("-c") + 1 >= len(argv):
        return False
    return argv[argv.index("-c") + 1].startswith(_MP_HELPERS)


_chain_shadowed_sitecustomize()
if os.environ.get("GACT_RUN") == "1" and not _multiprocessing_helper():
    try:
        _install()
    except Exception as e:  # noqa: BLE001 - any reason gact cannot run here stops this process
        reason = f"{type(e).__name__}: {e}"
        if os.environ.get("GACT_RUN_ALLOW_UNCOMPRESSED") == "1":
            _run_uncompressed(reason)
        else:
            print(f"gact-run: gact's hooks could not be installed in {' '.join(sys.argv) or sys.executable} "
                  f"(pid {os.getpid()}): {reason}\n"
                  "gact-run: stopped before the script ran; fix the cause, or pass --allow-uncompressed "
                  "to run without compression", file=sys.stderr)
            sys.stderr.flush()
            os._exit(EXIT_NO_HOOKS)
