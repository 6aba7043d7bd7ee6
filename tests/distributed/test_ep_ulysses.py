"""Ulysses sequence parallelism together with expert parallelism: on 2 gloo ranks
(``ulysses_size=2, ep_size=2`` over 2 FSDP2 shards) a tiny Qwen3-MoE (2 layers of 8 experts,
top-2) trains as one process does.

Both ranks read the same 4 chat samples, packed into one row of 217 positions; each runs its
half of them (a sample straddles the boundary) through the layers. Attention all-to-alls heads
for positions within the Ulysses group; each MoE layer routes the rank's own positions and
sends each (token, expert) pair to the rank holding that expert (here the same two ranks: rank r
holds experts 4r..4r+3). ``ep_worker.py`` runs 3 LoRA steps, LoRA on the attention and on the
experts (``target_parameters``); the per-step losses, gradient norms and an evaluation pass's
logps agree within ``run_loss_rtol``, the saved adapters within ``adamw_weight_atol``, and each
rank holds exactly its own 4 of the 8 experts.

The checkpoint asks for the router's auxiliary loss (``output_router_logits``,
``router_aux_loss_coef`` 0.5), which the step adds (``twinkle.model.router_aux``): each rank's
routers see its own positions and the Ulysses group totals the loss's per-expert sums, so the
runs stay equal with it."""

import json
import sys
from itertools import accumulate
from pathlib import Path

import pytest
from ep_runs import assert_ep_equals_one_process, run_ep_worker

from twinkle import DeviceMesh

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))  # the tiny MoE builders
from tiny_moe import EXPERTS, build_qwen3_moe  # noqa: E402

STEPS, LR = 3, 1e-2  # as ep_worker.py runs them


def _with_aux_loss(model_dir: Path) -> Path:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=0.5)
    path.write_text(json.dumps(config))
    return model_dir


def test_the_mesh_gives_each_rank_a_ulysses_and_an_expert_place():
    mesh = DeviceMesh.from_sizes(world_size=2, fsdp_size=2, ulysses_size=2, ep_size=2)
    assert mesh.data_world_size == 1  # both ranks read the same rows
    for rank in range(2):
        where = mesh.rank_coordinates(rank)
        # Ulysses rank r runs the r-th half of the positions; expert rank r holds the r-th block
        assert (where["ulysses"], where["ep"], where["data"]) == (rank, rank, 0)
    # 4 ranks: Ulysses pairs (0, 1) and (2, 3) on two data streams, blocks on (0, 1) and (2, 3),
    # so a Ulysses pair holds one block and exchanges tokens with the other pair
    mesh = DeviceMesh.from_sizes(world_size=4, fsdp_size=4, ulysses_size=2, ep_size=2)
    places = [mesh.rank_coordinates(r) for r in range(4)]
    assert [(p["ulysses"], p["ep"], p["data"]) for p in places] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 1),
        (1, 1, 1),
    ]


@pytest.mark.slow
@pytest.mark.cluster  # 2-process runs, with the other `-m cluster` suites
def test_ulysses_with_expert_parallelism_equals_one_process(tiny_model_dir, tmp_path, launcher):
    model_dir = _with_aux_loss(build_qwen3_moe(tiny_model_dir, tmp_path / "qwen3_moe"))
    one = run_ep_worker(launcher, model_dir, tmp_path / "one", 1, STEPS)
    two = run_ep_worker(launcher, model_dir, tmp_path / "two", 2, STEPS, ("--ulysses-size", "2"))
    lengths = one["lengths"]
    share = -(-sum(lengths) // 2)
    assert max(lengths) < share < sum(lengths)  # each rank runs half of the packed row
    ends = list(accumulate(lengths))
    assert any(end - n < share < end for end, n in zip(ends, lengths, strict=True))  # a sample straddles
    assert len(two["logps"]) == len(lengths)  # every row, gathered from both halves
    assert_ep_equals_one_process(
        one, two, "ulysses 2", LR, STEPS, EXPERTS, (0, 1), tmp_path / "one", tmp_path / "two"
    )
