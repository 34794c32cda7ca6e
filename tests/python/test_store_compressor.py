"""gact.Compressor on small models: gradients, skip rules, keys, lifetime, stats.

Thresholds: at 8 bits the per-element noise is at most range/255 per group, so the
gradient of a small MLP stays within a cosine of 0.999 of fp32 (measured ~0.9997);
the test asks for 0.99 as the task states.
"""

import collections
import json
import contextlib
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import _gact as C
import gact
from evalkit import SaveArgs


def mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def grads(model, x, y, comp=None):
    model.zero_grad()
    if comp is not None:
        with comp:
            loss = F.cross_entropy(model(x), y)
    else:
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    if comp is not None:
        comp.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def store():
    return gact.stats()["store"]


def test_mlp_gradients_close_to_fp32_and_bytes_shrink():
    model = mlp()
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    g0 = grads(model, x, y)
    before = store()
    g8 = grads(model, x, y, gact.Compressor(model, bits=8))
    after = store()
    assert F.cosine_similarity(g0, g8, dim=0) > 0.99
    bytes_in = after["bytes_in"] - before["bytes_in"]
    stored = after["bytes_stored"] - before["bytes_stored"]
    assert after["tensors_in"] > before["tensors_in"]
    # 8 bits + 2 fp32 per 256-element group: about 3.9x smaller than fp32
    assert 0 < stored < bytes_in / 3.5
    g2 = grads(model, x, y, gact.Compressor(model, bits=2))
    assert 0.5 < F.cosine_similarity(g0, g2, dim=0) < F.cosine_similarity(g0, g8, dim=0)


def test_a_stored_save_leaves_few_objects_for_the_collector():
    """What a stored save leaves alive through the forward that Python's cyclic collector tracks: its _Packed and the
    weak reference to the saved tensor, nothing else (each full collection traverses every one of them; a torch.Size
    shape was a third). A chain of tanh saves its 64 results, each stored (the step's live records are counted in
    the step before: they are replaced when the next one opens)."""
    w = nn.Parameter(torch.ones(()))
    comp = gact.Compressor(bits=4)

    def forward():
        h = torch.randn(64, 256) * w
        for _ in range(64):
            h = torch.tanh(h)
        return h.sum()

    for step in range(2):  # (the second step: the first one's tables are made)
        gc.collect()
        before = len(gc.get_objects())
        with comp:
            loss = forward()
        gc.collect()
        added = len(gc.get_objects()) - before
        loss.backward()
        comp.step()
    assert 64 <= added <= 2 * 64 + 16, added


def test_parameters_views_inputs_small_and_integers_are_skipped():
    model = nn.Linear(256, 256)
    comp = gact.Compressor(model, bits=4, min_bytes=4096)
    inp = torch.randn(64, 256)  # the model's input: the caller holds it anyway
    before = store()
    with comp:
        u = model(inp)  # saves inp (input)
        x = torch.randn(64, 256, requires_grad=True) * 1.0  # an activation
        h = model(x)  # saves x (compressed) and weight.t() (a parameter view)
        z = torch.exp(h)  # saves its output: compressed
        tiny = torch.randn(4, requires_grad=True) * 2
        s = torch.sigmoid(tiny)  # saves a 16-byte output: small
        idx = torch.randint(0, 64, (64,))
        g = z.index_select(0, idx)  # saves the int64 index: dtype
        loss = g.sum() + s.sum() + u.sum()
    after = store()
    loss.backward()
    comp.step()
    sk = {r: after["skipped"][r]["tensors"] - before["skipped"][r]["tensors"] for r in after["skipped"]}
    assert sk["parameter"] >= 1 and sk["input"] >= 1 and sk["small"] >= 1 and sk["dtype"] >= 1, sk
    assert after["tensors_in"] - before["tensors_in"] == 2


def test_a_kept_expanded_tensor_counts_the_bytes_its_elements_occupy():
    """A tensor kept as it is counts its memory: an expanded one (stride 0) its storage's 256 floats, not the
    64 x 256 it shows; a dense one and a slice with gaps their elements; a window view (overlapping) its span."""
    from gact import _compat
    comp = gact.Compressor(None, bits=4, min_bytes=0)
    x = torch.randn(64, 256, requires_grad=True) * 1.0
    c = (torch.randn(1, 256, requires_grad=True) * 1.0)
    before = store()
    with comp:
        y = torch.maximum(x, c.expand(64, 256))  # maximum keeps both exact: x, and c expanded
    after = store()
    y.sum().backward()
    comp.step()
    comp.close()
    kept = after["skipped"]["exact"]["bytes"] - before["skipped"]["exact"]["bytes"]
    assert after["skipped"]["exact"]["tensors"] - before["skipped"]["exact"]["tensors"] == 2
    assert kept == (64 * 256 + 256) * 4, kept  # was 2 x 64 x 256 x 4
    base = torch.zeros(64, 256)
    assert _compat.held_bytes(base) == _compat.held_bytes(base.t()) == 64 * 256 * 4
    assert _compat.held_bytes(base[:, ::2]) == 64 * 128 * 4
    assert _compat.held_bytes(torch.zeros(100).unfold(0, 10, 1)) == 100 * 4  # 91 windows of 10 over 100 floats
    assert _compat.held_bytes(torch.zeros(0, 3).expand(0, 3)) == 0
    assert _compat.held_bytes(base[:, :1].expand(64, 256)) == 64 * 4  # a column, repeated
    h = torch.zeros(8, 64, 32)
    assert _compat.held_bytes(h[:, :1].expand(-1, 64, -1)) == 8 * 32 * 4  # a class token's row per sample


def test_parameters_recognised_after_the_model_changes_storage():
    model = nn.Linear(128, 128)
    comp = gact.Compressor(model, bits=4, min_bytes=0)
    model.double().float()  # new parameter storages after the Compressor was built
    x = torch.randn(32, 128, requires_grad=True)
    before = store()
    with comp:
        # mul saves w.detach() for x's gradient: neither a leaf that requires grad nor a view
        # of one; only the storage check recognises it
        out = (x * model.weight.detach()[:32]).sum()
    after = store()
    out.backward()
    comp.step()
    assert after["skipped"]["parameter"]["tensors"] - before["skipped"]["parameter"]["tensors"] == 1


def test_excluded_modules_and_tensors():
    model = mlp()
    comp = gact.Compressor(model, bits=4, exclude=[model[2]])
    x = torch.randn(64, 64)
    before = store()
    with comp:
        loss = model(x).sum()
    loss.backward()
    comp.step()
    mid = store()
    assert mid["skipped"]["excluded"]["tensors"] > before["skipped"]["excluded"]["tensors"]

    extra = torch.randn(64, 300, requires_grad=True)
    e2 = extra * 1.0  # a non-leaf sharing nothing with `extra`'s storage
    comp2 = gact.Compressor(None, bits=4, exclude=[extra])
    with comp2:
        out = (extra.exp() * 2).sum()  # exp saves its result (new storage): compressed
        out2 = torch.sin(extra[:, :100]).sum()  # sin saves a view of `extra`... a leaf view: parameter
    assert e2.requires_grad
    (out + out2).backward()
    comp2.step()
    with pytest.raises(TypeError, match="exclude"):
        gact.Compressor(model, exclude=[3])
    with pytest.raises(TypeError, match="exclude"):
        gact.Compressor(model, exclude=3)
    # one module given without a list is the list of it (it raised "'Linear' object is not iterable", naming nothing)
    comp3 = gact.Compressor(model, bits=4, exclude=model[2])
    assert comp3._excluded_modules == {id(m) for m in model[2].modules()}
    comp3.close()


def test_bf16_and_unusual_ranks_are_compressed():
    before = store()
    comp = gact.Compressor(None, bits=4)
    a = torch.randn(4096, requires_grad=True)  # 1-D
    b = torch.randn(2, 2, 4, 8, 32, requires_grad=True)  # 5-D
    c = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    with comp:
        loss = a.exp().sum() + b.exp().sum() + c.exp().float().sum()
    loss.backward()
    comp.step()
    after = store()
    assert after["tensors_in"] - before["tensors_in"] == 3
    assert after["codecs"]["quant"]["tensors"] - before["codecs"]["quant"]["tensors"] == 3
    # d/dc exp(c) = exp(c), read back from the 4-bit copy of exp's output
    assert F.cosine_similarity(c.grad.float().flatten(), c.exp().float().flatten(), dim=0) > 0.98


def test_dedup_and_dropout_masks():
    before = store()
    lin1, lin2 = nn.Linear(128, 128), nn.Linear(128, 128)
    x = torch.randn(64, 128, requires_grad=True)
    comp = gact.Compressor(None, bits=8)
    with comp:
        h = torch.relu(x * 2)  # relu output saved by relu and by dropout's consumers
        d = F.dropout(h, 0.5, training=True)  # torch 1.13 CPU saves a float mask: quant
        m = d.masked_fill(h > 0.5, 0.0)  # saves a bool mask: mask codec
        loss = (lin1(m) + lin2(m)).sum()
    loss.backward()
    comp.step()
    after = store()
    assert after["dedup_hits"] > before["dedup_hits"]
    assert after["codecs"]["mask"]["tensors"] > before["codecs"]["mask"]["tensors"]
    assert after["live_handles"] == before["live_handles"]


