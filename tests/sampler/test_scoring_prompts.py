"""``prompt_logprobs``: a call's prompts scored together (one packed forward, a shared prefix
once) equal each prompt scored alone in float64, and a sampler's own routed copy keeps its
decoding products. Tolerances: ``scoring_reference``."""

import pytest
import torch
from scoring_reference import ATOL, assert_topk_matches, reference_logps, sharp_llama, token_rows

from twinkle.sampler import scoring
from twinkle.sampler.scoring import score_prompt, score_prompts


@pytest.fixture(scope="module")
def lm():
    return sharp_llama(seed=3)


def _check(lm, prompts, scores, k):
    for ids, (chosen, top) in zip(prompts, scores, strict=True):
        assert len(chosen) == len(top) == len(ids) and chosen[0] is None and top[0] is None
        if len(ids) == 1:
            continue
        ref = reference_logps(lm, ids)[:-1]
        want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(chosen[1:], dtype=torch.float64), want, atol=ATOL, rtol=0)
        if k:
            indices = torch.tensor([[i for i, _ in pos] for pos in top[1:]])
            values = torch.tensor([[v for _, v in pos] for pos in top[1:]])
            assert_topk_matches(values, indices, ref)
        else:
            assert all(pos == [] for pos in top[1:])


@pytest.mark.parametrize("k", [0, 6])
def test_prompts_scored_together_equal_each_alone_in_float64(lm, k, monkeypatch):
    calls, together = [], scoring.topk_at_targets
    monkeypatch.setattr(scoring, "topk_at_targets", lambda *a: calls.append(1) or together(*a))
    prompts = [row["input_ids"] for row in token_rows(seed=4)] + [[7]]
    _check(lm, prompts, score_prompts(lm, prompts, k), k)
    assert calls == [1]  # one forward for the four prompts of more than one token


def test_top_k_past_the_vocabulary_gives_the_whole_vocabulary(lm):
    prompts = [row["input_ids"] for row in token_rows(seed=5)[:2]]
    together = score_prompts(lm, prompts, 10_000)
    alone = [score_prompt(lm, ids, 10_000) for ids in prompts]
    for (chosen, top), (chosen_alone, top_alone) in zip(together, alone, strict=True):
        assert all(len(pos) == lm.config.vocab_size for pos in top[1:])
        assert chosen == pytest.approx(chosen_alone, abs=ATOL)
        for pos, pos_alone in zip(top[1:], top_alone[1:], strict=True):
            assert dict(pos) == pytest.approx(dict(pos_alone), abs=ATOL)


def test_a_samplers_own_copy_keeps_its_routed_linears(tiny_model_dir):
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    sampler = TorchSampler(str(tiny_model_dir))
    routed = {
        name: m.__dict__.get("forward") for name, m in sampler.lm.named_modules() if hasattr(m, "weight")
    }
    routed = {name: f for name, f in routed.items() if f is not None}
    assert routed  # the copy's linear layers run the decoding products
    rows = [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [1, 2, 3, 9]}]
    out = sampler.sample(rows, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert [len(r.prompt_logprobs) for r in out] == [6, 4]
    after = {name: sampler.lm.get_submodule(name).__dict__.get("forward") for name in routed}
    assert all(after[name] is f for name, f in routed.items())
