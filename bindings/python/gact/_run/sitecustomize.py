"""gact-run's sitecustomize: compress saved activations in an unmodified script.

Python imports this module at start-up because gact-run puts its folder first on
PYTHONPATH. It does nothing unless GACT_RUN=1. Then it:

1. chains to the sitecustomize this one shadows (Debian ships one), if any;
2. builds a model-less ``gact.Compressor`` from the GACT_* options and installs its
   saved-tensor hooks for the whole process (``Compressor.install_global``);
3. steps the compressor after every ``torch.optim.Optimizer.step``, through
   torch's global optimizer post-hook where it exists (2.x) or by wrapping the
   ``step`` of each optimizer class on construction (1.13);
4. dumps the stats document to GACT_STATS_PATH at exit.

Importing torch here costs start-up time in every Python process the command
starts; that is the price of needing no change to the script.
"""

import os
import sys


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


def _install():
    import atexit
    import functools

    import torch

    import gact
    from gact import _compat

    comp = gact.Compressor(None)
    comp.install_global()
    gact._run_compressor = comp  # for inspection by the script or tests

    def after_step(*_args, **_kwargs):
        comp.step()

    if _compat.HAS_OPTIMIZER_POST_HOOK:
        import torch.optim.optimizer as om

        om.register_optimizer_step_post_hook(after_step)
    else:
        original_init = torch.optim.Optimizer.__init__

        def wrap_step(cls):
            step = cls.__dict__.get("step")
            if step is None or getattr(step, "_gact_wrapped", False):
                return

            @functools.wraps(step)
            def stepped(self, *args, **kwargs):
                out = step(self, *args, **kwargs)
                after_step()
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

    path = os.environ.get("GACT_STATS_PATH")
    if path:

        def dump():
            try:
                gact.dump_stats(path)
            except Exception as e:
                print(f"gact-run: cannot write the stats to {path}: {e}", file=sys.stderr)

        atexit.register(dump)


_chain_shadowed_sitecustomize()
if os.environ.get("GACT_RUN") == "1":
    try:
        _install()
    except Exception as e:
        print(f"gact-run: could not install gact's hooks: {e}", file=sys.stderr)
        raise
