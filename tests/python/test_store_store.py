"""The activation store through _gact: put/get/release per dtype and codec, dedup,
strided input kept in its layout, DLPack export, NaN, leaks, stats keys and bad input.

Each test reads the store's counters before and after, so tests do not depend on
each other through the process-wide store.
"""

import pytest
import torch

import _gact as C

from gact import _compat


def put_full(t, bits=4, key=1, seed=0, version=None, **kw):
    """(handle, offset, shared, strides, upgraded)"""
    return C.store_put(
        t.data_ptr(), _compat.DTYPE_NAMES[t.dtype], tuple(t.shape), tuple(t.stride()), -1,
        t._version if version is None else version, _compat.storage_base(t), key, bits, 256, seed, 0, **kw)


def put(t, bits=4, key=1, seed=0, version=None, **kw):
    return put_full(t, bits, key, seed, version, **kw)[0]


def get(h, like):
    """The decoded tensor, through DLPack, viewed as `like` was saved."""
    r = C.store_get_dlpack(h, tuple(like.shape), tuple(like.stride()) if _compat.is_dense(like)
                           else C.store_info(h)["strides"], 0)
    out = torch.utils.dlpack.from_dlpack(r)
    return out.view(torch.bool) if like.dtype is torch.bool else out


def delta(before, after, key):
    return after[key] - before[key]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_float_round_trip_is_quantized_within_one_step(dtype, bits):
    x = torch.randn(4, 3, 1000).to(dtype)
    h = put(x, bits=bits)
    info = C.store_info(h)
    assert info["codec"] == "quant" and info["bits"] == bits and info["shape"] == tuple(x.shape)
    assert info["bytes_stored"] < info["bytes_in"]
    y = get(h, x)
    # one quantization step of the tensor's whole range bounds every group's step
    step = (x.float().max() - x.float().min()) / (2**bits - 1)
    ulp = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    assert (y.float() - x.float()).abs().max() <= step * (1 + 1e-5) + x.float().abs().max() * ulp
    assert C.store_release(h) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_sq_ranges_matches_the_groups(dtype):
    x = (torch.randn(3000) * torch.linspace(0.1, 4, 3000)).to(dtype)
    h = put(x, bits=4)
    info = C.store_info(h)
    g = torch.cat([x.float(), x.float()[-1:].expand(-3000 % 256)]).view(-1, 256)
    want = ((g.max(1).values - g.min(1).values).double() ** 2).sum().item()
    assert info["groups"] == g.shape[0]
    assert info["sum_sq_ranges"] == pytest.approx(want, rel=1e-6)
    C.store_release(h)


@pytest.mark.parametrize("rank", [0, 1, 5, 9])
def test_any_rank_is_compressed(rank):
    shape = (2,) * rank if rank else ()
    x = torch.randn(shape) if rank < 9 else torch.randn((2,) * 9)
    h = put(x, bits=8)
    assert C.store_info(h)["codec"] == "quant"
    assert get(h, x).shape == x.shape
    C.store_release(h)


@pytest.mark.parametrize("bits", [16, 32])
def test_wide_bits_store_raw_and_exact(bits):
    x = torch.randn(100, 37)
    h = put(x, bits=bits)
    assert C.store_info(h)["codec"] == "raw"
    assert torch.equal(get(h, x), x)
    C.store_release(h)


def test_masks_and_other_integers():
    before = C.store_stats()
    b = torch.rand(300, 300) > 0.3
    u = (torch.rand(300, 300) > 0.3).to(torch.uint8)
    v = torch.randint(0, 200, (300, 300), dtype=torch.uint8)
    v[0, 0] = 2
    i = torch.randint(-1000, 1000, (300, 300))
    hs = [put(t) for t in (b, u, v, i)]
    assert [C.store_info(h)["codec"] for h in hs] == ["mask", "mask", "raw", "raw"]
    assert C.store_info(hs[0])["bytes_stored"] < b.numel() // 8 + 256
    for h, t in zip(hs, (b, u, v, i)):
        assert torch.equal(get(h, t), t)
        C.store_release(h)
    after = C.store_stats()
    assert after["codecs"]["mask"]["tensors"] - before["codecs"]["mask"]["tensors"] == 2
    assert after["codecs"]["raw"]["tensors"] - before["codecs"]["raw"]["tensors"] == 2


