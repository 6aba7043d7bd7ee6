"""Megatron's ``sequence_parallel`` splits activations between tensor-parallel ranks: with one
tensor-parallel rank there is nothing to split, so a mesh or command line that asks for it runs
with one warning (upstream's multi-LoRA GRPO script builds such a mesh); with ``tp_size`` above
1 it is refused beside the tensor parallelism."""

import logging

import pytest

import twinkle
from twinkle import DeviceMesh
from twinkle.cli import CLI
from twinkle.model import MultiLoraMegatronModel, TransformersModel
from twinkle.utils.errors import UserError


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("twinkle") and r.levelno >= logging.WARNING
    ]


def test_sequence_parallel_without_tensor_parallelism_is_planned_as_nothing():
    mesh = DeviceMesh.from_sizes(world_size=1, tp_size=1, ep_size=1, pp_size=1, sequence_parallel=True)
    assert mesh.sequence_parallel and mesh.unimplemented() == []
    assert DeviceMesh.from_sizes(world_size=2, tp_size=2, sequence_parallel=True).unimplemented() == [
        "tp_size=2",
        "sequence_parallel=True",
    ]


def test_a_model_given_such_a_mesh_runs_with_one_warning(tiny_model_dir, caplog):
    mesh = DeviceMesh.from_sizes(world_size=1, tp_size=1, sequence_parallel=True)
    twinkle.initialize(global_device_mesh=mesh)
    MultiLoraMegatronModel(
        model_id=str(tiny_model_dir), device_mesh=mesh, max_loras=1, max_r=4, mixed_precision="no"
    )
    said = [line for line in _warnings(caplog) if "sequence_parallel" in line]
    assert said == [
        "MultiLoraMegatronModel: sequence_parallel=True with tp_size=1 has no effect (Megatron sequence "
        "parallelism splits activations between tensor-parallel ranks); ignored"
    ]


def test_with_tensor_parallelism_it_is_refused_in_one_line(tiny_model_dir):
    with pytest.raises(UserError, match="tp_size=2") as info:
        TransformersModel(
            model_id=str(tiny_model_dir),
            device_mesh=DeviceMesh.from_sizes(world_size=2, tp_size=2, sequence_parallel=True),
        )
    assert "sequence_parallel" in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_flag_alone_is_a_warning(tiny_model_dir, caplog, tmp_path):
    CLI.from_args(["--sequence-parallel", "--output-dir", str(tmp_path)], env={})
    twinkle.initialize()
    TransformersModel(model_id=str(tiny_model_dir))
    assert any(
        line.startswith("--sequence-parallel: TransformersModel ignores it") for line in _warnings(caplog)
    )
