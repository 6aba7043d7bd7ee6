"""``TurnCache``: longest-prefix matches, the byte budget, and emptying on other weights."""

import torch

from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler
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
    lm.weight.data.add_(1.0)  # written past the update counter, as some optimizers write: the sum moves
    cache.check_owner("a", weights_version(lm))
    assert not cache.entries
    cache.put(range(20), *kv(20))
    cache.check_owner("b", weights_version(lm))
    assert not cache.entries


PARAMS = SamplingParams(max_tokens=6, seed=1, logprobs=3, num_samples=2)


def _second_turn(first, responses):
    """Each first prompt continued by its first reply and an observation, and a new prompt."""
    rows = [
        {"input_ids": p["input_ids"] + list(r.sequences[0].tokens) + [7, 8, 9]}
        for p, r in zip(first, responses, strict=True)
    ]
    return rows + [{"input_ids": list(range(100, 130))}]


def test_a_second_turn_runs_only_its_new_tokens_and_samples_what_a_fresh_sampler_samples(tiny_model_dir):
    """The kept rows' keys and values were made in another batch layout (pads, a shared prefix);
    attention over them sums in another order, so log-probs agree within fp32 rounding of the
    2-layer model (1e-5), and the seeded draws are the same."""
    kept = TorchSampler(str(tiny_model_dir))
    fresh = TorchSampler(str(tiny_model_dir), engine_args={"enable_prefix_caching": False})
    assert fresh.turns is None
    first = [{"input_ids": list(range(5, 40))}, {"input_ids": list(range(50, 70))}]
    responses = kept.sample(first, PARAMS)
    assert len(kept.turns.entries) == 4  # two prompts x two samples, each kept when it stopped
    second = _second_turn(first, responses)
    got, want = kept.sample(second, PARAMS), fresh.sample(second, PARAMS)
    # each continued prompt reuses its prompt and reply but the reply's last token (never run)
    assert kept.turns.reused_tokens == (35 + 5) + (20 + 5)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert x.tokens == y.tokens
            torch.testing.assert_close(
                torch.tensor([e[0][1] for e in x.logprobs]),
                torch.tensor([e[0][1] for e in y.logprobs]),
                rtol=0,
                atol=1e-5,
            )
    kept.reset_prefix_cache()
    assert not kept.turns.entries


def test_changed_weights_are_never_continued(tiny_model_dir):
    sampler = TorchSampler(str(tiny_model_dir))
    first = [{"input_ids": list(range(5, 40))}]
    responses = sampler.sample(first, PARAMS)
    with torch.no_grad():
        next(sampler.lm.parameters()).mul_(1.5)
    sampler.sample(_second_turn(first, responses), PARAMS)
    assert sampler.turns.reused_tokens == 0
