"""The walk over autograd's graph that decides a correlated save's group (gact/saved.py: correlated, _reaches_to):
_gact_torch.graph_reaches (C++, bindings/python/torch_graph.cpp) answers as the Python walk does, on random graphs
and on the cases its bounds and barriers exist for."""
import random

import pytest
import torch

from gact import saved as S

native = pytest.mark.skipif(S._graph_reaches is None, reason="_gact_torch built without autograd's headers")


def both(*args, **kwargs):
    a = S._reaches_to(*args, native=True, **kwargs)
    b = S._reaches_to(*args, native=False, **kwargs)
    assert a == b, (args, kwargs)
    return a


def _random_graph(rng: random.Random, n: int) -> list:
    leaves = [torch.randn(4, 6, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    pool = list(leaves)
    for _ in range(n):
        x = rng.choice(pool)
        y = rng.choice(pool)
        op = rng.randrange(9)
        if x.dim() != 2 or y.shape != x.shape:
            x, y = rng.choice(leaves), rng.choice(leaves)
        if op == 0:
            z = x + y
        elif op == 1:
            z = x * y
        elif op == 2:
            z = x.sin()
        elif op == 3:
            z = x.pow(2).sum(-1, keepdim=True).expand(4, 6)  # a sum of squares, for the reduced operands' barrier
        elif op == 4:
            a, b = x.chunk(2, dim=1)  # two outputs of one node
            z = torch.cat([b, a], dim=1)
        elif op == 5:
            z = x.t().t()  # a chain of view nodes
        elif op == 6:
            z = x[:, :3].repeat(1, 2)
        elif op == 7:
            z = x.exp() * x
        else:
            z = (x * 2).tanh()
        pool.append(z)
    return leaves, pool


@native
def test_native_walk_answers_as_the_python_walk_on_random_graphs():
    rng = random.Random(7)
    outcomes = {True: 0, False: 0}
    for g in range(60):
        leaves, pool = _random_graph(rng, rng.randrange(3, 40))
        inner = [t for t in pool if t.grad_fn is not None]
        for _ in range(20):
            ops = rng.sample(inner, min(len(inner), rng.randrange(1, 4)))
            reduced = [rng.random() < 0.4 for _ in ops]
            kind = rng.randrange(3)
            if kind == 0:
                r = both(ops, leaf=rng.choice(leaves), reduced=reduced)
            elif kind == 1:
                base = rng.choice(inner)
                r = both(ops, targets=[base], reduced=reduced)
            else:
                root = rng.choice(inner)
                base = root.t()[1:].t() if rng.random() < 0.5 else root[:, 1:]
                r = both(ops, targets=[base, root], reduced=reduced, chain_of=(base, root))
            outcomes[r] += 1
    # (both answers occur, so the comparison above compares something)
    assert outcomes[True] > 50 and outcomes[False] > 50, outcomes


@native
def test_native_walk_bounds_and_barriers():
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    h = x * 1.5
    # a hit further back than CORRELATION_DEPTH nodes is not seen; one within it is
    deep = h
    for _ in range(S.CORRELATION_DEPTH + 2):
        deep = deep.sin()
    assert not both([deep], targets=[h])
    near = h.sin().cos()
    assert both([near], targets=[h])
    # the leaf's AccumulateGrad
    assert both([near], leaf=x)
    assert not both([near], leaf=torch.randn(2, requires_grad=True))
    # a sum of squares stops a reduced operand's walk, not another's
    sq = h.pow(2).sum()
    assert not both([sq], targets=[h], reduced=[True])
    assert both([sq], targets=[h], reduced=[False])
    signed = h.sum()
    assert both([signed], targets=[h], reduced=[True])
    # the other output of a two-output node's input: output_nr counts
    a, b = h.chunk(2, dim=0)
    assert both([a.sin()], targets=[a])
    assert not both([b.sin()], targets=[a])
    # the walk does not pass the view nodes between a part and its root: an operand computed from an intermediate
    # view on that chain reaches the root only through it
    root = x * 2.0
    mid = root.t()[1:]
    q = mid.t()
    other = mid.sin()
    assert not both([other], targets=[q, root], chain_of=(q, root))
    assert both([other], targets=[q, root])  # (without the chain, through it)
    # a part beside another of the same root (q beside k) reaches the root through its own slice: a hit
    k = root[:, 4:].exp()
    assert both([k], targets=[root[:, :4], root], chain_of=(root[:, :4], root))
    # a walk that meets more than CORRELATION_NODES nodes gives up: the target's node is 4 levels back, behind a
    # stack of n products, found with 8 of them and not with CORRELATION_NODES + 8
    target = torch.randn(3, requires_grad=True)
    for n, found in ((8, True), (S.CORRELATION_NODES + 8, False)):
        parts = [torch.randn(3, requires_grad=True) * 1.0 for _ in range(n)] + [target * 1.0]
        far = torch.stack(parts).sum(0).sin()
        assert both([far], leaf=target) is found, n


@native
def test_native_walk_refuses_a_null_tensor_and_a_short_reduced_list():
    h = torch.randn(3, requires_grad=True) * 2
    with pytest.raises(ValueError, match="null TensorImpl"):
        S._graph_reaches([0], [], 0, [], 0, 0, 6, 64)
    with pytest.raises(ValueError, match="one entry per operand"):
        S._graph_reaches([h._cdata, h._cdata], [], 0, [True], 0, 0, 6, 64)


def _correlated_by_each_operand(t, frame, results):
    """correlated() as it compared ``t`` with each operand in turn (_view_of), before the call's operands were
    indexed by memory (saved._views): the oracle of the test below, up to where both have found the operand t is."""
    if frame is None:
        return False
    if t.grad_fn is None:
        if not t.requires_grad:
            # an alias without a graph (p.detach()) of a live recorded result: that result's reads are its
            return S._alias_of_a_result(t, frame, results)
        # a leaf (a policy's probe cuts a module's input with one): computed from nothing, but given twice, or read
        # by an operand through its AccumulateGrad node
        ops = S._operands(frame)
        if sum(1 for a in ops if a is t) >= 2:
            return True
        others = [a for a in ops if a is not t and not a.is_leaf]
        return bool(others) and S._reaches_to(others, leaf=t, reduced=[a.numel() * 8 <= t.numel() for a in others])
    # (only operands with a graph, not leaves, can be computed from t: a linear layer's weight and bias cost a read
    # each; this runs for every stored save)
    every = S._operands(frame)
    ops = [a for a in every if not a.is_leaf]
    if not ops:
        if results is not None and not any(S._view_of(t, a) for a in every):
            S._record(results, t)  # (a result of operands that need no gradient: see below)
        return False
    if len(ops) == 1 and S._view_of(t, ops[0]):
        # t is the call's one operand with a graph
        if results is not None and S._in_place(frame) and S._view_of(t, S._arg(frame.args, frame.kwargs, 0, "input")):
            S._record(results, t)  # (an in-place call's result, saved as the operand it overwrote: exp_)
            return False
        return S._reads_a_result(t, frame, results)
    base = None  # the operand t is (or a whole view of)
    others = []
    for a in ops:
        if not S._view_of(t, a):
            others.append(a)
        elif base is None:
            base = a
        else:
            return True  # the same memory twice (p * p)
    if base is None:
        # (no operand is t: the call's result or a tensor it made inside; its inputs existed before it and cannot
        # be computed from it. Recorded: a later call reading it for its own gradient gets a blob of its own)
        if results is not None:
            S._record(results, t)
        return False
    return S._read_with_its_own(t, base, others, frame, results)  # (from here on as correlated() goes on)


def _random_call(rng: random.Random, pool: list, leaves: list) -> tuple:
    """A call's operands and a tensor it saves: an operand itself, a whole view or alias of one (a transpose, a
    reshape, detach(), the same memory as another dtype), a part of one, or a tensor of its own; operands repeated,
    leaves among them, a list argument."""
    ops = [rng.choice(pool if rng.random() < 0.7 else leaves) for _ in range(rng.randrange(1, 5))]
    if rng.random() < 0.2:
        ops.append(ops[0])
    src = rng.choice(ops + pool)
    how = rng.randrange(7)
    if how == 0:
        t = src
    elif how == 1:
        t = src.t()
    elif how == 2:
        t = src.reshape(-1)
    elif how == 3:
        t = src.detach()
    elif how == 4:
        t = src.detach().view(torch.int64)  # (the same memory, another dtype: not a view of it)
    elif how == 5:
        t = src[1:]
    else:
        t = src * 1
    if rng.random() < 0.3:
        ops = rng.sample(ops, len(ops))
    args = (ops[0], ops[1:]) if len(ops) > 1 and rng.random() < 0.5 else tuple(ops)
    return t, S.Frame(torch.mul, args, {})


def test_operands_indexed_by_memory_answer_as_each_compared():
    """correlated() finds the operands a save is a whole view of through an index of the call's operands by memory
    (one lookup a save, an LSTM cell's call saving 13): on random calls and saves it answers as comparing the save
    with every operand did, and records the same results."""
    rng = random.Random(11)
    outcomes = {True: 0, False: 0}
    for g in range(40):
        leaves, pool = _random_graph(rng, rng.randrange(3, 30))
        for _ in range(25):
            t, frame = _random_call(rng, pool, leaves)
            twin = S.Frame(frame.func, frame.args, frame.kwargs)
            got_results, want_results = {}, {}
            got = S.correlated(t, frame, got_results)
            want = _correlated_by_each_operand(t, twin, want_results)
            assert got == want, (t.shape, [a.shape for a in S._operands(twin)])
            assert got_results.keys() == want_results.keys()
            outcomes[got] += 1
    assert outcomes[True] >= 20 and outcomes[False] >= 500, outcomes  # (both answers occur)


@native
@pytest.mark.parametrize("reduce, width, passes", [
    (lambda y: y.sum(-1), 2, True), (lambda y: y.mean(-1), 3, True), (lambda y: y.sum(-1, keepdim=True), 15, True),
    (lambda y: y.sum(-1), 16, False), (lambda y: y.mean(-1), 256, False), (lambda y: y.sum(), 2, False),
    (lambda y: y.sum((0, 1)), 2, False), (lambda y: y.sum(0), 2, True)])
@pytest.mark.parametrize("square", ["pow", "product"])
def test_exact_read_walk_stops_at_a_sum_of_squares_over_many_values(reduce, width, passes, square):
    """graph_ancestors (Compressor._exact_read's walk) passes a sum's or mean's square only where the reduction adds
    fewer than SQUARE_SUM_MIN_SPAN values per result: a squared offset over x, y (z), whose quantization groups span
    many offsets; not a norm's or a variance's over a row of features, nor a whole tensor's sum. A square is a power or
    a product of a tensor with itself (a hand-written LayerNorm's xc * xc)."""
    from _gact_torch import graph_ancestors, graph_node
    x = torch.randn(8, width, requires_grad=True)
    base = x * 2
    y = base ** 2 if square == "pow" else base * base
    t = reduce(y) + 1  # (held: the walk reads t's graph by address)
    nodes = set(graph_ancestors(t._cdata, 8, 32))
    assert graph_node(y._cdata) in nodes or not passes
    assert (graph_node(base._cdata) in nodes) == passes


_GRAM_FORMS = {
    "mm": (lambda x, y, w: torch.mm(x, x.t()), True),
    "mm_of_a_copy": (lambda x, y, w: torch.mm(x.t().contiguous().t(), x.t()), True),  # (a copy holds x's values)
    "einsum": (lambda x, y, w: torch.einsum("cn,dn->cd", x, x), True),
    "matmul_3d": (lambda x, y, w: (x.unsqueeze(0) @ x.unsqueeze(0).transpose(1, 2)).squeeze(0), True),
    "cov": (lambda x, y, w: torch.cov(x), True),
    "addmm": (lambda x, y, w: torch.addmm(torch.eye(8), x, x.t()), True),
    "two_operands": (lambda x, y, w: x @ y.t(), False),
    "a_parameter": (lambda x, y, w: w @ w.t(), False),
}


@native
@pytest.mark.parametrize("form", sorted(_GRAM_FORMS))
def test_graph_products_tells_a_gram_product_of_an_activation(form):
    """graph_products (Compressor._exact_products's walk from a factored matrix) reaches the product a covariance is
    computed by, through the ridge, the scale and einsum's or torch.cov's views, and returns it where it multiplies an
    activation with a view of itself: not two operands, nor a parameter's Gram product, whose saves are no
    activations. The elementwise nodes it passed are returned either way."""
    from _gact_torch import graph_node, graph_products
    made, gram = _GRAM_FORMS[form]
    w = torch.randn(8, 16, requires_grad=True)
    x, y = torch.tanh(w * 2), torch.tanh(w * 3)
    c = made(x, y, w)
    m = c / 15 + 1e-4 * torch.eye(8)
    nodes, found = graph_products(m._cdata, 8, 32)
    assert graph_node(m._cdata) in nodes  # (the elementwise nodes passed: their saves are the matrix's own)
    assert found == gram and (graph_node(c._cdata) in nodes) == gram, (form, found)
