"""gact-bench quality: does bits="auto" train as well as uniform bits at its budget, on real data?

    gact-bench quality [--model digits|mnist|word_lm|all] [--budget 2] [--seeds 3] [--epochs N]
                       [--threads 1] [--json]

Each arm trains the same model from the same weights on the same batches (one seed sets
weights, batch order, dropout and gact's noise) and reports the final test loss:

  fp32      no Compressor
  uniformB  gact.Compressor(model, bits=B)
  autoB     gact.Compressor(model, bits="auto", budget=B): the plain API, default estimator

The data are what every Debian machine has offline: scikit-learn's bundled digits (1 797
8x8 images; half held out) and, for the word model, the license texts in
/usr/share/common-licenses (about 36 000 words; the last tenth of each file held out).

Models:
  digits   the demo's CNN (tools/demo.py), Adam, batch 64
  mnist    pytorch/examples' mnist script: its Net (two convolutions, dropout, 9216->128->10,
           log_softmax + nll_loss), Adadelta lr 1.0 with StepLR(gamma 0.7) per epoch, batch 64,
           on the digits upsampled to 28x28 and normalized as that script normalizes MNIST
  word_lm  pytorch/examples' word_language_model (LSTM): embedding 200, 2 LSTM layers of 200,
           dropout 0.2, tied-size decoder, SGD lr 20 with clipping 0.25, bptt 35, batch 20

The verdict per model: auto is "no worse" when its mean test loss over the seeds is at most
uniform's mean plus twice the standard error of the difference of the paired seeds (the
seed-to-seed noise of the comparison). Exit status 0 either way; --json prints one line.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import gact

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("digits", "mnist", "word_lm")


def _demo():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gact_demo", os.path.join(HERE, "..", "demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class MnistNet(nn.Module):
    """pytorch/examples mnist/main.py's Net."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


class WordLM(nn.Module):
    """pytorch/examples word_language_model's RNNModel (LSTM)."""

    def __init__(self, ntoken: int, ninp: int = 200, nhid: int = 200, nlayers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, x, hidden):
        emb = self.drop(self.encoder(x))
        out, hidden = self.rnn(emb, hidden)
        dec = self.decoder(self.drop(out)).view(-1, self.decoder.out_features)
        return F.log_softmax(dec, dim=1), hidden

    def init_hidden(self, bsz: int):
        z = torch.zeros(self.nlayers, bsz, self.nhid)
        return (z, z.clone())


def _compressor(model, arm: str, budget: float, seed: int):
    if arm == "fp32":
        return None
    if arm.startswith("uniform"):
        return gact.Compressor(model, bits=int(budget), seed=seed)
    return gact.Compressor(model, bits="auto", budget=budget, seed=seed)


def _forward(comp, fn):
    if comp is None:
        return fn()
    with comp:
        return fn()