def test_no_growth_over_many_steps_and_retain_graph():
    gc.collect()  # (cyclic garbage of earlier tests, freed by a collection during the steps, would move the count)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    comp = gact.Compressor(model, bits=4)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    alloc_before = None
    live0 = store()["live_handles"]
    for i in range(30):
        with comp:
            loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=(i % 10 == 0))
        if i % 10 == 0:
            loss.backward()  # second unpack of the same handles
        opt.step()
        opt.zero_grad()
        del loss
        assert comp.step() == live0
        assert C.store_live_handles() == live0
        if i in (0, 29):
            cur = gact.stats()["allocators"]["host"]["allocated_bytes.all.current"]
            if alloc_before is None:
                alloc_before = cur
            assert cur == alloc_before


_LAST_READ = textwrap.dedent("""
    import json, sys, torch, gact
    torch.manual_seed(0)
    comp = gact.Compressor(torch.nn.Linear(1, 1), bits=4)
    x, w = torch.randn(1024, 16, requires_grad=True), torch.randn(16, 1024)
    with comp:
        # the log-probabilities, 4 MiB, saved by log_softmax and by square (one blob); log_softmax's backward holds
        # its incoming gradient, the decoded log-probabilities, their exp and its result: the process's peak
        loss = torch.log_softmax(x @ w, dim=1).square().sum()
    keeps = []
    loss.register_hook(lambda g: keeps.append(gact.compressor._graph_keeps()))
    blob = comp.stats()["store"]["bytes_stored_current"]
    loss.backward(retain_graph=sys.argv[1] == "retain")
    print(json.dumps({"peak": gact.stats()["allocators"]["host"]["allocated_bytes.all.peak"], "blob": blob,
                      "keeps": keeps, "outside": gact.compressor._graph_keeps()}))
""")


