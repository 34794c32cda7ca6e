"""gact-bench quality (tools/bench/quality.py): the arms train, and the verdict follows the paired differences."""
from __future__ import annotations

import math

import pytest
import torch

from evalkit import load_bench

pytest.importorskip("sklearn")


def test_the_quality_bench_trains_every_arm_on_the_digits():
    q = load_bench("quality")
    torch.set_num_threads(1)
    r = q.run_model("digits", 2.0, seeds=2, epochs=1)
    assert set(r["arms"]) == {"fp32", "uniform2", "auto2"}
    for arm, rows in r["arms"].items():
        assert len(rows) == 2 and all(math.isfinite(x["test_loss"]) and x["test_loss"] < math.log(10) for x in rows)
        assert ("store_ratio" in rows[0]) == (arm != "fp32")
    diffs = [a["test_loss"] - u["test_loss"] for a, u in zip(r["arms"]["auto2"], r["arms"]["uniform2"])]
    assert r["auto_minus_uniform"] == pytest.approx(sum(diffs) / 2)
    assert r["auto_minus_uniform"] == pytest.approx(r["mean_test_loss"]["auto2"] - r["mean_test_loss"]["uniform2"])


def test_the_quality_verdict_weighs_the_difference_against_its_seed_noise():
    q = load_bench("quality")
    # paired differences 0.10, 0.12, 0.08: mean 0.10, SE 0.0115; far past 2 SE: worse
    assert q.verdict([1.10, 1.12, 1.08], [1.0, 1.0, 1.0]) == (pytest.approx(0.10), pytest.approx(0.02 / math.sqrt(3)),
                                                               False)
    # differences 0.05, -0.05, 0.03: mean 0.01 within 2 SE (0.0611): no worse
    assert q.verdict([1.05, 0.95, 1.03], [1.0, 1.0, 1.0])[2] is True
    # lower everywhere: no worse; one seed: a bare comparison
    assert q.verdict([0.9, 0.8], [1.0, 1.0])[2] is True
    assert q.verdict([1.01], [1.0]) == (pytest.approx(0.01), 0.0, False)
    assert q.verdict([1.0], [1.0])[2] is True
