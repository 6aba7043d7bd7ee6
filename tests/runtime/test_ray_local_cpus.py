"""A local cluster started for a run gives its groups CPU slots beyond the cores, within a bound."""

import os

import pytest

from twinkle.runtime import ray_cluster


class FakeRay:
    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(kwargs)


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_local_slots_cover_the_ranks_up_to_twice_the_cores(monkeypatch, cores):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert ray_cluster.local_cpus(cores) is None  # enough cores: Ray counts them itself
    assert ray_cluster.local_cpus(cores + 1) == cores + 1
    assert ray_cluster.local_cpus(ray_cluster.OVERSUBSCRIBE * cores) == ray_cluster.OVERSUBSCRIBE * cores
    assert ray_cluster.local_cpus(ray_cluster.OVERSUBSCRIBE * cores + 1) is None  # refused by the fit check


def test_connect_starts_a_local_cluster_of_the_slots_and_joins_an_address_as_it_is(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = FakeRay()
    assert ray_cluster.connect(ray, None, 3) is True
    assert ray.calls[-1]["num_cpus"] == 3
    assert ray_cluster.connect(ray, None, None) is True
    assert "num_cpus" not in ray.calls[-1]
    monkeypatch.setattr(ray_cluster, "check_address", lambda address: None)
    assert ray_cluster.connect(ray, "127.0.0.1:1", 3) is False  # a cluster's own size is its own
    assert "num_cpus" not in ray.calls[-1]