@pytest.mark.skipif(gact.compressor._graph_keeps is None, reason="needs _gact_torch's autograd headers")
def test_a_blob_goes_at_its_last_read_in_a_backward_that_keeps_no_graph():
    """Where the backward keeps no graph, a save's blob is released at its last read, before the node computes: held to
    the node's end, it stood beside the decoded tensor and what the node makes (log_softmax's: the process's peak). With retain_graph=True the blob stays for the next backward, and that peak holds it. (Fresh
    processes: the host arena's peak of allocated bytes is the measure.)"""
    runs = {}
    for mode in ("free", "retain"):
        r = subprocess.run([sys.executable, "-c", _LAST_READ, mode], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["free"]["keeps"] == [False] and runs["retain"]["keeps"] == [True]
    assert runs["free"]["outside"] is True  # (outside a backward: a read keeps the blob)
    blob = runs["free"]["blob"]
    # two blobs of one size: the exp image log_softmax reads and the values square reads, released at square's node in
    # both runs (earlier than log_softmax's read)
    assert blob > 1_000_000
    assert runs["retain"]["peak"] - runs["free"]["peak"] >= 0.9 * blob / 2, runs


def test_graph_kept_alive_is_a_leak_then_freed():
    model = mlp()
    comp = gact.Compressor(model, bits=4)
    before = store()
    with comp:
        loss = model(torch.randn(16, 64)).sum()
    assert comp.step() > before["live_handles"]  # no backward yet: the graph holds the handles
    assert store()["leaks"] > before["leaks"]
    del loss
    gc.collect()
    assert store()["live_handles"] == before["live_handles"]


class RecordingPolicy:
    def __init__(self):
        self.calls = []

    def bits_for(self, key, numel):
        self.calls.append((key, numel))
        return 2 if key.startswith("3:") else 8


def test_keys_are_stable_and_policy_sets_bits():
    model = mlp()
    pol = RecordingPolicy()
    comp = gact.Compressor(model, bits=4, policy=pol)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    before = store()["quant_bits"]
    grads(model, x, y, comp)
    first = list(pol.calls)
    pol.calls.clear()
    grads(model, x, y, comp)
    assert first and first == pol.calls
    names = [k for k, _ in first]
    assert len(set(names)) == len(names)
    assert all(":" in k for k in names) and any(k.startswith("3:") for k in names)
    after = store()["quant_bits"]
    assert after["2"] > before["2"] and after["8"] > before["8"]


def test_noise_depends_on_seed_and_step_and_is_reproducible():
    model = mlp()
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    a = grads(model, x, y, gact.Compressor(model, bits=2, seed=1))
    b = grads(model, x, y, gact.Compressor(model, bits=2, seed=1))
    c = grads(model, x, y, gact.Compressor(model, bits=2, seed=2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    comp = gact.Compressor(model, bits=2, seed=1)
    s0 = grads(model, x, y, comp)
    s1 = grads(model, x, y, comp)  # next step: new noise
    assert torch.equal(s0, a) and not torch.equal(s0, s1)


def test_bad_settings_are_rejected_by_name():
    model = mlp()
    for kw, match in [({"bits": 3}, "bits"), ({"bits": True}, "bits"), ({"group_size": 100}, "group_size"),
                      ({"min_bytes": -1}, "min_bytes"), ({"budget": 9}, "budget"), ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=match):
            gact.Compressor(model, **kw)
    with pytest.raises(TypeError, match="model"):
        gact.Compressor("resnet")
    with pytest.raises(ValueError, match="bits"):
        gact.configure(bits=3)


def test_numpy_integers_are_integers_and_strings_are_not_switches():
    """Settings read from a config file or computed with numpy: np.int64(256) as group_size was refused with
    "group_size=256 must be a power of two in [64, 1024]" (and seed, min_bytes alike), while swap="false", a
    truthy string, turned swap on (a 64 MiB pinned slab and blobs offloaded) where the same word in GACT_SWAP turns it
    off. Integers of any kind are taken as the int they are; a switch takes True or False (numpy's too)."""
    np = pytest.importorskip("numpy")
    model = mlp()
    c = gact.Compressor(model, bits=np.int64(2), group_size=np.int64(256), min_bytes=np.int32(0), seed=np.uint64(5),
                        adapt_interval=np.int16(10))
    assert (c.bits, c.group_size, c.min_bytes, c.seed, c.adapt_interval) == (2, 256, 0, 5, 10)
    assert all(type(v) is int for v in (c.bits, c.group_size, c.min_bytes, c.seed, c.adapt_interval))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    assert torch.equal(grads(model, x, y, c), grads(model, x, y, gact.Compressor(model, bits=2, min_bytes=0, seed=5)))
    for kw, match in [({"swap": "false"}, "swap"), ({"swap": 1}, "swap"), ({"derivatives": "no"}, "derivatives"),
                      ({"bits": 2.0}, "bits"), ({"bits": np.bool_(True)}, "bits"), ({"group_size": np.float64(256)},
                                                                                     "group_size")]:
        with pytest.raises(ValueError, match=match):
            gact.Compressor(model, **kw)
    for kw in ({"seed": True}, {"min_bytes": False}, {"group_size": True}, {"adapt_interval": True},
               {"bits": torch.tensor(True)}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            gact.Compressor(model, **kw)
    assert gact.Compressor(model, swap=np.bool_(False)).swap is False
    assert gact.Compressor(model, derivatives=np.bool_(False)).derivatives is False


def test_options_table_and_stats_dump(tmp_path):
    opts = gact.options()
    assert opts["min_bytes"] == 4096 and opts["group_size"] == 256
    assert any(r["env"] == "GACT_BITS" for r in opts.rows)
    p = tmp_path / "stats.json"
    gact.dump_stats(p)
    import json

    doc = json.loads(p.read_text())
    assert doc["schema_version"] >= 1 and "store" in doc and "host" in doc["allocators"]


def test_use_allocator_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        gact.use_allocator()


def test_gact_run_compresses_an_unmodified_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(64, 32)).pow(2).mean()
            loss.backward(); opt.step(); opt.zero_grad()
        print("done")
    """))
    stats = tmp_path / "stats.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tool = os.path.join(root, "tools", "gact-run")
    r = subprocess.run([sys.executable, tool, "--bits", "2", "--stats", str(stats), "--",
                        sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout
    import json

    doc = json.loads(stats.read_text())
    assert doc["store"]["steps"] == 3
    assert doc["store"]["quant_bits"]["2"] >= 3 and doc["store"]["leaks"] == 0
    r = subprocess.run([sys.executable, tool, "--bits", "3", "--", sys.executable, "-c", "0"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--bits" in r.stderr


@pytest.mark.parametrize("inplace", [False, True])
def test_relu_backward_uses_an_exact_mask(inplace):
    """ReLU's backward reads only result > 0, and gact keeps that as an exact 1-bit mask: with
    the ReLU output saved by nothing else, the gradient at 1 bit is bit-identical to fp32.
    (Quantized, a small positive output rounded to the group's min 0 would drop its gradient.)"""
    torch.manual_seed(0)
    lin = nn.Linear(64, 256)
    x, c = torch.randn(32, 64), torch.randn(32, 256)

    def loss_of():
        return (F.relu(lin(x), inplace=inplace) * c).sum()  # mul saves c only (excluded below)

    lin.zero_grad()
    loss_of().backward()
    g = lin.weight.grad.clone()
    comp = gact.Compressor(lin, bits=1, min_bytes=0, exclude=[c])
    before = C.stats_document()["store"]["codecs"]
    lin.zero_grad()
    with comp:
        loss = loss_of()
    loss.backward()
    comp.step()
    comp.close()
    after = C.stats_document()["store"]["codecs"]
    assert after["mask"]["tensors"] - before["mask"]["tensors"] == 1
    assert after["mask"]["bytes_in"] - before["mask"]["bytes_in"] == 32 * 256 * 4  # the float32 tensor it stands for
    assert after["mask"]["bytes_stored"] - before["mask"]["bytes_stored"] < 32 * 256 // 8 + 256  # 1 bit each
    assert torch.equal(lin.weight.grad, g)


def test_relu_output_saved_again_is_stored_as_values_too():
    """The next layer's save of the same ReLU output holds its values (quantized), not the mask."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    m.zero_grad()
    m(x).square().sum().backward()
    g = m[2].weight.grad.clone()
    comp = gact.Compressor(m, bits=8)
    m.zero_grad()
    with comp:
        loss = m(x).square().sum()
    loss.backward()
    comp.step()
    comp.close()
    # 8-bit values: the second Linear's weight gradient is close to fp32 (a mask would give
    # 0/1 inputs and a gradient nowhere near it).
    cos = F.cosine_similarity(m[2].weight.grad.reshape(-1), g.reshape(-1), dim=0)
    assert cos > 0.999, float(cos)


def test_log_softmax_output_keeps_at_least_4_bits():
    """cross_entropy's log-probabilities are exponentiated by their backward: they are stored as the
    probabilities, with at least 4 bits (a step of a third of the largest probability at 2 bits is noisier
    than log space at 4); nll_loss's save of the same tensor is read for its shape alone; everything else at
    the bits asked for."""
    torch.manual_seed(0)
    head = nn.Linear(32, 256)
    # inputs scaled by 8: confident, spread-out log-probabilities, as after some training
    h, y = 8 * torch.randn(64, 32), torch.randint(0, 256, (64,))
    head.zero_grad()
    F.cross_entropy(head(h), y).backward()
    g = head.weight.grad.clone()
    comp = gact.Compressor(head, bits=2)
    before = C.stats_document()["store"]
    head.zero_grad()
    with comp:
        loss = F.cross_entropy(head(h), y)
    loss.backward()
    comp.step()
    comp.close()
    after = C.stats_document()["store"]
    widths = {b: after["quant_bits"][b] - before["quant_bits"][b] for b in after["quant_bits"]}
    assert widths == {"1": 0, "2": 0, "4": 1, "8": 0}, widths  # h is the caller's input: kept
    assert after["unstored"]["shape"]["tensors"] - before["unstored"]["shape"]["tensors"] == 1  # nll_loss's save
    # 4-bit probabilities: cosine 0.998 to fp32 (4-bit log-probabilities gave 0.992, 2-bit ones 0.54)
    cos = F.cosine_similarity(head.weight.grad.reshape(-1), g.reshape(-1), dim=0)
    assert cos > 0.99, float(cos)


def test_attention_input_that_needs_no_gradient_is_stored_as_values():
    """An attention kernel's log-sum-exp (no gradient, one value per head and query position, padded with
    infinities by the memory-efficient kernel: issue 29) is kept exact, and so is a float mask the call
    was given; the batch fed straight into an attention layer, which its input projection saves as a
    flattened copy that needs no gradient either, is stored at the bits asked for (it took 4 bits as if
    it were a log-sum-exp)."""
    from gact import saved

    q = torch.randn(2, 4, 16, 8)
    lse = torch.randn(2, 4, 16)
    mask = torch.zeros(16, 16).masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf"))
    assert saved._attention(lse, (q, q, q), {}, None).kind == saved.EXACT
    assert saved._attention(mask, (q, q, q, mask), {}, None).kind == saved.EXACT
    assert saved._attention(mask, (q, q, q), {"attn_mask": mask}, None).kind == saved.EXACT
    assert saved._attention(q, (q, q, q), {}, None).kind == saved.VALUES
    assert saved._attention(q.reshape(-1, 8).clone(), (q, q, q), {}, None).kind == saved.VALUES
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(64, 4, batch_first=True)
    x = torch.randn(8, 32, 64)  # the model's first layer: no gradient into its input
    comp = gact.Compressor(bits=2)
    before = C.stats_document()["store"]
    with comp:
        out = attn(x, x, x, need_weights=False)[0]
    out.square().sum().backward()
    comp.step()
    comp.close()
    after = C.stats_document()["store"]
    widths = {b: after["quant_bits"][b] - before["quant_bits"][b] for b in after["quant_bits"]}
    # (torch 2.x's fused path stores the attention's q, k, v and output at 8 bits: see the test below; torch 1.13's
    # math path its attention map over 32 keys at a short softmax's 4 bits, and nothing else there)
    fused = hasattr(torch.nn.functional, "scaled_dot_product_attention")
    assert widths["4"] == (0 if fused else 1) and widths["2"] >= 1 and widths["2"] + widths["8"] >= 5, widths


def test_attention_query_and_key_keep_eight_bits():
    """The fused attention kernels rebuild the weights as exp(q kᵀ·scale − lse) from the saved query and key and
    the exact log-sum-exp: rounding q and k moves every weight of a row the same way (a bias growing with the
    scores' scale). q and k get at least 8 bits; v and the output the attention floor of 2."""
    from gact import saved

    def scaled_dot_product_attention():
        pass

    def multi_head_attention_forward():
        pass

    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    frame = saved.Frame(scaled_dot_product_attention, (q, k, v), {})
    assert [saved._attention(t, (q, k, v), {}, frame).min_bits for t in (q, k, v)] == [8, 8, 2]
    # multi-head attention: its first arguments are the layer's inputs, and the tracker does not see the attention
    # call inside it; its 4-dimensional saves that need a gradient (torch 2.x's fused path) come as q, k, v, output
    # (autograd saves an op's inputs in argument order, then its output): the first two get 8
    x = torch.randn(2, 16, 32, requires_grad=True)
    frame = saved.Frame(multi_head_attention_forward, (x, x, x), {})
    four = [t.clone().requires_grad_() for t in (q, k, v, q)]
    assert [saved._attention(t, (x, x, x), {}, frame).min_bits for t in four] == [8, 8, 2, 2]
    assert saved._attention(x, (x, x, x), {}, frame).min_bits == 2  # (the math path's 3-dimensional saves)


@pytest.mark.skipif(not hasattr(torch.nn, "attention"), reason="torch 2.x's fused attention kernels")
def test_fused_attention_gradients_carry_no_more_error_than_the_math_path():
    """Scores of std about 5 (inputs x4): at 4 bits with q and k at 4 bits too, the fused path's gradient averaged
    over 8 seeds was 14x further from fp32 than the math path's (1.42 against 0.10 relative; a bias, which
    averaging does not remove). The math path stores the weights themselves and has no such bias."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.o = nn.Linear(40, 120), nn.Linear(40, 40)

        def forward(self, x):
            q, k, v = self.qkv(x).view(4, 12, 3, 2, 20).permute(2, 0, 3, 1, 4)
            return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(4, 12, 40))

    torch.manual_seed(0)
    x = torch.randn(4, 12, 40) * 4
    model = Attn()

    def grad_error(math_path):
        def loss(m):
            if math_path:
                with sdpa_kernel(SDPBackend.MATH):
                    return m(x).square().mean()
            return m(x).square().mean()
        model.zero_grad()
        loss(model).backward()
        ref = model.qkv.weight.grad.clone()
        acc = torch.zeros_like(ref)
        for seed in range(8):
            model.zero_grad()
            comp = gact.Compressor(model, bits=4, min_bytes=0, seed=seed)
            with comp:
                out = loss(model)
            out.backward()
            comp.close()
            acc += model.qkv.weight.grad
        return float((acc / 8 - ref).norm() / ref.norm())

    fused, math = grad_error(False), grad_error(True)
    assert fused <= 2 * math, (fused, math)


def test_multi_head_attention_fused_path_carries_no_more_error_than_its_weights_path():
    """nn.MultiheadAttention with need_weights=False (what TransformerEncoderLayer asks for) runs torch 2.x's fused
    kernel inside F.multi_head_attention_forward, where the tracker sees only the outer call: its q and k were
    stored at 2-4 bits, and at scores of std about 5 the in-projection's 8-seed mean gradient was 32x its own norm
    away from fp32 at 4 bits (the need_weights=True path, which stores the weights: 0.13)."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(40, 2, batch_first=True)
    x = torch.randn(4, 12, 40) * 4

    def error(need_weights):
        def grad(comp=None):
            m.zero_grad()
            if comp is None:
                loss = m(x, x, x, need_weights=need_weights)[0].square().mean()
            else:
                with comp:
                    loss = m(x, x, x, need_weights=need_weights)[0].square().mean()
            loss.backward()
            return m.in_proj_weight.grad.clone()

        ref, acc = grad(), 0
        for seed in range(8):
            comp = gact.Compressor(m, bits=4, min_bytes=0, seed=seed)
            acc = acc + grad(comp)
            comp.close()
        return float((acc / 8 - ref).norm() / ref.norm())

    fused, weights = error(False), error(True)
    assert fused <= 2 * weights, (fused, weights)


def test_batch_norm_input_is_stored_channel_normalized():
    """A 1x1-spatial batch-norm input whose channels differ in scale by 10^3: a group of 256
    consecutive elements spans 256 channels, so without normalization a narrow channel's noise is
    set by the widest channel's range, and BatchNorm's backward scales it by 1/std_c². Stored as
    (x − mean_c)/std_c, every channel's noise is in proportion to its own spread. BatchNorm's
    per-channel mean and 1/std (2048 channels: 8 KiB each) are kept exactly ("stats")."""
    torch.manual_seed(0)
    c = 2048
    bn = nn.BatchNorm1d(c)
    scale = torch.logspace(-3, 0, c)[torch.randperm(c)]  # every group spans the 10^3 spread
    x = (torch.randn(16, c) * scale + 5 * scale).requires_grad_()
    w = torch.randn(16, c)

    def loss_of():
        return (bn(x * 1.0) * w).sum()  # a non-leaf input, as a conv's output would be

    x.grad = None
    loss_of().backward()
    g = x.grad.clone()
    comp = gact.Compressor(bn, bits=4)
    before = C.stats_document()["store"]["skipped"]["stats"]
    x.grad = None
    with comp:
        loss = loss_of()
    loss.backward()
    comp.step()
    comp.close()
    after = C.stats_document()["store"]["skipped"]["stats"]
    assert after["tensors"] - before["tensors"] == 2 and after["bytes"] - before["bytes"] == 2 * 4 * c
    cos = F.cosine_similarity(x.grad.reshape(-1), g.reshape(-1), dim=0)
    # 4 bits on normalized values: cosine 0.988 (stored as is: -0.06)
    assert C.stats_document()["store"]["quant_bits"]["4"] > 0
    assert cos > 0.98, float(cos)


def test_batch_norm_input_kept_at_full_precision_is_exact():
    """A policy that keeps a batch-norm input at full precision gets it back bit for bit (the
    channel normalization applies to quantized widths only)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    x, w = torch.randn(4, 3, 10, 10), torch.randn(4, 8, 8, 8)

    class KeepBN:
        def bits_for(self, key, numel):
            return 32 if key.startswith("1:") else 8

    m.zero_grad()
    (m(x) * w).sum().backward()
    g = [p.grad.clone() for p in m.parameters()]
    comp = gact.Compressor(m, bits=8, policy=KeepBN(), exclude=[w])
    m.zero_grad()
    with comp:
        loss = (m(x) * w).sum()
    loss.backward()
    comp.step()
    comp.close()
    assert all(torch.equal(p.grad, q) for p, q in zip(m.parameters(), g))


def test_thread_hooks_are_taken_out_when_the_thread_ends():
    # gact-run's hooks in a thread stayed in torch's thread-local state until the OS thread exited,
    # whose destructors then needed the GIL while the interpreter could be finalizing: the process
    # aborted at exit a few runs in a hundred ("terminate called without an active exception").
    # They leave with the thread's Python state now, before join() returns.
    import threading
    import weakref

    comp = gact.Compressor(None, bits=4, min_bytes=0)
    comp.install_global()
    try:
        refs, stored = [], []

        def body():
            comp.install_thread()
            refs.append(weakref.ref(comp._local.thread_hooks))
            before = comp.stats()["store"]["tensors_in"]
            x = torch.randn(64, 64, requires_grad=True)
            (x.tanh() * 2).sum().backward()
            stored.append(comp.stats()["store"]["tensors_in"] - before)
            # and its own op tracker, with the activations' stand-ins (their inputs stored as derivatives)
            nodes.append(type(torch.nn.functional.silu(x * 1).grad_fn).__name__)

        nodes = []
        t = threading.Thread(target=body)
        t.start()
        t.join()
        assert stored and stored[0] >= 1, stored  # the thread's saved tensors went to the store
        assert refs and refs[0]() is None  # its hooks left with it
        assert nodes == ["ActivationFunctionBackward"], nodes
        x = torch.randn(64, 64, requires_grad=True)
        before = comp.stats()["store"]["tensors_in"]
        (x.tanh() * 2).sum().backward()  # the main thread keeps its own
        assert comp.stats()["store"]["tensors_in"] > before
    finally:
        comp.uninstall_global()


def test_abort_step_releases_a_failed_steps_blobs_while_its_graph_lives():
    """Issue 29: after an exception in the forward (out of memory in a batch search), the caught exception
    keeps the step's graph, and with it every blob, alive. abort_step() frees them at once; a backward
    through that graph raises a clear error; the next step stores as before."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh())
    comp = gact.Compressor(model, bits=4)
    x = torch.randn(128, 64)
    kept = {}
    try:
        with comp:
            y = model(x)
            kept["y"] = y
            raise MemoryError("simulated: out of memory after the forward")
    except MemoryError as e:
        err = e  # the exception (and the graph) stay referenced
    live = comp.stats()["store"]
    assert live["live_handles"] >= 2 and live["bytes_stored_current"] > 0
    n = comp.abort_step()
    assert n >= live["live_handles"]  # (a blob read by two ops has two references)
    after = comp.stats()["store"]
    assert after["live_handles"] == 0 and after["bytes_stored_current"] == 0
    with pytest.raises(RuntimeError, match="abort_step"):
        kept["y"].sum().backward()
    del err, kept
    # the next step: stored and backward as usual
    with comp:
        loss = model(x).square().mean()
    loss.backward()
    assert comp.step() == 0
    assert comp.abort_step() == 0  # nothing open: a no-op


def test_each_compressors_noise_follows_its_own_steps():
    """Issue 33 row 8: the rounding noise used one store-wide step, so a second Compressor (a teacher run
    inside the student's forward, another thread) changed the first one's results. Now each Compressor's
    noise depends on its own seed and steps only: the student trains bit for bit the same with or
    without the teacher's Compressor stepping beside it."""
    x = torch.randn(64, 64)

    def train(with_teacher: bool):
        torch.manual_seed(0)
        student = mlp()
        teacher = mlp()
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        comp = gact.Compressor(student, bits=2, seed=7)
        tcomp = gact.Compressor(teacher, bits=2, seed=9) if with_teacher else None
        for _ in range(3):
            with comp:
                h = student[0](x)
                if tcomp is not None:
                    for _ in range(2):  # the teacher's own steps run ahead of the student's
                        with tcomp:
                            teacher(x).sum().backward()
                        tcomp.step()
                out = student[1:](h)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            comp.step()
        return [p.detach().clone() for p in student.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


def test_float64_beyond_float32_range_is_kept_exact():
    """Issue 33 row 9: float64 is quantized in float32; values below float32's normal range decoded as
    zeros (overflow was caught, underflow was not). A float64 tensor holding a nonzero magnitude outside
    [FLT_MIN, FLT_MAX] is now kept exact (counted as a refusal, `float64_range`); one inside is quantized
    as before, within one step of its group."""
    g = torch.Generator().manual_seed(0)
    tiny = torch.randn(64, 64, generator=g, dtype=torch.float64) * 1e-50
    huge = torch.randn(64, 64, generator=g, dtype=torch.float64) * 1e300
    sub = torch.randn(64, 64, generator=g, dtype=torch.float64) * 1e-40  # float32 subnormal range
    normal = torch.randn(64, 64, generator=g, dtype=torch.float64)
    cases = [tiny, huge, sub, normal]
    expected = [t.clone() for t in cases]
    comp = gact.Compressor(bits=4)
    before = C.stats_document()["store"]
    x = torch.ones(1, dtype=torch.float64, requires_grad=True)
    with comp:
        y = SaveArgs.apply(x, *cases)
    after = C.stats_document()["store"]
    del cases, tiny, huge, sub, normal  # decoded from the store, not handed back as held
    y.sum().backward()
    comp.close()
    got = SaveArgs.seen
    for t, e in zip(got[:3], expected[:3]):
        assert t.dtype == torch.float64 and torch.equal(t, e)
    step = float(expected[3].max() - expected[3].min()) / 15
    assert 0 < float((got[3] - expected[3]).abs().max()) <= step
    assert after["codecs"]["quant"]["tensors"] - before["codecs"]["quant"]["tensors"] == 1
    assert after["codecs"]["raw"]["tensors"] - before["codecs"]["raw"]["tensors"] == 3


def test_module_hooks_cost_nothing_once_every_compressor_is_closed():
    """gact's module hooks run through torch's global forward hooks, which put every module call in the process
    on torch's slow path: they are installed while some module has a hook of gact's, and removed when the last
    Compressor is closed or collected (a dead module's entries go with it)."""
    code = textwrap.dedent("""
        import gc, json, torch, torch.nn as nn, gact
        from gact import _compat
        mm = torch.nn.modules.module
        def ours():
            pre = [h for h in mm._global_forward_pre_hooks.values() if getattr(h, "__self__", None) is _compat._MODULE_HOOKS]
            post = [h for h in mm._global_forward_hooks.values() if getattr(h, "__self__", None) is _compat._MODULE_HOOKS]
            return len(pre), len(post), len(_compat._MODULE_HOOKS.pre), len(_compat._MODULE_HOOKS.post)
        out = {"before": ours()}
        a, b = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4)
        ca, cb = gact.Compressor(a, bits=4), gact.Compressor(b, bits=4)
        out["two"] = ours()
        ca.close()
        out["one closed"] = ours()
        del cb, b; gc.collect()  # collected without close(): its finalizer removes its hooks
        out["both gone"] = ours()
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = __import__("json").loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] == [0, 0, 0, 0]
    assert out["two"] == [1, 1, 4, 4]  # one global hook each way; a's three modules and b
    assert out["one closed"] == [1, 1, 1, 1]
    assert out["both gone"] == [0, 0, 0, 0]


def test_a_parameter_added_or_replaced_after_the_first_step_is_known_as_one():
    """The Compressor keeps the model's module list between steps (walking the model each step cost more
    than a tenth of a millisecond): a submodule registered later, or a parameter replaced, is still known as a
    parameter at the next step, so an alias of it (not a leaf) is kept, not compressed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64))
    comp = gact.Compressor(model, bits=4, min_bytes=0)
    x = torch.randn(8, 64)
    for _ in range(2):
        with comp:
            model(x).sum().backward()
        comp.step()
    model.add_module("late", nn.Linear(64, 64))
    model[0].weight = nn.Parameter(torch.randn(64, 64))
    with comp:
        model(x).sum()
    for p in model.parameters():
        assert gact.compressor._compat.storage_base(p) in comp._param_ptrs
    comp.close()


@pytest.mark.parametrize("bits", [4, "auto"])
def test_a_model_with_a_live_compressor_pickles_copies_and_scripts(bits, tmp_path):
    """Issue 32: torch.save(model) with a live Compressor raised "Can't pickle local object
    'weak_hook.<locals>.hook'" (word_language_model saves its best model every epoch). gact's module
    hooks no longer live in the modules: torch.save/load, copy.deepcopy, pickle, torch.jit.script and
    trace work, the copies carry no hooks, and the Compressor still names tensors by module."""
    import copy
    import pickle

    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))
    comp = gact.Compressor(model, bits=bits)
    x = torch.randn(32, 64)
    with comp:
        loss = model(x).square().mean()
    loss.backward()
    comp.step()
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)  # (torch 2.6 loads weights only by default)
    copies = [loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for c in copies:
        for m in c.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks
        assert torch.equal(c(x), model(x))
    assert torch.equal(torch.jit.script(model)(x), model(x))
    assert torch.equal(torch.jit.trace(model, x)(x), model(x))
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    # the Compressor still sees the modules: keys carry their names
    keys = []
    orig = comp._next_key
    comp._next_key = lambda *stack: (r := orig(*stack), keys.append(r[0]))[0]  # (its key, its decision key)
    with comp:
        loss = model(x).square().mean()
    loss.backward()
    comp.step()
    assert any(k.startswith("0:") for k in keys) and any(k.startswith("2:") for k in keys), keys
    comp.close()


class _VitBlock(nn.Module):
    """A ViT-shaped pre-norm block over 197 tokens, its attention through F.scaled_dot_product_attention
    where torch has it (2.x: on the CPU the flash kernel, which saves a log-sum-exp), by hand otherwise."""

    def __init__(self, dim=192, heads=3):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(F, "scaled_dot_product_attention"):
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


def test_vit_block_at_197_tokens_gradients_are_finite_and_close():
    """Issue 29: timm's ViT-B/16 trained to NaN at 4 and 2 bits on an H200: torch 2.x's fused attention saves
    a log-sum-exp (padded with infinities on the GPU) that gact stored quantized. Kept exact now; on the CPU
    under torch 2.6 the flash kernel's log-sum-exp takes the same path. Gradient cosine to fp32: >= 0.999
    at 8 bits, >= 0.99 at 4, all finite."""
    torch.manual_seed(0)
    model = nn.Sequential(_VitBlock(), _VitBlock())
    x = torch.randn(2, 197, 192)

    def grads(bits):
        model.zero_grad()
        if bits is None:
            model(x).square().mean().backward()
        else:
            comp = gact.Compressor(model, bits=bits)
            with comp:
                loss = model(x).square().mean()
            loss.backward()
            exact.append(comp.stats()["store"]["skipped"]["exact"]["tensors"])
            comp.close()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    exact = []
    ref = grads(None)
    for bits, floor in ((8, 0.999), (4, 0.99)):
        g = grads(bits)
        assert torch.isfinite(g).all(), bits
        cos = float(F.cosine_similarity(g, ref, dim=0))
        assert cos >= floor, (bits, cos)
    if int(torch.__version__.split(".")[0]) >= 2:
        assert min(exact) >= 2, exact  # each block's log-sum-exp kept exact


def test_a_program_that_never_calls_step_keeps_abort_steps_list_bounded():
    """abort_step() remembers the step's stored tensors weakly; without step() the step never ends, so
    the dead references are dropped as the list grows."""
    lin = nn.Linear(64, 64)
    comp = gact.Compressor(lin, bits=4, min_bytes=0)
    x = torch.randn(32, 64)
    for _ in range(2500):
        with comp:
            h = lin(x)
            loss = (torch.tanh(h) * torch.sigmoid(h)).sum()
        loss.backward()
    made = comp.stats()["store"]["tensors_in"]
    assert made >= 5000  # references made, almost all dead by now
    assert len(comp._live) < 4096 + 16
    comp.close()


_ACTIVATIONS_AT_NONFINITE = {
    "relu": torch.relu,
    "relu_": lambda x: torch.relu_(x * 1.0),
    "threshold": lambda x: torch.nn.functional.threshold(x, 0.5, -2.0),
    "hardtanh": lambda x: torch.nn.functional.hardtanh(x, -1.0, 1.0),
    "relu6": torch.nn.functional.relu6,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "leaky_relu": lambda x: torch.nn.functional.leaky_relu(x, 0.1),
    "clamp": lambda x: torch.clamp(x, -1.0, 1.0),
}


@pytest.mark.parametrize("name", sorted(_ACTIVATIONS_AT_NONFINITE))
def test_activation_masks_give_torchs_gradient_at_nan_and_inf(name):
    """Issue 33 row 10: the masks these activations save are exact, so the input gradient equals torch's
    bit for bit, NaN and +-Inf inputs included. torch's relu/threshold/hardtanh backwards zero the
    gradient only where x <= a (or x >= b), so a NaN passes it; hardsigmoid's, leaky_relu's and clamp's
    test the other way round."""
    fn = _ACTIVATIONS_AT_NONFINITE[name]
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(64, 1024, generator=g) * 2
    x0.view(-1)[::97] = float("nan")
    x0.view(-1)[5::101] = float("inf")
    x0.view(-1)[7::103] = -float("inf")
    w = torch.randn(64, 1024, generator=g)

    def grad(bits):
        x = x0.clone().requires_grad_(True)
        if bits is None:
            (fn(x * 1.0) * w).sum().backward()
        else:
            comp = gact.Compressor(bits=bits)
            with comp:
                y = (fn(x * 1.0) * w).sum()  # (a leaf would be kept as it is)
            y.backward()
            assert comp.stats()["store"]["roles"]["predicate"]["tensors"] == 1, "the mask was not stored"
            comp.close()
        return x.grad

    ref, got = grad(None), grad(2)
    assert torch.equal(ref.isnan(), got.isnan()), f"{name}: NaN gradients at other places than torch's"
    fin = ~ref.isnan()
    assert torch.equal(ref[fin], got[fin]), f"{name}: gradient differs from torch's (max {(ref - got)[fin].abs().max()})"


# ---- device verdicts: a tensor kept until its encode says whether it met NaN/Inf ----------------------------
#
# On a GPU the encode cannot answer at once (codecs/verdict.hpp): the Compressor keeps each device tensor until
# the answer is read and serves it as it is when the encode met NaN/Inf. Here host tensors take that path with
# a stand-in for the device's answer, so the bookkeeping is tested where no GPU is; the real answers are checked
# on a GPU by tools/gpu_check/nonfinite_contract.py (test_integration.py runs it on the CPU as well).

class _TwoHeads(nn.Module):
    """Two projections of one input (as q/k/v): the same tensor saved twice, one blob for both."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 128), nn.Linear(256, 128)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x)], dim=-1)


def _verdict_net():
    torch.manual_seed(3)
    # ReLU (its mask read as the next layer's boundary blob), ReLU6 and Hardtanh (masks of a closed range: a
    # predicate decode evaluated on the kept tensor), GELU (a stored derivative), batch and layer norm (inputs
    # stored normalized when the call returns), one input read by two layers
    return nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU6(),
                         _TwoHeads(), nn.LayerNorm(256), nn.Hardtanh(-0.5, 0.5), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 10))


def _verdict_grads(net, comp, x):
    net.zero_grad()
    if comp is None:
        loss = net(x).square().mean()
    else:
        with comp:
            loss = net(x).square().mean()
    loss.backward()
    if comp is not None:
        comp.step()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def _stand_in_verdicts(monkeypatch, answer):
    """Host tensors wait for verdicts; ``answer(calls_so_far, wait)`` gives each one. Returns the log of calls."""
    from gact import compressor as cm
    monkeypatch.setattr(cm.Compressor, "_VERDICTS_ON_HOST", True)
    log = {"calls": {}, "waits": 0}

    def verdict(h, wait=False):
        n = log["calls"][h] = log["calls"].get(h, 0) + 1
        log["waits"] += bool(wait)
        return answer(n, wait)

    monkeypatch.setattr(cm._C, "store_verdict", verdict)
    return log


def _holds(comp):
    return [p for p, _ in comp._verdicts if p.hold is not None]


@pytest.mark.parametrize("when", ["before backward", "at backward"])
def test_a_blob_whose_encode_met_nonfinite_values_is_served_as_the_tensor_kept_for_it(monkeypatch, when):
    """Every verdict says "met NaN/Inf": every stored tensor is then served exactly as it was saved, so the
    gradients equal fp32's bit for bit (ReLU6 and Hardtanh read predicates, evaluated on the kept tensor).
    Answered before backward (read by the next saves), or still pending when backward reads it."""
    x = torch.randn(32, 64)
    net = _verdict_net()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ref = _verdict_grads(net, None, x)
    net.load_state_dict(state)  # (batch norm's running statistics as before the reference step)
    pending_until = 2 if when == "before backward" else 10 ** 9
    log = _stand_in_verdicts(monkeypatch, lambda n, wait: -1 if n < pending_until else 1)
    comp = gact.Compressor(net, bits=2)
    start = comp.stats()["store"]
    g = _verdict_grads(net, comp, x)
    st = comp.stats()["store"]
    comp.close()
    assert torch.equal(g, ref)
    assert st["tensors_in"] - start["tensors_in"] >= 5 and len(log["calls"]) >= 5
    assert _holds(comp) == [] and comp._verdict_bytes == 0
    assert log["waits"] == 0


def test_a_clean_verdict_drops_the_kept_tensor_and_the_blob_is_decoded(monkeypatch):
    """Verdicts that come in clean change nothing: the same gradients as without them, and no tensor is kept
    once its answer was read (the next save reads it)."""
    x = torch.randn(32, 64)
    net = _verdict_net()
    comp = gact.Compressor(net, bits=2, seed=5)
    plain = _verdict_grads(net, comp, x)
    comp.close()
    log = _stand_in_verdicts(monkeypatch, lambda n, wait: -1 if n < 2 else 0)
    comp = gact.Compressor(net, bits=2, seed=5)
    with comp:
        loss = net(x).square().mean()
    # all read by now but the last save's (nothing polled after it)
    assert len(_holds(comp)) <= 1 and len(log["calls"]) >= 5
    net.zero_grad()
    loss.backward()
    comp.step()
    g = torch.cat([p.grad.flatten() for p in net.parameters()])
    comp.close()
    assert torch.equal(g, plain)
    assert _holds(comp) == [] and comp._verdict_bytes == 0


def test_past_the_window_a_save_waits_for_the_oldest_verdict(monkeypatch):
    """With nothing allowed to wait unread (VERDICT_WINDOW 0), each save waits for the verdicts before it: none
    is left for backward, which decodes every blob as usual."""
    from gact import compressor as cm
    x = torch.randn(32, 64)
    net = _verdict_net()
    comp = gact.Compressor(net, bits=4, seed=5)
    plain = _verdict_grads(net, comp, x)
    comp.close()
    monkeypatch.setattr(cm.Compressor, "VERDICT_WINDOW", 0)
    # (answered when waited for; the last save's, read at backward, is in by then)
    log = _stand_in_verdicts(monkeypatch, lambda n, wait: 0 if wait or n >= 2 else -1)
    comp = gact.Compressor(net, bits=4, seed=5)
    with comp:
        loss = net(x).square().mean()
    assert log["waits"] >= 4 and len(_holds(comp)) <= 1
    net.zero_grad()
    loss.backward()
    comp.step()
    g = torch.cat([p.grad.flatten() for p in net.parameters()])
    comp.close()
    assert torch.equal(g, plain)


def test_abort_step_drops_the_kept_tensors_of_its_step_only(monkeypatch):
    """abort_step() lets go of the tensors its step kept; an earlier step's graph, still alive, keeps its own
    until their verdicts are read (otherwise it would decode blobs no verdict cleared)."""
    _stand_in_verdicts(monkeypatch, lambda n, wait: -1)
    net = _verdict_net()
    x = torch.randn(32, 64)
    comp = gact.Compressor(net, bits=2)
    with comp:
        earlier = net(x).square().mean()
    comp.step()
    kept_before = _holds(comp)
    with comp:
        loss = net(x).square().mean()
    held = [p for p in _holds(comp) if p not in kept_before]
    assert len(kept_before) >= 5 and len(held) >= 5
    assert comp.abort_step() >= 5
    assert all(p.hold is None for p in held)
    assert _holds(comp) == kept_before and comp._verdict_bytes > 0
    with pytest.raises(RuntimeError, match="abort_step"):
        loss.backward()
    earlier.backward()  # served exactly: the kept tensors (their verdicts still out)
    comp.close()
    assert comp._verdicts == collections.deque() or _holds(comp) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("pred", [("gt_or_nan", 0.0, 0.0), ("gt", 0.1, 0.0), ("ge", 0.1, 0.0), ("lt", -0.3, 0.0),
                                  ("le", -0.3, 0.0), ("open", -1.0, 0.1), ("closed", -0.3, 1.0)])
def test_a_predicate_evaluated_on_the_kept_tensor_equals_the_mask_codecs(pred, dtype):
    """What a predicate save decodes to, computed by torch on the exact tensor (a device blob that met NaN/Inf)
    equals the mask codec's decode, at NaN and ±Inf too, and next to bounds a 16-bit dtype cannot hold (the codec
    compares in float32)."""
    from gact.compressor import _predicate_of
    from gact import _compat
    x = torch.randn(4096)
    x[::97] = float("nan")
    x[5::89] = float("inf")
    x[7::83] = float("-inf")
    x[11::61] = pred[1]  # on the threshold
    x[13::59] = pred[2]
    x = x.to(dtype)
    h = C.store_put(x.data_ptr(), _compat.DTYPE_NAMES[dtype], (4096,), (1,), -1, x._version, _compat.storage_base(x),
                    7, 1, 256, 0, 0, role="predicate", pred=pred)[0]
    try:
        assert C.store_info(h)["codec"] == "mask"
        tv, fv = 3.0, -2.0
        dec = torch.utils.dlpack.from_dlpack(C.store_get_dlpack(h, (4096,), (1,), 0, 0, 1, True, tv, fv))
        mine = torch.full_like(x, fv).masked_fill_(_predicate_of(x, pred), tv)
        assert dec.dtype == dtype and torch.equal(dec, mine)
    finally:
        C.store_release(h)


def test_verdicts_that_come_in_at_once_under_bits_auto(monkeypatch):
    """Verdicts read as soon as a later save polls them, all "met NaN/Inf", with the policy reading each stored
    tensor's facts as it is stored: nothing is read of a blob already freed, and every tensor is served exactly."""
    x = torch.randn(32, 64)
    net = _verdict_net()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ref = _verdict_grads(net, None, x)
    _stand_in_verdicts(monkeypatch, lambda n, wait: -1 if n < 2 else 1)
    comp = gact.Compressor(net, bits="auto", budget=2)
    for _ in range(2):
        net.load_state_dict(state)
        g = _verdict_grads(net, comp, x)
        assert torch.equal(g, ref)
    comp.close()


