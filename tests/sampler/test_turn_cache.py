"""``TurnCache``: longest-prefix matches, the byte budget, and emptying on other weights."""

import torch

from twinkle.sampler.turn_cache import MIN_REUSE, TurnCache, weights_version


def kv(length, layers=2):
    return [torch.randn(2, length, 4) for _ in range(layers)], [
        torch.randn(2, length, 4) for _ in range(layers)
    ]


def test_the_longest_common_prefix_wins_and_the_last_prompt_token_is_left_to_run():
    cache = TurnCache()
    short, long_ = list(range(20)), list(range(30))
    cache.put(short, *kv(20))
    cache.put(long_ + [99], *kv(31))
    n, kept = cache.match(long_ + [7, 8])
    assert n == 30 and kept.tokens[:30] == tuple(long_)
    n, kept = cache.match(list(range(25)))  # a prompt inside a kept row: all but its last token
    assert n == 24
    assert cache.match(list(range(MIN_REUSE - 1)) + [500]) == (0, None)  # too short to be worth it
    assert cache.match([1000] + long_) == (0, None)


def test_the_budget_drops_the_oldest_rows():
    keys, values = kv(10)
    one = sum(t.numel() * t.element_size() for t in (*keys, *values))
    cache = TurnCache(budget_bytes=2 * one)
    for start in (0, 100, 200):
        cache.put(range(start, start + 10), *kv(10))
    assert cache.bytes == 2 * one and len(cache.entries) == 2
    assert cache.match(list(range(10)) + [5]) == (0, None)  # the oldest went
    assert cache.match(list(range(200, 210)) + [5])[0] == 10


def test_other_weights_or_another_adapter_empty_it():
    lm = torch.nn.Linear(3, 3)
    cache = TurnCache()
    cache.check_owner("a", weights_version(lm))
    cache.put(range(20), *kv(20))
    cache.check_owner("a", weights_version(lm))
    assert len(cache.entries) == 1
    with torch.no_grad():
        lm.weight.add_(1.0)  # an optimizer step updates in place
    cache.check_owner("a", weights_version(lm))
    assert not cache.entries and cache.bytes == 0
    cache.put(range(20), *kv(20))
    cache.check_owner("b", weights_version(lm))
    assert not cache.entries
