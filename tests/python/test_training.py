"""End-to-end training with and without compression: fp32 against 8, 4 and 2 bits.

Three model families, each trained from the same seeds (initial weights, batch order
and gact's noise all follow the seed, so each compressed run is paired with the fp32
run of the same seed and the difference isolates the effect of compression):

* a small CNN on scikit-learn's bundled digits (898 train / 899 test): test accuracy;
* a 2-layer GCN on a networkx stochastic-block-model graph (600 nodes, 4 blocks, 80
  labelled): accuracy on the 520 unlabelled nodes;
* a character-level transformer LM on the licence texts of Debian's base-files
  package: held-out loss in nats per character.

Each prints mean ± std over the seeds and the paired difference to fp32. Tolerances
are the issue's aims (accuracy within 0.5 points at 8 and 4 bits, 1 point at 2 bits);
the measured differences, in the comments, sit inside them. The LM runs one seed here
to keep the suite affordable; `gact-bench train --accuracy` runs all three.
"""

import functools

import pytest

import evalkit as k

SEEDS = (0, 1, 2)

# |mean paired difference| to fp32, in accuracy points (percent) or nats per character.
TOLERANCE = {
    # digits, 6 epochs, 3 seeds, measured with gact on 2026-12-02: fp32 98.29 ± 0.36 %, paired Δ
    # 8-bit +0.07 ± 0.13, 4-bit 0.00 ± 0.00, 2-bit 0.00 ± 0.22 points. (Before ReLU outputs were
    # kept as exact masks, 2 bits lost 1.52 ± 1.58 points: rounding small positive outputs to 0
    # dropped their gradients.)
    "digits": {8: 0.5, 4: 0.5, 2: 1.0},
    # GCN, 3 seeds (fp32 99.23 ± 0.19 %), measured with gact: 8-bit 0.00, 4-bit -0.06, 2-bit -0.19.
    "gcn": {8: 0.5, 4: 0.5, 2: 1.0},
    # char LM, 1 seed, measured with gact on 2026-12-02: fp32 2.373 nats/char, Δ 8-bit +0.001,
    # 4-bit +0.005, 2-bit +0.018 (log-probabilities kept at >= 4 bits; at 2 bits they cost
    # +0.377). Allowed: about 1 % and 2 % of the loss.
    "charlm": {8: 0.025, 4: 0.025, 2: 0.05},
}


def _report(name, unit, results):
    base = results[None]
    print(f"\n{name}: fp32 {k.mean_std(base)[0]:.3f} ± {k.mean_std(base)[1]:.3f} {unit}")
    for bits in (8, 4, 2):
        r = results[bits]
        deltas = [a - b for a, b in zip(r, base)]
        m, s = k.mean_std(r)
        dm, ds = k.mean_std(deltas)
        print(f"  {bits}-bit: {m:.3f} ± {s:.3f} {unit}, paired Δ {dm:+.3f} ± {ds:.3f}")


def _check(name, results, bits_list=(8, 4, 2)):
    base = results[None]
    for bits in bits_list:
        deltas = [a - b for a, b in zip(results[bits], base)]
        dm = sum(deltas) / len(deltas)
        assert abs(dm) <= TOLERANCE[name][bits], (
            f"{name} {bits}-bit: mean difference to fp32 {dm:+.3f} exceeds ±{TOLERANCE[name][bits]}")


@functools.lru_cache(maxsize=1)
def _digits_results():
    data = k.digits()
    results = {bits: [k.train_digits(bits, s, epochs=6, data=data) for s in SEEDS] for bits in (None, 8, 4, 2)}
    _report("digits CNN", "% accuracy", results)
    return results


def test_digits_cnn_accuracy():
    results = _digits_results()
    assert k.mean_std(results[None])[0] > 95.0, "the fp32 baseline did not learn: the comparison is void"
    _check("digits", results)


def test_gcn_sbm_accuracy():
    graph = k.sbm_graph()
    results = {bits: [k.train_gcn(bits, s, graph=graph) for s in SEEDS] for bits in (None, 8, 4, 2)}
    _report("GCN on SBM", "% accuracy", results)
    assert k.mean_std(results[None])[0] > 90.0, "the fp32 baseline did not learn: the comparison is void"
    _check("gcn", results)


@functools.lru_cache(maxsize=1)
def _charlm_results():
    corpus = k.text_corpus()
    results = {bits: [k.train_charlm(bits, 0, corpus=corpus)] for bits in (None, 8, 4, 2)}
    _report("char LM", "nats/char", results)
    return results


def test_char_lm_loss():
    results = _charlm_results()
    # A uniform guess over bytes is ln 256 = 5.55 nats; unigram statistics alone give ~3.
    assert results[None][0] < 3.0, "the fp32 baseline did not learn: the comparison is void"
    _check("charlm", {b: v for b, v in results.items() if b != 2}, bits_list=(8, 4))


def test_char_lm_loss_2bit():
    # 2 bits missed the aim by far (+0.377 nats/char) while cross-entropy's log-probabilities
    # were stored at 2 bits: their backward exponentiates them (see gact/compressor.py).
    _check("charlm", _charlm_results(), bits_list=(2,))
