"""The teacher's scoring forward (``twinkle.model.scoring_topk``) gives what a plain computation
gives: each row alone through the model in float64, ``log_softmax``, ``topk``. The rows share
prefixes and differ in length, so the packed forward leaves out padding, tails and the repeated
prefixes, and the checks see that it did. Tolerances: ``scoring_reference``."""

import functools

import pytest
import torch
from scoring_reference import assert_topk_matches, reference_logps, sharp_llama, token_rows
from torch import nn

from twinkle.loss.gkd import INDICES, LOGPS
from twinkle.model import scoring_topk
from twinkle.model.scoring_topk import topk_at_targets
from twinkle.model.teacher import padded, teacher_topk

K = 8


@pytest.fixture(scope="module")
def lm():
    return sharp_llama()


def _reference(lm, rows):
    """The float64 log-probabilities at each supervised position, in row-major order."""
    refs = []
    for row in rows:
        logps = reference_logps(lm, row["input_ids"])
        scored = torch.tensor(row["labels"][1:]) != -100
        refs.append(logps[:-1][scored])
    return torch.cat(refs)


def _spy_pack(monkeypatch):
    """Record what ``pack`` laid out (None where it declined)."""
    laid, pack = [], scoring_topk.pack

    def spy(batch, share_prefix=True):
        out = pack(batch, share_prefix)
        laid.append(None if out is None else out["input_ids"].shape[1])
        return out

    monkeypatch.setattr(scoring_topk, "pack", spy)
    return laid


def test_teacher_topk_equals_each_row_alone_in_float64(lm, monkeypatch):
    rows = token_rows()
    laid = _spy_pack(monkeypatch)
    out = teacher_topk(lm, rows, K)
    ids, _, targets = padded(rows, 0)
    where = targets != -100
    assert out[LOGPS].shape == (*ids.shape, K) and out[INDICES].shape == (*ids.shape, K)
    assert_topk_matches(out[LOGPS][where], out[INDICES][where], _reference(lm, rows))
    assert not out[LOGPS][~where].any() and not out[INDICES][~where].any()
    # packed: each row up to its last scored position, the 6-token prefix all four share once
    # (which leaves out more than the middle two's 10-token prompt held once for them alone)
    kept = [len(row["input_ids"]) - 1 for row in rows]
    assert laid == [sum(kept) - 3 * 6]
    assert not out[LOGPS].requires_grad and not torch.is_inference(out[LOGPS])


def test_a_scored_shared_prefix_runs_its_head_once_and_reaches_every_row(lm, monkeypatch):
    rows = token_rows(seed=1)
    length = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])], mask[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"]), 1
    labels = ids.masked_fill(mask == 0, -100)  # every position scored, the shared prefixes too
    heads = []
    head_topk = scoring_topk.head_topk
    monkeypatch.setattr(
        scoring_topk, "head_topk", lambda hidden, *a: heads.append(len(hidden)) or head_topk(hidden, *a)
    )
    scores = topk_at_targets(lm, {"input_ids": ids, "attention_mask": mask, "labels": labels}, K)
    ref = torch.cat([reference_logps(lm, row["input_ids"])[:-1] for row in rows])
    assert_topk_matches(scores.values, scores.indices, ref)
    targets = torch.cat([torch.tensor(row["input_ids"][1:]) for row in rows])
    torch.testing.assert_close(
        scores.chosen.double(), ref.gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=0
    )
    # the head ran once on the 5 positions all rows share with their targets (the 6th predicts
    # each row's own next token)
    assert heads == [len(ref) - 3 * 5]


def test_head_blocks_and_the_padded_path_give_the_same_scores(lm, monkeypatch):
    rows = token_rows(seed=2)
    ref = _reference(lm, rows)
    _, _, targets = padded(rows, 0)
    where = targets != -100
    monkeypatch.setattr(scoring_topk, "BLOCK_BYTES", 4 * 97 * 5)  # 5 positions a block
    blocks = teacher_topk(lm, rows, K)
    assert_topk_matches(blocks[LOGPS][where], blocks[INDICES][where], ref)
    monkeypatch.setattr(scoring_topk, "can_pack", lambda lm: False)  # a family packing does not serve
    laid = _spy_pack(monkeypatch)
    unpacked = teacher_topk(lm, rows, K)
    assert laid == []
    assert_topk_matches(unpacked[LOGPS][where], unpacked[INDICES][where], ref)


def test_the_model_is_left_as_it_was(lm):
    layer = lm.model.layers[0].mlp.up_proj
    own = functools.partial(nn.Linear.forward, layer)
    layer.forward = own  # a layer that runs a forward of its own (a sampler's routed copy)
    lm.train()
    try:
        teacher_topk(lm, token_rows(), K)
        assert lm.training
        assert layer.__dict__["forward"] is own
        others = [m for m in lm.modules() if isinstance(m, nn.Linear) and m is not layer]
        assert not any("forward" in m.__dict__ for m in others)
    finally:
        del layer.forward
        lm.eval()


def test_rows_without_a_supervised_token_score_nothing(lm):
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}]
    out = teacher_topk(lm, rows, K)
    assert out[LOGPS].shape == (1, 3, K) and not out[LOGPS].any()
