"""gact.codecs from Python: blobs are bytes, round trips, determinism, clear errors.

Error bounds come from the codec's math (codecs/quant_math.hpp): per group,
step = (max - min) / (2^b - 1) and stochastic rounding moves a value by less than
one step; float16/bfloat16 outputs add at most one rounding of the output dtype.
"""

import pytest
import torch

import gact
from gact import codecs

GROUP = 256


def group_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-element bound on |x - decode(encode(x))| for the quant codec."""
    flat = x.detach().float().flatten()
    pad = (-flat.numel()) % GROUP
    g = torch.cat([flat, flat[-1:].expand(pad)]) if pad else flat
    g = g.view(-1, GROUP)
    step = (g.max(1).values - g.min(1).values) / (2**bits - 1)
    bound = step.repeat_interleave(GROUP)[: flat.numel()]
    ulp = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[x.dtype]
    return (bound * (1 + 1e-5) + flat.abs() * ulp + 1e-30).view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quant_round_trip_within_one_step(dtype, bits):
    x = (torch.randn(3, 5, 700) * 3 + 1).to(dtype)
    blob = codecs.encode(x, bits=bits, seed=7, key=3)
    assert isinstance(blob, bytes) and isinstance(blob, codecs.Blob)
    assert blob.codec == "quant" and blob.bits == bits and blob.dtype == dtype
    assert blob.shape == x.shape and blob.numel == x.numel()
    y = codecs.decode(blob)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    err = (y.float() - x.float()).abs()
    assert bool((err <= group_bound(x, bits)).all()), f"max error {err.max().item()}"
    # size: header + (min, max) per group + bits per element, nothing near the input size
    groups = -(-x.numel() // GROUP)
    payload = groups * 2 * x.element_size() + -(-x.numel() * bits // 8)
    assert payload <= len(blob) <= payload + 1024


def test_blob_is_bytes_like_and_survives_a_bytes_round_trip():
    x = torch.randn(1000)
    blob = codecs.encode(x, bits=4, seed=1)
    raw = bytes(blob)
    assert type(raw) is bytes and len(raw) == len(blob)
    again = codecs.Blob.from_bytes(bytearray(raw))
    assert again == blob and again.seed == 1 and again.bits == 4
    assert torch.equal(codecs.decode(again), codecs.decode(blob))
    assert torch.equal(codecs.decode(memoryview(raw)), codecs.decode(blob))
    assert "quant" in repr(blob)


def test_same_seed_same_blob_other_seed_other_noise():
    x = torch.randn(4096)
    a = codecs.encode(x, bits=2, seed=5, key=9)
    b = codecs.encode(x, bits=2, seed=5, key=9)
    c = codecs.encode(x, bits=2, seed=6, key=9)
    d = codecs.encode(x, bits=2, seed=5, key=10)
    assert a == b
    assert not torch.equal(codecs.decode(a), codecs.decode(c))
    assert not torch.equal(codecs.decode(a), codecs.decode(d))


@pytest.mark.parametrize("damage", ["truncate", "magic", "checksum", "empty"])
def test_corrupt_blob_raises_a_clear_error(damage):
    blob = bytearray(codecs.encode(torch.randn(2048), bits=4))
    if damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "magic":
        blob[0] ^= 0xFF
    elif damage == "checksum":
        blob[20] ^= 0x01  # inside the header: numel
    else:
        blob = bytearray()
    with pytest.raises(codecs.CorruptBlobError) as e:
        codecs.decode(bytes(blob))
    assert str(e.value)
    assert issubclass(codecs.CorruptBlobError, gact.GactError)


def test_masks_are_exact_and_one_bit():
    b = torch.rand(64, 129) > 0.5
    blob = codecs.encode(b)
    assert blob.codec == "mask" and len(blob) < b.numel() // 8 + 256
    assert torch.equal(codecs.decode(blob), b)
    u = b.to(torch.uint8)
    blob = codecs.encode(u)
    assert blob.codec == "mask"
    assert torch.equal(codecs.decode(blob), u)
    v = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    v[0] = 7
    blob = codecs.encode(v)
    assert blob.codec == "raw"
    assert torch.equal(codecs.decode(blob), v)


def test_nan_falls_back_to_raw_unless_quant_was_asked_for():
    x = torch.randn(3000)
    x[17] = float("nan")
    x[18] = float("inf")
    blob = codecs.encode(x, bits=4)
    assert blob.codec == "raw"
    y = codecs.decode(blob)
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    assert torch.equal(y[~torch.isnan(x)], x[~torch.isnan(x)])
    with pytest.raises(ValueError, match="NaN"):
        codecs.encode(x, bits=4, codec="quant")


def test_float64_beyond_float32s_range_falls_back_to_raw_unless_quant_was_asked_for():
    """A finite float64 value past float32's range (quantized in float32, it would overflow): the codec refuses
    it. encode returned an empty blob and then raised CorruptBlobError('truncated header') on it."""
    x = torch.randn(4096, dtype=torch.float64)
    x[7] = 1e39
    blob = codecs.encode(x, bits=8)
    assert blob.codec == "raw"
    assert torch.equal(codecs.decode(blob), x)
    with pytest.raises(ValueError, match="float32's normal range"):
        codecs.encode(x, bits=8, codec="quant")


def test_bad_parameters_are_rejected_by_name():
    x = torch.randn(512)
    with pytest.raises(ValueError, match="bits"):
        codecs.encode(x, bits=3)
    with pytest.raises(ValueError, match="group"):
        codecs.encode(x, bits=4, group_size=100)
    with pytest.raises(ValueError, match="codec"):
        codecs.encode(x, codec="zip")
    with pytest.raises(TypeError):
        codecs.encode([1.0, 2.0])