def test_a_save_raised_above_the_run_bits_is_not_served_by_a_narrower_blob_of_the_same_tensor():
    """One tensor read by a mul (values at the run's 2 bits) and then by a cube (its base at least 4 bits; the
    test was written with logsumexp's log-space floor, exact since). The store served the second save from the
    2-bit blob of the first: the gradient through the log-sum-exp stayed 1.45 from fp32 averaged over 8 seeds
    (a bias), against 0.09 with the saves in the other order."""
    torch.manual_seed(0)
    x = torch.randn(256, 64)

    def grad(seed=None):
        torch.manual_seed(0)
        q, t = nn.Linear(64, 64), nn.Parameter(torch.tensor(1.5))
        comp = gact.Compressor(q, bits=2, min_bytes=0, seed=seed) if seed is not None else None
        with comp if comp is not None else torch.enable_grad():
            sc = q(x) @ x.T
            a = (sc * t).mean()
            b = sc.pow(3).mean() / 64
            loss = b - sc.diagonal().mean() + 0 * a
        del sc
        loss.backward()
        if comp is not None:
            assert comp.stats()["store"]["quant_bits"]["4"] >= 1  # the cube's save has a blob of its own
            comp.close()
        return q.weight.grad

    ref = grad()
    mean = torch.stack([grad(s) for s in range(8)]).mean(0)
    assert ((mean - ref).norm() / ref.norm()).item() < 0.3