def train_digits_like(kind: str, arm: str, budget: float, seed: int, epochs: int) -> dict:
    demo = _demo()
    x_tr, y_tr, x_te, y_te = demo.load_digits(seed)
    if kind == "mnist":
        up = lambda x: (F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False) - 0.1307) / 0.3081
        x_tr, x_te = up(x_tr), up(x_te)
    torch.manual_seed(seed)
    if kind == "mnist":
        model = MnistNet()
        opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        loss_fn = F.nll_loss
    else:
        model = demo.DigitsCNN()
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
        sched = None
        loss_fn = F.cross_entropy
    comp = _compressor(model, arm, budget, seed)
    gen = torch.Generator().manual_seed(seed)
    n, batch = len(y_tr), 64
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(n, generator=gen)
        for i in range(n // batch):
            idx = perm[i * batch:(i + 1) * batch]
            loss = _forward(comp, lambda: loss_fn(model(x_tr[idx]), y_tr[idx]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if comp is not None:
                comp.step()
        if sched is not None:
            sched.step()
    model.eval()
    with torch.no_grad():
        out = model(x_te)
        test_loss = float(loss_fn(out, y_te))
        acc = float((out.argmax(1) == y_te).float().mean())
    return _finish(comp, {"test_loss": test_loss, "accuracy": acc})


def _license_corpus():
    """Word streams of the license texts (each file once: several names are links to one text)."""
    seen, train, test = set(), [], []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        real = os.path.realpath(path)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        with open(real, encoding="utf-8", errors="replace") as f:
            words = []
            for line in f:
                words += line.split() + ["<eos>"]
        cut = len(words) * 9 // 10
        train += words[:cut]
        test += words[cut:]
    if len(train) < 5000:
        raise SystemExit("gact-bench quality: /usr/share/common-licenses has too little text for word_lm")
    vocab = {w: i for i, w in enumerate(sorted(set(train)))}
    unk = len(vocab)
    ids = lambda ws: torch.tensor([vocab.get(w, unk) for w in ws], dtype=torch.long)
    return ids(train), ids(test), unk + 1


def _batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    n = data.size(0) // bsz
    return data[: n * bsz].view(bsz, -1).t().contiguous()


def train_word_lm(arm: str, budget: float, seed: int, epochs: int) -> dict:
    train_ids, test_ids, ntoken = _license_corpus()
    torch.manual_seed(seed)
    model = WordLM(ntoken)
    comp = _compressor(model, arm, budget, seed)
    bptt, lr, clip = 35, 20.0, 0.25
    train_data, test_data = _batchify(train_ids, 20), _batchify(test_ids, 10)
    for _ in range(epochs):
        model.train()
        hidden = model.init_hidden(20)
        for i in range(0, train_data.size(0) - 1, bptt):
            seq = min(bptt, train_data.size(0) - 1 - i)
            x, y = train_data[i:i + seq], train_data[i + 1:i + 1 + seq].reshape(-1)
            hidden = tuple(h.detach() for h in hidden)
            model.zero_grad()

            def fwd():
                out, h = model(x, hidden)
                return F.nll_loss(out, y), h

            loss, hidden = _forward(comp, fwd)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-lr)
            if comp is not None:
                comp.step()
        lr /= 1.5  # (the script divides by 4 when validation stops improving; a fixed decay here)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        hidden = model.init_hidden(10)
        for i in range(0, test_data.size(0) - 1, bptt):
            seq = min(bptt, test_data.size(0) - 1 - i)
            out, hidden = model(test_data[i:i + seq], hidden)
            total += float(F.nll_loss(out, test_data[i + 1:i + 1 + seq].reshape(-1), reduction="sum"))
            count += out.size(0)
    test_loss = total / count
    return _finish(comp, {"test_loss": test_loss, "perplexity": math.exp(test_loss)})


def _finish(comp, row: dict) -> dict:
    if comp is not None:
        s = comp.stats()["store"]
        row["store_ratio"] = s["bytes_in"] / s["bytes_stored"] if s["bytes_stored"] else 0.0
        comp.close()
    return row


DEFAULT_EPOCHS = {"digits": 20, "mnist": 14, "word_lm": 3}


def run_model(model: str, budget: float, seeds: int, epochs: int | None) -> dict:
    epochs = epochs or DEFAULT_EPOCHS[model]
    b = int(budget)
    arms = ["fp32", f"uniform{b}", f"auto{b}"]
    rows: dict = {a: [] for a in arms}
    for seed in range(seeds):
        for arm in arms:
            t0 = time.perf_counter()
            if model == "word_lm":
                r = train_word_lm(arm, budget, seed, epochs)
            else:
                r = train_digits_like(model, arm, budget, seed, epochs)
            r["seconds"] = time.perf_counter() - t0
            rows[arm].append(r)
            print(f"gact-bench quality: {model} seed {seed} {arm:9s} test loss {r['test_loss']:.4f}"
                  + (f", store ratio {r['store_ratio']:.2f}x" if "store_ratio" in r else "")
                  + f" ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    mean = {a: statistics.fmean(r["test_loss"] for r in rows[a]) for a in arms}
    diff, se, no_worse = verdict([r["test_loss"] for r in rows[f"auto{b}"]],
                                 [r["test_loss"] for r in rows[f"uniform{b}"]])
    return {"model": model, "budget": budget, "epochs": epochs, "seeds": seeds, "arms": rows, "mean_test_loss": mean,
            "auto_minus_uniform": diff, "se_of_difference": se, "auto_no_worse": no_worse}


def verdict(auto: list, uniform: list) -> tuple:
    """(mean of the paired differences auto - uniform, its standard error, whether auto is no worse: the mean
    difference at most twice its standard error). One seed has no standard error: a bare comparison, no worse
    only if not higher."""
    diffs = [a - u for a, u in zip(auto, uniform)]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return mean, se, mean <= 2.0 * se


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="all", choices=MODELS + ("all",))
    ap.add_argument("--budget", type=int, default=2, choices=(1, 2, 4, 8),
                    help="bits of the uniform arm and budget of the auto arm (default 2, gact's default budget)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=0, help="epochs (default: digits 20, mnist 14, word_lm 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    torch.set_num_threads(args.threads)
    models = MODELS if args.model == "all" else (args.model,)
    results = [run_model(m, float(args.budget), args.seeds, args.epochs or None) for m in models]
    print(f"\ngact-bench quality: final test loss, mean over {args.seeds} seeds (torch {torch.__version__})")
    b = args.budget
    print(f"{'model':8s} {'epochs':>6s} {'fp32':>8s} {'uniform' + str(b):>9s} {'auto' + str(b):>8s} "
          f"{'auto-uniform':>13s} {'2 SE':>7s}  verdict")
    for r in results:
        m = r["mean_test_loss"]
        print(f"{r['model']:8s} {r['epochs']:6d} {m['fp32']:8.4f} {m[f'uniform{b}']:9.4f} {m[f'auto{b}']:8.4f} "
              f"{r['auto_minus_uniform']:+13.4f} {2 * r['se_of_difference']:7.4f}  "
              + ("auto no worse" if r["auto_no_worse"] else "AUTO WORSE"))
    if args.json:
        print(json.dumps({"bench": "quality", "torch": torch.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
