"""Models, inputs and the result file shared by the GPU check's torch workloads.

Three models, each built from code or a config so that nothing is downloaded:

- ``resnet50``: torchvision's ``resnet50(weights=None)``, 224x224 RGB, 1000 classes;
- ``vit``: timm's ``vit_base_patch16_224`` (``pretrained=False``), 224x224, 1000 classes;
- ``bert``: transformers' ``BertForMaskedLM(BertConfig())`` (BERT-base), 128 tokens, every
  position a masked-LM target.

Where the library is missing (the development machine has none of timm and transformers)
an equivalent model defined here stands in, and ``source`` says which one ran. ``tiny``
gives small shapes of the same three for a CPU smoke run of the scripts. Inputs are random
tensors from a seeded generator.

``Result`` is the JSON file a workload leaves for gpu-check (``--result PATH``): ``ok``,
``error`` and ``figures``, rewritten atomically every time it changes, so a workload killed by
its timeout still leaves what it had measured.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

MODEL_NAMES = ("resnet50", "vit", "bert")


# ---- stand-ins defined here -------------------------------------------------------------

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
    """ResNet-50 (bottleneck blocks [3, 4, 6, 3]); `width` 64 is the standard one."""

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


class ViT(nn.Module):
    """A ViT classifier (patch embedding, class token, pre-norm encoder, linear head)."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 num_classes: int = 1000):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos
        return self.head(self.norm(self.encoder(t))[:, 0])


class BertLike(nn.Module):
    """A BERT-style masked-LM encoder (token + position embeddings, post-norm layers, LM head)."""

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


# ---- the workload of each model ---------------------------------------------------------

@dataclass
class Workload:
    """One model, how it was made, and its inputs."""

    name: str
    model: nn.Module
    source: str              # e.g. "torchvision.models.resnet50" or "stand-in (timm not importable: ...)"
    batch: int               # default batch size
    sample: Tuple[int, ...]  # per-sample input shape (image CHW, or (tokens,))
    classes: int             # classes (images) or vocabulary (tokens)
    tokens: bool             # token ids in, a prediction per position out

    def inputs(self, batch: int, device: torch.device, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets for `batch` samples (made on the CPU from `gen`, then moved)."""
        if self.tokens:
            x = torch.randint(0, self.classes, (batch,) + self.sample, generator=gen)
            y = torch.randint(0, self.classes, (batch,) + self.sample, generator=gen)
        else:
            x = torch.randn((batch,) + self.sample, generator=gen)
            y = torch.randint(0, self.classes, (batch,), generator=gen)
        return x.to(device), y.to(device)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        logits = getattr(out, "logits", out)      # transformers models return an output object
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _library_or_stand_in(make_lib: Callable[[], nn.Module], lib_name: str,
                         make_own: Callable[[], nn.Module]) -> Tuple[nn.Module, str]:
    try:
        return make_lib(), lib_name
    except ImportError as exc:
        return make_own(), f"stand-in defined in workload_models.py ({type(exc).__name__}: {exc})"


def make_workload(name: str, tiny: bool = False) -> Workload:
    """The workload `name` (one of MODEL_NAMES); `tiny` for small CPU shapes (always the stand-ins)."""
    if name == "resnet50":
        if tiny:
            return Workload(name, ResNet50(num_classes=10, width=8), "stand-in (tiny)", 4, (3, 32, 32), 10, False)

        def tv():
            import torchvision
            return torchvision.models.resnet50(weights=None)
        model, src = _library_or_stand_in(tv, "torchvision.models.resnet50(weights=None)", ResNet50)
        return Workload(name, model, src, 64, (3, 224, 224), 1000, False)
    if name == "vit":
        if tiny:
            return Workload(name, ViT(image=32, patch=8, dim=64, depth=2, heads=4, num_classes=10), "stand-in (tiny)",
                            4, (3, 32, 32), 10, False)

        def tm():
            import timm
            return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000)
        model, src = _library_or_stand_in(tm, "timm.create_model('vit_base_patch16_224', pretrained=False)", ViT)
        return Workload(name, model, src, 32, (3, 224, 224), 1000, False)
    if name == "bert":
        if tiny:
            return Workload(name, BertLike(vocab=1000, d_model=64, heads=4, ffn=128, layers=2, max_len=64),
                            "stand-in (tiny)", 4, (16,), 1000, True)

        def hf():
            import transformers
            return transformers.BertForMaskedLM(transformers.BertConfig())
        model, src = _library_or_stand_in(hf, "transformers.BertForMaskedLM(BertConfig())", BertLike)
        return Workload(name, model, src, 32, (128,), 30522, True)
    raise ValueError(f"unknown model '{name}'; choose from {', '.join(MODEL_NAMES)}")


def is_oom(exc: BaseException) -> bool:
    """True for an out-of-memory failure: torch's own, gact's (a MemoryError), or gact_torch_alloc's
    C++ exception, which torch raises as a RuntimeError reading 'CUDA out of memory'."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    if isinstance(exc, MemoryError):
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