def test_one_compressors_saves_are_never_served_by_another_compressors_blob():
    """A GAN-like pair: G's Compressor at 1 bit stores its output; D's, at 8 bits, saves the same tensor. D's save
    was served by G's 1-bit blob (D's gradient 0.47 from fp32 instead of 0.002), and G's abort_step() left that
    entry alive, counted as G's leak."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh())
    D = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
    z = torch.randn(128, 16)
    D(G(z)).pow(2).mean().backward()
    ref = D[0].weight.grad.clone()
    D.zero_grad()
    cg, cd = gact.Compressor(G, bits=1, min_bytes=0), gact.Compressor(D, bits=8, min_bytes=0)
    with cg:
        fake = G(z)
    with cd:
        loss = D(fake).pow(2).mean()
    del fake
    loss.backward()
    assert ((D[0].weight.grad - ref).norm() / ref.norm()).item() < 0.02
    cg.step()
    cd.step()
    with cg:
        fake = G(z)
    with cd:
        loss = D(fake).pow(2).mean()
    del fake
    assert cg.abort_step() >= 1
    assert cg.stats()["store"]["live_handles"] == 0 and cg.stats()["store"]["leaks"] == 0
    del loss
    assert cd.stats()["store"]["live_handles"] == 0
    cg.close()
    cd.close()


def test_a_with_block_entered_again_inside_other_hooks_is_the_innermost():
    """`with comp:` inside a save_on_cpu (or a user's saved_tensors_hooks, or a non-reentrant checkpoint) that is
    itself inside `with comp:`: as in torch, the innermost hooks take the saves. The inner `with` did nothing, so
    save_on_cpu kept the saves; and a checkpointed function with `with comp:` inside gave its forward's saves to
    the checkpoint and its recomputation's to comp: backward raised "Attempt to retrieve a tensor saved by
    autograd multiple times without checkpoint recomputation being triggered"."""
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    blk, head = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)), nn.Linear(64, 10)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    comp = gact.Compressor(nn.Sequential(blk, head), bits=8, min_bytes=0)
    with comp:
        with torch.autograd.graph.save_on_cpu():
            with comp:
                loss = blk(x).sum()
    loss.backward()
    assert comp.stats()["store"]["tensors_in"] >= 1  # the Tanh's output, stored by the innermost hooks: comp's
    comp.step()

    def f(h):
        with comp:
            return blk(h)

    def grads(use_comp):
        blk.zero_grad()
        head.zero_grad()
        with comp if use_comp else contextlib.nullcontext():
            loss = F.cross_entropy(head(cp.checkpoint(f if use_comp else blk, x, use_reentrant=False)), y)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in blk.parameters()])

    ref = grads(False)
    got = grads(True)
    comp.step()
    assert F.cosine_similarity(ref, got, dim=0) > 0.999
    assert comp.stats()["store"]["live_handles"] == 0
    comp.close()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_a_sparse_adjacency_saved_beside_the_activations(layout):
    """A graph layer's sparse adjacency times a layer's output: the sparse tensor is kept as it is; its size was
    taken with is_contiguous(), which sparse CSR and CSC tensors do not have (RuntimeError in the forward)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    dense = (torch.rand(64, 64) < 0.1).float()
    adj = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc()}[layout]
    x = torch.randn(64, 16)

    def grads(comp=None):
        lin.zero_grad()
        with comp if comp is not None else contextlib.nullcontext():
            loss = (adj @ lin(x)).square().sum()
        loss.backward()
        return [p.grad.clone() for p in lin.parameters()]

    ref = grads()
    comp = gact.Compressor(lin, bits=8)
    got = grads(comp)
    comp.step()
    kept = comp.stats()["store"]
    comp.close()
    for a, b in zip(got, ref):
        assert ((a - b).norm() / b.norm()).item() < 0.05
    assert kept["skipped"]["layout"]["tensors"] >= 1, kept["skipped"]


@pytest.mark.parametrize("op, mask", [
    (lambda z: F.threshold(z, 0.1, 0.0), lambda x: x > 0.1),
    (lambda z: z.clamp(max=0.1), lambda x: x <= 0.1),
    (lambda z: z.clamp(min=0.7), lambda x: x >= 0.7),
    (lambda z: z.clamp(min=0.1), lambda x: x >= 0.1),
    (lambda z: F.hardtanh(z, 0.1, 2.0), lambda x: (x > 0.1) & (x < 2.0)),
    (lambda z: z.clamp(0.1, 0.7), lambda x: (x >= 0.1) & (x <= 0.7)),
    (lambda z: F.relu6(z), lambda x: (x > 0) & (x < 6)),
], ids=["threshold", "clamp_max", "clamp_min_0.7", "clamp_min_0.1", "hardtanh", "clamp", "relu6"])
@pytest.mark.parametrize("bits", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_a_mask_keeps_torchs_test_at_a_bound_the_dtype_does_not_hold(op, mask, bits, dtype):
    """A threshold, clamp or hardtanh whose bound is no value of the tensor's dtype (0.1, 0.7 in float64, bfloat16,
    float16): the codec tests in float32 and decodes in the dtype, so the mask's edge moved from torch's test and a
    decode value equal to the bound landed on the wrong side of it (float64 threshold 0.1: 2 259 of 4 096 gradients
    wrong at every width; bfloat16 1 875; float16 clamp(min=0.1): the 704 elements at the rounded bound). Such saves
    are kept exact; a bound the dtype holds (relu6) is still a mask. Elements sit exactly at the bound rounded to the
    dtype too."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64).to(dtype)
    x[::2, ::3] = torch.tensor(0.1, dtype=dtype)
    x[1::2, ::5] = torch.tensor(0.7, dtype=dtype)

    def grad(bits):
        p = torch.nn.Parameter(torch.ones(64, dtype=dtype))
        got = []
        comp = gact.Compressor(None, bits=bits or 8, min_bytes=0)
        before = comp.stats()["store"]["codecs"]["mask"]["tensors"]
        with comp if bits else contextlib.nullcontext():
            z = x * p  # a temporary the program does not hold (a held tensor is used as it is)
            z.register_hook(got.append)
            y = op(z)
            del z
        masks = comp.stats()["store"]["codecs"]["mask"]["tensors"] - before
        y.float().sum().backward()
        comp.step()
        comp.close()
        return got[0], masks

    try:
        ref, _ = grad(None)
    except RuntimeError as e:
        if "not implemented" in str(e):
            pytest.skip(f"torch {torch.__version__} has no CPU kernel for this backward in {dtype}")
        raise
    got, masks = grad(bits)
    assert torch.equal(got != 0, ref != 0)
    if dtype is torch.float64:
        assert torch.equal(ref != 0, mask(x))
    if op.__code__.co_names[-1:] == ("relu6",):
        assert masks == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32])