def test_dedup_refcount_and_version():
    before = C.store_stats()
    x = torch.randn(64, 64)
    h1 = put(x)
    h2 = put(x)
    assert h1 == h2 and C.store_info(h1)["refcount"] == 2
    x.add_(1)  # in-place write: new version, new contents, new entry
    h3 = put(x)
    assert h3 != h1
    after = C.store_stats()
    assert delta(before, after, "dedup_hits") == 1
    assert delta(before, after, "tensors_in") == 2
    # a view of the same storage and version is served from the same blob, at its offset
    rows = x[8:16]
    h4, off, shared, _, _ = put_full(rows)
    assert h4 == h3 and off == 8 * 64 and shared
    assert torch.equal(get(h4, rows) if off == 0 else torch.utils.dlpack.from_dlpack(
        C.store_get_dlpack(h4, tuple(rows.shape), tuple(rows.stride()), off)), get(h3, x)[8:16])
    C.store_release(h4)
    assert C.store_release(h1) == 1
    assert C.store_release(h1) == 0
    with pytest.raises(ValueError, match="unknown handle"):
        get(h1, x)
    assert C.store_release(h1) == -1
    assert delta(before, C.store_stats(), "bad_releases") == 1
    C.store_release(h3)


def test_forget_stops_dedup():
    x = torch.randn(64, 64)
    h1 = put(x)
    C.store_forget(h1)
    h2 = put(x)
    assert h2 != h1
    C.store_release(h1)
    C.store_release(h2)


def test_new_step_stops_dedup():
    x = torch.randn(64, 64)
    h1 = put(x)
    C.store_begin_step(1000)
    h2 = put(x)
    assert h2 != h1
    C.store_release(h1)
    C.store_release(h2)


@pytest.mark.parametrize("make,gathered", [
    (lambda: torch.randn(300, 200).t(), False),
    (lambda: torch.randn(40, 50, 60)[:, ::3, 7:], True),
    (lambda: torch.randn(10, 1, 500).expand(10, 4, 500), True),
    (lambda: torch.randn(8, 3, 32, 32).permute(0, 2, 3, 1), False),
    (lambda: torch.randn(8, 3, 32, 32).contiguous(memory_format=torch.channels_last), False),
])
def test_strided_views_decode_to_their_layout(make, gathered):
    x = make()
    assert not x.is_contiguous()
    before = C.store_stats()
    h, _, _, strides, _ = put_full(x, bits=32)  # raw: exact, so the gather itself is checked
    y = get(h, x)
    assert torch.equal(y, x)
    if not gathered:  # dense views keep their own strides (channels_last stays channels_last)
        assert y.stride() == x.stride() and tuple(strides) == x.stride()
    else:  # others get dense strides in their own dim order, as empty_like gives
        assert y.stride() == torch.empty_like(x).stride() == tuple(strides)
    C.store_release(h)
    h = put(x, bits=8)
    y = get(h, x)
    step = (x.max() - x.min()) / 255
    assert (y - x).abs().max() <= step * (1 + 1e-5)
    C.store_release(h)
    assert delta(before, C.store_stats(), "gathers") == (2 if gathered else 0)


def test_decoded_tensors_share_one_image_and_return_it_to_the_pool():
    x = torch.randn(64, 1024)
    h = put(x, bits=4)
    before = C.store_stats()
    a, b = get(h, x), get(h, x)
    assert a.data_ptr() == b.data_ptr()  # decoded once while alive
    assert delta(before, C.store_stats(), "decodes") == 1
    ptr = a.data_ptr()
    del a, b
    c = get(h, x)  # decoded again, into the block the first image returned to the pool
    assert delta(before, C.store_stats(), "decodes") == 2 and c.data_ptr() == ptr
    del c
    C.store_release(h)


def test_nonfinite_is_stored_raw_and_counted():
    before = C.store_stats()
    x = torch.randn(50, 100)
    x[3, 4] = float("nan")
    x[7, 1] = -float("inf")
    h = put(x)
    assert C.store_info(h)["codec"] == "raw"
    y = get(h, x)
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(x))
    C.store_release(h)
    assert delta(before, C.store_stats(), "nonfinite_fallbacks") == 1


def test_leaks_are_counted_at_end_of_step():
    # The store is process-wide: graphs that earlier tests still hold keep their handles
    # alive, and every end_step counts them. Measure against what is alive on entry.
    import gc
    gc.collect()
    before = C.store_stats()
    live0 = before["live_handles"]
    C.store_begin_step(1)
    x = torch.randn(100, 100)
    h = put(x)
    assert C.store_end_step() == live0 + 1
    mid = C.store_stats()
    assert delta(before, mid, "leaks") == live0 + 1 and mid["leaks_last_step"] == live0 + 1
    assert mid["bytes_stored_current"] >= C.store_info(h)["bytes_stored"]
    C.store_release(h)  # the leaked handle stays valid until released
    assert C.store_end_step() == live0
    assert C.store_stats()["live_handles"] == live0


