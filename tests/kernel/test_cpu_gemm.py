"""The frozen weight's two products: oneDNN on fp32 CPU tensors, torch everywhere else, the same
values either way."""

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from nets import TwoLinear
from peft import LoraConfig, get_peft_model
from tolerances import assert_matmul, assert_within, gamma

from twinkle.kernel import cpu_gemm as gemm
from twinkle.kernel import set_switches, switches
from twinkle.kernel.lora.linear import fuse_lora_linears
from twinkle.utils.errors import UserError

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


pytestmark = pytest.mark.usefixtures("fresh_gemm")


def _rows(onednn_calls) -> list[tuple[int, ...]]:
    """The shapes of the oneDNN calls' inputs so far."""
    return [tuple(x.shape) for x, _ in onednn_calls]


@pytest.mark.parametrize("rows", [1, 7, 176])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_equal_torch(rows, with_bias):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 48), torch.randn(96, 48)
    bias = torch.randn(96) if with_bias else None
    g = torch.randn(rows, 96)
    # oneDNN's sums in their own order, within the worst fp32 error of k-term sums (tolerances.py)
    assert_matmul(gemm.linear(x, w, bias), x, w.t(), bias, "linear")
    assert_matmul(gemm.times_weight(g, w), g, w, what="times_weight")


def test_strided_operands_equal_torch():
    torch.manual_seed(0)
    x = torch.randn(48, 30).t()  # (30, 48), not contiguous
    w = torch.randn(96, 48)
    g = torch.randn(96, 30).t()
    # worst fp32 error of k-term sums in any order, elementwise (tolerances.py)
    assert_matmul(gemm.linear(x, w), x, w.t(), what="linear")
    assert_matmul(gemm.times_weight(g, w), g, w, what="times_weight")
    assert_matmul(gemm.linear(x[::2], w[::3]), x[::2], w[::3].t(), what="strided linear")


def test_no_rows_give_an_empty_result():
    x, w = torch.zeros(0, 8), torch.randn(4, 8)
    assert gemm.linear(x, w).shape == (0, 4)
    assert gemm.times_weight(torch.zeros(0, 4), w).shape == (0, 8)


@needs_onednn
def test_fp32_cpu_products_go_to_onednn(onednn_calls):
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    gemm.linear(x, w)
    gemm.times_weight(torch.randn(5, 4), w)
    assert _rows(onednn_calls) == [(5, 8), (5, 4)]


def test_other_dtypes_take_torch_exactly(onednn_calls):
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(gemm.linear(x, w), x @ w.t())
    assert torch.equal(gemm.times_weight(x @ w.t(), w), (x @ w.t()) @ w)
    assert _rows(onednn_calls) == []


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_environment_turns_it_off(monkeypatch, onednn_calls, value):
    monkeypatch.setenv("TWINKLE_ONEDNN", value)
    switches.reread()
    x, w, g = torch.randn(5, 8), torch.randn(4, 8), torch.randn(5, 4)
    assert torch.equal(gemm.linear(x, w), x @ w.t())
    assert torch.equal(gemm.times_weight(g, w), g @ w)
    assert _rows(onednn_calls) == []
    assert not gemm.onednn_enabled()


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_value_that_is_not_a_switch_is_refused(monkeypatch, value):
    monkeypatch.setenv("TWINKLE_ONEDNN", value)
    switches.reread()
    with pytest.raises(
        UserError, match=f"TWINKLE_ONEDNN='{value}' is not a switch: set it to one of auto, on, off"
    ):
        gemm.linear(torch.randn(2, 3), torch.randn(4, 3))


@needs_onednn
def test_a_failing_onednn_call_falls_back_once_with_a_warning(monkeypatch, caplog):
    attempts = []

    def broken(x, w, bias):
        attempts.append(1)
        raise RuntimeError("no primitive for this layout")

    monkeypatch.setattr(gemm, "_linear_pointwise", broken)
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        assert torch.equal(gemm.linear(x, w), x @ w.t())
        assert torch.equal(gemm.linear(x, w), x @ w.t())
    assert attempts == [1]  # turned off after the first failure
    assert "cpu_gemm [onednn] failed" in caplog.text
    assert "no primitive for this layout" in caplog.text


