"""gact's codecs, directly: encode a tensor into a self-describing blob and back.

``encode(tensor, bits=4)`` returns a :class:`Blob`, a ``bytes`` subclass (so it
is bytes-like: ``len(blob)`` is the stored size, ``bytes(blob)`` the raw bytes,
it can be written to a file or sent over a socket) whose header fields are
available as attributes. ``Blob.from_bytes(b)`` validates bytes read back, and
``decode(blob)`` rebuilds the tensor (contiguous). A corrupt blob raises
:class:`CorruptBlobError` naming what failed; nothing is read out of bounds.

The codec is chosen from the dtype unless given: float32/float16/bfloat16 ->
``quant`` (per-group min/max, stochastic rounding to ``bits`` bits), bool and
0/1 uint8 -> ``mask`` (1 bit per element), anything else -> ``raw``. A float
tensor holding NaN or Inf is encoded ``raw`` (lossless) unless ``codec="quant"``
was asked for explicitly, which then raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

import _gact as _C

from . import _compat

CorruptBlobError = _C.CorruptBlobError

__all__ = ["Blob", "CorruptBlobError", "encode", "decode"]


def _blob_bytes(data: Any, where: str) -> bytes:
    """The bytes of a bytes-like ``data`` (bytes, bytearray, memoryview, Blob, any buffer).

    Anything else is a TypeError: ``bytes(10**10)`` would be ten billion zero bytes, and
    ``bytes([1, 2])`` or a str would be a blob nobody meant."""
    if isinstance(data, bytes):
        return bytes(data) if type(data) is not bytes else data
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"{where}: expected a blob as bytes, bytearray or memoryview, "
                        f"not {type(data).__name__}") from None
    with view:
        return view.tobytes()


class Blob(bytes):
    """An encoded tensor: the blob's bytes, with its header fields as attributes
    (``codec``, ``dtype`` (a torch dtype), ``shape``, ``numel``, ``bits``, ``group_size``,
    ``seed``, ``key``). ``Blob(data)`` validates ``data`` like :meth:`from_bytes`.

    Raises:
        TypeError: for data that is not bytes-like.
        CorruptBlobError: when the header or sizes do not check out.
    """

    _info: dict

    def __new__(cls, data: Any) -> "Blob":
        raw = _blob_bytes(data, "gact.codecs.Blob")
        info = _C.codec_parse(raw)
        b = super().__new__(cls, raw)
        b._info = info
        return b

    @classmethod
    def from_bytes(cls, data: Any) -> "Blob":
        """Validate ``data`` (bytes, bytearray, memoryview, Blob) as a blob.

        Raises:
            TypeError: for data that is not bytes-like.
            CorruptBlobError: when the header or sizes do not check out.
        """
        return cls(data)

    def _field(self, name: str) -> Any:
        return self._info[name]

    @property
    def codec(self) -> str:
        return self._field("codec")

    @property
    def dtype(self) -> torch.dtype:
        return _compat.NAME_DTYPES[self._field("dtype")]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._field("shape"))

    @property
    def numel(self) -> int:
        return self._field("numel")

    @property
    def bits(self) -> int:
        return self._field("bits")

    @property
    def group_size(self) -> int:
        return self._field("group_size")

    @property
    def seed(self) -> int:
        return self._field("seed")

    @property
    def key(self) -> int:
        return self._field("key")

    def decode(self, device: Any = None) -> torch.Tensor:
        return decode(self, device=device)

    def __repr__(self) -> str:
        return (
            f"gact.codecs.Blob(codec={self.codec!r}, dtype={self.dtype}, shape={tuple(self.shape)}, "
            f"bits={self.bits}, bytes={len(self)})"
        )

    __str__ = __repr__


def _pick_codec(t: torch.Tensor) -> str:
    if t.dtype in _compat.FLOAT_DTYPES:
        return "quant"
    if t.dtype == torch.bool:
        return "mask"
    if t.dtype == torch.uint8 and (t.numel() == 0 or bool(((t == 0) | (t == 1)).all())):
        return "mask"
    return "raw"


def encode(
    tensor: torch.Tensor,
    bits: int = 4,
    group_size: int = 256,
    seed: int = 0,
    key: int = 0,
    codec: str | None = None,
) -> Blob:
    """Encode ``tensor`` (any device; CUDA tensors are copied to the host first).

    Args:
        bits: 1, 2, 4 or 8 (quant codec).
        group_size: elements per quantization group, a power of two in [64, 1024].
        seed, key: the stochastic-rounding noise stream (same inputs, same blob).
        codec: ``"quant"``, ``"mask"`` or ``"raw"``; default: chosen from the dtype.

    Raises:
        ValueError: for an unsupported dtype, bits, group size, codec, or NaN/Inf (float64 values outside
            float32's normal range, nonzero ones below it included) with codec="quant"; without ``codec``
            such a tensor is stored raw.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"gact.codecs.encode: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _compat.DTYPE_NAMES:
        raise ValueError(f"gact.codecs.encode: dtype {tensor.dtype} is not supported")
    if tensor.layout != torch.strided:
        raise ValueError(f"gact.codecs.encode: layout {tensor.layout} is not supported (dense tensors only)")
    for name, v in (("bits", bits), ("group_size", group_size), ("seed", seed), ("key", key)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"gact.codecs.encode: {name}={v!r} must be an integer")
    t = tensor.detach().to("cpu").contiguous()
    explicit = codec is not None
    c = codec if explicit else _pick_codec(t)
    shape = tuple(t.shape)
    blob, refused = _C.codec_encode(
        t.data_ptr(), _compat.DTYPE_NAMES[t.dtype], shape, c, int(bits), int(group_size), int(seed), int(key)
    )
    if refused is not None:
        if explicit:
            what = {"nonfinite": "holds NaN or Inf",
                    "float64_range": "holds float64 values outside float32's normal range or above 2^126 (quantized in float32)",
                    "wide": "holds a magnitude of 2^15 or more (a mask's fill such as torch.finfo(dtype).min), whose "
                            "quantization step would swamp every other value of its group"}
            raise ValueError(f"gact.codecs.encode: the tensor {what.get(refused, 'was refused (' + refused + ')')}, "
                             f"which codec={c!r} refuses; codec='raw' keeps it as it is")
        # (the codec chosen from the dtype refused it: kept as raw bytes, as the store keeps such a tensor)
        blob, _ = _C.codec_encode(
            t.data_ptr(), _compat.DTYPE_NAMES[t.dtype], shape, "raw", int(bits), int(group_size), int(seed), int(key)
        )
    return Blob.from_bytes(blob)


def decode(blob: Any, device: Any = None) -> torch.Tensor:
    """Decode a blob (Blob or any bytes-like object) into a new contiguous tensor on ``device``
    (default: the CPU).

    Raises:
        TypeError: for a blob that is not bytes-like (an int is not a size here).
        CorruptBlobError: when the blob fails validation.
    """
    b = blob if isinstance(blob, Blob) else Blob(_blob_bytes(blob, "gact.codecs.decode"))
    out = torch.empty(b.shape, dtype=b.dtype)
    _C.codec_decode(bytes(b), out.data_ptr(), out.numel() * out.element_size())
    if device is not None:
        out = out.to(device)
    return out
