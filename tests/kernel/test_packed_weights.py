"""Frozen weights packed for oneDNN: the same products as the dense weight, packed again after an
in-place change, freed with the weight, within the memory budget, and only where they apply."""

import gc
import logging

import pytest
import torch
from tolerances import assert_matmul

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import set_switches

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


pytestmark = [pytestmark, pytest.mark.usefixtures("fresh_gemm")]


@pytest.mark.parametrize("rows", [1, 7, 176, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_weight_gives_the_dense_weights_products(rows, with_bias, onednn_calls):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 48), torch.randn(96, 48)
    bias = torch.randn(96) if with_bias else None
    dense = gemm.linear(x, w, bias)
    assert gemm.pack_frozen([w]) == w.nbytes
    packed = gemm.linear(x, w, bias)
    assert onednn_calls[0][1] is w and onednn_calls[1][1].is_mkldnn  # the second call used the copy
    # the same sums on another layout, maybe in another order (one row takes a matrix-vector
    # kernel): both within the worst fp32 error of 48-term sums of the float64 product (tolerances.py)
    assert_matmul(dense, x, w.t(), bias, "dense")
    assert_matmul(packed, x, w.t(), bias, "packed")
    g = torch.randn(rows, 96)
    assert_matmul(gemm.times_weight(g, w), g, w, what="times_weight")
    assert not onednn_calls[-1][1].is_mkldnn  # the input gradient keeps the dense weight


def test_only_frozen_contiguous_fp32_matrices_are_packed():
    frozen = torch.randn(8, 4)
    skipped = [
        torch.randn(8, 4, requires_grad=True),
        torch.randn(4, 8).t(),
        torch.randn(8, 4, dtype=torch.bfloat16),
        torch.randn(8),
        torch.zeros(0, 4),
    ]
    assert gemm.pack_frozen([*skipped, frozen, frozen]) == frozen.nbytes  # and once only
    assert gemm.packed_bytes() == frozen.nbytes


def test_a_weight_changed_in_place_is_packed_again():
    torch.manual_seed(0)
    x, w = torch.randn(5, 16), torch.randn(32, 16)
    gemm.pack_frozen([w])
    before = gemm.linear(x, w)
    with torch.no_grad():
        w.mul_(-2.0)
    assert_matmul(gemm.linear(x, w), x, w.t(), what="scaled in place")  # the stale copy gives -before/2
    assert_matmul(-2.0 * before, x, w.t(), what="before, doubled")  # exact: a power of two
    w.data = torch.randn(32, 16)  # new storage, as a load might give
    assert_matmul(gemm.linear(x, w), x, w.t(), what="new storage")


def test_a_weight_that_stops_being_packable_goes_back_to_dense():
    torch.manual_seed(0)
    x, w = torch.randn(5, 16), torch.randn(32, 16)
    gemm.pack_frozen([w])
    w.data = torch.randn(16, 32).t()  # not contiguous any more
    assert_matmul(gemm.linear(x, w), x, w.t(), what="dense again")  # tolerances.py
    assert gemm.packed_bytes() == 0


def test_the_copy_is_freed_with_its_weight():
    w = torch.randn(64, 32)
    gemm.pack_frozen([w])
    assert gemm.packed_bytes() == w.nbytes
    del w
    gc.collect()
    assert gemm.packed_bytes() == 0


def test_packing_stops_at_the_memory_budget(monkeypatch):
    monkeypatch.setattr(gemm, "_physical_bytes", lambda: gemm.PACK_SHARE * 1000)
    small, big, other = torch.randn(10, 10), torch.randn(30, 10), torch.randn(5, 10)  # 400, 1200, 200 bytes
    assert gemm.pack_frozen([small, big, other]) == 400  # big does not fit, and packing stops there
    assert gemm.pack_frozen([other]) == 200  # the budget counts what is already packed
    assert gemm.pack_frozen([torch.randn(20, 10)]) == 0


def test_the_budget_is_a_share_of_the_containers_limit_when_lower(monkeypatch, tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    monkeypatch.setattr(gemm, "CGROUP_LIMITS", (str(v2), str(v1)))
    machine = gemm._physical_bytes()
    assert machine > 0
    v2.write_text("max\n")  # no limit
    assert gemm._physical_bytes() == machine
    v1.write_text(f"{gemm.PACK_SHARE * 1000}\n")
    assert gemm._physical_bytes() == gemm.PACK_SHARE * 1000
    assert gemm.pack_frozen([torch.randn(10, 10), torch.randn(30, 10)]) == 400


def test_a_build_that_cannot_pack_keeps_the_dense_weights(monkeypatch, caplog):
    def refuse(w):
        raise RuntimeError("no packing in this build")

    monkeypatch.setattr(gemm, "_pack", refuse)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        assert gemm.pack_frozen([w]) == 0
    assert "cpu_gemm [packed] failed" in caplog.text
    assert_matmul(gemm.linear(x, w), x, w.t(), what="dense")  # tolerances.py


def test_nothing_is_packed_with_onednn_off(monkeypatch):
    set_switches({"TWINKLE_ONEDNN": "0"})
    assert gemm.pack_frozen([torch.randn(8, 4)]) == 0