def test_dropout_in_every_float_dtype_is_stored(dtype):
    """Dropout's mask (x != 0) has no decode values: the check of a mask's bounds against the dtype raised TypeError
    on it for float64 and bfloat16 tensors, in every training step with dropout."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).to(dtype)
    x = torch.randn(32, 64, dtype=dtype)
    comp = gact.Compressor(None, bits=2, min_bytes=0)
    with comp:
        y = F.dropout(lin(x), 0.5, training=True)
    y.float().sum().backward()
    comp.close()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad.float()).all()


@pytest.mark.parametrize("act", [nn.GELU, nn.ELU, nn.SiLU])
def test_jit_trace_under_a_global_install_records_torchs_activations(act):
    """Under gact-run the op tracker covers the whole process: torch.jit.trace of a GELU, ELU or SiLU model recorded
    the derivative stand-in (an autograd.Function, a Python op) and its check of the traced graph failed
    ("Tracing failed sanity checks"). While a trace records, the tracker runs torch's own activations."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), act(), nn.Linear(256, 10))
    x = torch.randn(32, 64)
    comp = gact.Compressor(None, bits=4)
    comp.install_global()
    try:
        traced = torch.jit.trace(model, x)
    finally:
        comp.uninstall_global()
        comp.close()
    assert torch.equal(traced(x), model(x))


