"""What each backward reads from the tensors its op saves: the one table of gact's storage decisions.

A saved tensor is stored the way its reader needs it, decided by the op that saves it
(never by guesses from node names or save order):

``values``      quantized values at the tensor's bits (unbiased: linear readers such as a
                convolution's weight gradient get an unbiased gradient)
``log``         values at no fewer than LOG_MIN_BITS bits (the reader exponentiates them)
``exp``         a log-probability (log_softmax's result, at most 0) stored as its probability exp(x),
                quantized, and decoded with log: the reader uses exp(x) linearly (softmax minus the
                targets), so the gradient is unbiased, where rounding x itself biases it through the
                exponential (a classifier with logits spanning 58: 0.11 of the gradient at 4 bits)
``predicate``   an exact 1-bit mask of what the backward tests (``x > 0`` for a ReLU), decoded
                to two values that satisfy the test exactly as the original did
``normalized``  a normalization layer's input, quantized after normalizing with the layer's own
                statistics (kept exactly), so that a group spanning channels gives each channel
                noise in proportion to its own spread
``shape``       nothing: the backward reads only the tensor's shape (a pooling input, a loss's
                log-probabilities)
``indices``     max-pool indices, lossless as offsets inside their pooling window
``derivative``  an activation's input (SiLU, GELU, Mish, Softplus) stored as the activation's
                derivative f'(x), quantized: its backward, grad * f'(x), is linear in what is stored,
                so the gradient stays unbiased (f'(x^) of rounded values is not) and its noise is
                smaller at the same bits
``exact``       kept as it is: the gradient is discontinuous in the value (a sign with a zero, an
                equality with a reduction's result, a division by it)
``stats``       kept as it is: a normalization layer's per-channel statistics

The op is known from a ``torch.overrides.TorchFunctionMode`` active while the Compressor is
(``OpTracker``): when autograd's pack hook fires, the innermost torch function the mode saw is
the one saving the tensor (``hardtanh`` for ``nn.ReLU6``, ``linear``, ``batch_norm``, ...).
An op of torch's the table does not know gets ``values``: never a mask by guess. A save outside any
function the mode sees (a custom ``autograd.Function``'s, a TorchScript module's, a C++ extension's) and
a custom operator of another namespace are kept exact: gact does not know how their backward reads
them (a Function whose class says ``gact_saves = "values"`` gets values).

``TABLE`` has one row per op with its reason; bindings/python/README.md shows it
(``table_markdown()`` writes it, and a test keeps the two equal).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from . import _compat

# A log-space value's rounding step is a multiplicative error of e^step in what its reader
# exponentiates: at 2 bits a character LM lost 0.38 nats/char, at 4 bits 0.02.
LOG_MIN_BITS = 4

VALUES, LOG, EXP, PREDICATE, NORMALIZED, SHAPE, INDICES, EXACT, STATS, DERIVATIVE = (
    "values", "log", "exp", "predicate", "normalized", "shape", "indices", "exact", "stats", "derivative")


class Decision(NamedTuple):
    """How to store one saved tensor."""

    kind: str
    pred: tuple | None = None  # predicate: (name, a, b) for the codec
    decode: tuple | None = None  # predicate: (true_value, false_value) that satisfy the reader's test
    clamped: bool = False  # predicate: the tensor is the output of a clamp to the predicate's range
    window: dict | None = None  # indices: the pooling geometry
    min_bits: int = 0  # values: the fewest bits the reader tolerates
    # values: stored normalized per block of this many consecutive elements (a row) by the block's own largest
    # magnitude (0: plainly): the reader divides by a per-row quantity (a norm, a sum), and a quantization group that
    # spans rows of different scales would give a small row the rounding step of a large one, divided by its own
    # small norm (F.normalize over rows whose norms span 1000x: one seed's gradient 1.0x its norm off at 8 bits)
    rows: int = 0
    # values decided by a measurement of their call (Compressor._measure_qk): an attention call's query (1), key (2) or
    # both (3), whose backward rebuilds the weights as exp(q kᵀ·scale − lse): how far their rounding can move the scores
    # (attention_sigma); a fused attention's value or output (4), exact with its q and k; a side of a squared
    # difference (5, mse_loss's input and target): how its rounding step compares with the difference (near_ratio)
    qk: int = 0
    # values: a softmax's result, whose rows along this dimension sum to one (None: not one): decoded rows are made to
    # sum to one again, each row's excess taken back in equal shares from its nonzero values (Compressor._Packed.unpack;
    # a result holding a zero is stored as a boundary blob, so that its nonzero values are the exact ones: _store), as
    # the backward y·(g − Σ g·y) needs for its rows' gradient to sum to zero; rounded apart from one, a component every key
    # shares (an outlier feature in every token) leaks into the query's gradient (a q weight 0.5-0.9 of its gradient's
    # norm off at 8 bits, 0.11 corrected)
    simplex: int | None = None


_VALUES = Decision(VALUES)
_LOG = Decision(LOG)
_EXP = Decision(EXP, min_bits=LOG_MIN_BITS)  # (at 2 bits a step of a third of the largest probability: noisier than log space at 4)
_SHAPE = Decision(SHAPE)
_EXACT = Decision(EXACT)
_STATS = Decision(STATS)
_DERIVATIVE = Decision(DERIVATIVE)
# An attention's q and k: torch 2.x's fused kernels recompute the probabilities exp(q kᵀ·scale − lse) from
# them in the backward, so their rounding error is exponentiated. At 1 bit a 2-layer character LM's
# gradient error was 5e9 (relative) on the fused path against 6.8 on the math path; at 2 bits 0.48 and
# 0.45. Every float an attention call saves as values is kept at >= 2 bits.
_ATTENTION_VALUES = Decision(VALUES, min_bits=2)
#: an attention call's query and key: the fused kernels rebuild the weights as exp(q kᵀ·scale − lse) from them and
#: the exact log-sum-exp, so their rounding moves every weight of a row one way (each row then sums to more than 1,
#: by about half the variance of the rounding error of its scores: a bias, not noise, growing with the scores'
#: scale); at 8 bits its variance is 1/256 of 4 bits'
ATTENTION_QK_MIN_BITS = 8
_ATTENTION_QK = (None, Decision(VALUES, min_bits=ATTENTION_QK_MIN_BITS, qk=1),
                 Decision(VALUES, min_bits=ATTENTION_QK_MIN_BITS, qk=2),
                 Decision(VALUES, min_bits=ATTENTION_QK_MIN_BITS, qk=3))
#: ... and even at 8 bits that bias grows with the scores: peaked heads (a row-centred score spread of 12, 22) had 17 %
#: and 31 % of the gradient off at 8 bits on the fused path, with a bias of about 4 % (the math path: 3.5 %). Where the
#: bound attention_sigma puts on the rounding's standard deviation in a score is above ATTENTION_SIGMA_MAX (a bias of
#: at most sigma²/2, 0.5 %; the bound is 1.1-2x the deviation measured), the Compressor keeps that call's q and k exact
#: from the next step on; it measures at step 0 and every ATTENTION_CHECK_EVERY steps after, kept keys too (one read of
#: the bounds a step: on a GPU, no sync per call). Against the memory that costs: a layer whose bound is 0.095 (a score
#: spread of 3) had 3.4 % of the gradient off at 8 bits against 1.5 % exact; at 0.042 (spread 1.35), 1.8 % against 1.2 %
ATTENTION_SIGMA_MAX = 0.1
#: a fused attention call's value and output (Decision.qk 4): kept exact with its q and k. The fused backward takes
#: D = rowsum(dO·O) from the saved output and dP = dO·vᵀ from the saved value, and its scores' gradient P·(dP − D)
#: cancels on a peaked row only while O is P·v for the same v: rounded apart, what is left of a row where P is near one
#: is their rounding (a trained-like head of row maxima 0.97: the q and k weights' gradient 15 % off at 8 bits and 260 %
#: at 4 with q and k exact, against 2.7 % and 40 % through a hand-written softmax, whose saved P keeps it consistent)
_ATTENTION_VO = Decision(VALUES, min_bits=2, qk=4)
ATTENTION_CHECK_EVERY = 64
#: a result its backward reads through a square (tanh: 1 - y², sigmoid: y(1 - y)), and the recurrent calls whose
#: gates are such results: E[1 - ŷ²] = 1 - y² - Var(ŷ), a bias as large as the rounding's variance. At 2 bits the
#: 256-seed mean of a tanh MLP's first-layer gradient stayed 0.13 of its norm from fp32 (0.034 if unbiased), a
#: 2-layer LSTM's 0.073 (0.018); at 4 bits 0.0046 against 0.0039
QUADRATIC_MIN_BITS = 4
_QUADRATIC = Decision(VALUES, min_bits=QUADRATIC_MIN_BITS)
#: a normalization's input over fewer than NORM_FLOOR_BLOCK values per block (a layer or RMS norm over a transformer's
#: width, F.normalize's embeddings): its backward reads x̂·mean(g·x̂) from one rounding, whose i == i term is biased by
#: the rounding's variance over the block's size, and in a stack of such layers the bias adds up (2 bits, width 64,
#: depth 4: 7.0 % of the gradient for LayerNorm, 3.7 % for a hand-written RMSNorm): at least NORM_FLOOR_MIN_BITS,
#: which divides it by about 16; below NORM_SMALL_BLOCK (a batch norm over a small batch of 1x1 maps, whose spread
#: the backward divides by) NORM_SMALL_MIN_BITS. Outside an adaptive policy's budget.
NORM_SMALL_BLOCK = 64
NORM_SMALL_MIN_BITS = 8
NORM_FLOOR_BLOCK = 1024
NORM_FLOOR_MIN_BITS = 4


#: the fewest values a row normalized per row holds (Compressor._row_params): its scale and shift take 4 bytes, 2 bits a
#: value over 16 values (the codes of 16 values at 2 bits take 4 bytes too); over rows of 3 (an RGB or xyz loss's x ** 2)
#: the statistics would cost several times the codes
ROW_MIN = 16


def norm_floor(block: int) -> int:
    """The fewest bits a normalization's input over ``block`` values per statistics block is stored with (0: none)."""
    return NORM_SMALL_MIN_BITS if block < NORM_SMALL_BLOCK else NORM_FLOOR_MIN_BITS if block < NORM_FLOOR_BLOCK else 0


def _floored(block: int, rows: int = 0) -> Decision:
    """Values with norm_floor(block) bits at least (block 0: not known, NORM_FLOOR_MIN_BITS), normalized per ``rows``
    consecutive elements (Decision.rows)."""
    mb = norm_floor(block) if block > 0 else NORM_FLOOR_MIN_BITS
    return _VALUES if mb == 0 and rows == 0 else Decision(VALUES, min_bits=mb, rows=rows)


def _last_dim_rows(x: Any, dim: Any) -> int:
    """The row length where a reduction over ``dim`` of ``x`` reduces each row of its last dimension (dim -1 or the
    last, x of at least 2 dimensions): the blocks Decision.rows normalizes; 0 otherwise."""
    if not isinstance(x, torch.Tensor) or isinstance(dim, bool) or x.dim() < 2:
        return 0
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or dim not in (-1, x.dim() - 1):
        return 0
    return x.shape[-1] if x.shape[-1] > 1 else 0


class Row(NamedTuple):
    reads: str  # what the backward reads, for the README
    reason: str
    rule: Callable[[torch.Tensor, tuple, dict, "Frame"], Decision]


# The activation call whose input autograd is saving (an _ActivationCall), while its stand-in saves it: the
# storage table's rows for the activations answer `derivative` then (see ActivationFunction).
class _DerivativeLocal(threading.local):
    cell: Any = None


_DERIVATIVE_LOCAL = _DerivativeLocal()


# ---- argument access ------------------------------------------------------------------------

def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _scalar(x: Any) -> float | None:
    """A Python number (or 0-d tensor) as float; None for None, a tensor with elements, or a non-finite."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dim() != 0:
            return None
        x = x.item()
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _outside(a: float) -> float:
    """A value below `a` (strictly, also in bfloat16)."""
    return a - max(1.0, abs(a))


def _above(a: float) -> float:
    return a + max(1.0, abs(a))


def _pred_holds(pred: tuple, v: float) -> bool:
    """The predicate ``pred`` (codecs/README.md) of a float64 value ``v``, as torch's float64 backward tests it."""
    name, a, b = pred
    if name in ("gt_or_nan", "gt"):
        return v > a or (name == "gt_or_nan" and v != v)
    if name == "ge":
        return v >= a
    if name == "lt":
        return v < a
    if name == "le":
        return v <= a
    if name == "open":
        return a < v < b
    if name == "closed":
        return a <= v <= b
    return v != 0


def _rounded_to(x: float, dtype: torch.dtype) -> float | None:
    """``x`` as a value of ``dtype`` (float32, as the codec holds bounds and decode values, or a 16-bit one); None
    where it overflows to infinity."""
    v = torch.tensor(x, dtype=dtype).item()
    return v if math.isfinite(v) or not math.isfinite(x) else None


@functools.lru_cache(maxsize=4096)
def _predicate_fits(pred: tuple, decode: tuple, dtype: torch.dtype) -> bool:
    name, a, b = pred
    held = torch.float32 if dtype is torch.float64 else dtype  # (float64's mask goes through float32)

    def rounded(x: float) -> float | None:
        return _rounded_to(x, held)

    bounds = (a, b) if name in ("open", "closed") else (a,)
    if any(rounded(x) != x for x in bounds):
        return False
    true_value, false_value = (rounded(v) for v in decode)
    return true_value is not None and false_value is not None and \
        _pred_holds(pred, true_value) and not _pred_holds(pred, false_value)


def predicate_fits(d: "Decision", dtype: torch.dtype) -> bool:
    """Whether a mask of a ``dtype`` tensor keeps torch's own test. The codec evaluates the predicate on the values
    as float32 (16-bit ones widened, float64 narrowed) against float32 bounds and decodes its two values in the
    tensor's dtype (float64: through float32). torch tests a float64 tensor against the exact bound, and a 16-bit one
    against the bound as float32 (threshold, hardtanh) or rounded to its dtype (clamp): the codec agrees with all of
    them where each bound is a value of the dtype (of float32, for float64), and a decode value that equals a bound
    (threshold's, clamp's, hardtanh's) then lands on its side. float32 tensors always fit (torch's bound is float32).
    (A float64 value within float32's rounding of a bound, 3e-8 of it, or below 1.4e-45 in magnitude, is tested on its
    float32 rounding and may land on the other side: a rare element, README Known limits.)"""
    if dtype is torch.float32 or d.decode is None:  # (no decode values: dropout's mask, x != 0)
        return True
    return _predicate_fits(d.pred, d.decode, dtype)


def _matrix_power(t, args, kwargs, frame) -> Decision:
    # a negative power is an inverse's (read through -A⁻ᵀ·g·A⁻ᵀ, 11x the gradient at 1 bit); others are products
    n = _arg(args, kwargs, 1, "n")
    return _EXACT if not isinstance(n, int) or n < 0 else _VALUES


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


# ---- rules ----------------------------------------------------------------------------------

def _relu(t, args, kwargs, frame) -> Decision:
    # ReluBackward saves the result; its backward zeroes the gradient where result <= 0 (a NaN passes it:
    # hence gt_or_nan, not gt). A ReLU's output is >= 0: the mask can become a boundary blob (exact zeros)
    # when the next layer reads the same tensor's values.
    if not _is_float(t):
        return _VALUES
    return Decision(PREDICATE, ("gt_or_nan", 0.0, 0.0), (1.0, 0.0), clamped=True)


def _threshold(t, args, kwargs, frame) -> Decision:
    th = _scalar(_arg(args, kwargs, 1, "threshold"))
    if th is None or not _is_float(t):
        return _EXACT if _is_float(t) else _VALUES
    return Decision(PREDICATE, ("gt_or_nan", th, 0.0), (_above(th), th))


def _hardtanh_bounds(name: str, args, kwargs) -> tuple[float | None, float | None]:
    if name == "relu6":
        return 0.0, 6.0
    return _scalar(_arg(args, kwargs, 1, "min_val", -1.0)), _scalar(_arg(args, kwargs, 2, "max_val", 1.0))


def _hardtanh(t, args, kwargs, frame) -> Decision:
    lo, hi = _hardtanh_bounds(frame.name, args, kwargs)
    if lo is None or hi is None or not lo < hi or not _is_float(t):
        return _EXACT if _is_float(t) else _VALUES
    # (at a NaN torch's own hardtanh_backward disagrees with itself: its CPU vector path zeroes the
    # gradient, its scalar and CUDA paths pass it; the mask follows the vector path)
    return Decision(PREDICATE, ("open", lo, hi), ((lo + hi) / 2, lo))


def _hardsigmoid(t, args, kwargs, frame) -> Decision:
    if not _is_float(t):
        return _VALUES
    return Decision(PREDICATE, ("open", -3.0, 3.0), (0.0, -4.0))


def _clamp(t, args, kwargs, frame) -> Decision:
    if not _is_float(t):
        return _VALUES
    name = frame.name.rstrip("_")
    if name == "clamp_min":
        lo, hi, lo_given, hi_given = _arg(args, kwargs, 1, "min"), None, True, False
    elif name == "clamp_max":
        lo, hi, lo_given, hi_given = None, _arg(args, kwargs, 1, "max"), False, True
    else:
        lo, hi = _arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max")
        lo_given, hi_given = lo is not None, hi is not None
    a, b = _scalar(lo), _scalar(hi)
    if (lo_given and a is None) or (hi_given and b is None):
        return _EXACT  # bounds given as tensors: the test compares two tensors
    if a is not None and b is not None:
        if not a <= b:
            return _EXACT
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in (lo, hi)):
            # (a trained bound, 0-dimensional: its gradient sums the elements on its own side, which the predicate's
            # decode, one value for both sides, cannot tell; a learned threshold clamp(x, -t, t) got the upper
            # side's share on the lower bound, the upper bound none)
            return _EXACT
        return Decision(PREDICATE, ("closed", a, b), ((a + b) / 2, _outside(a)))
    if a is not None:
        return Decision(PREDICATE, ("ge", a, 0.0), (a, _outside(a)))
    if b is not None:
        return Decision(PREDICATE, ("le", b, 0.0), (b, _above(b)))
    return _VALUES


def _leaky_relu(t, args, kwargs, frame) -> Decision:
    # leaky_relu_backward(grad, x, slope) = grad * (x > 0 ? 1 : slope): the sign is all it reads.
    if not _is_float(t):
        return _VALUES
    return Decision(PREDICATE, ("gt", 0.0, 0.0), (1.0, -1.0))


def _rrelu(t, args, kwargs, frame) -> Decision:
    # rrelu saves its input (read for its sign) and its random slopes, which the kernel writes only after autograd
    # saved the buffer (torch reads them at backward through the same tensor): kept as they are, never encoded at
    # the save, which would read the buffer before it holds the slopes.
    if not _is_float(t) or not t.requires_grad:
        return _EXACT
    return Decision(PREDICATE, ("gt", 0.0, 0.0), (1.0, -1.0))


def _dropout(t, args, kwargs, frame) -> Decision:
    # The CPU kernel saves its scaled mask (0 and 1/(1-p)): a two-level tensor, exact as 1 bit and
    # its level. The CUDA kernel saves a bool mask, which the mask codec keeps losslessly anyway.
    if not _is_float(t) or t.requires_grad:
        return _VALUES
    return Decision(PREDICATE, ("ne", 0.0, 0.0), None)


def _or_derivative(rule: Callable) -> Callable:
    """A row's rule for an activation with a derivative stand-in: f'(x) where the stand-in saves (the
    `derivatives` option, an input above min_bytes), ``rule`` otherwise."""
    return lambda t, args, kwargs, frame: _DERIVATIVE if activation_call(t) is not None else \
        rule(t, args, kwargs, frame)


def _elu(t, args, kwargs, frame) -> Decision:
    alpha = _scalar(_arg(args, kwargs, 1, "alpha", 1.0))
    if alpha != 1.0 or _compat.forward_ad_active():
        # (under forward-mode AD a loss on the tangent, a Jacobian penalty, is read back through f''(x), e^x below 0
        # and 0 above: a jump at 0 that a rounded input crosses, at any width: 0.8 % of the gradient at 8 bits, 7.5x
        # what noise leaves in 128 seeds)
        return _EXACT
    # (out of place the input is saved, read through exp; in place the result, through min(result + alpha, 1),
    # whose kink at 0 rounding biases too: a convex or kinked derivative, biased by the rounding's variance as tanh's
    # square is)
    return _QUADRATIC


#: a softmax over fewer values than this keeps at least QUADRATIC_MIN_BITS: its backward reads the result
#: through y·(g - Σ g·y), whose diagonal term E[ŷ²] is biased by the rounding's variance. Over 8 values at 2
#: bits the 128-seed mean of the gradient stayed 1.6x what noise leaves, over 32 1.4x; over 64, 128 and 256
#: 1.02, 1.23 and 1.06-1.13x (256 seeds): the bias follows how peaked the rows are more than their width, and
#: wide rows (an attention map's) are where the bytes count
SOFTMAX_WIDE = 128


def _softmax(t, args, kwargs, frame) -> Decision:
    if not _is_float(t):
        return _VALUES
    if frame.name == "gumbel_softmax":  # (logits, tau, hard, eps, dim=-1)
        dim = _arg(args, kwargs, 4, "dim", -1)
    else:
        dim = _arg(args, kwargs, 1, "dim")
    if dim is None:
        dim = 0 if t.dim() in (0, 1, 3) else 1  # (F.softmax's and F.softmin's implicit dimension)
    try:
        n = t.shape[int(dim)] if t.dim() > 0 else 1
    except (IndexError, TypeError, ValueError):
        return _QUADRATIC
    d = _QUADRATIC if n < SOFTMAX_WIDE else _VALUES
    # (its rows sum to one: decoded so again; not gumbel_softmax's, a composite whose saves are not all its result)
    return d._replace(simplex=int(dim)) if frame.name != "gumbel_softmax" and n > 1 else d


def _celu(t, args, kwargs, frame) -> Decision:
    return _EXACT if _compat.forward_ad_active() else _QUADRATIC  # (see _elu)


def _pool_input_shape(t, args, kwargs, frame) -> Decision:
    return _SHAPE if _is_float(t) else _VALUES


def _mean_input(t, args, kwargs, frame) -> Decision:
    # torch 1.13's mean over dimensions saves its input for the input's sizes alone (torch 2.x saves nothing)
    return _SHAPE if _is_float(t) and _view_of(t, _arg(args, kwargs, 0, "input")) else _VALUES


def _max_pool(t, args, kwargs, frame) -> Decision:
    if _is_float(t):
        return _SHAPE  # max_pool's backward scatters through the indices; the input gives its shape
    if t.dtype not in (torch.int64, torch.int32):
        return _VALUES
    nd = int(frame.name[len("max_pool")])
    w = _window(t, args, kwargs, nd)
    return Decision(INDICES, window=w) if w is not None else _VALUES


def _tuple(x: Any, nd: int) -> tuple | None:
    if x is None:
        return None
    if isinstance(x, int):
        return (x,) * nd
    x = tuple(int(v) for v in x)
    if len(x) == 1:
        return x * nd
    return x if len(x) == nd else None


