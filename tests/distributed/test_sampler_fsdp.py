"""A sampler sharing a trainer sharded by FSDP2 over 2 gloo ranks: each rank samples its own share
of prompts (shares that generate for different numbers of steps, one empty) without a hang, and
gets the tokens and log-probabilities one process gets for the same prompts and seed; each
rank's log-probabilities equal its ``forward_only``'s (1e-4)."""

import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
]  # a 2-process run: with the other multi-process suites in `-m cluster` (CI runs both)

WORKER = Path(__file__).with_name("sampler_worker.py")


def test_each_fsdp_rank_samples_its_share_in_lockstep(tiny_model_dir, tmp_path, launcher):
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"x{nproc}"
        out.mkdir()
        args = ["--model-id", str(tiny_model_dir), "--out", str(out)]
        if nproc > 1:
            args += ["--fsdp-size", str(nproc)]
        job = launcher.run(WORKER, args, nproc=nproc, timeout_s=120)
        assert job.returncode == 0, job.output[-6000:]
        shares = {}
        for rank in range(nproc):
            shares.update(json.loads((out / f"rank-{rank}.json").read_text()))
        results[nproc] = shares
    one, sharded = results[1], results[2]
    assert sorted(sharded) == sorted(one) == ["0.0", "0.1", "1.0", "1.1"]
    assert [len(t) for t in one["0.0"]["tokens"]] == [8, 8]  # two samples per prompt
    assert [len(t) for t in one["0.1"]["tokens"][:2]] == [3, 3] and one["0.1"]["reasons"][:2] == [
        "length"
    ] * 2
    assert one["1.1"]["tokens"] == []
    for share in one:
        assert sharded[share]["tokens"] == one[share]["tokens"]
        for a, b in zip(sharded[share]["logprobs"], one[share]["logprobs"], strict=True):
            assert max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) < 1e-4
        assert sharded[share]["gap"] < 1e-4 and one[share]["gap"] < 1e-4