@needs_onednn
def test_the_lora_layer_uses_it_forward_and_backward(onednn_calls):
    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["up"], init_lora_weights=False)
    model = get_peft_model(TwoLinear(), config)
    fuse_lora_linears(model)
    x = torch.randn(3, 6, requires_grad=True)
    model(x).sum().backward()
    # the frozen base weight: once forward, once for x's gradient; the rank-2 products stay torch's
    assert len(onednn_calls) == 2
    assert x.grad is not None


def test_a_bias_autograd_records_takes_torch(onednn_calls):
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    bias = torch.zeros(4, requires_grad=True)
    gemm.linear(x, w, bias).sum().backward()
    assert _rows(onednn_calls) == []
    assert torch.equal(bias.grad, torch.full((4,), 5.0))


def test_a_product_autograd_would_record_takes_torch(onednn_calls):
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(4, 8)
    out = gemm.linear(x, w)
    out.sum().backward()
    assert _rows(onednn_calls) == []
    # ones @ w: each element a sum of 4 weights in some order, within gamma(4) of their
    # magnitudes of the float64 sum; a transposed or missing gradient is off by a weight
    expected = w.double().sum(0).expand(5, 8)
    assert_within(x.grad, expected, gamma(4) * w.double().abs().sum(0).expand(5, 8), "x.grad")


GROWTH = """
import torch
import twinkle
from twinkle.kernel import cpu_gemm as gemm

torch.set_num_threads(2)
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
w = torch.randn(1536, 576)
gemm.linear(torch.randn(8, 576), w)
start = rss_mib()
for rows in range(16, 416):  # a new row count every call, as packed batches bring
    gemm.linear(torch.randn(rows, 576), w)
    gemm.times_weight(torch.randn(rows, 1536), w)
print(rss_mib() - start)
"""


