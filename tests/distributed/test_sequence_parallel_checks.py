"""What Ulysses sequence parallelism refuses, in one line each, without starting any process:
heads the size does not divide, hybrid linear-attention families, families outside the ones it
runs, losses that are not a sum over tokens, a ``--ulysses-size`` the mesh left out. And the
mesh plans it for the model to run: ``TransformersModel`` no longer refuses ``ulysses_size``."""

import pytest
import torch
from tolerances import attention_sums, chain_tolerances
from transformers import LlamaConfig, Qwen3NextConfig

from twinkle import DeviceMesh
from twinkle.distributed.mesh import refuse_unimplemented
from twinkle.distributed.sequence_parallel import SequenceGroup
from twinkle.kernel.attention.ulysses import masked_attention
from twinkle.loss import HeadLoss, build_loss
from twinkle.model.parallel_sizes import refuse_cli_sizes
from twinkle.model.ulysses import Ulysses, check_model
from twinkle.utils.errors import UserError


def _one_line(info) -> str:
    text = str(info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (3, 3), (6, 3)])
def test_heads_the_size_does_not_divide(heads, kv_heads):
    config = LlamaConfig(hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(UserError) as info:
        check_model(config, 2)
    assert f"(num_attention_heads={heads}, num_key_value_heads={kv_heads})" in _one_line(info)
    check_model(LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2), 2)


def test_hybrid_linear_attention_is_refused_saying_why():
    with pytest.raises(UserError, match="recurrent state runs from each position to the next") as info:
        check_model(Qwen3NextConfig(num_attention_heads=4, num_key_value_heads=2), 2)
    assert "qwen3_next" in _one_line(info)


def test_a_family_it_does_not_run():
    from transformers import Gemma2Config

    with pytest.raises(UserError, match="gemma2 is not one of them") as info:
        check_model(Gemma2Config(num_attention_heads=4, num_key_value_heads=2), 2)
    _one_line(info)


class _OverSamples(HeadLoss):
    require_samples = True  # combines whole samples, without totalling them over the group


class _TokenInputs(HeadLoss):
    extra_inputs = ("token_weights",)  # per-token inputs, without declaring how a share reads them


@pytest.mark.parametrize("loss", [_TokenInputs(), _OverSamples()])
def test_a_loss_over_whole_samples_or_with_token_inputs_is_refused(loss):
    ulysses = Ulysses(SequenceGroup(2, 0, None))
    ulysses.check_loss(build_loss("CrossEntropyLoss", reduction="sum"))  # a sum over tokens: runs
    # the RL, preference and GKD losses declare sequence_parallel (tests/distributed/test_ulysses_rl_losses.py)
    for runs in ("DPOLoss", "GRPOLoss", "GSPOLoss", "SimPOLoss", "GKDLoss"):
        ulysses.check_loss(build_loss(runs))
    with pytest.raises(UserError, match="the loss must be a sum over tokens") as info:
        ulysses.check_loss(loss)
    _one_line(info)


def test_the_model_runs_what_the_mesh_plans():
    mesh = DeviceMesh.from_sizes(world_size=2, fsdp_size=2, ulysses_size=2)
    refuse_unimplemented(mesh, "TransformersModel", runs=("ulysses",))
    with pytest.raises(UserError, match="ulysses_size=2 \\(Ulysses sequence parallelism\\)"):
        refuse_unimplemented(mesh, "TorchSampler")
    args = {"infra": {"ulysses_size": 2}}
    refuse_cli_sizes(args, "TransformersModel", {"ulysses_size": 2})
    with pytest.raises(
        UserError, match="--ulysses-size 2: the mesh TransformersModel runs has ulysses_size=1"
    ):
        refuse_cli_sizes(args, "TransformersModel", {"ulysses_size": 1})


def test_masked_attention_of_a_padded_batch_equals_attention_row_by_row():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])  # row 1 right-padded
    out = masked_attention(q, k, v, real, 0.0, None, None)
    for row, n in enumerate((6, 4)):
        kk, vv = (t[row : row + 1, :, :n].repeat_interleave(2, dim=1) for t in (k, v))
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[row : row + 1, :, :n], kk, vv, is_causal=True
        )
        expected = expected[0].transpose(0, 1)
        # the same sums in another kernel's order: attention's chain of sums (tolerances.py)
        torch.testing.assert_close(
            out[row, :n], expected, **chain_tolerances(attention_sums(n, 8, 2), expected)
        )


