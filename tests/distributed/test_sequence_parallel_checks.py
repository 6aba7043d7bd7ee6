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
from twinkle.loss import build_loss
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


@pytest.mark.parametrize("loss", ["DPOLoss", "GRPOLoss"])
def test_a_loss_over_whole_samples_or_with_token_inputs_is_refused(loss):
    ulysses = Ulysses(SequenceGroup(2, 0, None))
    ulysses.check_loss(build_loss("CrossEntropyLoss", reduction="sum"))  # a sum over tokens: runs
    with pytest.raises(UserError, match="the loss must be a sum over tokens") as info:
        ulysses.check_loss(build_loss(loss))
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
