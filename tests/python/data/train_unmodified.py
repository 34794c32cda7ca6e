"""A plain PyTorch training script that knows nothing of gact (used by
test_integration.py::test_gact_run_on_an_unmodified_script through gact-run).

Trains a small MLP on a fixed synthetic classification problem and prints
"step N loss L" per step.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    y = (x[:, :5].sum(1) > 0).long() + 2 * (x[:, 5:10].sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(args.steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