def test_a_with_block_inside_a_global_install_leaves_the_global_op_tracker():
    """gact-run installs its Compressor for the whole process, and with bits="auto" the policy's probe replays a step
    inside `with comp:` on it. The block's end dropped the thread's op tracker instead of giving install_global's
    back: every later save was decided without knowing its op and kept exact, so gact-run --bits auto stored
    nothing after its first estimate (a ReLU MLP: 3 saves stored a step, then 0 and 9 kept exact), with no word
    said. Saves after the block are decided by their ops again: a ReLU's output goes to the store."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    comp = gact.Compressor(None, bits=4)
    comp.install_global()
    try:
        tracker = comp._local.tracker

        def stored_and_exact() -> tuple:
            x = torch.randn(32, 64)
            s0 = comp.stats()["store"]
            # (not x² of (32, 10), a batch of short samples, nor a product with a weight that needs no gradient: exact)
            model(x).sum().backward()
            s1 = comp.stats()["store"]
            exact = lambda s: s["skipped"].get("exact", {}).get("tensors", 0)  # noqa: E731
            return s1["tensors_in"] - s0["tensors_in"], exact(s1) - exact(s0)

        before = stored_and_exact()
        with comp:  # (as the probe's replay)
            model(torch.randn(8, 64)).sum().backward()
        assert comp._local.tracker is tracker
        after = stored_and_exact()
        assert before[0] >= 2 and before[1] == 0, before
        assert after == before, (before, after)
    finally:
        comp.uninstall_global()


def test_a_closed_compressor_refuses_to_be_entered_again():
    """close() takes out the module hooks: entered again, the Compressor stored the modules passed to exclude= (an
    excluded layer's weight gradient 0.50 of its norm off at 2 bits, where it was exact) and keyed every tensor by no
    module, without a word. It raises instead, naming close() and the way to give cached memory back; a graph made
    before close() still reads its saves."""
    torch.manual_seed(0)
    model = mlp()
    comp = gact.Compressor(model, bits=2, exclude=[model[0]])
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with comp:
        loss = F.cross_entropy(model(x), y)
    comp.close()
    loss.backward()
    assert model[0].weight.grad is not None
    with pytest.raises(RuntimeError, match=r"closed.*empty_cache"):
        with comp:
            pass
    with pytest.raises(RuntimeError, match="closed"):
        comp.install_global()
    assert getattr(comp._local, "depth", 0) == 0 and comp._global_depth == 0


def test_a_frozen_tensor_used_through_a_view_is_served_from_its_base():
    """A frozen matrix kept as a plain attribute (precomputed class or text embeddings as a head), used as f @ E.t(),
    saved E.t() for f's gradient: the view dies after the forward, so the blob was decoded, at 2 bits 0.75 of the
    gradient's norm in noise, while E itself stayed alive. A saved view whose base lives unchanged is made again
    from the base: f's gradient is fp32's, the blob dropped ("held"). A base changed in place still raises torch's
    error, and a base that died leaves the decode."""
    torch.manual_seed(0)
    enc = nn.Linear(64, 32)
    E = torch.randn(100, 32)  # (not a parameter, not a buffer)
    x = torch.randn(16, 64)

    def grad(comp):
        enc.zero_grad()
        with comp if comp is not None else contextlib.nullcontext():
            f = enc(x)
            loss = (f @ E.t()).logsumexp(-1).sum()
        loss.backward()
        return enc.weight.grad.clone()

    comp = gact.Compressor(enc, bits=2, min_bytes=0)
    held = lambda: comp.stats()["store"]["unstored"].get("held", {}).get("tensors", 0)  # noqa: E731
    before = held()
    assert torch.equal(grad(comp), grad(None))
    assert held() > before
    with comp:
        loss = (enc(x) @ E.t()).sum()
    E.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    E2 = torch.randn(100, 32)
    with comp:
        loss = (enc(x) @ E2.t()).sum()
    del E2
    loss.backward()  # (decoded: the base is gone)


def test_a_stored_tensors_one_reference_follows_its_version_and_its_storage():
    """A stored save holds one object for its version counter and its storage (_gact_torch.saved_ref): current()
    follows changes made through any alias, same() tells the saved storage from another one put under the tensor
    (`t.data = other`), and a tensor without storage (sparse) checks nothing, as a missing storage reference did."""
    saved_ref = gact.compressor._saved_ref
    if saved_ref is None:
        pytest.skip("_gact_torch is not built")
    t = torch.randn(8, 8)
    r = saved_ref(t._cdata)
    assert r.current() == t._version and r.same(t._cdata)
    t.detach().add_(1.0)  # (through an alias: the counter is shared)
    assert r.current() == t._version == 1
    v = t[2:]
    assert r.same(v._cdata)  # (a view uses the same storage)
    t.data = torch.randn(8, 8)
    assert not r.same(t._cdata) and not r.same(0)
    sparse = torch.eye(4).to_sparse()
    assert saved_ref(sparse._cdata).same(t._cdata)
    with pytest.raises(ValueError, match="null TensorImpl"):
        saved_ref(0)


def test_a_saved_view_is_made_from_its_base_only_while_they_share_the_storage_saved():
    """The base is compared by its storage itself, not its address: `E.data = empty` then `E.data = other` can put
    another storage at the freed address (the CUDA caching allocator hands the same block back), and a view made from
    it read the new values (45x the gradient's error). And a view whose own memory was replaced (`v.data = other`,
    which keeps v._base) is not its base's any more (a gradient error of 9e5). Both are read from their blobs."""
    if gact.compressor._storage_ref is None:
        pytest.skip("_gact_torch is not built: saved views are not made from their bases")
    torch.manual_seed(0)
    enc = nn.Linear(64, 32)
    x = torch.randn(16, 64)

    def grad(comp, make, between=lambda: None):
        enc.zero_grad()
        with comp if comp is not None else contextlib.nullcontext():
            f = enc(x)
            loss = (f @ make()).sum()
        between()
        loss.backward()
        return enc.weight.grad.clone()

    E = torch.randn(100, 32)
    want = grad(None, lambda: E.t())

    def swap_twice():
        old = E.data
        E.data = torch.zeros(0)
        del old
        E.data = torch.full((100, 32), 1e3)  # (perhaps at the freed address)

    comp = gact.Compressor(enc, bits=8, min_bytes=0)
    got = grad(comp, lambda: E.t(), swap_twice)
    assert (got - want).norm() < 0.05 * want.norm()  # (the forward's values, through the blob at 8 bits)
    E, W = torch.randn(100, 32), torch.randn(32, 100)

    def swapped():  # (a view of E whose memory is W's now; it dies with the forward, E and W live on)
        v = E.t()
        v.data = W
        return v

    want = grad(None, swapped)
    got = grad(comp, swapped)
    assert (got - want).norm() < 0.05 * want.norm()
    comp.close()


class _Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, h):
        self.lin(h)
        raise ValueError("this branch gives up")


