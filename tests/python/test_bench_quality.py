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
    assert r["auto_no_worse"] == (r["mean_test_loss"]["auto2"] <= r["mean_test_loss"]["uniform2"]
                                  + 2 * r["se_of_difference"])