@needs_onednn
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the RSS from /proc")
def test_the_first_onednn_product_bounds_its_kernel_caches():
    def growth(**env):
        clean = {k: v for k, v in os.environ.items() if k not in gemm_caches}
        done = subprocess.run(
            [sys.executable, "-c", GROWTH],
            env={**clean, "TWINKLE_ONEDNN": "on", **env},  # every shape to oneDNN, whichever is faster here
            capture_output=True,
            text=True,
            check=True,
        )
        return float(done.stdout.split()[-1])

    gemm_caches = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    bounded = growth()
    # a capacity the user set is kept: torch's default of 1024 shapes
    unbounded = growth(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    assert bounded < 150, bounded  # measured 66 MiB
    assert unbounded > 2 * bounded + 100, (bounded, unbounded)  # measured 505 MiB


@pytest.fixture
def slowed(monkeypatch):
    """``slowed(side)`` makes one library's product 2 ms slower than it is, so ``auto`` must pick
    the other; returns the measured shapes' log."""
    measured = []
    real_measure = gemm._measure

    def measure(product, w):
        measured.append((product, tuple(w.shape)))
        return real_measure(product, w)

    monkeypatch.setattr(gemm, "_measure", measure)
    set_switches({"TWINKLE_ONEDNN": "auto"})

    def slow(side: str):
        name = "_onednn_product" if side == "onednn" else "_torch_product"
        real = getattr(gemm, name)

        def slower(*args):
            time.sleep(0.002)
            return real(*args)

        monkeypatch.setattr(gemm, name, slower)

    return slow, measured


@needs_onednn
@pytest.mark.parametrize("slower", ["onednn", "torch"])
def test_auto_routes_each_shape_to_the_library_measured_faster(slowed, onednn_calls, slower):
    slow, measured = slowed
    slow(slower)
    x, w, g = torch.randn(5, 8), torch.randn(4, 8), torch.randn(5, 4)
    calls_before = len(onednn_calls)
    for _ in range(3):
        assert_matmul(gemm.linear(x, w), x, w.t(), what="linear")  # either library (tolerances.py)
        assert_matmul(gemm.times_weight(g, w), g, w, what="times_weight")
    # each product of this shape measured once; then every call goes where the measurement said
    assert measured == [("linear", (4, 8)), ("times_weight", (4, 8))]
    real_calls = [c for c in _rows(onednn_calls)[calls_before:] if c[0] == 5]
    assert len(real_calls) == (6 if slower == "torch" else 0)
    assert gemm._faster == {("linear", 4, 8): slower == "torch", ("times_weight", 4, 8): slower == "torch"}


@needs_onednn
@pytest.mark.parametrize("slower", ["onednn", "torch"])
def test_auto_packs_only_the_shapes_onednn_wins(slowed, monkeypatch, slower):
    slow, measured = slowed
    monkeypatch.setattr(gemm, "_packed", {})
    slow(slower)
    weights = [torch.randn(16, 8), torch.randn(16, 8)]
    packed = gemm.pack_frozen(weights)
    if slower == "onednn":  # torch wins: no copy kept, and the second weight is not even packed
        assert packed == 0 and gemm._packed == {}
    else:
        assert packed == sum(w.nbytes for w in weights)
        assert all(id(w) in gemm._packed for w in weights)
    assert measured == [("linear", (16, 8))]  # once for the shape


def _new_process(monkeypatch):
    """What a new process starts from: no choices in memory, the cache file not yet read."""
    monkeypatch.setattr(gemm, "_faster", {})
    monkeypatch.setattr(gemm, "_routes", {})


@needs_onednn
@pytest.mark.parametrize("slower", ["onednn", "torch"])
def test_a_measured_choice_is_kept_for_later_processes(slowed, monkeypatch, slower):
    slow, measured = slowed
    slow(slower)
    w = torch.randn(4, 8)
    first = gemm.faster_here("linear", w)
    assert first == (slower == "torch") and measured == [("linear", (4, 8))]
    files = list((gemm._routes_file().parent).glob("routes-*.json"))
    assert files == [gemm._routes_file()]
    # a later process reads the choice instead of measuring
    _new_process(monkeypatch)
    assert gemm.faster_here("linear", w) == first
    assert measured == [("linear", (4, 8))]
    # another shape is measured and added to the same file, the first choice kept
    assert gemm.faster_here("linear", torch.randn(6, 8)) == first
    assert measured == [("linear", (4, 8)), ("linear", (6, 8))]
    assert gemm._read_routes(gemm._routes_file()) == {("linear", 4, 8): first, ("linear", 6, 8): first}


@needs_onednn
def test_the_choice_is_measured_again_on_other_threads_and_after_a_broken_file(slowed, monkeypatch):
    slow, measured = slowed
    w = torch.randn(4, 8)
    gemm.faster_here("linear", w)
    path = gemm._routes_file()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # other threads: another file, measured afresh
        _new_process(monkeypatch)
        assert gemm._routes_file() != path
        gemm.faster_here("linear", w)
        assert len(measured) == 2
    finally:
        torch.set_num_threads(threads)
    path.write_text("{not json", encoding="utf-8")
    _new_process(monkeypatch)
    gemm.faster_here("linear", w)
    assert len(measured) == 3
    assert ("linear", 4, 8) in gemm._read_routes(path)  # rewritten whole


@needs_onednn
def test_a_choice_another_process_kept_first_wins(slowed, monkeypatch):
    """Two ranks measuring at once: the second to finish takes the first one's choice."""
    slow, measured = slowed
    slow("torch")  # this process would pick oneDNN
    w = torch.randn(4, 8)
    path = gemm._routes_file()
    real_measure = gemm._measure

    def measure_while_another_keeps(product, weight):
        choice = real_measure(product, weight)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"choices": {"linear 4 8": false}}', encoding="utf-8")
        return choice

    monkeypatch.setattr(gemm, "_measure", measure_while_another_keeps)
    assert gemm.faster_here("linear", w) is False
    assert gemm._faster[("linear", 4, 8)] is False