def _window(idx: torch.Tensor, args, kwargs, nd: int) -> dict | None:
    """The pooling geometry of max_pool{nd}d indices, with `inner` for their memory order; None when the
    indices' layout is not one the window codec reads (they are then stored losslessly as they are)."""
    x = _arg(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or idx.dim() < nd or x.dim() != idx.dim():
        return None
    kernel = _tuple(_arg(args, kwargs, 1, "kernel_size"), nd)
    stride = _tuple(_arg(args, kwargs, 2, "stride"), nd) or kernel
    if not stride:  # stride=None or an empty list means the kernel size
        stride = kernel
    pad = _tuple(_arg(args, kwargs, 3, "padding", 0), nd)
    dil = _tuple(_arg(args, kwargs, 4, "dilation", 1), nd)
    if kernel is None or stride is None or pad is None or dil is None:
        return None
    out = tuple(idx.shape[-nd:])
    inp = tuple(x.shape[-nd:])
    st = idx.stride()
    inner = st[-1] if idx.numel() else 1
    expect = inner
    for d in range(idx.dim() - 1, idx.dim() - nd - 1, -1):  # spatial dims row-major among themselves
        if idx.shape[d] != 1 and st[d] != expect:
            return None
        expect *= idx.shape[d]
    return {"nd": nd, "inner": int(inner), "in": inp, "out": out, "kernel": kernel, "stride": stride,
            "pad": pad, "dilation": dil}


def _view_of(t: torch.Tensor, x: Any) -> bool:
    """Whether `t` is `x` or a view of all of it (the same storage start and element count)."""
    if t is x:
        return True
    if not isinstance(x, torch.Tensor):
        return False
    # (a torch.func transform's wrapped tensor has no storage of its own to compare: inside vmap a mul of a
    # batched and a plain tensor raised "Cannot access data pointer")
    # (nor a sparse tensor's: it has no data pointer)
    try:
        return t.numel() == x.numel() and t.dtype == x.dtype and x.layout is torch.strided and \
            t.layout is torch.strided and not _compat.is_functorch_wrapped(x) and \
            not _compat.is_functorch_wrapped(t) and t.data_ptr() == x.data_ptr()
    except NotImplementedError:  # (nor a Tensor subclass standing for a computation: SDPA's CausalBias, _dense)
        return False


def _loss_input_shape(t, args, kwargs, frame) -> Decision:
    # nll_loss's backward scatters -weight / total_weight at the targets: its input gives only the
    # shape (its total_weight is read: values, and small).
    if _is_float(t) and _view_of(t, _arg(args, kwargs, 0, "input")):
        return _SHAPE
    return _VALUES


def _cross_entropy(t, args, kwargs, frame) -> Decision:
    # With class-index targets the call is log_softmax then nll_loss: log_softmax saves its result, read through
    # exp (stored as exp); nll_loss then saves the same tensor for its shape alone, and the targets. Label
    # smoothing adds a sum of the log-probabilities (which saves nothing) and probability targets a product with
    # the targets (which saves the targets): the log-probabilities are still read through exp alone (as log-space
    # values, rounded before the exp, label smoothing 0.1 over logits x 10 kept 5 % of the gradient in the mean of
    # 256 seeds at 4 bits). A target or a class weight that is trained reads them linearly too: log-space values.
    if not (_is_float(t) and t.requires_grad):
        return _VALUES
    x = _arg(args, kwargs, 0, "input")
    if isinstance(x, torch.Tensor) and t.numel() < x.numel():
        # (a per-row term made inside, torch 1.13's label-smoothing loss of each row, +460 over 97 classes: not
        # log-probabilities, whose exp would overflow; one value per row, exact)
        return _EXACT
    target, weight = _arg(args, kwargs, 1, "target"), _arg(args, kwargs, 2, "weight")
    if not isinstance(target, torch.Tensor) or (target.is_floating_point() and target.requires_grad) or \
            (isinstance(weight, torch.Tensor) and weight.requires_grad):
        return _LOG
    seen = (t.data_ptr(), t.numel())  # (nll_loss's save may be a reshaped view: 3-D and 5-D inputs)
    if frame is not None and frame.seen == seen:
        return _SHAPE
    if frame is not None:
        frame.seen = seen
    return _EXP


def _log_softmax(t, args, kwargs, frame) -> Decision:
    # (its only save is its result)
    return _EXP if _is_float(t) else _VALUES


def _attention(t, args, kwargs, frame) -> Decision:
    # What an attention call saves, on every path torch takes (math, flash, memory-efficient, cuDNN; the
    # private entry points the fused paths go through are rows of their own): the query, key, value and
    # output as values. Its log-sum-exp (a float that needs no gradient, one value per head and query
    # position: at least 3 dimensions, padded by the memory-efficient kernel to a multiple of 32 with
    # infinities) is read through exp: exact, a 1/head_dim share of the output's bytes. A float mask the
    # call was given is exact (it holds -inf). Integer saves (philox seed and offset, cumulative sequence
    # lengths) are kept for their dtype. Not exact: the flattened copy of an input that needs no gradient
    # (the batch fed straight into an attention layer, which its input projection saves in 2 dimensions).
    if not _is_float(t):
        return _VALUES
    mask = _arg(args, kwargs, 3, "attn_mask")
    # (the mask, or autocast's copy of it in the call's dtype: a float32 ALiBi bias under bfloat16 autocast; not a
    # Tensor subclass standing for one, torch.nn.attention.bias.CausalBias, which holds no values)
    if isinstance(mask, torch.Tensor) and _dense(mask) and (_view_of(t, mask) or cast_copy_of(t, mask)):
        return _EXACT
    if not t.requires_grad and t.grad_fn is None and t.dim() >= 3 and \
            not any(_view_of(t, a) for a in list(args) + list(kwargs.values())):
        return _EXACT
    mha = frame is not None and frame.name == "multi_head_attention_forward"
    q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    role = (1 if not mha and _given_as(t, q) else 0) | (2 if not mha and _given_as(t, k) else 0)
    if role:
        return _ATTENTION_QK[role]  # (before the maps: a head size equal to the keys' count gives q and k a map's shape)
    if _attention_map(t, args, kwargs, mha):
        if frame is not None:
            frame.mapped = True  # (the math path: its backward reads P, saved before v)
        return _QUADRATIC
    if mha:
        # (its first arguments are the layer's inputs; the tracker does not see the attention call inside it, whose
        # q, k, v and output are its only 4-dimensional saves that need a gradient (torch 2.x, need_weights=False:
        # a fused kernel). Autograd's generated code saves an op's inputs before its output, in argument order, so
        # q and k are the first two: at their floor; v and the output at the run's bits, exact with q and k)
        if t.dim() == 4 and t.requires_grad:
            frame.count += 1
            return _ATTENTION_QK[frame.count] if frame.count <= 2 else _ATTENTION_VO
        return _ATTENTION_VALUES
    # (a fused kernel's v and output, read together by its backward: exact with its q and k; not on the math path)
    return _ATTENTION_VALUES if (frame is not None and frame.mapped) or not t.requires_grad else _ATTENTION_VO


def _flex_attention(t, args, kwargs, frame) -> Decision:
    # flex_attention (torch >= 2.5; the tracker sees its higher-order op: query, key, value, score_mod, block_mask,
    # scale, kernel_options, then the tensors score_mod and mask_mod close over). Its backward recomputes the scores
    # from q and k through the user's score_mod and exp(score - lse), as a fused attention kernel does: q and k at
    # their floor, v and the output (read linearly) at the run's bits, and every other float it saves exact: the
    # log-sum-exp (autograd gives it a graph here, so the attention row's test for it does not apply) and the tensors
    # score_mod reads (a bias table, read through the softmax). Integer block-mask tensors are kept for their dtype.
    if not _is_float(t):
        return _VALUES
    q, k, v = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key"), _arg(args, kwargs, 2, "value")
    role = (1 if _given_as(t, q) else 0) | (2 if _given_as(t, k) else 0)
    if role:
        return _ATTENTION_QK[role]
    if _given_as(t, v):
        return _ATTENTION_VALUES
    if frame is not None and isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and t.dim() == q.dim() \
            and tuple(t.shape) == (*q.shape[:-1], v.shape[-1]) and not any(_view_of(t, a) for a in _operands(frame)):
        return _ATTENTION_VALUES  # (the output)
    return _EXACT


#: a side of a squared difference (mse_loss's input or target, Decision.qk 5)
_DIFFERENCE_SIDE = Decision(VALUES, qk=5)
#: near_ratio above which a squared difference's sides are kept exact: the rounding step above a quarter of the
#: difference's rms, where the rounding carries about a tenth of what the backward reads (the gradient's error from it
#: was about 0.4x the ratio: a denoiser at σ = 0.05, ratio 0.46 at 8 bits, 18 %; at σ = 0.2, 0.11, 4.4 %; a perceptual
#: loss's VGG features at 4 bits, 0.12-0.28, stay stored or nearly)
NEAR_STEP_MAX = 0.25


def _mse_side(t, args, kwargs, frame) -> Decision:
    if not _is_float(t) or t.is_complex():
        return _VALUES
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
    return _DIFFERENCE_SIDE if _view_of(t, a) or _view_of(t, b) else _VALUES


def near_ratio(frame: "Frame", bits: int, group: int) -> torch.Tensor | None:
    """A squared difference's (mse_loss's) rounding step at ``bits`` (the rms over both sides' quantization groups of
    ``group`` values) over the rms of the difference of its sides, as a 0-dimensional float32 tensor on their device
    (read at step(), no sync here); None where it cannot be computed. Its backward reads 2·(input − target): where the
    step exceeds that difference, the rounding is most of what it reads (a model near its target: a denoiser at small
    noise, a distilled feature, a depth at 1 %)."""
    a, b = _arg(frame.args, frame.kwargs, 0, "input"), _arg(frame.args, frame.kwargs, 1, "target")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.numel() == 0:
        return None
    reduction = _arg(frame.args, frame.kwargs, 4, "reduction")
    if (reduction in ("none", 0) or _arg(frame.args, frame.kwargs, 3, "reduce") is False) and a.shape == b.shape and \
            a.dim() >= 2 and a.shape[0] >= 2:
        return _near_ratio_per_sample(a, b, bits, group)
    try:
        with torch.no_grad():
            a, b = a.detach(), b.detach()
            steps = []
            for x in (a, b):
                x = x.reshape(-1)
                n = x.numel() - x.numel() % group if x.numel() >= group else x.numel()
                x = x[:n].view(-1, min(group, n)).float()
                steps.append((x.amax(1) - x.amin(1)).square().mean())
            step = torch.sqrt((steps[0] + steps[1]) / 2) / ((1 << bits) - 1)
            return step / (a - b).float().square().mean().sqrt()
    except RuntimeError:  # (no memory for the difference, shapes that do not broadcast: not measured)
        return None


def _near_ratio_per_sample(a: torch.Tensor, b: torch.Tensor, bits: int, group: int) -> torch.Tensor | None:
    """near_ratio of an unreduced squared difference (reduction="none"), whose elements the program weighs as it likes,
    per sample along the first dimension: each sample's step (over its own groups, or the whole tensor's where a sample
    is shorter than a group) over the rms of its own difference, the rms of these over the samples. A loss weighted
    per sample (EDM's λ(σ) = (σ² + σ_d²)/(σ·σ_d)², diffusers' min-SNR weights) gives each sample a like share of the
    gradient, and a sample at small noise a difference of about σ: over the whole tensor, the samples at large noise
    made the rms, and the rounding was 0.09 of the gradient's norm at 8 bits (0.003 for the difference saved)."""
    try:
        with torch.no_grad():
            n = a.shape[0]
            a, b = a.detach().reshape(n, -1), b.detach().reshape(n, -1)
            per = a.shape[1]
            steps = []
            for x in (a, b):
                if per >= group:
                    x = x[:, :per - per % group].reshape(n, -1, group).float()
                    steps.append((x.amax(2) - x.amin(2)).square().mean(1))
                else:
                    m = x.numel() - x.numel() % group if x.numel() >= group else x.numel()
                    x = x.reshape(-1)[:m].view(-1, min(group, m)).float()
                    steps.append((x.amax(1) - x.amin(1)).square().mean().expand(n))
            step = torch.sqrt((steps[0] + steps[1]) / 2) / ((1 << bits) - 1)
            rms = (a - b).float().square().mean(1).sqrt()
            # (a sample with no difference at all, masked out or matched exactly, weighs nothing: left out, not an
            # infinite or NaN ratio that would keep the whole call exact)
            live = rms > 0
            ratio = torch.where(live, step / torch.where(live, rms, torch.ones_like(rms)), torch.zeros_like(rms))
            return (ratio.square().sum() / live.sum().clamp_min(1)).sqrt()
    except RuntimeError:
        return None


def attention_sigma(q_stats: tuple, k_stats: tuple, scale: float, shared: bool = False) -> torch.Tensor:
    """A bound on the standard deviation that rounding q and k at ATTENTION_QK_MIN_BITS adds to a score q·k·scale, from
    each one's (largest magnitude, largest row norm) as 0-dimensional tensors: a value's rounding error has a variance
    of at most step²/4, its group's step is at most 2·largest/(2^b − 1), so the error of q_i·k_j is at most
    scale·(step_q/2)·|k_j| and scale·(step_k/2)·|q_i| in standard deviation, independent; ``shared`` (q is k: one
    rounding, whose two terms add on the diagonal) √2 times that. On the tensors' device."""
    (aq, nq), (ak, nk) = q_stats, k_stats
    half_step = (2.0 ** 0.5 if shared else 1.0) / ((1 << ATTENTION_QK_MIN_BITS) - 1)
    return scale * half_step * torch.sqrt((aq * nk).square() + (ak * nq).square())


def attention_scale(frame: Frame, t: torch.Tensor) -> float:
    """The scale an attention call multiplies its scores by: its ``scale`` argument, or 1/sqrt(head size)."""
    index = {"scaled_dot_product_attention": 6, "flex_attention": 5}.get(frame.name, -1)
    scale = _arg(frame.args, frame.kwargs, index, "scale") if index >= 0 else frame.kwargs.get("scale")
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else \
        1.0 / math.sqrt(max(t.shape[-1], 1))


def _given_as(t: torch.Tensor, a: Any) -> bool:
    """Whether ``t`` is the argument ``a`` the call was given (its query, key, ...), a view of it, or autocast's copy
    of it in the call's dtype (rotary embeddings with float32 cos/sin under bfloat16 autocast hand a float32 q and k to an
    attention that computes in bfloat16: the fused kernel saves the copies, and rebuilds the weights from them)."""
    if not isinstance(a, torch.Tensor):
        return False
    return _view_of(t, a) or (t.dtype != a.dtype and _copy_of(t, a))


def _copy_of(t: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``t`` is a dtype copy of ``a`` (autocast's), or a view of one: of that very output of its node (q, k and
    v split from one projection share a node), or, without a graph, a copy of ``a``'s shape."""
    g = t.grad_fn
    if g is None:
        return cast_copy_of(t, a)
    for _ in range(7):
        name = type(g).__name__
        if name == "ToCopyBackward0":
            fn, nr = g.next_functions[0]
            if a.grad_fn is not None:
                return fn is a.grad_fn and nr == a.output_nr
            return getattr(fn, "variable", None) is a
        if name not in VIEW_NODES:
            return False
        nxt = g.next_functions
        if not nxt or nxt[0][0] is None:
            return False
        g = nxt[0][0]
    return False


def _attention_map(t: torch.Tensor, args: tuple, kwargs: dict, mha: bool) -> bool:
    """Whether ``t`` has the shape of the call's attention probabilities (queries × keys) over fewer than
    SOFTMAX_WIDE keys: the math path (torch 1.13's multi-head attention, a 2.x call with need_weights=True,
    scaled_dot_product_attention on inputs no fused kernel takes: enable_gqa on the CPU, a float64 call) saves
    the softmax's result, which its backward reads as any softmax's (y·(g − Σ g·y)): at least QUADRATIC_MIN_BITS,
    as a softmax over as few values. A map is made by the softmax (or a dropout of it, or a mask applied to it:
    a product), through views: a fused kernel's saves (the inputs, the output, the log-sum-exp) and q, k, v
    (projections, views of them) are not, whatever their shapes; the math path's scaled copy of q is a product,
    given the floor where the head size equals the keys' count (bytes, not bias)."""
    if t.dim() < 2 or not t.requires_grad:
        return False
    if mha:  # (query (L, N, E) or (L, E), key (S, N, E) or (S, E); the maps are (N·heads, L, S) or (N, heads, L, S))
        q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2):
            return False
        queries, keys = q.shape[0], k.shape[0]
    else:  # (query (..., L, E), key (..., S, E))
        q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2):
            return False
        queries, keys = q.shape[-2], k.shape[-2]
    if keys >= SOFTMAX_WIDE or t.shape[-2] != queries or t.shape[-1] != keys:
        return False
    if any(_given_as(t, a) for a in (*args, *kwargs.values())):
        return False  # (what the call was given, or autocast's copy of it: q, k, v, a mask; a map is made inside it)
    g = through_copies(t.grad_fn)[0]
    return g is not None and type(g).__name__ in _MAP_NODES


#: what makes an attention call's map of probabilities on its math path (seen through views): the softmax, the
#: dropout of it, a mask or scale applied to it
_MAP_NODES = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0", "NativeDropoutBackward0", "FusedDropoutBackward0",
                        "MulBackward0", "DivBackward0", "MaskedFillBackward0", "WhereBackward0"})


def _kl_div(t, args, kwargs, frame) -> Decision:
    # kl_div(input, target): the target's gradient reads it through log (log_target: exp); the input's reads the
    # target linearly, and the input is read by nothing but the target's gradient (linearly)
    if not _is_float(t):
        return _VALUES
    target = _arg(args, kwargs, 1, "target")
    if isinstance(target, torch.Tensor) and _view_of(t, target):
        return _EXACT if target.requires_grad else _QUADRATIC
    return _VALUES


def _rms_norm(t, args, kwargs, frame) -> Decision:
    # x * rsqrt(mean(x^2) + eps) * w: the input as values, read twice by the backward (x̂·mean(g·x̂)): at least
    # norm_floor's bits over the normalized shape; 1/rms (one value per row, read through a division in the backward)
    # exact, like a norm's result; x·(1/rms), the weight's factor, values.
    x = _arg(args, kwargs, 0, "input")
    # (ATen's rms_norm reads a float16 or bfloat16 input through its float32 copy, saved for both reads)
    if not _given_as(t, x):
        # (a full-size tensor made inside, x·(1/rms) that the weight's gradient reads linearly: values)
        return _VALUES if isinstance(x, torch.Tensor) and t.numel() >= x.numel() and _is_float(t) else _EXACT
    shape = _arg(args, kwargs, 1, "normalized_shape")
    try:
        block = math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
    except (TypeError, ValueError):
        block = 0
    return _floored(block)


def _broadcast_factor(t, args, kwargs, frame) -> Decision:
    # a * s with s broadcast over a (a per-row 1/rms, a squeeze-excitation gate, a per-channel scale): each
    # value of s multiplies a whole row in the forward and its gradient sums over that row, so its rounding
    # error does not average out, and a heavy-tailed s (1/rms of rows of very different scales) rounded per
    # group of rows is off by orders of magnitude. Exact when the other operand has at least 8x its
    # elements (so it costs at most 1/8 of that operand's bytes); the full-size operand is values.
    if not _is_float(t):
        return _VALUES
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    other = b if _view_of(t, a) else a if _view_of(t, b) else None
    if isinstance(other, torch.Tensor) and other.numel() >= 8 * t.numel():
        return _EXACT
    if isinstance(other, torch.Tensor) and _complex_part(t) and _view_of(t, other):
        return _EXACT  # (X.real * X.real: a spectrum's squared magnitude, as X.real ** 2 is in _pow)
    if isinstance(other, torch.Tensor) and other.requires_grad and not t.requires_grad and \
            (t.dim() == 1 or (t.dim() == 2 and t.shape[-1] < ROW_MIN)) and 1 < t.numel() <= SHORT_BATCH_MAX:
        # (a weight that needs no gradient, times the per-sample losses: sigma² over a ladder of sigmas, EDM's λ(σ),
        # importance weights, spanning orders of magnitude; rounded in steps of the largest, the small ones were 0 or a
        # step at random: a score network's gradient 0.5-1.4 of its norm at 8 bits. Exact: one value a sample. Or a few
        # per sample, (B, H < ROW_MIN): N-BEATS's MASE and MAPE weights over the horizon, 1 / each series' scale over
        # series of levels 10 to 1e4, were 15 % of the gradient's norm at 8 bits from the loss alone. Not a mask or a
        # table of a sample's or a map's size (a float attention mask, dropout by hand, a per-pixel weight): stored, as
        # a 0/1 mask loses nothing at 4 bits, where keeping them exact doubled a small transformer's step's bytes)
        return _EXACT
    if isinstance(other, torch.Tensor) and other.requires_grad and _short_direction(t):
        # (a unit vector over fewer than ROW_MIN values times another, a dot product of face normals, (n0 * n1).sum(-1):
        # near convergence the normalization's backward keeps only what is perpendicular to it, which the rounding of
        # such a row is most of; exact, as F.normalize's input and cosine_similarity's are. A mesh's normal-consistency
        # loss was 0.18-0.20 of the gradient's norm at 8 bits)
        return _EXACT
    if isinstance(other, torch.Tensor) and other.requires_grad and other.numel() == t.numel() and \
            _inverse_pair(t, other):
        # (h * rsqrt(1 + h²), an inverse square root unit, or h * (1 + |h|).reciprocal(): a division written as a product,
        # whose gradient r + h·r' is two terms that nearly cancel where r falls as 1/|h|, each read from one factor's
        # rounding: 0.13 of the gradient's norm at 8 bits, 2.3 at 4 at |h| up to 25. Both factors exact, and the saves
        # the inverse was computed through: Compressor._pack, inverse_partner)
        return _EXACT
    if isinstance(other, torch.Tensor) and other.requires_grad and _per_row(other, t):  # (requiring grad: s's gradient reads a)
        # (s's gradient, sum(g·a) over each row, reads a; through a hand-written RMSNorm's rsqrt it reaches the row
        # scaled by 1/rms³: a small row must not take a large one's rounding step. Normalized per row)
        return Decision(VALUES, rows=t.shape[-1])
    return _VALUES


#: nodes that gather rows (a mesh's normals indexed by the faces of each edge, n[f0])
_GATHERING = frozenset({"IndexBackward0", "IndexSelectBackward0", "GatherBackward0", "EmbeddingBackward0"})


def _signed_dim(d: int) -> int:
    """A dimension a node saved, as a signed int: torch 1.13 shows a negative one as its unsigned 64-bit pattern."""
    return d - (1 << 64) if d >= 1 << 63 else d


def _input_shape(g: Any, name: str, shape: Any) -> Any:
    """The shape of the tensor the moving or gathering node ``g`` was given, from what it saved or from the shape of
    its result (``shape``, None where unknown): None where neither tells."""
    sizes = getattr(g, "_saved_self_sym_sizes", None) or getattr(g, "_saved_self_sizes", None)
    if sizes:
        return tuple(int(n) for n in sizes)
    if shape is None:
        return None
    if name in ("CloneBackward0", "ToCopyBackward0"):
        return shape
    if name == "TransposeBackward0":
        i, j = (getattr(g, "_saved_dim0", None), getattr(g, "_saved_dim1", None))
        if not isinstance(i, int) or not isinstance(j, int):
            return None
        i, j = _signed_dim(i), _signed_dim(j)
        out = list(shape)
        out[i], out[j] = out[j], out[i]
        return tuple(out)
    if name == "PermuteBackward0":
        dims = getattr(g, "_saved_dims", None)
        if not isinstance(dims, tuple) or len(dims) != len(shape):
            return None
        out = [0] * len(shape)
        for k, d in enumerate(dims):
            out[_signed_dim(d)] = shape[k]
        return tuple(out)
    if name == "TBackward0" and len(shape) == 2:
        return (shape[1], shape[0])
    if name == "UnsqueezeBackward0":
        d = getattr(g, "_saved_dim", None)
        if not isinstance(d, int):
            return None
        d = _signed_dim(d)
        out = list(shape)
        del out[d]
        return tuple(out)
    return None