def test_the_embedding_task_is_refused():
    from twinkle.model.embedding import final_hidden
    from twinkle.model.ulysses import ATTRIBUTE

    class Model:  # a model set up for Ulysses: the attribute ``install`` sets
        pass

    lm = Model()
    setattr(lm, ATTRIBUTE, Ulysses(SequenceGroup(2, 0, None)))
    with pytest.raises(UserError, match="does not run with ulysses_size > 1") as info:
        final_hidden(lm, {})
    _one_line(info)


def test_a_rank_takes_its_share_of_a_packed_row_padded_to_a_multiple_of_the_size():
    from twinkle.kernel.attention.packed import Segments

    # two groups, each a 2-token prefix then one sample: 7 positions, padded to 8 for 2 ranks
    segments = Segments(((2, 4), (6, 7)), 0, ((0, 2, 1), (4, 2, 1)))
    ids = torch.arange(10, 17)[None]
    inputs = {
        "input_ids": ids,
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
        "attention_mask": torch.ones_like(ids),
        "twinkle_segments": segments,
    }
    targets = torch.tensor([[-100, -100, 5, 6, -100, -100, 7]])
    shares = []
    for rank in (0, 1):
        ulysses = Ulysses(SequenceGroup(2, rank, None))
        local, local_targets, mask, gather = ulysses.share(dict(inputs), targets, targets != -100, None)
        assert local["input_ids"].shape == (1, 4) and gather is None
        assert local["twinkle_ulysses"].key_mask is None  # a packed row: its segments say who sees whom
        shares.append((local, local_targets[mask], ulysses._ordinals))
    (zero, zero_targets, zero_order), (one, one_targets, one_order) = shares
    assert one["input_ids"].tolist() == [[14, 15, 16, 0]] and one["position_ids"].tolist() == [[0, 1, 2, 0]]
    # the pad is a sample of its own, after the last block
    whole = one["twinkle_segments"]
    assert whole.spans == ((2, 4), (6, 7), (7, 8)) and whole.blocks[-1] == (7, 0, 1) and whole.length == 8
    assert zero_targets.tolist() == [5, 6] and one_targets.tolist() == [7]
    assert zero_order.tolist() == [0, 1] and one_order.tolist() == [2]  # places in the whole list
    # the gathered row attends as the row without the pad did
    from twinkle.kernel.attention.packed import segment_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    out = segment_attention(q, k, v, whole)
    expected = segment_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], segments)
    torch.testing.assert_close(out[:, :7], expected, **chain_tolerances(attention_sums(7, 4, 2), expected))


def test_each_rank_replays_the_routes_of_its_own_positions():
    """Routing replay is accepted with ``ulysses_size`` 2, and a rank's forward replays the routes
    of its share of every row's positions (the padding's routed by the router itself), as a rank's
    share of the padded batch is sliced: 2 rows of 5 positions, padded to 6, rank 1 runs 3..5."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from twinkle.model.router_replay import NO_ROUTE, RouterReplay
    from twinkle.model.transformers.moe.router_replay import RouterReplayAction
    from twinkle.model.ulysses import check_folder

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32,
    )  # fmt: skip
    check_folder(None, config, 2)  # no refusal: heads divide, and replay is not in question
    torch.manual_seed(0)
    lm = Qwen3MoeForCausalLM(config)
    replay = RouterReplay.install(lm)
    replay.action = RouterReplayAction.REPLAY_FORWARD
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    routes = torch.rand(2, 5, 2, 8, generator=torch.Generator().manual_seed(2)).argsort(-1)[..., :2]
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids,
        "routed_experts": routes,
    }
    replay.arm(batch, None)
    ulysses = Ulysses(SequenceGroup(2, 1, None))
    inputs = {
        "input_ids": ids,
        "position_ids": torch.arange(5).expand(2, 5),
        "attention_mask": batch["attention_mask"],
    }
    local = ulysses.share(inputs, ids, ids >= 0, None)[0]
    assert ulysses.span == (2, 5, 3, 6)
    replay.share(ulysses.group, ulysses.span)
    with torch.no_grad():  # the rank's tokens alone (the attention's all-to-all left out)
        lm(input_ids=local["input_ids"], position_ids=local["position_ids"])
    ran = replay.take().reshape(2, 3, 2, 2)  # (rows, the share's positions, layers, top-k)
    assert torch.equal(ran[:, :2], routes[:, 3:])  # positions 3 and 4: their recorded routes
    expected = replay._current["targets"].reshape(2, 3, 2, 2)
    assert bool((expected[:, 2] == NO_ROUTE).all())  # the padding: the router's own choice
    assert bool((ran[:, 2] >= 0).all())
