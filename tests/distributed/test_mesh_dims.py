"""``DeviceMesh``'s other dimensions (tp, pp, cp, ep, Ulysses): every rank's coordinates against
hand-computed ones, and a model asked to run one it does not implement refusing in one line."""

import numpy as np
import pytest

from twinkle import DeviceMesh
from twinkle.model import TransformersModel
from twinkle.utils.errors import UserError


def _table(mesh: DeviceMesh, *names: str) -> list[tuple[int, ...]]:
    return [tuple(mesh.rank_coordinates(r)[n] for n in names) for r in range(mesh.world_size)]


def test_tp_is_innermost_and_shares_the_data_rank():
    # dp 2 x tp 2: ranks 0,1 are replica 0's two tensor-parallel halves, reading data rank 0
    mesh = DeviceMesh.from_sizes(dp_size=2, tp_size=2, world_size=4)
    assert (mesh.fsdp_size, mesh.dp_size, mesh.tp_size, mesh.world_size) == (1, 2, 2, 4)
    assert _table(mesh, "dp", "tp", "data") == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert mesh.data_world_size == 2 and mesh.get_slice(8, 1) == slice(4, 8)
    assert mesh.mesh_dim_names == ("dp", "fsdp", "tp") and mesh.mesh.tolist() == [[[0, 1]], [[2, 3]]]


def test_pp_is_outermost():
    # pp 2 x fsdp 2 x tp 2 = 8: rank = (pp * 2 + fsdp) * 2 + tp
    mesh = DeviceMesh(fsdp_size=2, dp_size=1, pp_size=2, tp_size=2)
    assert _table(mesh, "pp", "fsdp", "tp", "data") == [
        (0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 1), (0, 1, 1, 1),
        (1, 0, 0, 0), (1, 0, 1, 0), (1, 1, 0, 1), (1, 1, 1, 1),
    ]  # fmt: skip
    assert mesh.describe() == "1 replica(s) x 2 shard(s) x pp 2 x tp 2 = 8 ranks"


def test_dp_fsdp_cp_and_the_upstream_form_agree():
    # dp 2 x fsdp 2 x cp 2: rank = ((dp * 2 + fsdp) * 2 + cp); data rank = dp * 2 + fsdp
    mesh = DeviceMesh(fsdp_size=2, dp_size=2, cp_size=2)
    assert _table(mesh, "dp", "fsdp", "cp", "data") == [
        (0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 1), (0, 1, 1, 1),
        (1, 0, 0, 2), (1, 0, 1, 2), (1, 1, 0, 3), (1, 1, 1, 3),
    ]  # fmt: skip
    upstream = DeviceMesh(mesh=np.arange(8).reshape(2, 2, 2), mesh_dim_names=("dp", "fsdp", "cp"))
    assert upstream == mesh and upstream.data_world_size == 4


def test_ep_and_ulysses_as_upstream_documents_them():
    # ep 2 over 4 ranks: expert groups of consecutive ranks; Ulysses 2: pairs of data ranks share data
    mesh = DeviceMesh(fsdp_size=4, dp_size=1, ep_size=2, sp_size=2)
    assert mesh.ulysses_size == 2
    assert _table(mesh, "ep", "ulysses", "data") == [(0, 0, 0), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert mesh.data_world_size == 2


def test_this_process_reads_its_coordinates_from_rank(monkeypatch):
    mesh = DeviceMesh(fsdp_size=1, dp_size=2, tp_size=2, pp_size=2)
    assert mesh.tp_rank is None  # no launcher
    monkeypatch.setenv("RANK", "7")
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank, mesh.cp_rank, mesh.data_rank) == (1, 1, 1, 0, 1)
    assert (mesh.tp_world_size, mesh.pp_world_size, mesh.etp_world_size) == (2, 2, 1)


def test_a_model_asked_to_run_tensor_parallelism_refuses_in_one_line(tiny_model_dir):
    with pytest.raises(UserError) as info:
        TransformersModel(str(tiny_model_dir), device_mesh=DeviceMesh(fsdp_size=1, dp_size=1, tp_size=2))
    assert str(info.value) == (
        "TransformersModel: not supported yet: tp_size=2 (tensor parallelism); it runs dp replicas x fsdp "
        "shards only: set tp_size to 1 (or False) in the mesh it is given"
    )


def test_flash_attention_falls_back_to_sdpa_with_one_warning_where_it_cannot_run(tiny_model_dir, caplog):
    from twinkle.model import attention_choice

    attention_choice._warned.clear()
    with caplog.at_level("WARNING"):
        first = TransformersModel(str(tiny_model_dir), attn_implementation="flash_attention_2")
        second = TransformersModel(str(tiny_model_dir), attn_implementation="flash_attention_2")
    warnings = [r.getMessage() for r in caplog.records if "attn_implementation" in r.getMessage()]
    assert len(warnings) == 1 and "a CUDA device (this run is on cpu)" in warnings[0], warnings
    assert first.model.config._attn_implementation == second.model.config._attn_implementation == "sdpa"
    eager = TransformersModel(str(tiny_model_dir), attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"  # what the device runs is honoured
    with pytest.raises(UserError, match="attn_implementation='fast' is not one of flash_attention_2"):
        TransformersModel(str(tiny_model_dir), attn_implementation="fast")
