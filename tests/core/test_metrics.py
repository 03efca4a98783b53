"""The metrics type: ratios, totals and gauges, merged across micro-batches, ranks and mini-batches."""

from __future__ import annotations

import pickle

from loongsage.core.metrics import Metrics


def test_ratios_and_totals_add_up_and_gauges_keep_the_latest():
    rank0 = Metrics().add("train/clipfrac", 1.0, 4.0).total("train/loss", 0.25).gauge("train/grad_norm", 2.0)
    rank1 = Metrics().add("train/clipfrac", 3.0, 4.0).total("train/loss", 0.5)
    step = Metrics().merge(rank0).merge(rank1)
    assert step.ratios == {"train/clipfrac": (4.0, 8.0)}
    assert step.means() == {"train/clipfrac": 0.5, "train/loss": 0.75, "train/grad_norm": 2.0}
    step.merge(Metrics().gauge("train/grad_norm", 3.0))  # the next mini-batch's optimizer step
    assert step.means()["train/grad_norm"] == 3.0


def test_a_ratio_with_nothing_measured_is_not_reported():
    m = Metrics().add("train/is_approx_k3_kl", 0.0, 0.0).add("train/kl", 1.0, 2.0)
    assert m.means() == {"train/kl": 0.5}


def test_without_gauges_and_renamed():
    m = Metrics().add("train/x", 1.0, 2.0).total("train/loss", 1.0).gauge("train/lr", 1e-4)
    assert m.without_gauges().means() == {"train/x": 0.5, "train/loss": 1.0}
    critic = m.renamed("train/", "critic/")
    assert critic.means() == {"critic/x": 0.5, "critic/loss": 1.0, "critic/lr": 1e-4}
    assert m.means()["train/loss"] == 1.0  # the original is left alone
    assert pickle.loads(pickle.dumps(m)) == m  # what crosses a Ray call
