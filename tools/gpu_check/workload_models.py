"""Models, synthetic batches and result files shared by the GPU check's torch workloads.

Everything is defined here so nothing is downloaded and torchvision is not needed:
ResNet-50 (bottleneck blocks [3, 4, 6, 3], 224x224 RGB, 1000 classes) and a BERT-base-like
encoder (12 layers of torch.nn.TransformerEncoderLayer, d_model 768, 12 heads, FFN 3072,
GELU, vocabulary 30522, masked-token prediction on random tokens). Inputs are random
tensors from a seeded generator, made on the target device.

``Result`` is the JSON file a workload leaves for gpu-check (``--result PATH``): ``ok``,
``error`` and ``figures``, rewritten atomically every time it changes, so a workload killed by
its timeout still leaves what it had measured.
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn


# ---- ResNet-50 ------------------------------------------------------------------------------

class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + idt)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        layers, cin = [], width
        for i, blocks in enumerate((3, 4, 6, 3)):
            w = width * (2 ** i)
            for b in range(blocks):
                layers.append(Bottleneck(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


# ---- BERT-base-like encoder -----------------------------------------------------------------

class BertLike(nn.Module):
    def __init__(self, vocab: int = 30522, d_model: int = 768, heads: int = 12, ffn: int = 3072,
                 layers: int = 12, max_len: int = 512):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.norm = nn.LayerNorm(d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.norm(self.tok(tokens) + self.pos(pos)[None])
        return self.head(self.encoder(h))


# ---- workloads ------------------------------------------------------------------------------

MODELS: Dict[str, Dict[str, Any]] = {
    # name: constructor, default batch, and the per-sample input shape
    "resnet50": {"make": ResNet50, "batch": 64, "sample": (3, 224, 224), "max_batch": 4096},
    "bert_base": {"make": BertLike, "batch": 32, "sample": (128,), "max_batch": 8192},
}


def make_batch(name: str, batch: int, device: torch.device, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets for model `name` (targets: class ids, or token ids per position)."""
    spec = MODELS[name]
    if name == "resnet50":
        x = torch.randn((batch,) + spec["sample"], generator=gen, device="cpu").to(device)
        y = torch.randint(0, 1000, (batch,), generator=gen).to(device)
    else:
        seq = spec["sample"][0]
        x = torch.randint(0, 30522, (batch, seq), generator=gen).to(device)
        y = torch.randint(0, 30522, (batch, seq), generator=gen).to(device)
    return x, y


def loss_of(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "resnet50":
        return nn.functional.cross_entropy(out, y)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def is_oom(exc: BaseException) -> bool:
    """True for torch's CUDA out-of-memory error (a RuntimeError subclass in torch >= 1.13)."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc)


class Result:
    """The workload's result file: ``{"ok": bool, "error": str, "figures": {...}}``."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self.data: Dict[str, Any] = {"ok": False, "error": "", "figures": {}}

    @property
    def figures(self) -> Dict[str, Any]:
        return self.data["figures"]

    def save(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def run(self, body: Callable[["Result"], None]) -> int:
        """Run `body(self)`; any exception becomes ok=False with its text. @returns the exit status."""
        try:
            body(self)
            self.data["ok"] = not self.data["error"]
        except BaseException as exc:  # reported in the file, and by the exit status
            self.data["ok"] = False
            self.data["error"] = f"{type(exc).__name__}: {exc}"
            self.data["traceback"] = traceback.format_exc()[-4000:]
            print(self.data["traceback"], flush=True)
        self.save()
        print("result: " + json.dumps({"ok": self.data["ok"], "error": self.data["error"]}), flush=True)
        return 0 if self.data["ok"] else 1
