"""Memory saved by compression: ratios on a CNN, a vision transformer and a GCN.

For each model one training step runs uncompressed under pass-through saved-tensor
hooks that sum the bytes autograd saves (evalkit.SavedBytesCounter: distinct tensors,
parameters, buffers and the caller's input batch left out, since they stay alive
either way and gact leaves them as they are), then one step runs under gact at 8, 4 and 2 bits. From the
store's counters (before/after snapshots, since the store is process-wide):

* store ratio = bytes_in / bytes_stored over the quant codec's blobs;
* coverage = 1 - (floating-point bytes gact kept as they are) / the baseline's
  floating-point saved bytes, the share of the activation memory gact compresses (a
  silent skip of a tensor kind shows up here);
* whole-step ratio = baseline saved bytes / (bytes stored + bytes kept as they are), the
  memory of saved activations with and without gact. A ReLU output read by the ReLU (its
  predicate) and by the next layer (its values) is one boundary blob; a pooling input read
  only for its shape costs nothing; normalization inputs carry their statistics (bfloat16,
  4 bytes per channel) and keep at least 8 bits when a channel has fewer than 64 elements.

Arithmetic behind the expected ratios (fp32, groups of 256): b bits per element plus
per-group metadata m bits (two fp16 numbers = 32 bits per group = 0.125 bit/element
with compact metadata, two fp32 = 0.25) plus a fixed header per blob: 32/(4+0.125) =
7.8x at 4 bits, 32/(2+0.125) = 15.1x at 2 bits, 32/(8+0.125) = 3.9x at 8 bits, less
the headers. Thresholds sit below the values measured with gact (in the comments).
"""

import pytest
import torch
import torch.nn.functional as F

import evalkit as k
import gact


def _resnet():
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, lambda m: F.cross_entropy(m(x), y), (x,)


def _vit():
    torch.manual_seed(0)
    model = k.TinyViT(image=32, patch=4, d_model=96, heads=4, layers=3)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, lambda m: F.cross_entropy(m(x), y), (x,)


def _gcn():
    graph = k.sbm_graph()
    torch.manual_seed(0)
    model = k.GCN(graph.x.shape[1], 64, 4, dropout=0.5)
    return model, lambda m: F.cross_entropy(m(graph.a_hat, graph.x)[graph.train], graph.y[graph.train]), (graph.a_hat, graph.x)


MODELS = {"resnet18": _resnet, "vit": _vit, "gcn": _gcn}

# Minimum store ratio (bytes_in / bytes_stored over the quant codec's blobs) and whole-step ratio
# per model and bits. Measured (fp32 metadata, groups of 256), 8/4/2 bits: store ratio resnet18
# 3.76/6.57/8.71 (its small late batch-norm inputs keep 8 bits, those under 1 024 values a block 4), vit
# 3.85/7.43/10.86 (its layer norms over 96 values keep 4 bits), gcn 3.87/7.50/14.12; coverage 98.8 %, 99.7 %,
# 99.7 %; whole-step ratio resnet18 4.47/7.32/9.25, vit 4.85/9.23/13.34, gcn 9.01/14.39/20.50.
RATIO_MIN = {
    "resnet18": {8: 3.5, 4: 6.0, 2: 8.3},
    # (vit at 2 bits: torch 1.13's attention maps over its 65 tokens keep a short softmax's 4 bits)
    "vit":      {8: 3.5, 4: 7.0, 2: 10.4},
    "gcn":      {8: 3.5, 4: 7.0, 2: 12.0},
}
WHOLE_MIN = {
    "resnet18": {8: 4.0, 4: 6.5, 2: 9.0},
    "vit":      {8: 4.5, 4: 8.5, 2: 12.8},  # (the maps and the layer norms' inputs at 4 bits as above)
    "gcn":      {8: 8.0, 4: 12.0, 2: 17.0},
}
if hasattr(torch.nn, "attention"):
    # torch 2.x: nn.MultiheadAttention runs a fused kernel that rebuilds the weights from q and k, which keep 8 bits
    # (README, "Known limits"): measured 3.85/6.42/8.77 store ratio, 5.39/8.90/12.03 whole-step under torch 2.6
    RATIO_MIN["vit"] = {8: 3.5, 4: 6.0, 2: 8.4}
    WHOLE_MIN["vit"] = {8: 4.5, 4: 8.0, 2: 11.5}
# Minimum share of the baseline's floating-point saved bytes that gact compresses.
COVERAGE_MIN = {"resnet18": 0.9, "vit": 0.9, "gcn": 0.9}


def _measure(name):
    model, loss_of, inputs = MODELS[name]()
    model.zero_grad(set_to_none=True)
    with k.SavedBytesCounter(model, inputs) as counter:
        loss = loss_of(model)
    loss.backward()
    rows = {}
    for bits in (8, 4, 2):
        before = gact.stats()
        comp = k.make_compressor(model, bits)
        k.compute_grad(model, loss_of, comp)
        comp.close()
        after = gact.stats()
        quant = {f: k.store_section(after)["codecs"]["quant"][f] - k.store_section(before)["codecs"]["quant"][f]
                 for f in ("bytes_in", "bytes_stored")}
        b_in, b_q = quant["bytes_in"], quant["bytes_stored"]
        b_st = k.store_delta(before, after, "bytes_stored")
        assert b_in > 0 and b_q > 0, f"{name} {bits}-bit: nothing compressed ({b_in=} {b_q=})"
        kept = {r: k.store_section(after)["skipped"][r]["bytes"] - k.store_section(before)["skipped"][r]["bytes"]
                for r in ("small", "excluded", "layout", "device", "dtype", "stats")}
        kept_float = kept["small"] + kept["excluded"] + kept["layout"] + kept["device"] + kept["stats"]
        whole = counter.total_bytes / (b_st + sum(kept.values()))
        rows[bits] = dict(ratio=b_in / b_q, coverage=1.0 - kept_float / counter.float_bytes, whole=whole,
                          bytes_in=b_in, bytes_stored=b_st)
    print(f"\n{name}: baseline saved {counter.total_bytes / 2**20:.2f} MiB "
          f"({counter.float_bytes / 2**20:.2f} MiB float, {counter.count} tensors)")
    for bits, r in rows.items():
        print(f"  {bits}-bit: store ratio {r['ratio']:.2f}x, coverage {100 * r['coverage']:.1f}%, "
              f"whole-step ratio {r['whole']:.2f}x ({r['bytes_stored'] / 2**20:.3f} MiB stored)")
    return counter, rows


@pytest.mark.parametrize("name", list(MODELS))
def test_compression_ratio(name):
    counter, rows = _measure(name)
    for bits, r in rows.items():
        assert r["ratio"] >= RATIO_MIN[name][bits], (
            f"{name} {bits}-bit: ratio {r['ratio']:.2f}x < {RATIO_MIN[name][bits]}x")
        assert r["whole"] >= WHOLE_MIN[name][bits], (
            f"{name} {bits}-bit: whole-step ratio {r['whole']:.2f}x < {WHOLE_MIN[name][bits]}x")
        assert r["coverage"] >= COVERAGE_MIN[name], (
            f"{name} {bits}-bit: only {100 * r['coverage']:.1f}% of the float saved bytes compressed")
        # Quantized blobs hold distinct float tensors the baseline saved too.
        assert r["bytes_in"] <= counter.float_bytes * 1.0001
    assert rows[2]["ratio"] > rows[4]["ratio"] > rows[8]["ratio"]