class _Optional(nn.Module):
    """Calls a child whose forward raises, catches it and goes on (an optional branch, a fallback path)."""

    def __init__(self):
        super().__init__()
        self.flaky = _Flaky()

    def forward(self, x):
        try:
            return self.flaky(x)
        except ValueError:
            return x


class _GivesUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.optional = _Optional()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x):
        return self.body(self.optional(x))


def test_a_module_added_or_put_in_place_later_is_hooked_and_excluded_by_name():
    """Module hooks and exclude= were fixed by module id when the Compressor was made: a module added later
    (model.head = ...) was never hooked, its saves named after its parent, and one put in an excluded module's place
    was compressed without a word. From the next step on, a new module is hooked under its own name, and one in an
    excluded module's place is excluded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
    comp = gact.Compressor(model, bits=4, exclude=[model[2]])
    x = torch.randn(32, 64)

    def excluded_bytes(add_head: bool = False):
        before = comp.stats()["store"]["skipped"]["excluded"]["bytes"]
        with comp:
            out = model(x)
            if add_head:
                out = model.head(out)
            loss = out.square().sum()
            keys = dict(comp._key_counts)
        loss.backward()
        comp.step()
        return comp.stats()["store"]["skipped"]["excluded"]["bytes"] - before, keys

    first, _ = excluded_bytes()
    assert first >= 32 * 128 * 4  # (the excluded layer's input)
    model[2] = torch.nn.Linear(128, 64)  # put in the excluded layer's place
    model.head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    excluded_bytes(add_head=True)  # (the step it happens in: hooked at the next one)
    again, keys = excluded_bytes(add_head=True)
    assert again == first, (again, first)
    assert any(isinstance(k, str) and k.startswith("head") for k in keys), keys  # (its saves under its own name)
    comp.close()


@pytest.mark.parametrize("exclude_flaky", [False, True])
def test_a_module_whose_forward_raised_leaves_the_module_stack(exclude_flaky):
    """A module whose forward raised, caught by its caller, never ran its forward hook, so its entry stayed on top of
    the Compressor's module stack: the rest of the step's saves were named after it, and with it in exclude= every
    one of them was kept uncompressed (store ratio 0). Its entry goes when its caller leaves (README, Known limits:
    until then the caller's own later saves are still under it): only its own saves are excluded."""
    torch.manual_seed(0)
    model = _GivesUp()
    x = torch.randn(256, 64)
    comp = gact.Compressor(model, bits=2, exclude=[model.optional.flaky] if exclude_flaky else [])
    with comp:
        loss = model(x).pow(2).mean()
    loss.backward()
    store = comp.stats()["store"]
    comp.step()
    comp.close()
    assert store["ratio"] > 8 and store["tensors_in"] >= 2, store
    assert store["skipped"]["excluded"]["tensors"] == (1 if exclude_flaky else 0)


class _Act(nn.Module):
    def forward(self, h):
        return torch.tanh(h)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, h, act, depth=0):
        h = act(self.lin(h))
        return self(h, act, depth - 1) if depth > 0 else torch.sigmoid(h)  # (recursion: itself again)


class _PassesItsChild(nn.Module):
    """Hands one child to another as an argument: act runs inside block's forward, though registered beside it."""

    def __init__(self):
        super().__init__()
        self.block, self.act = _Block(), _Act()

    def forward(self, x, depth=0):
        return self.block(x, self.act, depth)


@pytest.mark.parametrize("depth", [0, 2])
def test_exclusion_holds_through_a_sibling_called_as_an_argument_and_through_recursion(depth):
    """A module called from inside another that is not its parent (a sibling passed as an argument), and a module that
    calls itself, run under the caller's entry of the module stack: every save inside an excluded block stays exact,
    its own and those after the sibling or the recursive call returned."""
    torch.manual_seed(0)
    model = _PassesItsChild()
    comp = gact.Compressor(model, bits=2, min_bytes=0, exclude=[model.block])
    with comp:
        loss = model(torch.randn(32, 64), depth).sum()
    loss.backward()
    store = comp.stats()["store"]
    comp.close()
    assert store["tensors_in"] == 0 and store["skipped"]["excluded"]["tensors"] >= 2 * (depth + 1) + 1, store


def test_a_threads_hooks_are_taken_out_only_on_that_thread():
    """install_thread's hooks are popped when the thread's Python state is cleared. The thread-locals of threads
    Python did not start (a DataLoader's, torch's) are collected on the main thread at interpreter exit, where the
    pop took the main thread's hooks and then met an empty stack: torch printed an INTERNAL ASSERT at exit under
    gact-run with DataLoader workers. On another thread the pop is left alone."""
    import threading
    from gact.compressor import _ThreadHooks

    calls = []

    class _Tracker:
        def __exit__(self, *a):
            calls.append("exit")

    made = []
    worker = threading.Thread(target=lambda: made.append(_ThreadHooks(lambda: calls.append("pop"), _Tracker())))
    worker.start()
    worker.join()
    made.pop().__del__()  # (on the main thread: not its own)
    assert calls == []
    own = _ThreadHooks(lambda: calls.append("pop"), _Tracker())
    own.__del__()
    assert calls == ["exit", "pop"]
    own.ident = -1  # (collected later: nothing more)


def test_an_interrupt_while_entering_leaves_nothing_installed(monkeypatch):
    """`with comp:` calls no __exit__ when __enter__ raises: a Ctrl-C landing after the op tracker was entered left it
    and the saved-tensor hooks on the thread for good (every later torch call paid the tracker, and every later
    `with comp:` took the nested path). __enter__ undoes what it installed before raising."""
    from gact import saved as gsaved
    comp = gact.Compressor(mlp(), bits=4)
    modes = torch._C._len_torch_function_stack() if hasattr(torch._C, "_len_torch_function_stack") else None
    real = gsaved.OpTracker.__enter__

    def enter_then_interrupt(self):
        real(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(gsaved.OpTracker, "__enter__", enter_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with comp:
            pass
    monkeypatch.setattr(gsaved.OpTracker, "__enter__", real)
    assert getattr(comp._local, "depth", 0) == 0 and getattr(comp._local, "tracker", None) is None
    if modes is not None:
        assert torch._C._len_torch_function_stack() == modes
    x = torch.randn(64, 64)
    with comp:
        loss = comp.model(x).sum()
    loss.backward()
    assert comp.stats()["store"]["tensors_in"] >= 1
    comp.close()
