"""Plain PyTorch training scripts that know nothing of gact, in the launch patterns
gact-run must handle (tests/python/test_gact_run.py runs them under gact-run):

  thread      the training loop runs in a threading.Thread
  launcher    this script starts itself again in a subprocess (mode thread) and waits
  by-hand     no optimizer: an LSTM cell unrolled over time, weights updated by hand
  grad-only   no optimizer and no backward: torch.autograd.grad, weights updated by hand
  accumulate  gradient accumulation: four micro-batches' backward per optimizer step
  by-data     no optimizer: zero_grad() first, weights updated through .data (pytorch/examples' word LM)
  ddp         one rank of DistributedDataParallel over gloo (started by torchrun)
  forever     trains until killed, printing "ready" after three steps
  gan         a GAN's loop: two optimizers, the generator's graph alive at the discriminator's step
  keep-graph  one optimizer; each iteration keeps a forward's graph alive into the next
  options     prints what gact-run configured (needs gact: only for the flags test)

Each prints "step N loss L" per step (options: one JSON line).
"""

import argparse
import os
import subprocess
import sys
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp():
    """A batch, its labels and a small MLP, the same in every run."""
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    y = (x[:, :5].sum(1) > 0).long()
    return x, y, nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2))


def mlp_steps(steps):
    x, y, model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    while steps < 0 or step < steps:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if steps < 0 and step == 2:
            print("ready", flush=True)
        step += 1


def by_hand(steps):
    torch.manual_seed(0)
    cell, head = nn.LSTMCell(16, 128), nn.Linear(128, 16)
    params = list(cell.parameters()) + list(head.parameters())
    x = torch.randn(12, 32, 16)
    for step in range(steps):
        h = c = torch.zeros(32, 128)
        loss = 0.0
        for t in range(11):
            h, c = cell(x[t], (h, c))
            loss = loss + F.mse_loss(head(h), x[t + 1])
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
        print(f"step {step} loss {loss.item():.4f}", flush=True)


def grad_only(steps):
    """The gradients come from torch.autograd.grad alone (no .backward(), no optimizer)."""
    x, y, model = mlp()
    params = list(model.parameters())
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= 0.05 * g
        print(f"step {step} loss {loss.item():.4f}", flush=True)


def accumulate(steps):
    """Each step accumulates the gradients of four micro-batches, then steps the optimizer once."""
    x, y, model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        for mb in range(4):
            loss = F.cross_entropy(model(x[mb * 16:(mb + 1) * 16]), y[mb * 16:(mb + 1) * 16]) / 4
            loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


def by_data(steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 2))
    x = torch.randn(64, 32)
    y = (x[:, 0] > 0).long()
    for step in range(steps):
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)  # (no version change: only the gradients tell)
        print(f"step {step} loss {loss.item():.4f}", flush=True)


def ddp(steps):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 32, generator=g)
    y = (x[:, 0] > 0).long()
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def gan(steps):
    """pytorch/examples' dcgan loop in miniature: D steps on real and detached fake, then G steps through
    D on the same fake, whose graph (G's) is alive when D's optimizer steps."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64), nn.Tanh())
    D = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
    real = torch.randn(64, 64)
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    for step in range(steps):
        D.zero_grad()
        err_real = F.binary_cross_entropy_with_logits(D(real), ones)
        err_real.backward()
        fake = G(torch.randn(64, 16))
        err_fake = F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        err_fake.backward()
        opt_d.step()
        G.zero_grad()
        err_g = F.binary_cross_entropy_with_logits(D(fake), ones)
        err_g.backward()
        opt_g.step()
        print(f"step {step} loss {err_g.item():.4f}", flush=True)


def keep_graph(steps):
    """One optimizer, and a forward whose graph the script keeps across iterations (a leak of its own)."""
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kept = None
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        kept = model(x * 2).sum()  # never backwarded: its graph lives until the next iteration
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    del kept


def options():
    import json

    import gact

    comp = gact._run_compressor
    print(json.dumps({"options": dict(gact.options()), "group_size": comp.group_size, "swap": comp.swap}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("thread", "launcher", "by-hand", "grad-only", "accumulate", "by-data", "ddp", "forever", "gan", "keep-graph", "options"))
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.mode == "thread":
        t = threading.Thread(target=mlp_steps, args=(args.steps,))
        t.start()
        t.join()
    elif args.mode == "launcher":
        sys.exit(subprocess.call([sys.executable, os.path.abspath(__file__), "thread", "--steps", str(args.steps)]))
    elif args.mode == "by-hand":
        by_hand(args.steps)
    elif args.mode == "grad-only":
        grad_only(args.steps)
    elif args.mode == "accumulate":
        accumulate(args.steps)
    elif args.mode == "by-data":
        by_data(args.steps)
    elif args.mode == "ddp":
        ddp(args.steps)
    elif args.mode == "forever":
        mlp_steps(-1)
    elif args.mode == "gan":
        gan(args.steps)
    elif args.mode == "keep-graph":
        keep_graph(args.steps)
    else:
        options()


if __name__ == "__main__":
    main()