def _short_direction(t: torch.Tensor) -> bool:
    """Whether ``t`` is, up to moves, copies and gathers of its rows, a tensor divided by its 2-norm over a dimension of
    fewer than ROW_MIN values (F.normalize(c, dim=1) over 3 channels, c / c.norm(dim=-1, keepdim=True))."""
    g = t.grad_fn
    shape: Any = tuple(t.shape)  # (followed back to the normalized tensor's, node by node; None where unknown)
    for _ in range(6):
        if g is None:
            return False
        name = type(g).__name__
        if name not in _REARRANGING and name not in _GATHERING:
            break
        shape = _input_shape(g, name, shape)
        g = g.next_functions[0][0] if g.next_functions else None
    if g is None or type(g).__name__ != "DivBackward0" or len(g.next_functions) < 2 or not shape:
        return False
    d = g.next_functions[1][0]
    for _ in range(5):
        if d is None:
            return False
        name = type(d).__name__
        if name == "SqrtBackward0":
            d = d.next_functions[0][0]
            if d is None or type(d).__name__ != "SumBackward1":
                return False
            name = "SumBackward1"
        if "Norm" in name or name == "SumBackward1":
            dims = getattr(d, "_saved_dim", None)
            if not isinstance(dims, tuple) or len(dims) != 1:
                return False
            k = _signed_dim(dims[0])
            return -len(shape) <= k < len(shape) and 1 < int(shape[k]) < ROW_MIN
        if name not in _TO_A_NORM:
            return False
        d = d.next_functions[0][0] if d.next_functions else None
    return False