def test_measuring_leaves_the_random_streams_alone(monkeypatch):
    set_switches({"TWINKLE_ONEDNN": "auto"})
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    gemm.linear(torch.ones(3, 8), torch.ones(6, 8))  # measures this shape first
    assert torch.equal(torch.rand(4), expected)


@needs_onednn
def test_the_default_routes_by_a_rule_never_by_a_timing(monkeypatch, onednn_calls):
    """Without ``TWINKLE_ONEDNN`` every shape goes to oneDNN and is packed, on any machine and
    under any load: nothing is measured and no route is kept in the cache."""
    monkeypatch.delenv("TWINKLE_ONEDNN", raising=False)
    switches.reread()
    assert switches.value("TWINKLE_ONEDNN") == "on"

    def timed(product, w):
        raise AssertionError(f"measured {product} {tuple(w.shape)}")

    monkeypatch.setattr(gemm, "_measure", timed)
    weights = [torch.randn(16, 8), torch.randn(12, 8)]
    assert gemm.pack_frozen(weights) == sum(w.nbytes for w in weights)
    x, g = torch.randn(5, 8), torch.randn(5, 16)
    assert_matmul(gemm.linear(x, weights[0]), x, weights[0].t(), what="linear")
    assert_matmul(gemm.times_weight(g, weights[0]), g, weights[0], what="times_weight")
    assert _rows(onednn_calls) == [(5, 8), (5, 16)]
    assert not gemm._routes_file().parent.exists()


@needs_onednn
def test_off_never_measures_and_takes_torch(monkeypatch, onednn_calls):
    set_switches({"TWINKLE_ONEDNN": "off"})
    monkeypatch.setattr(gemm, "_measure", lambda *a: pytest.fail("measured with TWINKLE_ONEDNN=off"))
    w = torch.randn(16, 8)
    assert gemm.faster_here("linear", w) is False and gemm.faster_here("times_weight", w) is False
    assert gemm.faster_here("gemv", w) is False and gemm.faster_here("gemv8", w) is False
    assert gemm.pack_frozen([w]) == 0
    assert torch.equal(gemm.linear(torch.ones(3, 8), w), torch.ones(3, 8) @ w.t())
    assert _rows(onednn_calls) == []


@needs_onednn
@pytest.mark.parametrize("slower", ["onednn", "torch"])
def test_a_decoding_steps_few_rows_take_the_library_measured_faster_even_when_on(slowed, slower):
    """ "gemv" is measured in the default ``on`` as well (at 1 row, over copies past the caches),
    kept in the machine's file like the other choices; ``few_rows`` follows the choice."""
    slow, measured = slowed
    set_switches({"TWINKLE_ONEDNN": "on"})
    slow(slower)
    w = torch.randn(64, 48)
    choice = gemm.faster_here("gemv", w)
    assert choice == (slower == "torch") and measured == [("gemv", (64, 48))]
    assert gemm._read_routes(gemm._routes_file()) == {("gemv", 64, 48): choice}
    assert gemm.faster_here("linear", w) is True and measured == [("gemv", (64, 48))]  # on: not measured
    x = torch.randn(1, 48)
    for onednn in (True, False):
        assert_matmul(gemm.few_rows(x, w, None, onednn), x, w.t(), what="linear")


@needs_onednn
def test_few_rows_goes_where_it_is_told(onednn_calls):
    x, w, bias = torch.randn(2, 48), torch.randn(64, 48), torch.randn(64)
    gemm.few_rows(x, w, bias, False)
    assert _rows(onednn_calls) == []
    out = gemm.few_rows(x, w, bias, True)
    assert _rows(onednn_calls) == [(2, 48)]
    assert_matmul(out, x, w.t(), bias, "linear")
    with torch.enable_grad():  # a product autograd records is never oneDNN's
        gemm.few_rows(x, w.requires_grad_(), bias, True)
    assert _rows(onednn_calls) == [(2, 48)]
