import math

import pytest

from twinkle.metric import TokenMetrics


def test_a_window_is_the_token_weighted_mean_and_starts_again_after_compute():
    metrics = TokenMetrics()
    metrics.start_batch()
    metrics.update(loss_sum=6.0, tokens=3, correct=2, input_tokens=10, samples=2)
    metrics.update(loss_sum=2.0, tokens=1, correct=1, input_tokens=5, samples=1)
    out = metrics.compute()
    assert out["loss"] == pytest.approx(8.0 / 4)  # over tokens, not the mean of the two batch means
    assert out["accuracy"] == pytest.approx(3 / 4)
    assert (out["supervised_tokens"], out["tokens"], out["samples"]) == (4, 15, 3)
    assert out["tokens_per_second"] > 0
    again = metrics.compute()
    assert again["tokens"] == 0 and math.isnan(again["loss"])


def test_the_clock_starts_at_the_first_batch(monkeypatch):
    clock = iter([100.0, 104.0])
    monkeypatch.setattr("twinkle.metric.token_metrics.time.perf_counter", lambda: next(clock))
    metrics = TokenMetrics()
    metrics.start_batch()  # 100.0
    metrics.start_batch()  # a second batch does not restart it
    metrics.update(loss_sum=1.0, tokens=1, correct=0, input_tokens=40, samples=1)
    assert metrics.compute()["tokens_per_second"] == pytest.approx(40 / 4.0)  # read at 104.0