def _per_row(s: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``s`` holds one value per row of ``a``'s last dimension (broadcast over it: shape (..., 1))."""
    return a.dim() >= 2 and s.dim() >= 1 and s.shape[-1] == 1 and a.shape[-1] > 1 and \
        s.numel() * a.shape[-1] == a.numel()


#: the most values of a one-dimensional tensor whose square keeps its base exact (a batch of scalars, one per sample or
#: per edge: ConfGF's edge distances under a sigma each; four times that for a batch of short samples, (B, d < 16), 1 MiB
#: in float32); a flattened activation squared (a penalty), a scene's million points, are larger and stay stored
SHORT_BATCH_MAX = 1 << 16


def _pow(t, args, kwargs, frame) -> Decision:
    # d(x^p)/dx = p x^(p-1): below p = 1 that is a division by a power of x (p = 0.5: 1/(2 sqrt x), p = -0.5:
    # a hand-written RMSNorm's rsqrt, p = -1: a reciprocal), which a rounded x near zero makes explode, as
    # for rsqrt and reciprocal: the base exact. A tensor exponent also reads log(x): the base exact. At
    # p = 1 and 2 the base is values (x^2's backward is 2x, linear in it), and so is a tensor exponent and the
    # result; any other p above 1 reads the base through a power (x^3: 3x^2, whose expectation under rounding
    # misses by 3 Var(x)), kept at 4 bits or more as tanh's result is.
    base = _arg(args, kwargs, 0, "input") if frame.name != "__rpow__" else _arg(args, kwargs, 1, "other")
    if frame.name != "__rpow__" and _is_float(t) and not _view_of(t, base):
        # a tensor exponent, read by the base's gradient through x^(e-1): at least 4 bits (stored at 2, a sweep
        # measured its mean 3.3x what noise leaves at 2048 seeds; 1.07x at 4)
        e = _arg(args, kwargs, 1, "exponent")
        if isinstance(e, torch.Tensor) and _view_of(t, e):
            return _QUADRATIC
    if frame.name == "__rpow__" or not (_is_float(t) and _view_of(t, base)):
        return _VALUES
    p = 2 if frame.name in ("square", "square_") else _arg(args, kwargs, 1, "exponent")
    if isinstance(p, torch.Tensor):
        p = _scalar(p) if p.dim() == 0 and not p.requires_grad else None
        if p is None:
            return _EXACT
    if isinstance(p, (int, float)) and not isinstance(p, bool):
        if p < 1:
            return _EXACT
        if p != 1 and p != 2:
            return _QUADRATIC
        if p == 2 and (_complex_part(t) or _complex_magnitude(t)):
            # (re² + im² of a spectrum, X.real ** 2 or view_as_real(X).pow(2): its magnitude's square, under a sqrt and
            # a log in every spectral loss, whose gradient divides the base by |X|²; a quiet bin shares its group with
            # loud ones, whose step is 1e4x its magnitude: a multi-resolution STFT loss's gradient was 1.7x its norm
            # off at 8 bits, 2 500x with view_as_real. So is |X| ** 2, torchaudio's power spectrogram under a mel
            # filterbank and a log: 0.12-0.51 at 8 bits near convergence)
            return _EXACT
        if p == 2 and ((t.dim() == 2 and t.shape[-1] < ROW_MIN and 1 < t.shape[0] and
                        t.numel() <= SHORT_BATCH_MAX * 4) or (t.dim() == 1 and 1 < t.numel() <= SHORT_BATCH_MAX)):
            # (a batch of short samples, (B, d) with d < ROW_MIN, or of scalars: 2-D points, a low-dimensional score's
            # residual, an edge distance's. Rows that short are not normalized per row, and a loss may weigh each
            # sample's square by a scale of its own (denoising score matching's sigma² over a ladder of sigmas, EDM's
            # λ(σ)): a sample at small sigma, rows of about 1/sigma, set the step of groups whose other samples the
            # weight then multiplied by up to 9: 0.32-0.77 of the gradient's norm at 8 bits at d = 2, 1.2-1.7 over a
            # flat tensor of edge distances (ConfGF). Exact: such a tensor is small)
            return _EXACT
        if p == 2 and t.dim() >= 2 and t.shape[-1] > 1:
            # (x², a hand-written RMSNorm's or variance's: the gradient of the row's mean of squares reaches each row
            # scaled by 1/rms³; normalized per row, a small row keeps its own rounding step)
            return Decision(VALUES, rows=t.shape[-1])
    return _VALUES


def _spectral_transform(t, args, kwargs, frame) -> Decision:
    return _EXACT if frame.name == "istft" or t.dim() <= 1 else _VALUES


def _complex_part(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of a complex tensor's memory: its real or imaginary part, or view_as_real of it."""
    b = t._base
    return b is not None and b.is_complex()


def _complex_magnitude(t: torch.Tensor) -> bool:
    """Whether ``t`` is, up to moves and copies of its elements, abs() of a complex tensor (a spectrum's magnitude)."""
    return _graph_complex_magnitude is not None and t.grad_fn is not None and _graph_complex_magnitude(t._cdata)


def _divisor(t, args, kwargs, frame) -> Decision:
    # d(a / b)/db = -a / b^2: a quantized divisor near zero makes the gradient explode and biases it. A dividend over a
    # divisor of one value per row (a softmax by hand, e / e.sum(-1, keepdim=True); h / h.norm(dim=-1, keepdim=True)) is
    # read for the divisor's gradient divided by that row's b^2: normalized per row (Decision.rows)
    other = _arg(args, kwargs, 1, "other")
    if isinstance(other, torch.Tensor) and t is other:
        return _EXACT
    a = _arg(args, kwargs, 0, "input")
    if isinstance(other, torch.Tensor) and other.requires_grad and isinstance(a, torch.Tensor) and _view_of(t, a) and \
            _is_float(t):
        if 0 < _broadcast_size(other, a) < ROW_MIN and _a_norm(other):
            # (a norm of one value per row of fewer than ROW_MIN values, along any dimension: a normalization by hand,
            # o / o.norm(dim=1, keepdim=True) over 3 channels; such rows have no scale of their own: exact, as
            # F.normalize's input. Surface normals near their target: 1.9-3.4 of the gradient's norm at 8 bits. Not a
            # deviation over a small batch, h / h.std(0, keepdim=True), which reads no direction)
            return _EXACT
        if _per_row(other, a):
            return Decision(VALUES, rows=a.shape[-1])
        if _own_divisor(t, args, kwargs) and (_below_one(other) or _computed_from(other, a)):
            # a divisor of its own per element (a Normal's variance in log_prob, -(x - loc)² / (2 var)): the dividend's
            # rounding enters the divisor's gradient as δa / b², where a small b_i has a small a_i, whose group step
            # is large beside it (SAC's tanh-squashed Normal: 2x the gradient's norm at 8 bits, every step). Where
            # every |b| >= 1, a divisor computed from the dividend: a's gradient is 1/b - a·b'/b², two terms that
            # nearly cancel where b grows with |a| (a softsign by hand, a / (1 + k·|a|): 1/b² left), and only the
            # second reads the rounded a (a spiking network's fast-sigmoid surrogate at k = 25: 0.15 of the gradient's
            # norm at 8 bits in one layer, 10x through its membrane's time steps)
            return _EXACT
    return _VALUES


def _computed_from(b: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the divisor ``b`` is computed from the dividend ``a`` element for element: a's node within
    CORRELATION_DEPTH nodes behind b's, through elementwise calls that keep the shape (_SAME_SHAPE_NODES) and views that
    are no broadcast (_WALKED_VIEWS). Not through a reduction, a broadcast or a repeat: a row's statistic expanded to the
    dividend's shape (a / a.sum(-1, keepdim=True).expand_as(a), a layer norm by hand over an expanded deviation) divides
    each row by one value, where nothing cancels per element. A view of the dividend's (``h[:, :d] / (1 +
    h[:, :d].abs())``, two slices of one tensor, or its transpose taken twice) counts: ``a``'s node is then found
    through the views ``a`` was cut with."""
    return b.grad_fn is not None and _walks_to([b.grad_fn], a)


def _view_sources(a: torch.Tensor) -> list:
    """``a``'s node and the nodes it was cut from through views that are no broadcast (_WALKED_VIEWS), at most 8; for a
    leaf (or a view of one), its AccumulateGrad node where that is reached."""
    g = a.grad_fn
    out: list = []
    for _ in range(8):
        if g is None:
            break
        out.append(g)
        if type(g).__name__ not in _WALKED_VIEWS:
            break
        nxt = g.next_functions
        g = nxt[0][0] if nxt else None
    return out


def _walks_to(start: list, a: torch.Tensor) -> bool:
    """Whether ``a`` (its node, or the nodes it is a view of: _view_sources) is one of the nodes ``start`` or lies within
    CORRELATION_DEPTH nodes behind them, through same-shape elementwise calls and views that are no broadcast,
    CORRELATION_NODES at most."""
    targets = _view_sources(a)
    if not targets and not a.requires_grad:
        return False
    if any(n is g for n in start for g in targets):
        return True
    # (a slice or select passed only where the dividend was cut the same way: h[:, :d] / (2 + sigmoid(h[:, d:])) divides
    # by another part of h, where nothing cancels)
    cuts = {_cut(g) for g in targets if type(g).__name__ in _CUTS}
    frontier, held = list(start), []  # (held: a node's Python object can be made anew and take a freed one's id)
    seen: set = set()
    for _ in range(CORRELATION_DEPTH):
        nxt = []
        for node in frontier:
            name = type(node).__name__
            if name not in _SAME_SHAPE_NODES and name not in _WALKED_VIEWS:
                continue
            if name in _CUTS and _cut(node) not in cuts:
                continue
            for fn, _ in node.next_functions:
                if fn is None or id(fn) in seen:
                    continue
                if any(fn is g for g in targets) or (not targets and getattr(fn, "variable", None) is a):
                    return True
                seen.add(id(fn))
                held.append(fn)
                nxt.append(fn)
                if len(held) >= CORRELATION_NODES:
                    return False
        frontier = nxt
    return False


#: the view nodes that take a part of a tensor (_walks_to passes one only where the dividend was cut the same way)
_CUTS = frozenset({"SliceBackward0", "SelectBackward0"})


def _cut(node: Any) -> tuple:
    """Which part of its input a slice or select node takes."""
    if type(node).__name__ == "SelectBackward0":
        return ("select", getattr(node, "_saved_dim", None), getattr(node, "_saved_index", None))
    return ("slice", getattr(node, "_saved_dim", None), getattr(node, "_saved_start", None),
            getattr(node, "_saved_end", None), getattr(node, "_saved_step", None))


#: the nodes that invert what they are given, element for element (1 / b, b ** -p, rsqrt(b))
_INVERTING = frozenset({"ReciprocalBackward0", "RsqrtBackward0"})


def _inverse_source(r: torch.Tensor) -> Any:
    """The node of what ``r`` is the inverse of, element for element, or None: ``r`` made by reciprocal, rsqrt, a
    negative power, ``c / b`` (b's node) or such a result scaled by a constant (``2 / b`` is reciprocal then a product
    with a number)."""
    g = r.grad_fn
    for _ in range(2):
        if g is None:
            return None
        name = type(g).__name__
        nxt = g.next_functions
        if name in _INVERTING or (name == "PowBackward0" and _negative(getattr(g, "_saved_exponent", None))):
            return nxt[0][0] if nxt else None
        if name == "DivBackward0" and len(nxt) > 1 and nxt[0][0] is None:
            return nxt[1][0]  # (a constant tensor over b)
        if name not in ("MulBackward0", "MulBackward1", "DivBackward1") or not nxt:
            return None
        if name == "MulBackward0" and len(nxt) > 1 and nxt[1][0] is not None:
            return None  # (a product of two tensors that require grad: not a constant's)
        g = nxt[0][0]
    return None


def _negative(e: Any) -> bool:
    return isinstance(e, (int, float)) and not isinstance(e, bool) and e < 0


def inverse_partner(t: torch.Tensor, frame: "Frame | None") -> torch.Tensor | None:
    """The other operand of a quotient or product whose terms cancel element for element, kept exact with ``t``: the
    divisor ``b`` of ``t / b`` where b is computed from t (_computed_from), or the factor ``r`` of ``t * r`` (or of
    ``r * t``) where one of the two is the inverse of something computed from the other (``h * rsqrt(1 + h²)``,
    ``h * (1 + |h|).reciprocal()``). The saves that operand was computed through must be read exact too (the sqrt's
    result under ``h / sqrt(1 + h²)``): Compressor._exact_read. None otherwise."""
    if frame is None:
        return None
    name = frame.name
    args, kwargs = frame.args, frame.kwargs
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.numel() != b.numel():
        return None
    if name in _DIVISIONS:
        return b if _view_of(t, a) and b.requires_grad and _computed_from(b, a) else None
    if name in _MULS:
        other = b if _view_of(t, a) else a if _view_of(t, b) else None
        if other is not None and _inverse_pair(t, other):
            return other
    return None


_MULS = frozenset("mul mul_ __mul__ __rmul__ __imul__ multiply".split())


def _inverse_pair(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether one of the same-size factors ``x`` and ``y`` is the inverse of something computed from the other, element
    for element (_inverse_source, _walks_to): their product saturates (h / sqrt(1 + h²) written as a product), and its
    gradient is two terms that nearly cancel, each read from one factor's rounding."""
    if not (x.requires_grad and y.requires_grad) or x.numel() != y.numel():
        return False
    for r, h in ((x, y), (y, x)):
        src = _inverse_source(r)
        if src is not None and _walks_to([src], h):
            return True
    return False


#: the nodes a divisor reaches its norm through (a clamp, an epsilon added, a broadcast, a scale)
_TO_A_NORM = frozenset({"AddBackward0", "AddBackward1", "ClampMinBackward0", "ClampBackward1", "ClampBackward0",
                        "ExpandBackward0", "MulBackward1", "DivBackward1"})


def _a_norm(b: torch.Tensor) -> bool:
    """Whether the divisor ``b`` is a 2-norm (norm, vector_norm, or the square root of a sum of squares), through clamps,
    an added epsilon, a broadcast or a scale (4 nodes at most)."""
    g = b.grad_fn
    for _ in range(4):
        if g is None:
            return False
        name = type(g).__name__
        if "Norm" in name or name == "SqrtBackward0":
            return True
        if name not in _TO_A_NORM:
            return False
        nxt = [n for n, _ in g.next_functions if n is not None]
        g = nxt[0] if len(nxt) == 1 else None
    return False


def _broadcast_size(s: torch.Tensor, a: torch.Tensor) -> int:
    """The size of the one dimension of ``a`` that ``s`` is broadcast along (s has a's shape with that dimension 1, or
    as many dimensions fewer in front: one value per row along it), 0 where s is no such tensor."""
    if a.dim() < 1 or s.dim() > a.dim():
        return 0
    shape = (1,) * (a.dim() - s.dim()) + tuple(s.shape)
    found = 0
    for n, m in zip(a.shape, shape):
        if m == n:
            continue
        if m != 1 or found:
            return 0
        found = n
    return found if found > 1 and s.dim() == a.dim() else 0


def _own_divisor(t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``t`` is a division's dividend over a divisor of as many elements that requires grad."""
    b = _arg(args, kwargs, 1, "other")
    return isinstance(b, torch.Tensor) and b.requires_grad and b.numel() == t.numel() and \
        _view_of(t, _arg(args, kwargs, 0, "input"))


def _below_one(b: torch.Tensor, above: bool = False) -> bool:
    """Whether some |b| < 1 (a divisor that amplifies what is divided by it); ``above``: some |b| > 1. On a GPU, where
    reading it back would wait for the device, or where it cannot be read: assumed."""
    if b.device.type != "cpu":
        return True
    try:
        with torch.no_grad():
            m = b.detach().abs()
            return bool(m.amax() > 1) if above else bool(m.amin() < 1)
    except RuntimeError:
        return True


#: where a norm-like call takes its order: (position, keyword); calls not listed have none (a 2-norm)
_ORDER_ARG = {"norm": (1, "p"), "normalize": (1, "p"), "linalg_vector_norm": (1, "ord"), "linalg_norm": (1, "ord"),
              "dist": (2, "p"), "pairwise_distance": (2, "p"), "cdist": (2, "p"), "pdist": (1, "p")}


def _divides(args, kwargs, frame) -> bool:
    """Whether a norm-like call is a 2-norm, whose backward reads its input linearly and divides by its result
    (x / ||x||): the input as values, the result exact. Any other order reads the input through a curve, at
    1 < p < inf x |x|^(p-2) / ||x||^(p-1) (biased by a rounded input at any width: p = 3 8.8x what noise leaves in
    1 024 seeds at 2 bits, p = 1.5 8.2x at 8 bits, |x|^(-1/2) near zero), at p = 1, +-inf or 0 signs or which
    element reached the result (a test that rounding moves elements across); a matrix norm of linalg_norm reads
    singular vectors: everything such a call saves is kept exact."""
    where = _ORDER_ARG.get(frame.name)
    p = _arg(args, kwargs, where[0], where[1]) if where is not None else None
    if p is None or p == "fro":
        return True
    if not isinstance(p, (int, float)) or isinstance(p, bool) or p != 2:
        return False
    return frame.name != "linalg_norm" or not _matrix_norm(args, kwargs)


def _matrix_norm(args, kwargs) -> bool:
    """Whether a linalg_norm call takes a matrix norm: two dimensions given, or a 2-D input without any."""
    dim = _arg(args, kwargs, 2, "dim")
    if isinstance(dim, (tuple, list)):
        return len(dim) == 2
    if dim is not None:
        return False
    x = _arg(args, kwargs, 0, "input")
    return isinstance(x, torch.Tensor) and x.dim() == 2


def _normalize(t, args, kwargs, frame) -> Decision:
    # F.normalize, x / max(||x||, eps), runs its ops inside one call: x as values; the norm and its clamped,
    # expanded copy (the norm's backward divides by the one, div's by the other) exact. They hold one value
    # per row.
    if not _divides(args, kwargs, frame):
        return _EXACT
    x = _arg(args, kwargs, 0, "input")
    if t is not x:
        return _EXACT
    dim = _arg(args, kwargs, 2, "dim", 1)
    n = _reduced_size(x, dim)
    if 0 < n < ROW_MIN:
        # (over a dimension of size 1 each value is its own row, divided by its own magnitude: x / |x| reads a
        # rounded x near 0 at 1 / |x|. Rows shorter than ROW_MIN have no scale of their own: a direction of 2 to 15
        # values (an angle's (sin, cos), a normal, a quaternion) shares its group with rows 1 000x longer, whose step
        # exceeds it, and the backward reads it twice: a bias, 5 % of the gradient at 256 seeds. And a direction near
        # its target (a geodesic loss, acos of <q, q_gt>) gets a gradient nearly parallel to it, which the backward
        # projects out: what is left is the rounding's. Kept, at the input's bytes)
        return _EXACT
    return _floored(n, _last_dim_rows(x, dim))


def _reduced_size(x: Any, dim: Any) -> int:
    """How many values of ``x`` each result of a reduction over ``dim`` (an int) sums; 0 where that cannot be told."""
    if not isinstance(x, torch.Tensor) or isinstance(dim, bool) or not isinstance(dim, int):
        return 0
    try:
        return x.shape[dim] if x.dim() else 1
    except IndexError:
        return 0


def _reduction_result(t, args, kwargs, frame) -> Decision:
    # A norm, a standard deviation, a distance: the backward divides by the result (x / ||x||, (x - mean) /
    # std). A float tensor with fewer elements than the call's broadcast tensor arguments is such a result
    # (kept exact; one value per reduced row); the inputs and full-size differences are values.
    if not _is_float(t):
        return _VALUES
    if not _divides(args, kwargs, frame):
        return _EXACT
    shapes = [a.shape for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    try:
        largest = math.prod(torch.broadcast_shapes(*shapes)) if shapes else 0
    except RuntimeError:  # shapes the call does not broadcast (it reduces them first)
        largest = max(math.prod(sh) for sh in shapes)
    if t.numel() < largest:
        return _EXACT
    # a reduction over a dimension of size 1 (h[:, :1].norm(dim=-1), a distance over one feature) keeps every
    # element: its result, made by the norm's own node, is still the divisor (stored as values, the 1024-seed mean
    # stayed 1.1x the gradient's norm off)
    if not any(isinstance(a, torch.Tensor) and _view_of(t, a) for a in (*args, *kwargs.values())):
        g = through_copies(t.grad_fn)[0]
        if g is not None and any(k in type(g).__name__ for k in _REDUCTION_RESULT_NODES):
            return _EXACT
    if frame.name == "cosine_similarity":
        # (each input is read twice by its own gradient, x1/(n1 n2) - cos·x1/n1² with cos summing x1·x2: as a
        # normalization's input, at least norm_floor's bits over the reduced dimension. Over rows of fewer than ROW_MIN
        # values, as F.normalize's: everything it saves exact, torch 1.13's normalized copies of x1 and x2 too)
        dim = _arg(args, kwargs, 2, "dim", 1)
        x1 = _arg(args, kwargs, 0, "x1")
        if 0 < _reduced_size(x1, dim) < ROW_MIN:
            return _EXACT
        for x in (x1, _arg(args, kwargs, 1, "x2")):
            if isinstance(x, torch.Tensor) and _view_of(t, x):
                n = _reduced_size(x, dim)
                return _EXACT if 0 < n < ROW_MIN else _floored(n, _last_dim_rows(x, dim))
    elif frame.name in _NORM_DIM_ARG:
        # (a 2-norm's backward reads its input divided by the result: a row of the last dimension by its own norm. Over
        # rows of fewer than ROW_MIN values, which have no scale of their own: exact, as F.normalize's. A flow's
        # end-point error, (pred - gt).norm(dim=1) over 2 channels near convergence: 3-4 % of the gradient at 8 bits)
        x = _arg(args, kwargs, 0, "input")
        if isinstance(x, torch.Tensor) and _view_of(t, x):
            dim = _arg(args, kwargs, _NORM_DIM_ARG[frame.name], "dim")
            if isinstance(dim, (tuple, list)) and len(dim) == 1:
                dim = dim[0]
            if 1 < _reduced_size(x, dim) < ROW_MIN:
                return _EXACT
            rows = _last_dim_rows(x, dim)
            if rows:
                return Decision(VALUES, rows=rows)
    elif frame.name == "pairwise_distance":
        # (the difference x1 - x2 + eps over its last dimension: as a norm's input over short rows)
        x1 = _arg(args, kwargs, 0, "x1")
        if isinstance(x1, torch.Tensor) and x1.dim() >= 1 and 1 < x1.shape[-1] < ROW_MIN:
            return _EXACT
    return _VALUES


#: where a 2-norm call takes its dimension
_NORM_DIM_ARG = {"norm": 2, "linalg_vector_norm": 2, "linalg_norm": 2, "std": 1, "std_mean": 1, "var": 1, "var_mean": 1}
#: the nodes of a norm's, a deviation's or a distance's result (a full-size difference inside a pairwise distance is a
#: subtraction's, read linearly)
_REDUCTION_RESULT_NODES = ("Norm", "Std", "Dist")


def _positions(index: int, name: str):
    """A rule for a call whose backward reads a float tensor as positions (argument `index`, `name`): where
    to sample, which image a box is in. Its gradient is not linear in them, and a rounded box's image index
    can point past the batch (the backward then writes out of bounds): exact, and so is a copy of them in
    another dtype (CUDA autocast casts them first). Its other tensors: values."""
    def rule(t, args, kwargs, frame) -> Decision:
        a = _arg(args, kwargs, index, name)
        cast = isinstance(a, torch.Tensor) and t.shape == a.shape and t.dtype != a.dtype
        if t is a or cast:
            return _EXACT
        if name == "grid" and isinstance(a, torch.Tensor) and a.requires_grad and _is_float(t):
            # the grid's gradient reads differences of neighbouring texels times the resolution, which a texel's
            # rounding step (the group's range over 2^b - 1) swamps on a smooth map: a deformation or pose learned
            # through grid_sample over a generated triplane was 0.06-0.12 of the gradient's norm at 8 bits (0.01 exact)
            return _EXACT
        return _VALUES
    return rule


#: autograd nodes of views: through them a tensor is still the one it views (a split of a packed projection
#: weight, a transpose)
VIEW_NODES = frozenset({"SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0", "ViewBackward0",
                        "UnsafeViewBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                        "SliceBackward0", "SelectBackward0", "UnbindBackward0", "AsStridedBackward0",
                        "ExpandBackward0", "ReshapeAliasBackward0"})

#: the view nodes a walk from a divisor to its dividend goes through (_walks_to): not a broadcast (expand, as_strided),
#: which divides a whole row by one value
_WALKED_VIEWS = VIEW_NODES - {"ExpandBackward0", "AsStridedBackward0"}


def cast_copy_of(t: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``t``, without a graph, is a copy of ``a`` in another dtype or a view of such a copy (what
    autocast makes of a tensor that does not require grad; autocast is off inside a pack hook, so the
    call's own argument must tell): its base has ``a``'s shape and another dtype."""
    if t.grad_fn is not None or t.dtype == a.dtype:
        return False
    b = t._base if t._base is not None else t  # (a linear layer saves a transpose or a 2-D view)
    return b.shape == a.shape


def through_copies(g: Any, stop: Any = None) -> tuple:
    """Follow the graph from node ``g`` through dtype copies (``ToCopyBackward0``: autocast's) and views, at
    most 6 of them: (the node reached, ``stop`` if met, else the first other node or None; whether a copy was
    passed). A split in-projection's chunk and a linear layer's transpose are views."""
    cast = False
    for _ in range(7):
        if g is None or g is stop:
            return g, cast
        name = type(g).__name__
        if name == "ToCopyBackward0":
            cast = True
        elif name not in VIEW_NODES:
            return g, cast
        nxt = g.next_functions
        g = nxt[0][0] if nxt else None
    return None, cast


def _derived_from(t: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``t`` is ``a``, a view of it, or a copy of it in another dtype (and views of that): what a
    layer saves of the weight it is given (a linear layer its transpose; under autocast the copy it
    computed with)."""
    if t is a or t._base is a:
        return True
    g, target = t.grad_fn, a.grad_fn
    if g is None:
        return target is None and cast_copy_of(t, a)  # the copy of a weight that does not require grad
    if target is None:
        return False  # (a parameter's copies are the Compressor's parameter check)
    return through_copies(g, target)[0] is target


#: tests: host tensors take the rules' device branch (what cannot be read back there is assumed)
_DEVICE_RULES_ON_HOST = False

#: calls that select the smallest values of their input (its minimum along a dimension or over all of it, its k smallest,
#: its k-th, its order), or the largest of a negated one (a maximum, the k largest, a log-sum-exp: a smooth minimum): the
#: gradient reaches mostly those, through the saves the input was computed from (Compressor._exact_read)
SELECTING_CALLS = frozenset("min amin topk kthvalue sort msort max amax logsumexp exp".split())
#: the SELECTING_CALLS that pick the largest values (of a negated distance, for them to select small distances); exp of a
#: negated distance (a Gaussian, exp(-0.5 q), an RBF) weighs the near pairs, whose gradient it passes
_SELECTING_LARGEST = frozenset("max amax logsumexp exp".split())


def _scaled_source(g: Any) -> tuple:
    """The node a tensor made by ``g`` is, up to a negation, products or quotients with operands that need no gradient
    (-d, -d / tau, -0.5 * q: a Python number is a wrapped tensor with no edge of its own) and moves of its elements;
    whether a negation (NegBackward0) was passed an odd number of times; and the products and quotients passed, as
    (node, the name of their constant operand's saved attribute), whose signs _negative_constants reads. (None, False,
    ()) where there is none. No saved operand is read here (reading one runs its unpack hook, which would decode or pin
    it): the sign is the values' to tell (selects_small), or on a device, where they are not read back, the negation's
    and the constants'."""
    negated = False
    constants: list = []
    for _ in range(5):
        g = _past_rearranging(g)
        if g is None:
            return None, False, ()
        name = type(g).__name__
        edges = g.next_functions
        if name == "NegBackward0" or name in ("MulBackward1", "DivBackward1"):
            negated ^= name == "NegBackward0"
            if name != "NegBackward0":
                constants.append((g, "_saved_other"))
            g = edges[0][0] if edges else None
            continue
        if name in ("MulBackward0", "DivBackward0") and len(edges) == 2:
            a, b = edges[0][0], edges[1][0]
            if a is not None and b is None:
                constants.append((g, "_saved_other"))
                g = a
                continue
            if name == "MulBackward0" and a is None and b is not None:
                constants.append((g, "_saved_self"))
                g = b
                continue
        return g, negated, constants
    return None, False, ()


class Unread(Exception):
    """A saved operand peeked at (peek) is one gact stored: it is not decoded for a look."""


_PEEKING = threading.local()


def peeking() -> bool:
    """Whether this thread peeks at a saved operand (peek): a Compressor's unpack then hands back a tensor it kept
    as it was, with none of an unpack's effects (the forward's holds, the deferred saves), and raises Unread for
    anything it stored."""
    return getattr(_PEEKING, "on", False)


def peek(node: Any, attr: str) -> Any:
    """``node``'s saved ``attr`` where reading it costs nothing (not saved through gact, or kept by it as it was);
    None where gact stored it (a blob is not decoded for a look) or it is gone (a graph run backward)."""
    _PEEKING.on = True
    try:
        return getattr(node, attr)
    except (Unread, RuntimeError, AttributeError):
        return None
    finally:
        _PEEKING.on = False


def _negative_constants(constants: list) -> bool:
    """Whether an odd number of the constants _scaled_source passed are negative numbers (-0.5 * q, q / -2: a Python
    number, saved as a one-element CPU tensor, which gact keeps as it is). A look only (peek): an operand gact
    stored (a weight of many elements) is neither decoded nor released, and counts as positive."""
    odd = False
    for node, attr in constants:
        c = peek(node, attr)
        if c is None:
            continue
        if isinstance(c, torch.Tensor):
            if c.numel() != 1 or c.device.type != "cpu" or c.is_complex():
                continue
            c = c.item()
        if isinstance(c, (int, float)) and c < 0:
            odd = not odd
    return odd


def _reaches_difference(g: Any) -> bool:
    """Whether the distance made by ``g`` is one of differences (a - b, cdist, a norm of them) within 6 nodes: a
    Gaussian's or an RBF's exp(-(x - mu)²), not exp(-h²) of a hidden layer's output (a Gaussian activation)."""
    def step(n: Any, name: str) -> Any:
        if name in _DIFFERENCE_NODES:
            return True
        return [m for m, _ in n.next_functions if m is not None] if name in _TO_A_DIFFERENCE else ()
    return _breadth_first(g, 6, 24, step)


def _breadth_first(g: Any, levels: int, limit: int, step: Callable) -> bool:
    """A walk from the node ``g`` over ``levels`` levels and ``limit`` nodes, past moves of elements: ``step(node,
    name)`` returns True where the walk has found what it looks for, or the nodes to go on to."""
    frontier, seen = [g], 0
    for _ in range(levels):
        nxt: list = []
        for n in frontier:
            n = _past_rearranging(n)
            if n is None or seen >= limit:
                continue
            seen += 1
            found = step(n, type(n).__name__)
            if found is True:
                return True
            nxt.extend(found)
        frontier = nxt
    return False


def selects_small(frame: "Frame") -> bool:
    """Whether a SELECTING_CALLS call selects values small next to the rest of its input: a float input made as a
    distance is (_distance_like), at least 0 and with a smallest value under 1/16 of its largest (on a GPU, where reading
    that back would wait for the device: any such input); or, for a call that takes the largest values (max, amax,
    logsumexp, topk with largest=True), the negation of such a distance. Under a Chamfer loss, min over squared distances
    picks the nearest pairs, 0.05 apart among differences up to 2: the saves of the differences, rounded in steps of the
    largest, were 0.14 of the gradient's norm at 8 bits, and 0.07-0.10 where the nearest is taken by topk, sort,
    kthvalue, the max of the negation or a smooth minimum. A minimum over features (a pooling over a residual stream,
    over a ReLU's output) selects nothing small and is left alone, as is a maximum of a distance (the farthest pair)."""
    x = _arg(frame.args, frame.kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or not _is_float(x) or x.grad_fn is None or x.numel() == 0:
        return False
    name = frame.name
    if name in ("min", "max") and isinstance(_arg(frame.args, frame.kwargs, 1, "other"), torch.Tensor):
        return False  # (torch.min(a, b): elementwise, each pair's smaller one)
    if name == "sort" and _arg(frame.args, frame.kwargs, 2, "descending") is True:
        return False
    largest = name in _SELECTING_LARGEST or (name == "topk" and _arg(frame.args, frame.kwargs, 3, "largest") is not False)
    sign = 1.0
    if largest:
        # (the largest values of a scaled distance: its smallest where it is negated, which the values tell on the
        # host; on a GPU assumed, as for any distance)
        g, negated, constants = _scaled_source(x.grad_fn)
        if g is None or not _distance_like_node(g) or (name == "exp" and not _reaches_difference(g)):
            return False
        if x.device.type != "cpu" or _DEVICE_RULES_ON_HOST:
            # (no values read back: a written negation or a negative number tells, -d, -d / tau, -q / 2, -0.5 * q; not
            # x.abs().amax(), a scale)
            return negated ^ _negative_constants(constants)
        sign = -1.0
    elif not _distance_like(x):
        return False
    if x.device.type != "cpu" or _DEVICE_RULES_ON_HOST:
        return True
    try:
        with torch.no_grad():
            v = x.detach()
            # (in float32 where the CPU's aminmax takes no float16 or bfloat16: raising, it had answered True, and the
            # largest of a positive half-precision distance, the farthest pair, was served exact)
            lo, hi = torch.aminmax((v if v.dtype in (torch.float32, torch.float64) else v.float()) * sign)
            return bool(lo >= 0) and bool(lo * 16 < hi)
    except RuntimeError:
        return True


#: the nodes a distance is summed or shifted through (a squared distance as |a|² + |b|² − 2ab: adds, subtractions, sums,
#: a scalar's product, views); the nodes that make one are _DISTANCE_NODES, beside _SQUARE_SUMS below
_DISTANCE_THROUGH = frozenset({"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "SumBackward0",
                               "SumBackward1", "MeanBackward0", "MeanBackward1", "MulBackward1", "ClampMinBackward0",
                               "ClampBackward1"})


def _distance_like(x: torch.Tensor) -> bool:
    """Whether ``x`` is made as a distance is: by a power, a norm, cdist, a square root, an absolute value or a product
    of a tensor with itself, through sums, additions, subtractions, a scalar's product and views (5 nodes back at most,
    16 in all)."""
    return _distance_like_node(x.grad_fn)


def _shares_a_factor(a: Any, b: Any) -> bool:
    """Whether one of the nodes ``a`` and ``b`` is a product (elementwise or batched) one of whose factors, past moves of
    its elements, is the other: the operands of (w * d) * d, or of (d @ A) @ d."""
    for u, v in ((a, b), (b, a)):
        if u is not None and v is not None and type(u).__name__ in ("MulBackward0", "BmmBackward0") and \
                any(n is not None and (n is v or _past_rearranging(n) is v) for n, _ in u.next_functions):
            return True
    return False


def _distance_like_node(g: Any) -> bool:
    """_distance_like of the tensor the node ``g`` makes."""
    def step(n: Any, name: str) -> Any:
        if name in _DISTANCE_NODES:
            return True
        edges = n.next_functions
        if name == "MulBackward0" and len(edges) == 2 and edges[0][0] is not None and edges[1][0] is not None:
            a, b = edges[0][0], edges[1][0]
            if (a is b and edges[0][1] == edges[1][1]) or _shares_a_factor(a, b):
                return True  # (x * x; (w * d) * d: a quadratic form written by hand, a Gaussian's ia·dx·dx)
            return (a, b)  # (a weighted square, w * d ** 2: the weight and the square)
        if name == "BmmBackward0" and len(edges) == 2 and edges[0][0] is not None and edges[1][0] is not None and \
                _shares_a_factor(_past_rearranging(edges[0][0]), _past_rearranging(edges[1][0])):
            return True  # (dᵀ·A·d by einsum("pgi,gij,pgj->pg", d, A, d): a batched product of (d, A) with d)
        return [m for m, _ in edges] if name in _DISTANCE_THROUGH else ()
    return _breadth_first(g, 5, 16, step)


#: the calls of spectral decompositions, whose backward divides by the gaps between their eigenvalues or singular values,
#: and their autograd nodes (torch.lobpcg and the low-rank factorizations run one of these calls)
SPECTRAL_CALLS = frozenset("linalg_eigh symeig linalg_eig eig svd linalg_svd".split())
SPECTRAL_NODES = frozenset({"LinalgEighBackward0", "SymeigBackward0", "LinalgEigBackward0", "EigBackward0",
                            "LinalgSvdBackward0", "SvdBackward0"})


def near_spectral(t: torch.Tensor) -> bool:
    """Whether ``t`` is an output of a spectral decomposition (eigenvectors, singular vectors, eigenvalues; up to views
    and copies), or the result of a call given one (``V * r``, ``V @ diag(r) @ V.t()``). The backward of a matrix
    function built from them (ZCA whitening: W = V diag(L^-1/2) Vᵀ) cancels terms divided by the eigenvalue gaps
    exactly, between its reads of V; two reads of V rounded apart leave those terms, amplified by 1/gap (one seed at 8
    bits: 0.26 of the gradient's norm at a smallest gap of 1.2e-3). Such a result counts where it is a vector or a
    matrix no taller than wide (a matrix built from the factors), not a batch projected onto them (hc @ V, a PCA's),
    nor a result two calls away (the whitened batch hc @ W): a rounding of those moves the matrix function's gradient
    as a whole, which that cancellation keeps bounded."""
    g = _past_rearranging(t.grad_fn)
    if g is None:
        return False
    if type(g).__name__ in SPECTRAL_NODES:
        return True
    if t.dim() >= 2 and t.shape[-2] > t.shape[-1]:
        return False
    for n, _ in g.next_functions:
        n = _past_rearranging(n)
        if n is not None and type(n).__name__ in SPECTRAL_NODES:
            return True
    return False


#: calls whose backward solves with their matrix or its factors (a factorization, an inverse, a solve, a determinant):
#: where that matrix is a product of activations (a covariance x @ x.T, a kernel k @ k.T + λI), the product's operands
#: are kept exact (Compressor._exact_read, CONDITIONED_MATRIX_ARG)
CONDITIONED_CALLS = frozenset("""cholesky linalg_cholesky linalg_cholesky_ex inverse linalg_inv linalg_inv_ex solve
    linalg_solve linalg_solve_ex cholesky_inverse linalg_lu linalg_lu_factor linalg_lu_factor_ex lu det logdet slogdet
    linalg_det linalg_slogdet linalg_lstsq lstsq pinverse linalg_pinv linalg_ldl_factor linalg_ldl_factor_ex
    linalg_tensorinv linalg_tensorsolve""".split())
#: where a CONDITIONED_CALLS call takes its matrix, where not its first argument: (position, keyword)
CONDITIONED_MATRIX_ARG = {"solve": (1, "A"), "lstsq": (1, "A")}
#: the autograd nodes of matrix products (mm, bmm, matmul's, einsum's, addmm's): where a walk from a conditioned call's
#: matrix ends (_gact_torch.graph_products, which tells a Gram product of an activation, x @ x.T, among them)
PRODUCT_NODES = frozenset({"MmBackward0", "BmmBackward0", "AddmmBackward0", "BaddbmmBackward0", "MvBackward0",
                           "MatmulBackward0"})


def conditioned_matrix(frame: "Frame") -> Any:
    """The matrix a CONDITIONED_CALLS call factors, inverts or solves with, where it was computed (a tensor with a
    graph), else None. Its backward multiplies the output's gradient by the inverse twice (A⁻ᵀ g A⁻ᵀ for an inverse,
    the same through a Cholesky factor), large along the matrix's small singular directions; where the matrix is a
    product x @ y.T, the gradient of x is that times y, which cancels along those directions, since y is small there: a
    rounded y, small there no more, leaves the large part. A W-MSE whitening (cholesky of a batch's covariance over 120
    features and 128 samples) was 0.32 of the gradient's norm off at 8 bits."""
    pos, key = CONDITIONED_MATRIX_ARG.get(frame.name, (0, "input"))
    a = _arg(frame.args, frame.kwargs, pos, key)
    if a is None and key == "input":
        a = frame.kwargs.get("A")
    return a if isinstance(a, torch.Tensor) and a.grad_fn is not None and _is_float(a) else None


#: what the autograd nodes of a conditioned call's results are named with (an inverse, a factor, a solution)
_CONDITIONED_RESULT_PARTS = ("Cholesky", "Solve", "Inv", "Lstsq", "Det", "LuFactor")


def beside_conditioned(t: torch.Tensor, frame: Frame | None) -> bool:
    """Whether ``t`` is the result of a conditioned call (an inverse, a Cholesky factor, a triangular solve's result; up
    to moves and copies), or is saved by a call given one as another operand: ``x @ W`` with W the inverse square root of
    a batch's covariance, saving x for W's gradient (and W for x's). That gradient goes back through the factorization, which amplifies
    it along the covariance's small directions, where x is small: rounded, it is small there no more (a W-MSE
    whitening's conv2d(x, W): 0.087 of the gradient's norm at 8 bits with the covariance's operands exact, 0.011 with x
    too). Asked only in a step whose conditioned call's matrix was a product of activations
    (Compressor._exact_products)."""
    if frame is None:
        return False
    if _conditioned_result(t):
        return True  # (the result itself, W: read for x's gradient, small; rounded it doubled the error left)
    for a in _operands(frame):
        if a is t or a.grad_fn is None or _view_of(t, a):
            continue
        if _conditioned_result(a):
            return True
    return False


def _conditioned_result(a: torch.Tensor) -> bool:
    """Whether ``a`` is the result of a conditioned call (an inverse, a factor, a solution), up to moves and copies."""
    g = _past_rearranging(a.grad_fn)
    return g is not None and any(p in type(g).__name__ for p in _CONDITIONED_RESULT_PARTS)


def _past_rearranging(g: Any) -> Any:
    """The first node from ``g`` on that does more than move, copy or cast elements (_REARRANGING), at most 8 back."""
    for _ in range(8):
        if g is None or type(g).__name__ not in _REARRANGING:
            return g
        nxt = g.next_functions
        g = nxt[0][0] if nxt else None
    return None


#: elementwise nodes and views (with sums over them), through which a read kept exact for a call that divides by it is
#: a function of what they read (Compressor._exact_read): arithmetic, powers, clamps, the activations (torch's, and
#: gact's stand-ins that store their derivative), sums and cumulative sums (entmax's sorted moments, cumsum(x ** 2) / ρ
#: − (cumsum(x) / ρ) ** 2 under a square root), and the calls that gather, flip or join elements (a survival curve's
#: S(t) = 1 - cumsum(pmf) gathered at each sample's time: DeepHit's log S was 0.52-1.8 of the gradient's norm at 8
#: bits; an ordinal model's cat of sigmoid differences); the C++ walk also passes a matrix product with one operand
#: that needs no gradient, a fixed linear map (a Cox model's risk sets R @ exp(h))
ELEMENTWISE_NODES = VIEW_NODES | frozenset("""AddBackward0 AddBackward1 SubBackward0 SubBackward1 RsubBackward0
    RsubBackward1 MulBackward0 MulBackward1 DivBackward0 DivBackward1 NegBackward0 PowBackward0 PowBackward1
    PowBackward2 ClampBackward0 ClampBackward1 ClampMinBackward0 ClampMinBackward1 ClampMaxBackward0 ClampMaxBackward1
    AbsBackward0 SqrtBackward0 RsqrtBackward0 ReciprocalBackward0 ExpBackward0 Exp2Backward0 Expm1Backward0
    SigmoidBackward0 TanhBackward0 SoftmaxBackward0 SoftplusBackward0 EluBackward0 EluBackward1 CeluBackward0
    SeluBackward0 ErfBackward0 ErfcBackward0 SiluBackward0 GeluBackward0 GeluBackward1 MishBackward0
    HardtanhBackward0 HardsigmoidBackward0 HardswishBackward0 LeakyReluBackward0 LogSigmoidBackward0
    ActivationFunctionBackward _HardsigmoidFunctionBackward SumBackward0 SumBackward1 MeanBackward0 MeanBackward1
    CumsumBackward0 CloneBackward0 ToCopyBackward0 SqueezeBackward0 SqueezeBackward1 UnsqueezeBackward0 WhereBackward0
    MaskedFillBackward0 MaskedFillBackward1 ReluBackward0 ThresholdBackward0 GatherBackward0 IndexBackward0
    IndexSelectBackward0 FlipBackward0 RollBackward0 CatBackward0 StackBackward0""".split())

#: the elementwise nodes that keep their input's shape, which _computed_from walks a divisor back through
_SAME_SHAPE_NODES = ELEMENTWISE_NODES - VIEW_NODES - frozenset(
    """SumBackward0 SumBackward1 MeanBackward0 MeanBackward1 CumsumBackward0 GatherBackward0 IndexBackward0
    IndexSelectBackward0 CatBackward0 StackBackward0 FlipBackward0 RollBackward0 SqueezeBackward0 SqueezeBackward1
    UnsqueezeBackward0""".split())

#: calls whose backward divides by a saved operand, or by a function of it that vanishes where it does (log, a
#: denominator, a square root, BCE's p(1 - p)): the operand they keep exact is where _exact_read starts
DIVIDING_CALLS = frozenset("""log log_ log2 log2_ log10 log10_ log1p log1p_ xlogy xlogy_ special_xlogy reciprocal
    reciprocal_ rsqrt rsqrt_ sqrt sqrt_ pow pow_ __pow__ __ipow__ float_power binary_cross_entropy poisson_nll_loss logit
    logit_ atanh atanh_ arctanh div div_ __truediv__ __itruediv__ __rtruediv__ __rdiv__ true_divide divide""".split())


def divides_by(t: torch.Tensor, frame: Frame | None) -> bool:
    """Whether the call saving ``t`` (kept exact) divides by it or takes its log (DIVIDING_CALLS), or divides it by a
    divisor of its own per element (a variance): the gradient that flows back through ``t`` is then divided by it, or
    by that divisor (``__rtruediv__``'s argument 0 is its divisor). Only where that amplifies: some |t| below 1 (a
    reciprocal's or rsqrt's saved result above 1); on a GPU, assumed (_below_one)."""
    if frame is None:
        return False
    name = frame.name
    if name not in DIVIDING_CALLS:
        return False
    if name in _DIVISIONS:  # (only the divisor, argument 1, is divided by)
        b = _arg(frame.args, frame.kwargs, 1, "other")
        if _view_of(t, b):
            return _below_one(t)
        # (the dividend: kept exact by _divisor only over a divisor of its size below 1 somewhere)
        return _own_divisor(t, frame.args, frame.kwargs)
    if name == "__rtruediv__":
        return _view_of(t, _arg(frame.args, frame.kwargs, 0, "input")) and _below_one(t)
    if name in _RESULT_SAVED:
        return _below_one(t, above=True)
    return _below_one(t)


#: dividing calls that save their result, which is large where they amplify (1/x, 1/sqrt(x)); ``c / x`` is Tensor.__rdiv__
#: (torch's __rtruediv__ is the same function, named so), reciprocal(x) * c: it saves the reciprocal
_RESULT_SAVED = frozenset("reciprocal reciprocal_ rsqrt rsqrt_ __rdiv__".split())


#: nodes that only move, copy or cast a tensor's elements (a window partition: roll, view, permute, reshape's copy)
_REARRANGING = VIEW_NODES | {"CloneBackward0", "RollBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                             "SqueezeBackward1", "ToCopyBackward0"}


def _padded_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` is, up to moves and copies of its elements, the result of ``F.pad`` over dimensions before the
    last: whole rows of the pad's value (zeros) among the input's rows (Swin's window partition of a map padded to
    whole windows). A pad of the last dimension counts too where a permute or transpose comes after it: a map padded
    in NCHW and then made NHWC has whole rows of zeros, which its pixels are. At most 8 nodes back."""
    g = t.grad_fn
    moved = False  # (a permute or transpose on the way: the padded dimensions need not be the last one any more)
    for _ in range(8):
        if g is None:
            return False
        name = type(g).__name__
        if name == "ConstantPadNdBackward0":
            pad = getattr(g, "_saved_pad", None)
            if pad is None:
                return False
            return any(pad) if moved else len(pad) >= 4 and pad[0] == 0 and pad[1] == 0 and any(pad[2:])
        if name not in _REARRANGING:
            return False
        moved = moved or name in ("PermuteBackward0", "TransposeBackward0", "TBackward0")
        nxt = g.next_functions
        g = nxt[0][0] if nxt else None
    return False


def _weight(index: int, name: str):
    """A rule for a layer given its weight (argument `index`, `name`): a weight computed in the forward (weight
    or spectral norm, a parametrization, a low-rank update, fake quantization) is not a parameter but is read
    like one, usually the same for every sample, so its rounding would not average out over the batch: exact
    (a kernel computed per sample is kept too: memory, not fidelity). So is autocast's copy of a weight that
    does not require grad. The input: values; a linear layer's input padded with whole rows (_padded_rows)
    normalized per row, which keeps those rows zero: a zero row's output can get a huge gradient (F.normalize of
    it: g/eps, Swin v2's keys), which the weight's gradient multiplies with that row, exactly zero in fp32 and
    the rounding noise of the rows it shares a group with otherwise (1e8x the gradient's norm at 8 bits)."""
    def rule(t, args, kwargs, frame) -> Decision:
        w = _arg(args, kwargs, index, name)
        if isinstance(w, torch.Tensor) and _is_float(t) and _derived_from(t, w):
            return _EXACT
        if frame.name == "linear" and t.dim() >= 2 and _is_float(t) and _padded_rows(t):
            return Decision(VALUES, rows=t.shape[-1])
        if frame.name == "linear" and t.dim() == 2 and t.shape[-1] < ROW_MIN and 1 < t.shape[0] and \
                t.numel() <= SHORT_BATCH_MAX * 4 and _is_float(t) and t is _arg(args, kwargs, 0, "input"):
            # (a batch of samples of fewer than ROW_MIN values, the first layer of a low-dimensional model: rows too
            # short to be normalized per row, whose gradients a loss may weigh per sample, as x² of such a batch; a
            # score network's perturbed 2-D input, rounded in steps of the widest noise, was 0.04 of the gradient's
            # norm at 8 bits with the rest exact. Exact: it is 1/16 of the layer's output or less)
            return _EXACT
        return _VALUES
    return rule


def _normalization(t, args, kwargs, frame) -> Decision:
    if not _is_float(t):
        return _VALUES
    if frame.name in ("batch_norm", "instance_norm"):
        training = bool(_arg(args, kwargs, 5, "training", False)) if frame.name == "batch_norm" else True
        if frame.name == "instance_norm":
            training = bool(_arg(args, kwargs, 5, "use_input_stats", True))
        if t.dim() >= 2 and training:
            return Decision(NORMALIZED)
        return _STATS if t.dim() == 1 else _VALUES
    # layer_norm / group_norm: the input first, then mean and 1/std
    if t is _arg(args, kwargs, 0, "input"):
        return Decision(NORMALIZED)
    if t.grad_fn is not None or not t.requires_grad:
        return _STATS  # the layer's own statistics
    return _VALUES


_exact_row = lambda why: Row("its value through a discontinuous test", why, lambda *a: _EXACT)  # noqa: E731

#: op name (as the tracker sees it) -> what its backward reads and how gact stores it
TABLE: dict[str, Row] = {}


def _add(names: str, reads: str, reason: str, rule) -> None:
    row = Row(reads, reason, rule)
    for n in names.split():
        TABLE[n] = row


_add("relu relu_", "result > 0", "predicate `x > 0`; a boundary blob when the next layer reads the values too", _relu)
_add("threshold threshold_ _threshold", "input > threshold", "predicate `x > t`", _threshold)
_add("hardtanh hardtanh_ relu6", "min < input < max", "predicate `lo < x < hi` (ReLU6: 0 < x < 6)", _hardtanh)
_add("hardsigmoid hardsigmoid_", "-3 < input < 3", "predicate `-3 < x < 3`", _hardsigmoid)
_add("clamp clamp_ clip clip_ clamp_min clamp_min_ clamp_max clamp_max_",
     "min <= input <= max", "predicate `lo <= x <= hi` (`x >= lo`, `x <= hi`); tensor bounds, and two bounds one of which "
     "is trained (a learned threshold, clamp(x, -t, t)): exact", _clamp)
_add("leaky_relu leaky_relu_", "sign of input", "predicate `x > 0`", _leaky_relu)
_add("rrelu rrelu_", "sign of input; random slopes", "predicate `x > 0`; slopes kept (the kernel writes them after the save)",
     _rrelu)
_add("dropout dropout_ dropout1d dropout2d dropout3d feature_dropout alpha_dropout feature_alpha_dropout",
     "its mask", "CPU: the scaled mask as 1 bit and its level (exact); CUDA: the bool mask, lossless", _dropout)
_add("_fake_quantize_learnable_per_tensor_affine _fake_quantize_learnable_per_channel_affine",
     "input through round(x / scale) and the clamp's bounds (the scale's and zero point's gradients)",
     "exact: a rounded input moves the rounding's and the clamp's edges (at 2 bits the zero point's mean gradient was "
     "1.2-1.6x its size off)", lambda *a: _EXACT)
_add("_standard_gamma", "the sample and the concentration through the gamma distribution's implicit reparameterization "
     "(_standard_gamma_grad)",
     "exact: that derivative is steep for samples near 0 (a concentration near 1 or below puts a few percent of them "
     "there): Gamma.rsample's and Chi2's gradients at 4 bits were 3-5x what noise leaves off, the same at every step",
     lambda *a: _EXACT)
#: softplus's beta above which, stored as its input, the input keeps 8 bits: its backward reads sigmoid(beta·x), whose
#: curvature grows with beta², so the rounding's bias does (an SDF network's Softplus(beta=100) at 4 bits: the 50-seed
#: mean 7x what noise leaves, its first layer's gradient 7 % off; beta = 1 and 10: 0.7 % and 1.6 %)
SOFTPLUS_STEEP_BETA = 10
_STEEP_CURVE = Decision(VALUES, min_bits=8)


def _curved(t, args, kwargs, frame) -> Decision:
    if frame.name == "softplus":
        beta = _scalar(_arg(args, kwargs, 1, "beta", 1))
        if isinstance(beta, (int, float)) and abs(beta) > SOFTPLUS_STEEP_BETA:
            return _STEEP_CURVE
    return _QUADRATIC


_add("silu gelu mish softplus", "input through the activation's derivative",
     "the derivative f'(x) as values, computed when saved (`derivatives` option); without it (an input under "
     f"`min_bytes`, `derivatives=False`, `torch.ops.aten.gelu`) the input as values at >= {QUADRATIC_MIN_BITS} bits (read "
     "through a curve: at 2 bits aten.gelu's 1 024-seed mean was 3x what noise leaves), at 8 for softplus with beta "
     f"above {SOFTPLUS_STEEP_BETA} (sigmoid(beta·x))", _or_derivative(_curved))
_add("tanh tanh_ sigmoid sigmoid_ special_expit lstm lstm_cell gru gru_cell rnn_tanh rnn_tanh_cell",
     "result through its square (1 - y², y(1 - y)); inside the recurrent calls, their gates",
     f"values (>= {QUADRATIC_MIN_BITS} bits): the square of a rounded value is biased by its rounding variance",
     lambda *a: _QUADRATIC)
_add("rnn_relu rnn_relu_cell", "each time step's result > 0, inside one call",
     "exact: the call's ReLU and the next step's product read one tensor, which the tracker cannot tell apart "
     "(stored as values, small positives rounded to 0 lost their gradient: a bias)", lambda *a: _EXACT)
_add("sin sin_ cos cos_", "input through cos and sin",
     "exact: a rounding step of a radian or more (a SIREN's 30 x) moves the derivative's sign", lambda *a: _EXACT)
_add("elu elu_", "input through exp (in place: the result through min(result + alpha, 1)), sign of input",
     "the derivative f'(x) as values where gact's stand-in runs (F.elu; `derivatives` option); otherwise values (>= "
     f"{QUADRATIC_MIN_BITS} bits) when alpha = 1 (a curve or a kink of a rounded value is biased), exact otherwise "
     "and under forward-mode AD (a loss on the tangent reads the input through f''(x), which jumps at 0)",
     _or_derivative(_elu))
_add("celu celu_", "input through exp (in place: the result through min(result + alpha, 1))",
     f"the derivative f'(x) as values where gact's stand-in runs (F.celu; `derivatives` option); otherwise values (>= "
     f"{QUADRATIC_MIN_BITS} bits): a curve or a kink of a rounded value is biased; exact under forward-mode AD, as "
     "elu's", _or_derivative(_celu))
_add("erf special_erf logsigmoid log_sigmoid", "input through exp(-x²), sigmoid(-x)",
     "the derivative f'(x) as values where gact's stand-in runs (torch.erf, Tensor.erf, F.logsigmoid; `derivatives` "
     f"option); otherwise values (>= {QUADRATIC_MIN_BITS} bits): a curve of a rounded value is biased",
     _or_derivative(lambda *a: _QUADRATIC))
_add("tanhshrink glu i0 i0_ special_i0 igamma igamma_ igammac igammac_ special_gammainc special_gammaincc",
     "input through a curve (sigmoid, i1; tanhshrink's result through its square)",
     f"values (>= {QUADRATIC_MIN_BITS} bits): a curve of a rounded value is biased by its rounding variance",
     lambda *a: _QUADRATIC)
_add("erf_ erfc erfc_ special_erfc atan atan_ arctan arctan_ asinh asinh_ arcsinh arcsinh_ sinh sinh_ cosh cosh_",
     "input through a curve of unit width (exp(-x²), 1/(1+x²), 1/sqrt(1+x²), cosh) over an unbounded input",
     "values at >= 8 bits: a curve of a rounded value is biased by its rounding variance, and 4 bits' step over an input "
     "spanning tens of units is wider than the curve (erf 5.5x, atan 4.3x what noise leaves at 2 bits; an arctan "
     "surrogate over a membrane of +-5: 0.40 of the gradient's norm at 4 bits, 0.007 at 8)",
     lambda *a: _STEEP_CURVE)
_add("tan tan_", "result through 1 + y²",
     "exact: its range has no bound (tan 1.5 = 14), and a group that reaches the pole rounds in steps of 1.9 at 4 bits, "
     "whose variance raised the small values' 1 + y² by up to 90 % (a layer's bias gradient 12 % off, 18x what noise "
     "leaves in 128 seeds; 9x at 2 bits over a bounded range)", lambda *a: _EXACT)
_add("kl_div", "the input, linearly; a trained target through log",
     f"the input as values; a target that needs a gradient exact (its log of a rounded value: at 4 bits mutual "
     f"learning's kl_div(log_softmax(b), softmax(a)) stayed 2.7x what noise leaves); otherwise values (>= "
     f"{QUADRATIC_MIN_BITS} bits)", _kl_div)
_add("matrix_power linalg_matrix_power", "the matrix (a negative power: its inverse)",
     "values for a power >= 0; exact for a negative one (an inverse)", _matrix_power)
_add("softmax _softmax special_softmax softmin gumbel_softmax", "result through y·(g - Σ g·y)",
     f"values; at least {QUADRATIC_MIN_BITS} bits over fewer than {SOFTMAX_WIDE} values (the square of a rounded "
     "value is biased; a router's or a head's softmax); decoded rows made to sum to one, each row's excess taken back in "
     "equal shares from its nonzero values (a component all keys share cancels in the query's gradient only then); a "
     "result holding a zero (a masked row; on a GPU any) as a boundary blob at 0, whose zeros are the exact ones",
     _softmax)
_add("softsign binary_cross_entropy_with_logits soft_margin_loss multilabel_soft_margin_loss copysign copysign_ "
     "special_i0e special_i1 special_i1e special_ndtr special_log_ndtr special_zeta segment_reduce _segment_reduce "
     "vander linalg_vander",
     "input through a division by 1 + abs(x) or by x, a sigmoid, a sign, a Gaussian's density, a power",
     "exact: biased even at 4 bits (softsign 3.1x, multilabel_soft_margin_loss 8.5x what noise leaves, "
     "copysign's sign and segment_reduce's max lost at any width)", lambda *a: _EXACT)
_EXACT_ROW = _exact_row("exact: the gradient jumps where the value crosses a threshold, a sign or another "
                        "tensor, so rounding would move elements across it (a bias, not noise)")
for _n in "selu selu_ hardswish hardswish_ prelu abs abs_ absolute absolute_ sgn sign amax max maximum " \
          "minimum fmax fmin median nanmedian scatter_reduce scatter_reduce_ index_reduce index_reduce_ prod l1_loss " \
          "smooth_l1_loss huber_loss margin_ranking_loss hinge_embedding_loss multi_margin_loss " \
          "multilabel_margin_loss fmod fmod_ remainder remainder_ hardshrink " \
          "softshrink".split():
    TABLE[_n] = _EXACT_ROW
_add("mse_loss", "input and target through their difference",
     f"values; from the next step, at 8 bits where their rounding step is above {NEAR_STEP_MAX:g}x the rms of their "
     "difference, and exact where 8 bits' is too (near_ratio: measured at step 0 and every "
     f"{ATTENTION_CHECK_EVERY} steps; per sample where unreduced, which a loss may weigh per sample): the backward reads 2·(input − target), which a model near its target makes far "
     "smaller than either's rounding step (a denoiser at σ = 0.005, F.mse_loss(D, x0): 1.76 of the gradient's norm at 8 "
     "bits, against 0.01 for ((D − x0) ** 2).mean(), which saves the difference)", _mse_side)
_add("min amin", "its value through a discontinuous test; the values it selects",
     "exact, as max's; a minimum over a distance at least 0 whose smallest value is under 1/16 of its largest (on a "
     "GPU, any distance) serves exact the saves it was computed through, from the next step (selects_small: the "
     "gradient reaches only the nearest pairs, whose differences the rounding of the farthest swamps), as do "
     "topk(largest=False), kthvalue and sort over such a distance and max, amax, logsumexp, topk and exp over its "
     "negation (a smooth minimum -τ·logsumexp(-d/τ); a Gaussian's exp(-q/2) of a hand-written quadratic form)",
     lambda *a: _EXACT)
_add("matrix_exp linalg_matrix_exp", "the matrix through exp",
     "exact: the backward is the exponential of a block matrix that holds it, so a rounded matrix's error is "
     "exponentiated (at 2 bits the 512-seed mean stayed 0.18 of the gradient's norm off)", lambda *a: _EXACT)
_add("det logdet slogdet linalg_det linalg_slogdet linalg_solve linalg_solve_ex solve cholesky linalg_cholesky "
     "linalg_cholesky_ex cholesky_solve cholesky_inverse lu_solve linalg_lu_solve linalg_lu linalg_lu_factor "
     "linalg_lu_factor_ex lu lu_unpack linalg_lstsq lstsq qr linalg_qr pinverse linalg_pinv linalg_eigh "
     "linalg_eigvalsh symeig linalg_eig linalg_eigvals eig svd linalg_svd linalg_svdvals linalg_matrix_norm "
     "linalg_cond triangular_solve linalg_solve_triangular linalg_ldl_factor linalg_ldl_solve "
     "geqrf ormqr linalg_householder_product orgqr inverse linalg_inv linalg_inv_ex linalg_tensorinv linalg_tensorsolve "
     "nuclear_norm",
     "the matrix, its factors", "exact: the backward solves with them or divides by eigenvalue gaps, so a rounded "
     "matrix's error grows with its condition number (logdet of a random 16x16 SPD matrix: 20x the gradient); a "
     "spectral decomposition's outputs, and the results of the calls given them, exact where later calls save them "
     "(near_spectral: their gap divisions cancel between the reads of V); a factored, inverted or solved matrix computed "
     "from a product of activations (a covariance): the product's operands exact from the next step, and the batch "
     "read beside the result (conditioned_matrix, beside_conditioned)",
     lambda *a: _EXACT)
_add("grad backward", "anything the double backward reads",
     "exact: saved by a backward with create_graph=True, whose next backward reads them in any way (an ELU's sign)",
     lambda *a: _EXACT)
_add("div div_ divide divide_ true_divide true_divide_", "the divisor; the dividend for the divisor's gradient",
     "the divisor exact (d/db of a/b = -a/b^2); the dividend as values, normalized per row over a divisor of one value "
     "per row (e / e.sum(-1, keepdim=True)), exact over one value per row of fewer than 16 values along any dimension "
     "(o / o.norm(dim=1, keepdim=True) over 3 channels), exact over a divisor of its size that requires grad and is below 1 "
     "somewhere (a variance; on a GPU, any such divisor) or is computed from it element for element (a softsign by hand, "
     "through a view of it too), with the saves that divisor was computed through",
     _divisor)
_add("normalize", "input twice; its norm through a division",
     "input as values normalized per row (over the last dimension), >= 4 bits below 1 024 values per row (8 below 64), "
     "exact over rows of fewer than 16 values (a direction in 2-D to 4-D: an angle's pair, a normal, a quaternion); "
     "the norm (one value per row) exact (all exact at an order other than 2)", _normalize)
_add("norm linalg_vector_norm linalg_norm frobenius_norm dist _weight_norm std std_mean var var_mean pairwise_distance "
     "cosine_similarity", "input; the norm or deviation through a division",
     "input as values (a 2-norm's over the last dimension normalized per row; cosine_similarity's too, read twice: >= 4 "
     "bits below 1 024 values per row, 8 below 64; exact over fewer than 16 values along any dimension, "
     "pairwise_distance's difference too); the reduced result exact (all exact at an order other than 2, and "
     "for a matrix norm)", _reduction_result)
#: the most coordinates a point has for cdist and pdist to keep their points exact (a position in 2-D, 3-D, or 4-D)
POINT_DIMS_MAX = 4


def _distance_points(t, args, kwargs, frame) -> Decision:
    # cdist's and pdist's backward divides by the distances: those exact (cdist's are (..., r1, r2) for points
    # (..., r1, m) and (..., r2, m); pdist's one row of pairs); the points and their copies exact where they are
    # positions (m <= POINT_DIMS_MAX), whose distances can be a thousandth of their range, as values otherwise (a feature
    # vector's distances are about as large as its range)
    if not _is_float(t):
        return _VALUES
    if not _divides(args, kwargs, frame):
        return _EXACT
    x1 = _arg(args, kwargs, 0, "x1" if frame.name == "cdist" else "input")
    if not isinstance(x1, torch.Tensor) or x1.dim() < 1:
        return _EXACT
    # (wide points exact too where near_points cannot serve them: on a device, where reading the distances back would
    # wait for it; without _gact_torch's graph calls, where the Compressor does not list a call's stored saves; under
    # allow_mutation_on_saved_tensors, where a point may change before backward)
    wide = x1.shape[-1] > POINT_DIMS_MAX and x1.device.type == "cpu" and not _DEVICE_RULES_ON_HOST and \
        _graph_reaches is not None and not _compat.mutation_allowed()
    points = _VALUES if wide else _EXACT
    if frame.name == "pdist":
        return _EXACT if t.dim() == 1 else points
    x2 = _arg(args, kwargs, 1, "x2")
    if not isinstance(x2, torch.Tensor) or x1.dim() < 2 or x2.dim() < 2:
        return _EXACT
    return _EXACT if t.dim() >= 2 and tuple(t.shape[-2:]) == (x1.shape[-2], x2.shape[-2]) else points


#: the calls whose wide points near_points serves exact
POINT_DISTANCE_CALLS = frozenset({"cdist", "pdist"})
#: the smallest distance, as a share of the points' range, under which near_points keeps wide points exact
NEAR_POINTS_SHARE = 1.0 / 16.0


def near_points(t: torch.Tensor, frame: Frame) -> bool:
    """Whether ``t``, saved by a cdist or pdist call of order 2 over points of more than POINT_DIMS_MAX coordinates
    (stored as values by _distance_points, on the host), is the call's distances, and the smallest of them is under
    NEAR_POINTS_SHARE of the points' range. The backward divides each difference of two points by their distance, so
    the points' rounding, in steps of their range, is amplified by range / distance: features near their codes or
    prototypes (a VQ layer near convergence, a codebook reset to batch samples, whose distance the matrix-product path
    computes as 1e-7, not 0) made a soft VQ's codebook gradient 20x its norm off at 8 bits and 3e4x where a code equals
    a sample. Then the call's point saves, stored before its distances, are served exact from the operands
    (Compressor._pack)."""
    name = frame.name
    if name not in POINT_DISTANCE_CALLS or not _is_float(t) or t.numel() == 0 or t.device.type != "cpu" or \
            _DEVICE_RULES_ON_HOST or not _divides(frame.args, frame.kwargs, frame):
        return False
    x1 = _arg(frame.args, frame.kwargs, 0, "x1" if name == "cdist" else "input")
    x2 = _arg(frame.args, frame.kwargs, 1, "x2") if name == "cdist" else x1
    if not isinstance(x1, torch.Tensor) or not isinstance(x2, torch.Tensor) or x1.dim() < 2 or x2.dim() < 2 or \
            x1.shape[-1] <= POINT_DIMS_MAX or x1.numel() == 0 or x2.numel() == 0:
        return False
    if name == "cdist":
        if t.dim() < 2 or tuple(t.shape[-2:]) != (x1.shape[-2], x2.shape[-2]):
            return False
    elif t.dim() != 1:
        return False
    if t.grad_fn is None or type(t.grad_fn).__name__ not in _DISTANCE_RESULTS:
        return False  # (a point save, or a copy of one, whose shape is the distances')
    with torch.no_grad():
        def span(x: torch.Tensor) -> float:
            lo, hi = torch.aminmax(x.detach() if x.dtype in (torch.float32, torch.float64) else x.detach().float())
            return float(hi - lo)
        d = t.detach()
        d = d if d.dtype in (torch.float32, torch.float64) else d.float()
        # (a distance of exactly 0, a point given twice, amplifies nothing: the backward masks it)
        near = float(torch.where(d > 0, d, d.new_tensor(float("inf"))).amin())
        return near < NEAR_POINTS_SHARE * max(span(x1), span(x2))


#: the autograd nodes that make a cdist's or pdist's distances (the call's result, which near_points reads)
_DISTANCE_RESULTS = frozenset({"CdistBackward0", "EuclideanDistBackward0", "PdistBackward0"})


_add("cdist pdist", "points through their differences; the distances through a division",
     f"the distances exact, and points of at most {POINT_DIMS_MAX} coordinates: the backward divides each difference "
     "of two points by their distance, so a position's rounding, in steps of its range, is amplified by range / "
     "distance (atoms 150 Å from the origin at 1.2 Å: 0.25 of the gradient's norm at 8 bits, 6x the same molecule at the "
     "origin; points 0.05 from their targets under a Chamfer loss: 0.12); wider points (feature vectors) as values, "
     f"exact where a distance is under {NEAR_POINTS_SHARE:g} of their range (features near their codes: near_points; "
     "on a device always) (all exact at an order other than 2)", _distance_points)
_add("binary_cross_entropy gaussian_nll_loss poisson_nll_loss cosine_embedding_loss triplet_margin_loss "
     "triplet_margin_with_distance_loss atan2 atan2_ arctan2 arctan2_ logit logit_ special_logit renorm renorm_ "
     "lp_pool1d lp_pool2d lp_pool3d",
     "input through a division by a function of it", "exact: p(1-p), a variance, a norm or x^2 + y^2 divides",
     lambda *a: _EXACT)
_add("stft istft", "the window (and istft the sum of its squares over the frames, which it divides by)",
     "stft's one-dimensional saves (the window) exact, its others values; istft's exact: one window given to stft and "
     "istft is read by both, twice (a rounding shared by both reads biased the gradient before them: 9x what noise "
     "leaves in 256 seeds at 2 bits), and istft divides by it", _spectral_transform)
_add("local_response_norm", "input and a divisor computed inside the call", "exact: its divisor is not visible apart",
     lambda *a: _EXACT)
_add("roi_align roi_pool ps_roi_align ps_roi_pool", "boxes (image index, corners) as positions",
     "boxes exact", _positions(1, "rois"))
_add("conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d linear",
     "input; the weight it is given",
     "input as values (a linear layer's, padded with whole rows by F.pad: normalized per row; a linear layer's over a "
     "batch of samples of fewer than 16 values exact); a weight computed in the forward exact", _weight(1, "weight"))
_add("bilinear", "inputs; the weight it is given",
     "inputs as values (one tensor as both: a rounding each); a weight computed in the forward exact",
     _weight(2, "weight"))
_add("grid_sample grid_sampler grid_sampler_2d grid_sampler_3d", "the grid as positions; input's differences for the "
     "grid's gradient", "grid exact; input as values, exact where the grid requires grad (a learned deformation, a "
     "spatial transformer)", _positions(1, "grid"))
_add("deform_conv2d", "the offsets as positions", "offsets exact; input and mask as values", _positions(2, "offset"))
_add("reciprocal reciprocal_ __rdiv__ rsqrt rsqrt_ sqrt sqrt_ log log_ log2 log2_ log10 log10_ log1p log1p_ "
     "special_log1p",
     "input or result in a division", "exact: a rounded value near zero makes 1/x explode", lambda *a: _EXACT)
_add("max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices max_pool3d_with_indices",
     "indices; input only for its shape", "indices lossless in window offsets (4 bits for 3x3); input: shape only",
     _max_pool)
_add("adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d adaptive_max_pool1d_with_indices "
     "adaptive_max_pool2d_with_indices adaptive_max_pool3d_with_indices",
     "indices; input only for its shape", "input: shape only; indices kept as they are", _pool_input_shape)
_add("avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d",
     "input only for its shape", "shape only", _pool_input_shape)
_add("mean", "input only for its shape (torch 1.13 saves it)", "shape only", _mean_input)
_add("nll_loss nll_loss2d", "targets; input only for its shape", "input: shape only; targets kept", _loss_input_shape)
_add("cross_entropy", "log-probabilities through exp",
     f"the probabilities exp(x) as values (>= {LOG_MIN_BITS} bits), decoded with log (unbiased; class or probability "
     f"targets, label smoothing); a trained target or class weight: log-space values (>= {LOG_MIN_BITS} bits)",
     _cross_entropy)
_add("log_softmax special_log_softmax", "its result through exp",
     f"the probabilities exp(x) as values (>= {LOG_MIN_BITS} bits), decoded with log (unbiased)", _log_softmax)
_add("ctc_loss", "log-probabilities through products of exp over time steps",
     "exact: its backward's beta recursion multiplies exp of one log-probability per time step (a bias of the "
     "rounding's variance, compounding with the sequence's length)", lambda *a: _EXACT)
_add("logsumexp special_logsumexp logcumsumexp logaddexp logaddexp2",
     "log-space values through exp of their differences",
     "exact: exp of a rounded difference is biased by the rounding's variance, at any logit scale a model trains at "
     "(a mixture-of-experts z-loss, logsumexp(logits)^2, over logits x 3: 3.9x what noise leaves in 256 seeds at 4 "
     "bits)", lambda *a: _EXACT)
_add("scaled_dot_product_attention multi_head_attention_forward _scaled_dot_product_attention_math "
     "_scaled_dot_product_efficient_attention _scaled_dot_product_flash_attention "
     "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_cudnn_attention "
     "_efficient_attention_forward _flash_attention_forward",
     "q, k, v, output; log-sum-exp through exp; the mask; the math path's probabilities", "q and k at >= 8 bits (fused kernels recompute "
     "exp(q kᵀ·scale − lse): a bias that grows with the scores; in multi-head attention's fused path v and the "
     "output too), and exact from the next step where their rounding could move a score by more than "
     f"{ATTENTION_SIGMA_MAX} (peaked heads: measured at step 0 and every {ATTENTION_CHECK_EVERY} steps), with a fused "
     "kernel's v and output (its backward's rowsum(dO·O) and dO·vᵀ cancel on a peaked row only from one v); v and "
     f"output at >= 2 bits; the math path's probabilities over fewer than {SOFTMAX_WIDE} keys at >= "
     f"{QUADRATIC_MIN_BITS} bits (a softmax's); the log-sum-exp and a float mask exact; "
     "philox seed/offset and sequence lengths kept (integers)", _attention)
_add("flex_attention", "q, k, v, output; log-sum-exp through exp; what score_mod and mask_mod read",
     "q and k at >= 8 bits (the backward recomputes the scores through score_mod and exp(score − lse)), exact from the "
     "next step where their rounding could move a score too far (as scaled_dot_product_attention's), v and output "
     "at >= 2 bits; the log-sum-exp and every other float it saves (score_mod's tensors) exact; block-mask indices kept "
     "(integers)", _flex_attention)
_add("mul mul_ __mul__ __rmul__ __imul__ multiply", "each operand", "values; an operand broadcast over one with at "
     "least 8x its elements (a per-row scale, a gate) exact; the other factor of one requiring grad with one value per "
     "row normalized per row (h * rsqrt(mean(h²))); a complex tensor's part times itself exact (as its x²); a unit "
     "vector over fewer than 16 values times a tensor requiring grad exact (a dot product of normals); a weight of up to "
     "65 536 values that needs no gradient (per sample, or rows of fewer than 16 values), times one that does, exact; both factors exact "
     "where one is the inverse of something computed from the other element for element (h * rsqrt(1 + h²)), with the "
     "saves that inverse was computed through",
     _broadcast_factor)
def _einsum(t, args, kwargs, frame) -> Decision:
    # (a dot product of unit vectors over fewer than ROW_MIN values, einsum("ij,ij->i", n0, n1): exact, as mul's)
    if _is_float(t) and _short_direction(t) and any(isinstance(a, torch.Tensor) and a.requires_grad and a is not t
                                                    for a in _tensor_args(frame)):
        return _EXACT
    return _VALUES


_add("einsum", "each operand", "values; a unit vector over fewer than 16 values exact where another operand requires "
     "grad (as mul's)", _einsum)
_add("cross linalg_cross", "each operand (rows of 3)",
     "exact: 3-vectors have no scale of their own, and a normal made from two edges and normalized keeps, near "
     "convergence, only what is perpendicular to its neighbours' (a mesh's normal-consistency loss through cross's "
     "rounded edges: 0.031 of the gradient's norm at 8 bits, against 0.0025 exact)", lambda *a: _EXACT)
_add("rms_norm _fused_rms_norm", "input twice (x̂·mean(g·x̂)); 1/rms through a division",
     "input as values, >= 4 bits below 1 024 values per row (8 below 64); 1/rms exact", _rms_norm)
_add("pow pow_ __pow__ __ipow__ __rpow__ float_power float_power_ square square_", "base through p x^(p-1); log(base)",
     "base exact for an exponent below 1 or a tensor exponent (a division by a power of it), and for x² of a complex "
     "tensor's real or imaginary part or of its abs() (a spectrum's squared magnitude, torchaudio's power=2), and for "
     "x² of a batch of samples of fewer than 16 values, (B, d), or of up to 65 536 scalars (a loss may weigh each "
     "sample's square); values for 1 and 2 (x²'s "
     "base normalized per row of its last dimension); "
     f"values (>= {QUADRATIC_MIN_BITS} bits) for another exponent (a power of a rounded value is biased), and for a "
     "tensor exponent (read through x^(e-1))",
     _pow)
_add("acos acos_ arccos arccos_ asin asin_ arcsin arcsin_ acosh acosh_ arccosh arccosh_ atanh atanh_ arctanh "
     "arctanh_ erfinv erfinv_ special_erfinv digamma digamma_ special_digamma special_psi lgamma lgamma_ "
     "special_gammaln polygamma polygamma_ special_polygamma mvlgamma mvlgamma_ special_multigammaln xlogy xlogy_ "
     "special_xlogy special_xlog1py special_entr special_ndtri sinc sinc_ special_sinc hypot hypot_ cumprod cumprod_ "
     "addcdiv addcdiv_",
     "input through a singular derivative or a division by it",
     "exact: 1/sqrt(1-x^2), 1/x, the poles of digamma, a product's quotients explode near their singularity",
     lambda *a: _EXACT)
_add("batch_norm instance_norm layer_norm group_norm", "input normalized by the layer's statistics",
     "normalized values with the layer's mean and 1/std kept exactly", _normalization)


def rule_for(name: str | None) -> Row | None:
    return TABLE.get(name) if name else None


def table_markdown() -> str:
    """The README table: one row per op (the names that share a rule on one line)."""
    groups: dict[int, tuple[list[str], Row]] = {}
    for name, row in TABLE.items():
        groups.setdefault(id(row), ([], row))[0].append(name)
    lines = ["| op | backward reads | stored as |", "|---|---|---|"]
    for names, row in groups.values():
        lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {row.reads} | {row.reason} |")
    return "\n".join(lines)


# ---- the tracker ----------------------------------------------------------------------------

class Frame:
    """One torch function call seen by the tracker; saves that need the call's other saves
    (a normalization input waiting for the layer's statistics) wait here until it returns."""

    __slots__ = ("func", "args", "kwargs", "pending", "stats", "seen", "count", "group", "operands", "views", "all_views",
                 "name", "_wrapped", "qk", "qk_keys", "mapped", "stored", "selected", "near")

    def __init__(self, func: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.pending: list | None = None
        self.stats: list | None = None
        self.seen: tuple | None = None  # cross_entropy: the log-probabilities stored as exp (nll_loss saves them again)
        self.count = 0  # multi_head_attention_forward: its 4-dimensional saves so far
        self.group = 0  # the store's group of its correlated saves (correlation_group), once it has one
        self.operands: list | None = None  # _operands(self), once a save asked (an LSTM cell's call saves 26 tensors)
        self.views: tuple | None = None  # _views(self), once a stored save asked
        self.all_views: dict | None = None  # _all_views(self), once asked
        # the function's name, as the storage table keys it: an operator called as ``torch.ops.aten.relu.default`` is
        # ``relu``; one of another library's namespace ``ns::op`` (a custom op, whose backward gact does not know) is
        # ``ns::op`` (no row: kept exact, see decide). (An attribute, not a property: a stored save reads it about six
        # times, a call is made once)
        self.name: str = _function_name(func)
        self._wrapped: bool | None = None
        self.qk: dict | None = None  # an attention call's q and k measured so far: {role: (key, statistics)}
        # an attention call's keys decided with its measured q and k (theirs, its value's and output's: Decision.qk 4)
        self.qk_keys: list | None = None
        self.mapped = False  # an attention call that saved its probabilities (the math path)
        self.stored: list | None = None  # the call's stored saves, as the Compressor's _store listed them
        self.selected = False  # a SELECTING_CALLS call whose input's chain was served exact (Compressor._pack)
        self.near: int | None = None  # a host squared difference's decision for its sides (Compressor._near_now)

    @property
    def wrapped(self) -> bool:
        """Whether the call was given a tensor of a torch.func transform (vmap's batched tensors) or a nested tensor:
        autograd then saves the plain tensors beneath them, which no test of which operand a save is can match, and a
        nested tensor's sizes are no integers a rule could compare (an attention's key count)."""
        w = self._wrapped
        if w is None:
            try:
                w = any(_compat.is_functorch_wrapped(a) or a.is_nested for a in _tensor_args(self))
            except NotImplementedError:  # (SDPA's CausalBias: _nested)
                w = any(_compat.is_functorch_wrapped(a) or _nested(a) for a in _tensor_args(self))
            self._wrapped = w
        return w


_OP_TYPES = tuple(c for c in (getattr(getattr(torch, "_ops", None), "OpOverload", None),
                               getattr(getattr(torch, "_ops", None), "OpOverloadPacket", None)) if c is not None)
#: the operator namespaces whose ops the storage table names by their own name (torch's, torchvision's)
_TABLE_NAMESPACES = frozenset({"aten", "prims", "torchvision"})


def _function_name(func: Any) -> str:
    """Frame.name of ``func``."""
    if _OP_TYPES and isinstance(func, _OP_TYPES):
        packet = getattr(func, "overloadpacket", func)
        qualified = getattr(packet, "_qualified_op_name", "") or ""
        namespace, _, op = qualified.partition("::")
        if op:
            return op if namespace in _TABLE_NAMESPACES else qualified
    return getattr(func, "__name__", "") or ""


_get_tracing_state = getattr(torch._C, "_get_tracing_state", None)


def _jit_tracing() -> bool:
    return _get_tracing_state is not None and _get_tracing_state() is not None


#: the rounding functions as the tracker sees them (torch's and the tensor's, in place too): a quantizer's straight-through
#: estimator rounds x / s and adds the rounding back detached, (round(v) - v).detach() + v, so that the scale's gradient
#: is a sum of g·(round(v) - v) over the clamp's inside, the difference of two reads (the rounded codes' and the
#: dividend's) that nearly cancel: rounded in steps of their range, that gradient was 1-10x its own size at 4 bits
#: and 0.2-0.5x at 8 (hand-written LSQ); see Compressor._on_round and _straight_through
ROUNDING_FUNCTIONS = frozenset(f for m in (torch, torch.Tensor) for n in ("round", "round_", "floor", "floor_", "ceil",
                                                                          "ceil_", "trunc", "trunc_", "fix", "fix_")
                               if (f := getattr(m, n, None)) is not None)


def straight_through_shape(t: torch.Tensor) -> bool:
    """Whether ``t`` is made as a straight-through estimator's result is, c + v with c detached ((round(v) - v).detach()
    + v): a sum or difference with one operand that needs no gradient (its values not looked at)."""
    g = t.grad_fn
    if g is None or type(g).__name__ not in ("AddBackward0", "SubBackward0") or not t.is_floating_point():
        return False
    edges = g.next_functions
    return len(edges) == 2 and (edges[0][0] is None) != (edges[1][0] is None)


def whole_numbers(t: torch.Tensor) -> torch.Tensor:
    """A 0-dimensional bool tensor on ``t``'s device: whether every value of ``t`` is a whole number (no read back)."""
    with torch.no_grad():
        d = t.detach()
        return torch.eq(d, torch.round(d)).all()


#: ``Tensor.data``'s getter as the tracker sees it (a method-wrapper of the descriptor)
_DATA = torch.Tensor.data
_METHOD_WRAPPER = type(torch.Tensor.data.__get__)
#: a descriptor's calls, as the tracker sees a tensor attribute's getter and setter
_DESCRIPTOR_CALLS = frozenset({"__get__", "__set__", "__delete__"})


#: calls that can give a tensor's memory up while it lives, with no version change (seen by the op tracker; set_ is not)
_GIVES_MEMORY_UP = frozenset({torch.Tensor.resize_, torch.Tensor.resize_as_, torch.Tensor.share_memory_})


def _outs(kwargs: dict | None) -> tuple:
    """The tensors a call's out= argument names."""
    out = kwargs.get("out") if kwargs else None
    return tuple(out) if isinstance(out, (tuple, list)) else (out,) if out is not None else ()


class OpTracker(TorchFunctionMode):
    """A TorchFunctionMode that records the torch function running on this thread, so that a pack hook
    knows which op saves its tensor. ``on_exit(frame)`` runs when a call with pending saves returns."""

    def __init__(self, on_exit: Callable[[Frame], None],
                 on_alias: Callable[[torch.Tensor], None] | None = None,
                 on_result: Callable[[Frame, Any], None] | None = None,
                 on_round: Callable[[Any], None] | None = None) -> None:
        super().__init__()
        # on_round(x): round, floor, ceil or trunc was given x (a quantizer's straight-through estimator, see
        # ROUNDING_FUNCTIONS)
        self._on_round = on_round
        self.stack: list[Frame] = []
        self._on_exit = on_exit
        # on_result(frame, result): a call that stored saves (frame.stored) returned ``result``
        self._on_result = on_result
        # on_alias(t): `t.data` was taken, an alias whose in-place writes move no version counter of t's
        self._on_alias = on_alias
        # {function: stand-in} run in its place (the frame still names the function), or None; the policy's
        # probe sets double_backward_substitutes() for its passes
        self.substitutes: dict | None = None
        # min_store_bytes(): the size below which the tracker's Compressor keeps a saved tensor as it is
        # (None: 0). An activation whose input is smaller runs as torch's own, not its derivative stand-in:
        # its input is kept anyway, and the stand-in would only add a Python autograd node to the call.
        self.min_store_bytes: Callable[[], float] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func.__class__ is _METHOD_WRAPPER and func.__name__ in _DESCRIPTOR_CALLS:
            # A tensor attribute's getter or setter (p.grad, x.shape, x.data = y): it makes no autograd node and
            # saves nothing, so it needs no frame; an optimizer's step and zero_grad read and write hundreds of
            # them a step, each paying for a frame before
            if func.__self__ is _DATA and self._on_alias is not None and args and not _compat.is_compiling():
                self._on_alias(args[0])
            return func(*args, **(kwargs or {}))
        if _compat.is_compiling():  # (traced by torch.compile: every call as torch's, see _compat.is_compiling)
            return func(*args, **(kwargs or {}))
        if (func in _GIVES_MEMORY_UP or (kwargs and "out" in kwargs)) and self._on_alias is not None:
            # (x.resize_, an out= call that resizes, share_memory_: x's memory given up with no version change, and a
            # tensor made at its address next must get no blob of x's: the address forgotten first, as for .data)
            for x in ((args[0],) if func in _GIVES_MEMORY_UP and args else ()) + _outs(kwargs):
                if isinstance(x, torch.Tensor):
                    self._on_alias(x)
        frame = Frame(func, args, kwargs or {})
        stack = self.stack
        stack.append(frame)
        try:
            subs = self.substitutes
            if subs is not None:
                sub = subs.get(func)
                # (not under forward-mode AD: the stand-ins have no jvp; not inside a torch.func / functorch
                # transform, whose tensors are wrapped: they refuse an autograd.Function without setup_context;
                # not while torch.jit.trace records, where sizes are traced values)
                # A derivative stand-in saves for gact's hooks alone: under other hooks on top (a non-reentrant
                # checkpoint's, whose recomputation runs torch's own op; save_on_cpu's) torch's op saves what its
                # own backward reads (in-place ELU its result, logsigmoid a buffer too)
                if sub is not None and not self._transformed(args, frame.kwargs) and \
                        (sub not in _DERIVATIVE_STAND_INS or
                         (_compat.gact_hooks_on_top() and not self._too_small(args, frame.kwargs))) \
                        and not _compat.forward_ad_active():
                    func = sub
            out = func(*args, **frame.kwargs)
            if frame.stored and self._on_result is not None:
                self._on_result(frame, out)
            if func in ROUNDING_FUNCTIONS and self._on_round is not None and args:
                self._on_round(args[0])
            return out
        finally:
            try:
                stack.pop()
            finally:  # (a Ctrl-C landing on the pop must not leave the call's waiting saves unstored)
                if frame.pending:
                    self._on_exit(frame)

    def current(self) -> Frame | None:
        return self.stack[-1] if self.stack else None

    @staticmethod
    def _transformed(args: tuple, kwargs: dict) -> bool:
        """Whether the call's input is a tensor of a torch.func / functorch transform (grad's, vmap's) or a nested
        tensor, or torch.jit.trace is recording (a stand-in would be traced as a Python op, and the trace's check of its
        graph fails)."""
        if _jit_tracing() or _compat.functorch_active():
            return True
        x = args[0] if args else kwargs.get("input")
        # (a nested tensor has no sizes the stand-in could read: it is kept as it is anyway)
        return isinstance(x, torch.Tensor) and (_compat.is_functorch_wrapped(x) or getattr(x, "is_nested", False))

    def _too_small(self, args: tuple, kwargs: dict) -> bool:
        """Whether an activation's input is below the size the Compressor stores (see min_store_bytes)."""
        size = self.min_store_bytes
        if size is None:
            return False
        x = args[0] if args else kwargs.get("input")
        if type(x) is not torch.Tensor:
            return False
        limit = size()  # (None once the Compressor is gone)
        n = x.numel()
        return limit is not None and (n == 0 or n * x.element_size() < limit)


class _HardsigmoidFunction(torch.autograd.Function):
    """hardsigmoid with a backward autograd can differentiate again (torch 1.13's hardsigmoid_backward has no
    derivative): the same values, the same saved input, the gradient grad * [-3 < x < 3] * (1/6) from
    differentiable ops."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.nn.functional.hardsigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ((x > -3) & (x < 3)).to(grad.dtype) * (1.0 / 6.0)  # as torch: times a sixth


def _hardsigmoid_twice_differentiable(input, inplace=False):
    if inplace or not input.requires_grad:
        return torch.nn.functional.hardsigmoid(input, inplace)
    return _HardsigmoidFunction.apply(input)


class _RoIAlignFunction(torch.autograd.Function):
    """torchvision's roi_align, whose backward autograd cannot differentiate ("double backwards on roi_align not
    supported"): the same values, the same saved boxes; its input gradient is _RoIAlignAdjoint's."""

    @staticmethod
    def forward(ctx, input, rois, *meta):
        ctx.save_for_backward(rois)
        ctx.meta, ctx.shape = meta, tuple(input.shape)
        return torch.ops.torchvision.roi_align(input, rois, *meta)

    @staticmethod
    def backward(ctx, grad):
        (rois,) = ctx.saved_tensors
        return (_RoIAlignAdjoint.apply(grad, rois, ctx.shape, *ctx.meta), None) + (None,) * len(ctx.meta)


class _RoIAlignAdjoint(torch.autograd.Function):
    """roi_align's input gradient (torchvision's own backward kernel): linear in the output's gradient, so its
    derivative is roi_align itself."""

    @staticmethod
    def forward(ctx, grad, rois, shape, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
        ctx.save_for_backward(rois)
        ctx.meta = (spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
        n, c, h, w = shape
        return torch.ops.torchvision._roi_align_backward(grad, rois, spatial_scale, pooled_height, pooled_width,
                                                         n, c, h, w, sampling_ratio, aligned)

    @staticmethod
    def backward(ctx, gg):
        (rois,) = ctx.saved_tensors
        return (torch.ops.torchvision.roi_align(gg, rois, *ctx.meta),) + (None,) * 7


def _roi_align_twice_differentiable(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio,
                                    aligned):
    meta = (spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
    if not input.requires_grad or input.dim() != 4:
        return torch.ops.torchvision.roi_align(input, rois, *meta)
    return _RoIAlignFunction.apply(input, rois, *meta)


# ---- scaled_dot_product_attention, twice differentiable ------------------------------------------

#: the autograd nodes of torch 2.x's fused attention kernels, whose backward has no derivative
_FUSED_ATTENTION_NODES = ("ScaledDotProductFlashAttention", "ScaledDotProductEfficientAttention",
                          "ScaledDotProductCudnnAttention", "ScaledDotProductFusedAttention",
                          "EfficientAttention", "FlashAttention")


def _sum_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """g summed over the dimensions that broadcasting added to a tensor of ``shape``."""
    lead = g.dim() - len(shape)
    if lead:
        g = g.sum(tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(dims, keepdim=True) if dims else g


class _AttentionFunction(torch.autograd.Function):
    """scaled_dot_product_attention with the saves of torch's fused kernel and a backward autograd can
    differentiate again (the fused kernels' backward has no derivative: the policy's probe failed on every
    transformer under torch 2.x). It saves what the fused node saved, in its order (``layout``: for each
    slot "q", "k", "v", "out" or the fused node's own tensor: its log-sum-exp, a converted mask, philox
    seed and offset, sequence lengths), and its backward reads q, k, v and the output from those saves:
    with P = softmax(q kᵀ·scale + bias) recomputed from q and k, D = rowsum(dO ∘ O),
    dV = P̃ᵀ dO, dS = P ∘ (dO vᵀ ∘ M/(1−p) − D), dQ = dS k·scale, dK = dSᵀ q·scale (P̃ = P ∘ M/(1−p), M the
    dropout mask drawn here and kept on the context, not saved)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, layout, others, p, is_causal, scale, gqa, leaf_output, like=None):
        ctx.set_materialize_grads(True)
        s = _attention_scores(q, k, mask, is_causal, scale, gqa)
        attn = _safe_softmax(s)
        keep = None
        if p > 0.0:
            keep = torch.rand_like(attn) >= p
            attn = attn * keep / (1.0 - p)
        out = torch.matmul(attn.to(v.dtype), _expand_heads(v, q, gqa))
        if like is not None and like.stride() != out.stride():
            # the fused kernel's layout (its output is (B, L, H, E) in memory): the store groups elements in
            # memory order, so the probe's rounding variances are those of the step's blob
            out = torch.empty_like(like).copy_(out)
        # leaf_output (the policy's probe inside an attention module, where q, k and v are cut leaves): the
        # output is saved as a leaf of its own, so that its derivative is its own and not also q's, k's
        # and v's through the forward
        slots = {"q": q, "k": k, "v": v, "out": leaf_output(out) if leaf_output is not None else out}
        ctx.save_for_backward(*[slots[x] if isinstance(x, str) else others[x] for x in layout])
        ctx.layout, ctx.mask, ctx.keep = layout, mask, keep
        ctx.p, ctx.is_causal, ctx.scale, ctx.gqa = p, is_causal, scale, gqa
        return out

    @staticmethod
    def backward(ctx, d_out):
        saved = dict(zip(ctx.layout, ctx.saved_tensors))
        q, k, v, out = saved["q"], saved["k"], saved["v"], saved["out"]
        mask, keep, p, gqa = ctx.mask, ctx.keep, ctx.p, ctx.gqa
        s = _attention_scores(q, k, mask, ctx.is_causal, ctx.scale, gqa)
        attn = _safe_softmax(s)
        dropped = attn if keep is None else attn * keep / (1.0 - p)
        ve = _expand_heads(v, q, gqa)
        do = d_out.to(s.dtype)
        dv = torch.matmul(dropped.transpose(-2, -1), do)
        dp = torch.matmul(do, ve.to(s.dtype).transpose(-2, -1))
        if keep is not None:
            dp = dp * keep / (1.0 - p)
        dsum = (do * out.to(s.dtype)).sum(-1, keepdim=True)
        ds = attn * (dp - dsum)
        ke = _expand_heads(k, q, gqa).to(s.dtype)
        dq = torch.matmul(ds, ke) * _scale_of(q, ctx.scale)
        dk = torch.matmul(ds.transpose(-2, -1), q.to(s.dtype)) * _scale_of(q, ctx.scale)
        dk, dv = _fold_heads(dk, k, gqa), _fold_heads(dv, v, gqa)
        dmask = None
        if isinstance(mask, torch.Tensor) and mask.requires_grad:
            dmask = _sum_to(ds, mask.shape).to(mask.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None, None, None, None, None, None, None, None


def _scale_of(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _expand_heads(x: torch.Tensor, q: torch.Tensor, gqa: bool) -> torch.Tensor:
    """k or v with its heads repeated to q's (grouped-query attention, ``enable_gqa``)."""
    if gqa and x.dim() >= 3 and x.shape[-3] != q.shape[-3]:
        return x.repeat_interleave(q.shape[-3] // x.shape[-3], -3)
    return x


def _fold_heads(g: torch.Tensor, x: torch.Tensor, gqa: bool) -> torch.Tensor:
    """The gradient of _expand_heads(x): each group of repeated heads summed back into its head."""
    if gqa and x.dim() >= 3 and g.shape[-3] != x.shape[-3]:
        n = x.shape[-3]
        return g.unflatten(-3, (n, g.shape[-3] // n)).sum(-3)
    return g


def _attention_scores(q, k, mask, is_causal, scale, gqa):
    """q kᵀ·scale plus the mask (a float mask added; a boolean mask's False and a causal mask's upper
    triangle -inf), in float32 for half-precision inputs."""
    dt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    s = torch.matmul(q.to(dt), _expand_heads(k, q, gqa).to(dt).transpose(-2, -1)) * _scale_of(q, scale)
    if is_causal:
        n, m = q.shape[-2], k.shape[-2]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if isinstance(mask, torch.Tensor):
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(dt)
    return s


def _safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, 0 on a row that is all -inf (as torch's attention kernels give),
    with no NaN in its derivatives either."""
    dead = (s == float("-inf")).all(-1, keepdim=True)
    if not bool(dead.any()):
        return torch.softmax(s, -1)
    return torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)


def _attention_twice_differentiable(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False, *, leaf_output=None):
    """scaled_dot_product_attention for a pass that differentiates its backward: where torch runs a fused
    kernel, _AttentionFunction with the same saves (learned from one run of torch's own call, whose output
    is discarded); elsewhere (the math path, already twice differentiable) torch's call."""
    kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
    if not torch.is_grad_enabled() or not any(isinstance(x, torch.Tensor) and x.requires_grad
                                              for x in (query, key, value)):
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    captured: list = []

    def capture(t):
        captured.append(t)
        return len(captured) - 1

    with torch.autograd.graph.saved_tensors_hooks(capture, lambda i: captured[i]):
        fused = _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    node = fused.grad_fn.name() if fused.grad_fn is not None else ""
    if not node.startswith(_FUSED_ATTENTION_NODES):
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    layout: list = []
    others: dict = {}
    named = (("q", query), ("k", key), ("v", value), ("out", fused))
    for i, t in enumerate(captured):
        name = next((n for n, x in named if n not in layout and isinstance(t, torch.Tensor) and
                     (t is x or (t.shape == x.shape and t.stride() == x.stride() and t.dtype == x.dtype and
                                 t.data_ptr() == x.data_ptr()))), None)
        if name is None:
            others[i] = t
            layout.append(i)
        else:
            layout.append(name)
    if not all(n in layout for n in ("q", "k", "v", "out")):
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    return _AttentionFunction.apply(query, key, value, attn_mask, tuple(layout), others, float(dropout_p),
                                    bool(is_causal), scale, bool(enable_gqa), leaf_output, fused.detach())


#: torch's attention builtin (the tracker sees this object, whatever name the caller used); None before 2.0
_SDPA = getattr(torch._C._nn, "scaled_dot_product_attention", None)

#: stand-ins for functions whose backward autograd cannot differentiate, for passes that need a double
#: backward (the policy's probe): same values, same saved tensors, so the storage table reads them alike
DOUBLE_BACKWARD = {torch.nn.functional.hardsigmoid: _hardsigmoid_twice_differentiable}
if _SDPA is not None:
    DOUBLE_BACKWARD[_SDPA] = _attention_twice_differentiable


def double_backward_substitutes() -> dict:
    """DOUBLE_BACKWARD, and torchvision's roi_align where torchvision's ops are loaded."""
    subs = dict(DOUBLE_BACKWARD)
    try:
        op = torch.ops.torchvision.roi_align
        torch.ops.torchvision._roi_align_backward  # noqa: B018 (both must exist)
    except (AttributeError, RuntimeError):
        return subs
    subs[op] = _roi_align_twice_differentiable
    return subs


# ---- activations whose input is stored as their derivative ----------------------------------------

class _Activation(NamedTuple):
    """An elementwise activation f whose backward is grad * f'(x), by torch's own kernels."""

    forward: Callable  # f(x, *extra)
    backward: Callable  # grad * f'(x) from (grad, x, *extra); once differentiable at most
    derivative: Callable  # f'(x) from (x, *extra), one new tensor of x's size
    inplace: Callable | None = None  # f(x) written into x
    # torch's in-place form reads its result in backward (elu_, celu_): a later in-place change of it raises there
    reads_result: bool = False


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=x.dtype, device=x.device).expand(x.shape)


def _derivative_by(backward: Callable) -> Callable:
    """f'(x) by a backward kernel given a unit gradient of stride 0 (no tensor of x's size to fill)."""
    return lambda x, *extra: backward(_unit(x), x, *extra)


def _derivative_over_ones(backward_out: Callable, backward: Callable) -> Callable:
    """f'(x) by a backward kernel's out= form, written over a unit gradient of x's size and layout: for kernels
    that a stride-0 gradient slows (gelu's takes 3x as long, against a fill of ones). Under
    allow_mutation_on_saved_tensors() by the functional form (``backward``): torch's dispatch mode of that context
    reads every out= argument as ``out``, and raised KeyError at gelu_backward's ``grad_input``."""
    def derivative(x, *extra):
        d = torch.ones_like(x)
        if _compat.mutation_allowed():
            return backward(d, x, *extra)
        return backward_out(d, x, *extra, grad_input=d)
    return derivative


class _ActivationCall:
    """One call of an activation stand-in: which activation, its extra arguments, and whether the pack hook
    stored the derivative in place of the input (set after the forward, when autograd packs the save)."""

    __slots__ = ("act", "extra", "stored", "saved", "probed", "result")

    def __init__(self, act: _Activation, extra: tuple) -> None:
        self.act, self.extra, self.stored = act, extra, False
        # in place, where torch's own backward reads the result: (the result, its version when the call returned),
        # the result held weakly; the backward raises torch's error where it was changed in place since
        self.result: tuple | None = None
        # the policy's probe's leaf holding f'(x): the backward multiplies by it (not by the unpacked save, which
        # autograd ties to the saved input), so that the probe's double backward reaches it
        self.probed: torch.Tensor | None = None
        self.saved: Any = None  # a weak reference to the tensor it saves

    def derivative(self, x: torch.Tensor) -> torch.Tensor:
        """f'(x): torch's backward kernel given a unit gradient."""
        return self.act.derivative(x, *self.extra)


class ActivationFunction(torch.autograd.Function):
    """An activation with torch's values, saving its input; a Compressor's pack hook may store f'(x) for it
    instead (marking the call), and the backward then multiplies by what it gets back. The tracker runs it only
    where gact's hooks are the innermost (under a non-reentrant checkpoint's or save_on_cpu's, torch's own op
    runs); where the save was kept, the input comes back and the backward is torch's."""

    @staticmethod
    def forward(ctx, x, copy, call):
        if copy is not None:  # in place, as torch's own: the input saved as a copy made first (with its graph)
            saved = copy
            call.act.inplace(x, *call.extra)
            ctx.mark_dirty(x)
            y = x
        else:
            saved = x
            y = call.act.forward(x, *call.extra)
        ctx.save_for_backward(saved)
        ctx.call = call
        call.saved = weakref.ref(saved)
        _DERIVATIVE_LOCAL.cell = call  # read by the pack hook, which runs after this returns
        return y

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        call = ctx.call
        if call.result is not None:
            _check_result(call.result)
        if call.probed is not None:
            return grad * call.probed, None, None
        if call.stored:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "gact: a backward with create_graph=True through an activation whose input gact stored as "
                    "its derivative (silu, gelu, mish, softplus, elu, celu, erf, logsigmoid): the derivative cannot be "
                    "differentiated again. Run that forward with gact.Compressor(..., derivatives=False) (GACT_DERIVATIVES=0 "
                    "under gact-run), or exclude the module.")
            return grad * saved, None, None
        if torch.is_grad_enabled():  # a double backward: through the activation itself
            with torch.enable_grad():
                y = call.act.forward(saved, *call.extra)
            return torch.autograd.grad(y, saved, grad, create_graph=True)[0], None, None
        return call.act.backward(grad, saved, *call.extra), None, None


def _activation_stand_in(act: _Activation, function: Callable, inplace_at: int | None,
                         extra: Callable[[tuple, dict], tuple]) -> Callable:
    def stand_in(*args, **kwargs):
        x = args[0] if args else kwargs.get("input")
        if type(x) is not torch.Tensor or not x.requires_grad or not torch.is_grad_enabled() or \
                not x.is_floating_point():
            return function(*args, **kwargs)
        inplace = inplace_at is not None and bool(_arg(args, kwargs, inplace_at, "inplace", False))
        if inplace and (x._base is not None or x.is_leaf):  # on a view or a leaf: torch's own (checks, messages)
            return function(*args, **kwargs)
        call = _ActivationCall(act, extra(args, kwargs))
        try:
            y = ActivationFunction.apply(x, x.clone() if inplace else None, call)
        finally:
            _DERIVATIVE_LOCAL.cell = None
        if inplace and act.reads_result:
            call.result = (_weak_version(y), y._version)
        return y
    return stand_in


def _weak_version(t: torch.Tensor) -> Any:
    """What tells ``t``'s version later without holding it: its version counter (_gact_torch), or a weak reference."""
    if _version_ref is not None:
        try:
            return _version_ref(t._cdata)
        except (AttributeError, ValueError):
            pass
    return weakref.ref(t)


def _check_result(result: tuple) -> None:
    """Raise torch's error where an in-place activation's result (see _ActivationCall.result) was changed in place
    after the call: torch's elu_ and celu_ read their result in backward and raise there; the stand-in stored the
    derivative of a copy, and without this check the program ran on, its gradient computed from the values before
    the change."""
    ref, version = result
    if isinstance(ref, weakref.ref):
        t = ref()
        now = -1 if t is None else t._version
    else:
        now = ref.current()
    if now >= 0 and now != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: the "
            f"result of an in-place activation (ActivationFunctionBackward) is at version {now}; expected version "
            f"{version} instead. Hint: torch's own elu_/celu_ read their result in backward; change a copy of it.")


def _gelu_extra(args: tuple, kwargs: dict) -> tuple:
    return (_arg(args, kwargs, 1, "approximate", "none"),)


def _softplus_extra(args: tuple, kwargs: dict) -> tuple:
    return (_arg(args, kwargs, 1, "beta", 1), _arg(args, kwargs, 2, "threshold", 20))


_F = torch.nn.functional
_aten = torch.ops.aten
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _elu_extra(args: tuple, kwargs: dict) -> tuple:
    return (_arg(args, kwargs, 1, "alpha", 1.0),)


def _elu_backward(g, x, alpha, input_scale=1.0):
    return _aten.elu_backward(g, alpha, 1, input_scale, False, x)


def _erf_derivative(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-x * x).mul_(_TWO_OVER_SQRT_PI)


def _log_sigmoid_derivative(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(-x)


#: {function: stand-in}: the activations whose saved input a Compressor stores as f'(x) (option `derivatives`)
DERIVATIVE_SUBSTITUTES = {
    _F.silu: _activation_stand_in(
        _Activation(torch._C._nn.silu, _aten.silu_backward, _derivative_by(_aten.silu_backward),
                    torch._C._nn.silu_),
        _F.silu, 1, lambda a, k: ()),
    _F.gelu: _activation_stand_in(
        _Activation(lambda x, approximate: torch._C._nn.gelu(x, approximate=approximate),
                    lambda g, x, approximate: _aten.gelu_backward(g, x, approximate=approximate),
                    _derivative_over_ones(lambda g, x, approximate, grad_input: _aten.gelu_backward.grad_input(
                        g, x, approximate=approximate, grad_input=grad_input),
                        lambda g, x, approximate: _aten.gelu_backward(g, x, approximate=approximate))),
        _F.gelu, None, _gelu_extra),
    _F.mish: _activation_stand_in(
        _Activation(torch._C._nn.mish, _aten.mish_backward, _derivative_by(_aten.mish_backward), torch._C._nn.mish_),
        _F.mish, 1, lambda a, k: ()),
    _F.softplus: _activation_stand_in(
        _Activation(torch._C._nn.softplus, _aten.softplus_backward, _derivative_by(_aten.softplus_backward)),
        _F.softplus, None, _softplus_extra),
    # their input read through a curve (exp, exp(-x²), sigmoid): biased as values even at 4 bits (erf 1.5 %,
    # elu 2.5 % of the gradient), unbiased as f'(x)
    _F.elu: _activation_stand_in(
        _Activation(torch._C._nn.elu, _elu_backward, _derivative_by(_elu_backward), torch._C._nn.elu_, True),
        _F.elu, 2, _elu_extra),
    _F.celu: _activation_stand_in(
        _Activation(torch.celu, lambda g, x, alpha: _elu_backward(g, x, alpha, 1.0 / alpha),
                    _derivative_by(lambda g, x, alpha: _elu_backward(g, x, alpha, 1.0 / alpha)), torch.celu_, True),
        _F.celu, 2, _elu_extra),
    _F.logsigmoid: _activation_stand_in(
        _Activation(_F.logsigmoid, lambda g, x: g * _log_sigmoid_derivative(x), _log_sigmoid_derivative),
        _F.logsigmoid, None, lambda a, k: ()),
}
for _f in (torch.erf, torch.special.erf, torch.Tensor.erf):
    DERIVATIVE_SUBSTITUTES[_f] = _activation_stand_in(
        _Activation(torch.erf, lambda g, x: g * _erf_derivative(x), _erf_derivative), _f, None, lambda a, k: ())


#: the stand-ins of DERIVATIVE_SUBSTITUTES (the tracker runs torch's own function for inputs too small to store)
_DERIVATIVE_STAND_INS = frozenset(DERIVATIVE_SUBSTITUTES.values())


def activation_call(t: torch.Tensor) -> _ActivationCall | None:
    """The activation stand-in call on this thread whose save autograd is packing, if ``t`` is that save."""
    call = _DERIVATIVE_LOCAL.cell
    return call if call is not None and call.saved() is t else None


def _checkpoint_codes() -> frozenset:
    """The code objects that save a checkpoint's inputs: the reentrant CheckpointFunction.forward (and
    checkpoint() itself), and in torch 2.x the non-reentrant checkpoint's _NoopSaveInputs, whose
    setup_context saves the block's inputs with the outer hooks (gact's) before the checkpoint's own
    hooks take over; its recomputation reads them."""
    import inspect

    import torch.utils.checkpoint as cp
    # (torch 2.x wraps checkpoint() in a dynamo decorator: its own code is the wrapped function's)
    codes = [cp.checkpoint.__code__, inspect.unwrap(cp.checkpoint).__code__]
    gen = getattr(cp, "_checkpoint_without_reentrant_generator", None)  # torch 2.x: runs _NoopSaveInputs
    if gen is not None:
        codes.append(inspect.unwrap(gen).__code__)
    fwd = getattr(getattr(cp, "CheckpointFunction", None), "forward", None)
    if fwd is not None:
        codes.append(fwd.__code__)
    return frozenset(codes)


_CHECKPOINT_CODES = _checkpoint_codes()


#: how many frames above the pack hook the code that made autograd save can be (checkpoint(),
#: CheckpointFunction.forward, torch 2.x's _NoopSaveInputs.setup_context; AOTAutograd's compiled function)
_SAVER_DEPTH = 4


def _untracked_save(t: torch.Tensor) -> Decision:
    """How to store a tensor saved outside every function the tracker saw, in this order:

    - from the Python stack above the pack hook, walked once: a torch.utils.checkpoint saving its inputs
      (reentrant: they are read by the recomputation of its whole block, through every op in it, a ReLU's test
      among them): exact; a torch.compile'd graph saving at run time (AOTAutograd's compiled function: its saves
      are not the eager ops', fused, recomputed, and nothing tells which op reads them how; a log's input stored
      as values took the gradient's cosine to 0.78): exact, and counted as compiled;
    - a custom ``torch.autograd.Function``'s save (its ``ctx.save_for_backward``, told by track_function_saves):
      exact, unless the Function says its backward reads its saves linearly (a class attribute
      ``gact_saves = "values"``): gact cannot know what its backward does with them (a log-sum-exp read through
      exp, a ReLU's test);
    - otherwise exact too: an op the tracker does not see (a TorchScript module's or function's, a C++
      extension's), or autograd's engine thread saving for a backward with create_graph=True (where the tracker
      does not run). As values, a scripted ReLU MLP's 256-seed mean gradient was 15x what noise leaves at 2 bits."""
    f = sys._getframe(2)  # this <- decide <- the Compressor's pack hook <- (autograd) <- the saving Python code
    depth = 0
    while f is not None and depth < _SAVER_DEPTH:
        code = f.f_code
        if code in _CHECKPOINT_CODES:
            return _EXACT
        if "aot_autograd" in code.co_filename:  # (torch/_functorch/_aot_autograd/..., 2.0-2.1: .../aot_autograd.py)
            return EXACT_COMPILED  # (before the Function test: AOTAutograd's compiled function is one)
        f = f.f_back
        depth += 1
    cls = _saving_function(t)
    if cls is not None and getattr(cls, "gact_saves", None) == "values":
        return _VALUES
    return _EXACT


class _FunctionSaves(threading.local):
    ctx: Any = None  # a weak reference to the ctx whose save_for_backward ran last on this thread


_FUNCTION_SAVES = _FunctionSaves()
_torch_save_for_backward: Any = None
_track_lock = threading.Lock()


def track_function_saves() -> None:
    """Wrap ``FunctionCtx.save_for_backward`` (once) to remember, per thread, which custom autograd.Function saved
    last: autograd packs what it was given right after the Function's forward returns, outside every function the
    tracker sees (_saving_function)."""
    global _torch_save_for_backward
    fctx = getattr(getattr(torch.autograd, "function", None), "FunctionCtx", None)
    if _torch_save_for_backward is not None or fctx is None:
        return
    with _track_lock:
        if _torch_save_for_backward is not None:
            return
        orig = fctx.save_for_backward

        @functools.wraps(orig)
        def save_for_backward(self, *tensors):
            orig(self, *tensors)
            try:
                _FUNCTION_SAVES.ctx = weakref.ref(self)
            except TypeError:  # (a ctx without weak references: its saves are not told apart, and kept exact)
                _FUNCTION_SAVES.ctx = None

        fctx.save_for_backward = save_for_backward
        _torch_save_for_backward = orig


def _saving_function(t: torch.Tensor) -> Any:
    """The custom autograd.Function class whose ``ctx.save_for_backward`` was given ``t``, while autograd packs its
    saves (None: not such a save)."""
    r = _FUNCTION_SAVES.ctx
    ctx = r() if r is not None else None
    if ctx is None:
        return None
    saved = getattr(ctx, "to_save", None)  # (autograd clears it once the saves are packed)
    if not saved or not any(s is t for s in saved):
        return None
    return getattr(type(ctx), "_forward_cls", None)


#: a tensor a torch.compile'd graph saves (see decide): kept as it is
EXACT_COMPILED = Decision(EXACT)


def decide(t: torch.Tensor, frame: Frame | None) -> Decision:
    """How to store tensor `t` saved during `frame` (None: outside any function the tracker saw)."""
    if frame is None:
        return _untracked_save(t)
    if frame.wrapped:
        # (torch 2.x's vmap leaves saved-tensor hooks on; a divisor, a power's base or a grid went by as values: kept as
        # they are, as under torch 1.13's functorch.vmap, which turns the hooks off; a nested tensor's call, whose saves
        # are the dense buffers beneath its operands: kept as they are, as the nested tensors themselves are)
        return _EXACT
    name = frame.name
    row = TABLE.get(name)
    if row is None:
        # (an operator of another library, ns::op: a custom op, whose backward may read its saves through anything)
        return _EXACT if "::" in name else _VALUES
    args = frame.args
    if args and (name[-1] == "_" and name[-2] != "_" or name.startswith("__i")) and _original_of(t, args[0]):
        # an in-place call saves a clone of its operand as it was (pow_, div_, h **= 3): the rule reads it as the
        # operand (a base through a power, a dividend over a per-row divisor)
        args = (t, *args[1:])
    return row.rule(t, args, frame.kwargs, frame)


def _original_of(t: torch.Tensor, a: Any) -> bool:
    """Whether ``t`` is the clone an in-place call on ``a`` saves of ``a`` as it was: clone's node over a's edge, while
    the call runs (a's node is not moved to the call's yet), of a's shape and dtype."""
    if t is a or not isinstance(a, torch.Tensor):
        return False
    g = t.grad_fn
    if g is None or type(g).__name__ != "CloneBackward0" or t.shape != a.shape or t.dtype != a.dtype:
        return False
    nxt = g.next_functions
    return bool(nxt) and nxt[0][0] is not None and nxt[0][0] is a.grad_fn and nxt[0][1] == a.output_nr


#: how far back through another operand's graph correlated() looks for the saved tensor, and how many nodes it
#: visits at most (a hand-written RMSNorm's rsqrt(h.pow(2).mean(-1) + eps) reaches h in 4 steps)
CORRELATION_DEPTH = 6
CORRELATION_NODES = 64
#: results recorded in one step at most (correlated): a program that never calls step() does not grow the record
#: without end
RESULTS_MAX = 1 << 16


def _operands(frame: Frame) -> list:
    """The dense tensors a call was given (directly, or in a list or tuple argument: torch.cat's, einsum's); not a
    sparse one or a torch.func transform's wrapped one, which share no blob with a saved tensor."""
    ops = frame.operands
    if ops is not None:  # (the call's arguments, their layouts and wrappers do not change while it runs)
        return ops
    ops = frame.operands = [a for a in _tensor_args(frame) if _dense(a)]
    return ops


def _tensor_args(frame: Frame):
    """The tensors a call was given, directly or in a list or tuple argument."""
    for a in (*frame.args, *frame.kwargs.values()) if frame.kwargs else frame.args:
        if isinstance(a, torch.Tensor):
            yield a
        elif type(a) in (list, tuple):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _nested(a: torch.Tensor) -> bool:
    """Whether ``a`` is a nested tensor (not a Tensor subclass standing for a computation, SDPA's CausalBias, whose
    attributes raise NotImplementedError)."""
    try:
        return a.is_nested
    except NotImplementedError:
        return False


def _dense(a: torch.Tensor) -> bool:
    """Whether ``a`` is a dense tensor with memory: not sparse, not a transform's wrapped tensor, not a Tensor subclass
    standing for a computation (SDPA's CausalBias, whose attributes raise NotImplementedError)."""
    try:
        return a.layout is torch.strided and not _compat.is_functorch_wrapped(a)
    except NotImplementedError:
        return False


def _views(frame: Frame) -> tuple:
    """The call's operands by memory, for _view_of against each of them at once: ({(data pointer, element count,
    dtype): operands with it}, the operands that are no leaf (have a graph)). A tensor t is a whole view of an operand
    a, as _view_of says, where t is a or t's key is a's (the operands are all dense and unwrapped). A leaf that requires
    grad (a parameter, which stays a leaf) is not indexed: correlated() reads only the operands with a graph, and a
    layer's weight and bias would cost three reads each; _all_views has them."""
    v = frame.views
    if v is None:
        index: dict = {}
        ops = []
        for a in _operands(frame):
            if a.is_leaf:
                if a.requires_grad:
                    continue
            else:
                ops.append(a)
            index.setdefault(_memory_key(a), []).append(a)
        v = frame.views = (index, ops)
    return v


def _memory_key(a: torch.Tensor) -> tuple:
    """An operand's memory, as _views indexes it: (data pointer, element count, dtype)."""
    try:
        return (a.data_ptr(), a.numel(), a.dtype)
    except RuntimeError:  # (a subclass without storage: only itself is itself)
        return (id(a),)


def _all_views(frame: Frame) -> dict:
    """_views' index with the leaves that require grad too."""
    index = frame.all_views
    if index is None:
        index = {}
        for a in _operands(frame):
            index.setdefault(_memory_key(a), []).append(a)
        frame.all_views = index
    return index


_GROUPS = itertools.count(1)


def correlation_group(t: torch.Tensor, frame: Frame | None, results: dict | None = None) -> int:
    """The store's group for a save of ``t`` (put_params::group): the call's own (one per call, shared by its
    saves of the same memory) where correlated(), else 0 (the storage's common blobs). ``results``: the step's
    tensors stored as a call's own result or inner tensor (what this records, for correlated())."""
    if frame is not None and frame.name in _PRODUCTS_OF_READS and _given_twice(t, frame):
        # (its backward multiplies two of its reads, here of one memory: nn.Bilinear(h, h)'s weight gradient is a sum of
        # g·h_i·h_j, whose i == j terms read one rounding squared where both saves share a blob: 8 % of the weight's
        # gradient at 2 bits; with or without a graph for h, a frozen backbone's features or bl(h, h.detach()). Each save
        # gets a rounding of its own: a group of its own)
        return next(_GROUPS)
    if not correlated(t, frame, results):
        return 0
    if not frame.group:
        frame.group = next(_GROUPS)
    return frame.group


#: calls whose backward multiplies two of their saved operands with each other (not each with the gradient alone, as a
#: product's factors are read): given one memory twice, each save needs its own rounding
_PRODUCTS_OF_READS = frozenset({"bilinear", "_trilinear"})


def _given_twice(t: torch.Tensor, frame: Frame) -> bool:
    """Whether the call was given ``t``'s memory (t, or a whole view of it) as two of its operands."""
    if t.layout is torch.strided and not _compat.is_functorch_wrapped(t):
        return len(_all_views(frame).get((t.data_ptr(), t.numel(), t.dtype), ())) >= 2
    return sum(1 for a in _operands(frame) if a is t) >= 2


def _record(results: dict, t: torch.Tensor) -> None:
    if len(results) >= RESULTS_MAX:  # (a program that never ends a step: the record starts again)
        results.clear()
    try:
        r = weakref.ref(t)
    except TypeError:  # (a tensor that takes no weak reference: not recorded)
        return
    results[_result_key(t)] = r


def _recorded(results: dict, t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a recorded result that still lives (a dead one's address may hold another tensor
    now, of the same version and dtype)."""
    r = results.get(_result_key(t))
    return r is not None and r() is not None


def _result_key(t: torch.Tensor) -> tuple:
    """A recorded result's memory: its storage and version (a view of it, read later, is found by it too)."""
    return (t.data_ptr() - t.storage_offset() * t.element_size(), t._version, t.dtype)


def correlated(t: torch.Tensor, frame: Frame | None, results: dict | None = None) -> bool:
    """Whether the call saving ``t`` for its values was given another operand computed from ``t`` (or ``t``'s
    memory twice), element for element: ``p * log(p)``, ``p * p``, ``e / e.exp()``. Its backward multiplies this
    read of ``t`` with a gradient that flows back into ``t`` through the other operand, where another save of
    ``t`` (softmax's of its result) is read again: served by one blob, both reads are one rounding, and their
    product is biased by the rounding's variance (the entropy of a softmax over 256 classes: 1.6x the gradient's
    norm at 2 bits, not shrinking with seeds). Such a call's saves get blobs of their own (correlation_group),
    with their own rounding. An operand that reduces ``t`` (has fewer elements) counts when the
    reduction is signed (a DCN cross layer's x0 @ w), or through a sum of squares over fewer than NORM_FLOOR_BLOCK
    values (a hand-written RMSNorm's rsqrt(h.pow(2).mean(-1)) over a small width, a norm); over more its term is a
    negligible share of the sum, and the tensor's extra blob would cost every such layer bytes (_square_sum_shared;
    README, Known limits). Looks CORRELATION_DEPTH nodes back at most, CORRELATION_NODES nodes
    in all (a dependence further back keeps the shared blob).

    Across calls (``results``, the step's record): a call that reads ``t`` for ``t``'s own gradient (``y ** 2``,
    ``mse_loss(y, target)`` with either side trained, ``y.var()``, ``y.norm()``, ``cosine_similarity``; not a
    product's factor, a layer's input for its weight or a numerator, _CROSS_READS), where ``t`` was stored as
    another call's result that still lives (``exp``'s, ``softmax``'s, ``tanh``'s: their backward multiplies that
    gradient with their own read of it), would make the two reads one rounding (``mse_loss(exp(h), t)`` at 2 bits:
    14x what noise leaves in 1 024 seeds; an exp-parameterized Normal's ``log_prob``). Such a read gets its own.
    A save that is no operand of its call (its result, or a tensor made inside it) is recorded there."""
    if frame is None:
        return False
    if t.grad_fn is None:
        if not t.requires_grad:
            # an alias without a graph (p.detach()) of a live recorded result: that result's reads are its
            return _alias_of_a_result(t, frame, results)
        # a leaf (a policy's probe cuts a module's input with one): computed from nothing, but given twice, or read
        # by an operand through its AccumulateGrad node
        ops = _operands(frame)
        if sum(1 for a in ops if a is t) >= 2:
            return True
        others = [a for a in ops if a is not t and not a.is_leaf]
        return bool(others) and _reaches_to(others, leaf=t, reduced=[_square_sum_shared(a, t) for a in others])
    # (only operands with a graph, not leaves, can be computed from t: a linear layer's weight and bias cost a read
    # each; this runs for every stored save: the operands t is a whole view of are looked up by memory, _views)
    views, ops = _views(frame)
    if t.layout is torch.strided and not _compat.is_functorch_wrapped(t):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if not ops:
            if results is not None and key not in _all_views(frame):
                _record(results, t)  # (a result of operands that need no gradient: see below)
            return False
        same = views.get(key, ())
    else:  # (no memory to compare: only t itself is t)
        key, same = None, [a for a in _operands(frame) if a is t]
        if not ops:
            if results is not None and not same:
                _record(results, t)
            return False
    if same:
        same = [a for a in same if not a.is_leaf]  # (in the operands' order)
    if len(same) >= 2:
        return True  # the same memory twice (p * p)
    if len(ops) == 1 and same:
        # t is the call's one operand with a graph
        if results is not None and _in_place(frame) and _view_of(t, _arg(frame.args, frame.kwargs, 0, "input")):
            _record(results, t)  # (an in-place call's result, saved as the operand it overwrote: exp_)
            return False
        return _reads_a_result(t, frame, results)
    if not same:
        # (no operand is t: the call's result or a tensor it made inside; its inputs existed before it and cannot
        # be computed from it. Recorded: a later call reading it for its own gradient gets a blob of its own)
        if results is not None:
            _record(results, t)
        return False
    base = same[0]  # the operand t is (or a whole view of)
    others = [a for a in ops if a is not base and not any(a is b for b in views.get(key, ()))]
    return _read_with_its_own(t, base, others, frame, results)


def _read_with_its_own(t: torch.Tensor, base: torch.Tensor, others: list, frame: Frame, results: dict | None) -> bool:
    """correlated() once the operand ``t`` is (a whole view of), ``base``, and the call's other operands with a graph,
    ``others``, are known: whether one of them was computed from t, or the call reads a recorded result as t."""
    if others:
        # t's node, and the node of the tensor it is a whole view of (p.t() * log(p).t(): log read p, not p.t())
        # (and of its root when only a part of it: p[:, :32] * log(p[:, :32]) makes two slices of p, log reads the
        # other one; a part of one projection's output, q beside k, reaches the root too: a group, no bytes more
        # where nothing else saves that memory)
        root = base._base
        if root is not None and root.grad_fn is None:
            root = None
        # another output of the node that made t (unbind's, chunk's) is a sibling, not computed from t; the same
        # output is another view of t's memory
        targets = [(base.grad_fn, base.output_nr)] + ([(root.grad_fn, root.output_nr)] if root is not None else [])
        rest = []
        for a in others:
            sibling = False
            for g, nr in targets:
                if a.grad_fn is g:
                    if a.output_nr == nr:
                        return True
                    sibling = True
            if not sibling:
                rest.append(a)
        # (an operand that reduces t over at least NORM_FLOOR_BLOCK values: through a sum of squares, left shared)
        if rest and _reaches_to(rest, targets=[base] if root is None else [base, root],
                                reduced=[_square_sum_shared(a, t) for a in rest], chain_of=(base, root)):
            return True
    return _reads_a_result(t, frame, results)


#: calls that read a saved operand only for another operand's gradient (a product's factors, a layer's input for its
#: weight) or only for its shape (torch 1.13's mean and gather): a result read there is not read for its own gradient
_CROSS_READS = frozenset("""mul __mul__ __rmul__ __imul__ mul_ multiply matmul __matmul__ __rmatmul__ mm bmm linear addmm
    addmm_ baddbmm baddbmm_ addbmm addbmm_ addmv addmv_ mv dot vdot inner outer ger einsum tensordot kron chain_matmul
    multi_dot bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d addcmul addcmul_
    addcdiv addcdiv_ embedding embedding_bag mean gather take_along_dim index_select""".split())
#: a quotient reads its numerator only for the denominator's gradient
_DIVISIONS = frozenset("div div_ __truediv__ __itruediv__ true_divide divide __floordiv__".split())

#: the calls inverse_partner looks at
INVERTING_CALLS = _MULS | _DIVISIONS


def _square_sum_shared(a: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether a correlation of ``t`` through the operand ``a`` is left shared where it passes a sum of squares: ``a``
    has at most 1/NORM_FLOOR_BLOCK of t's elements, a reduction over so many values that each one's rounding squared
    is a negligible share of the sum (a hand-written RMSNorm's rsqrt(h.pow(2).mean(-1)) over a wide model's width).
    Over fewer (width 64 at depth 4, 2 bits: 3.7 % of the gradient's norm) such a call's saves get their own."""
    return a.numel() * NORM_FLOOR_BLOCK <= t.numel()


def _in_place(frame: Frame) -> bool:
    name = frame.name
    return name.endswith("_") and not name.endswith("__")


def _alias_of_a_result(t: torch.Tensor, frame: Frame, results: dict | None) -> bool:
    """Whether ``t``, without a graph, is an alias (``p.detach()``) of a live recorded result ``p`` that the call
    also reads through another operand: given with ``p``'s memory again (``p * p.detach()``), or with one computed
    from ``p`` (``p.detach() * log(p)``)."""
    if not results:
        return False
    r = results.get(_result_key(t))
    src = r() if r is not None else None
    if src is None or src.grad_fn is None:
        return False
    ops = [a for a in _operands(frame) if not a.is_leaf]
    if any(_view_of(t, a) or _result_key(a) == _result_key(t) for a in ops):
        return True
    return bool(ops) and _reaches_to(ops, targets=[src])


def _reads_a_result(t: torch.Tensor, frame: Frame, results: dict | None) -> bool:
    """Whether the call reads ``t`` for ``t``'s own gradient (not a product's factor, a layer's input for its weight,
    a numerator) where ``t``'s memory is a result the step recorded and that still lives (rule (2) of correlated)."""
    if not results or frame.name in _CROSS_READS:
        return False
    if frame.name in _DIVISIONS and _view_of(t, _arg(frame.args, frame.kwargs, 0, "input")):
        return False
    return _recorded(results, t)


#: a sum of squares (a norm, a variance, a mean of x²): a reduction through one of these carries each value's rounding
#: as one n-th of the sum (README, Known limits), and is left shared; a signed one (x0 @ w in a DCN cross layer, a
#: pooled gate) is not (the entry's own rounding squared stays about 1/√n of it: 4.5 % of the gradient over 256 values)
_SQUARE_SUMS = frozenset({"PowBackward0", "PowBackward1", "NormBackward0", "NormBackward1", "NormBackward2",
                          "NormBackward3", "LinalgVectorNormBackward0", "VarBackward0", "VarBackward1", "StdBackward0",
                          "StdBackward1", "VarMeanBackward0", "StdMeanBackward0"})
#: nodes whose result is at least 0 by construction, as a distance is (saved._distance_like): the squares and norms
#: above, a pairwise distance, a square root, an absolute value
_DISTANCE_NODES = _SQUARE_SUMS | {"CdistBackward0", "EuclideanDistBackward0", "SqrtBackward0", "AbsBackward0"}
#: the nodes that make differences, or distances of them (_reaches_difference)
_DIFFERENCE_NODES = frozenset({"SubBackward0", "SubBackward1", "RsubBackward0", "RsubBackward1", "CdistBackward0",
                               "EuclideanDistBackward0", "PdistBackward0"})
#: the nodes _reaches_difference passes on its way to a difference (a distance's own, products and joins of them)
_TO_A_DIFFERENCE = _DISTANCE_THROUGH | _DISTANCE_NODES | {"MulBackward0", "BmmBackward0", "StackBackward0", "CatBackward0"}


#: the fewest values a sum of squares adds per result for Compressor._exact_read's walk to stop at it (a norm, a
#: variance over a row of features); over fewer (a squared distance over x and y, a 3-D offset: DIoU's center term, a
#: keypoint's NLL, 0.2-1 of the gradient's norm at 8 bits divided by a small per-element divisor) the walk goes on to
#: the squares: their quantization groups span many such sums, and a small one takes the step of the largest
SQUARE_SUM_MIN_SPAN = 16


try:  # (torch_graph.cpp: a spectrum's magnitude, |S|, told by its abs node's complex input; None without it)
    from _gact_torch import graph_complex_magnitude as _graph_complex_magnitude
except ImportError:
    _graph_complex_magnitude = None

try:  # a tensor's version counter held without the tensor (bindings/python/torch_cpu.cpp)
    from _gact_torch import version_ref as _version_ref
except ImportError:
    _version_ref = None
try:  # (the walk in C++: bindings/python/torch_graph.cpp; absent where _gact_torch was built without autograd's headers)
    from _gact_torch import graph_configure as _graph_configure, graph_reaches as _graph_reaches
except ImportError:
    _graph_reaches = None
else:
    _graph_configure(set(VIEW_NODES), set(_SQUARE_SUMS))
    try:
        from _gact_torch import graph_configure_ancestors as _graph_configure_ancestors
    except ImportError:
        pass
    else:
        try:
            _graph_configure_ancestors(set(ELEMENTWISE_NODES), SQUARE_SUM_MIN_SPAN, set(PRODUCT_NODES))
        except TypeError:  # (a _gact_torch built before the products: its walks as they were)
            _graph_configure_ancestors(set(ELEMENTWISE_NODES), SQUARE_SUM_MIN_SPAN)


def _reaches_to(operands: list, targets: list = (), leaf: torch.Tensor | None = None, reduced: list | None = None,
                chain_of: tuple | None = None, native: bool | None = None) -> bool:
    """_reaches with what it looks for: an edge to a target tensor's (grad_fn, output_nr), or to the AccumulateGrad of
    ``leaf``; ``chain_of`` (base, root): the view nodes from base's grad_fn back to root's, which no walk passes (root
    None: none). Walked by _gact_torch.graph_reaches where it is built (``native`` False: in Python, as tests compare)."""
    if native is None:
        native = _graph_reaches is not None
    if native:
        base, root = chain_of if chain_of is not None else (None, None)
        return _graph_reaches([a._cdata for a in operands], [x._cdata for x in targets],
                              leaf._cdata if leaf is not None else 0, reduced or [],
                              base._cdata if root is not None else 0, root._cdata if root is not None else 0,
                              CORRELATION_DEPTH, CORRELATION_NODES)
    hits = [(x.grad_fn, x.output_nr) for x in targets]
    hits = [(g, nr) for g, nr in hits if g is not None]
    if leaf is not None:
        hit = lambda fn, i: any(fn is g and i == nr for g, nr in hits) or getattr(fn, "variable", None) is leaf  # noqa: E731
    else:
        hit = lambda fn, i: any(fn is g and i == nr for g, nr in hits)  # noqa: E731
    chain: set = set()  # the view nodes between base and its root: a walk does not pass them (q beside k)
    held = []  # (their Python objects, held: a freed one's id could be another node's)
    if chain_of is not None and chain_of[1] is not None:
        base, root = chain_of
        g = base.grad_fn
        for _ in range(8):
            if g is None or g is root.grad_fn or type(g).__name__ not in VIEW_NODES:
                break
            chain.add(id(g))
            held.append(g)
            nxt = g.next_functions
            g = nxt[0][0] if nxt else None
    return _reaches(operands, hit, reduced, chain)


def _reaches(operands: list, hit: Callable[[Any, int], bool], reduced: list | None = None,
             stop: set | None = None) -> bool:
    """Whether a node that ``hit(node, input_nr)`` accepts is among the inputs of the graphs of ``operands``,
    CORRELATION_DEPTH nodes back at most and CORRELATION_NODES nodes in all; for an operand whose ``reduced`` entry
    is set (a reduction of the saved tensor), not through a sum of squares (_SQUARE_SUMS); never through a node
    whose id is in ``stop``."""
    seen: dict = {}  # id -> node (held: a node's Python object can be made anew and take a freed one's id)
    for j, a in enumerate(operands):
        barrier = reduced is not None and reduced[j]
        frontier = [a.grad_fn]
        for _ in range(CORRELATION_DEPTH):
            nxt = []
            for node in frontier:
                if (barrier and type(node).__name__ in _SQUARE_SUMS) or (stop and id(node) in stop):
                    continue
                for fn, i in node.next_functions:
                    if fn is None:
                        continue
                    if hit(fn, i):
                        return True
                    k = (barrier, id(fn))  # (a node left unexpanded behind a barrier is expanded for another operand)
                    if k not in seen:
                        seen[k] = fn
                        nxt.append(fn)
                if len(seen) > CORRELATION_NODES:
                    return False
            if not nxt:
                break
            frontier = nxt
    return False