def test_stats_keys():
    s = C.store_stats()
    for k in ("tensors_in", "bytes_in", "bytes_stored", "ratio", "codecs", "quant_bits", "skipped",
              "skipped_tensors", "skipped_bytes", "dedup_hits", "nonfinite_fallbacks", "live_handles",
              "bytes_stored_current", "bytes_stored_peak", "leaks", "leaks_last_step", "steps", "bytes_encoded",
              "boundary_blobs", "last_step"):
        assert k in s, k
    assert set(s["last_step"]) == {"bytes_in", "bytes_encoded", "bytes_decoded"}
    assert set(s["codecs"]) == {"raw", "quant", "mask", "window"}
    assert set(s["skipped"]) == {"parameter", "small", "dtype", "excluded", "input", "layout", "device", "stats",
                                 "exact", "memory"}
    assert set(s["unstored"]) == {"shape", "held"}
    assert set(s["roles"]) == {"values", "predicate", "indices"}
    doc = C.stats_document()
    assert doc["store"].keys() == s.keys() and "schema_version" in doc


def test_note_skip_counts_by_reason():
    before = C.store_stats()["skipped"]["small"]
    C.store_note_skip("small", 100)
    after = C.store_stats()["skipped"]["small"]
    assert after["tensors"] - before["tensors"] == 1 and after["bytes"] - before["bytes"] == 100
    with pytest.raises(ValueError, match="skip reason"):
        C.store_note_skip("tired", 1)


def test_bad_input_is_rejected_by_name():
    x = torch.randn(10, 10)
    with pytest.raises(ValueError, match="bits=3"):
        put(x, bits=3)
    p = x.data_ptr()
    with pytest.raises(ValueError, match="dtype"):
        C.store_put(p, "complex64", (10, 10), (10, 1), -1, 0, p, 0, 4, 256, 0, 0)
    with pytest.raises(ValueError, match="strides"):
        C.store_put(p, "float32", (10, 10), (1,), -1, 0, p, 0, 4, 256, 0, 0)
    with pytest.raises(ValueError, match="null data"):
        C.store_put(0, "float32", (10, 10), (10, 1), -1, 0, 0, 0, 4, 256, 0, 0)
    with pytest.raises(ValueError, match="group"):
        put_bad_group = C.store_put(p, "float32", (10, 10), (10, 1), -1, 0, p, 0, 4, 100, 0, 0)[0]
        C.store_release(put_bad_group)
    with pytest.raises(ValueError, match="role"):
        C.store_put(p, "float32", (10, 10), (10, 1), -1, 0, p, 0, 4, 256, 0, 0, role="everything")
    with pytest.raises(ValueError, match="predicate"):
        C.store_put(p, "float32", (10, 10), (10, 1), -1, 0, p, 0, 4, 256, 0, 0, role="predicate",
                    pred=("sometimes", 0.0, 0.0))
    h = put(x)
    with pytest.raises(ValueError, match="destination"):
        C.store_get(h, x.data_ptr(), 12, 0)
    with pytest.raises(ValueError, match="outside the decoded image"):
        C.store_get_dlpack(h, (10, 10), (10, 1), 5)
    with pytest.raises(ValueError, match="holds no predicate"):
        C.store_get_dlpack(h, (10, 10), (10, 1), 0, predicate=True)
    C.store_release(h)


def test_a_signal_during_a_put_undoes_it():
    """A Ctrl-C that came while the store encoded raised from its handler as soon as store_put returned, before Python
    held the handle: the blob stayed stored, owned by nothing, a leak at every later step that abort_step() and close()
    could not reach (86 handles after 300 steps interrupted at random points). The binding runs the handler itself
    and undoes the put: the exception reaches the caller and nothing stays stored."""
    import signal

    class Interrupted(Exception):
        pass

    def handler(*_):
        raise Interrupted

    x = torch.randn(32 << 20)  # (128 MiB: its encode takes far longer than the timer's millisecond)
    before = C.store_live_handles()
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.001)
        with pytest.raises(Interrupted):
            put(x, 4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert C.store_live_handles() == before
