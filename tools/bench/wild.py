"""Models no gact test was written around, for `gact-bench train --wild`: torchvision's classifiers,
detection, segmentation and video models, a GRU language model, a hand-written causal attention block
and torch's transformer decoder, each with fresh weights, train mode and a small input.

Each entry builds (model, forward) where forward() runs one forward pass and returns what the model
returns (a tensor, a tuple or torchvision's dict of losses); `loss_of` turns that into one scalar.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


def loss_of(out: Any) -> torch.Tensor:
    """Sum of the mean squares of every tensor the model returned (a detection model's dict of losses too)."""
    if isinstance(out, dict):
        return sum(loss_of(v) for v in out.values())
    if isinstance(out, (list, tuple)):
        return sum(loss_of(v) for v in out)
    return out.float().square().mean()


def _classifier(name: str, batch: int, size: int, **kw) -> Callable[[], tuple]:
    def build():
        import torchvision as tv
        m = getattr(tv.models, name)(num_classes=10, **kw)
        x = torch.randn(batch, 3, size, size)
        return m, lambda: m(x)
    return build


def _detection():
    import torchvision as tv
    m = tv.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(num_classes=3, weights=None, weights_backbone=None)
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 160, 160, generator=g) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 90.0, 120.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[30.0, 30.0, 100.0, 80.0]]), "labels": torch.tensor([2])}]
    return m, lambda: m(images, targets)


def _segmentation(name: str):
    def build():
        import torchvision as tv
        kw = {"aux_loss": True} if name.startswith("deeplab") else {}
        m = getattr(tv.models.segmentation, name)(num_classes=5, weights=None, weights_backbone=None, **kw)
        x = torch.randn(2, 3, 96, 96)
        return m, lambda: m(x)
    return build


def _video():
    import torchvision as tv
    m = tv.models.video.r3d_18(num_classes=5)
    x = torch.randn(2, 3, 8, 64, 64)
    return m, lambda: m(x)


class _GruLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        self.rnn = nn.GRU(64, 128, 2, batch_first=True)
        self.out = nn.Linear(128, 500)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.out(self.rnn(self.emb(t))[0]), -1)


def _gru():
    m = _GruLM()
    t = torch.randint(0, 500, (8, 30), generator=torch.Generator().manual_seed(0))
    return m, lambda: m(t)


class _CausalBlock(nn.Module):
    """Pre-norm causal self-attention written out by hand (no nn.MultiheadAttention), then an MLP."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        a = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


def _causal():
    m = nn.Sequential(*[_CausalBlock() for _ in range(3)])
    x = torch.randn(4, 32, 64)
    return m, lambda: m(x)


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(64, 4, 128, batch_first=True, norm_first=True)
        self.dec = nn.TransformerDecoder(layer, 2)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.dec(tgt, memory, tgt_mask=mask)


def _decoder():
    m = _Decoder()
    tgt, memory = torch.randn(4, 20, 64), torch.randn(4, 12, 64)
    return m, lambda: m(tgt, memory)


#: name -> builder of (model, forward)
MODELS: dict[str, Callable[[], tuple]] = {
    "convnext_tiny, 64 px, b4": _classifier("convnext_tiny", 4, 64),
    "swin_t, 64 px, b2": _classifier("swin_t", 2, 64),
    "swin_v2_t, 64 px, b2": _classifier("swin_v2_t", 2, 64),
    "efficientnet_b0, 64 px, b4": _classifier("efficientnet_b0", 4, 64),
    "regnet_y_400mf, 64 px, b4": _classifier("regnet_y_400mf", 4, 64),
    "googlenet, 64 px, b4": _classifier("googlenet", 4, 64, aux_logits=False, init_weights=True),
    "mnasnet0_5, 64 px, b4": _classifier("mnasnet0_5", 4, 64),
    "resnext50_32x4d, 64 px, b4": _classifier("resnext50_32x4d", 4, 64),
    "fasterrcnn_mobilenet_v3 (train losses)": _detection,
    "lraspp_mobilenet_v3, 96 px": _segmentation("lraspp_mobilenet_v3_large"),
    "deeplabv3_mobilenet_v3 + aux, 96 px": _segmentation("deeplabv3_mobilenet_v3_large"),
    "r3d_18, 8 x 64 px": _video,
    "GRU LM (2 x 128)": _gru,
    "hand-written causal attention (3 x 64)": _causal,
    "nn.TransformerDecoder (2 x 64)": _decoder,
}
