"""Call ops: chains, switches and fall-through, and what ``twinkle kernels`` reports."""

import logging

import pytest
import torch
from tolerances import attention_sums, chain_tolerances

from twinkle.kernel import DEFAULT_CALL_CHAINS, SWITCHES, describe, registry, set_switches, switched, switches
from twinkle.kernel.attention.packed import Segments, segment_attention
from twinkle.utils.errors import UserError


@pytest.fixture
def scratch_op(monkeypatch):
    """A call op of its own, ``demo``: ``fast`` (available as the test says) then ``plain``."""
    monkeypatch.setitem(registry._CHAINS, "demo", ("fast", "plain"))
    monkeypatch.setitem(registry._DEFAULT_CHAINS, "demo", ("fast", "plain"))
    monkeypatch.setitem(registry._CALLS, "demo", {})
    monkeypatch.delitem(registry._PLAIN, "demo", raising=False)
    here = {"fast": True}
    registry.register_call("demo", "fast", lambda: here["fast"], "a demo device")
    registry.register_call("demo", "plain", lambda: True, "nothing", plain=True)
    registry.forget()
    yield here
    registry.forget()


def test_a_chain_holds_what_is_available_in_order(scratch_op):
    assert registry.chain("demo") == ("fast", "plain")
    scratch_op["fast"] = False
    assert registry.chain("demo") == ("fast", "plain")  # availability is asked once per process
    registry.forget()
    assert registry.chain("demo") == ("plain",)
    assert registry.state("demo", "fast") == (False, "unavailable (needs a demo device)")


def test_a_failure_takes_the_backend_out_with_one_warning(scratch_op, caplog):
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        registry.disable("demo", "fast", "RuntimeError: boom")
        registry.disable("demo", "fast", "RuntimeError: boom")
    assert caplog.text.count("demo [fast] failed (RuntimeError: boom)") == 1
    assert not registry.enabled("demo", "fast") and registry.enabled("demo", "plain")
    assert registry.state("demo", "fast")[1].startswith("failed, fell through")


def test_an_availability_check_that_raises_is_unavailable(scratch_op, caplog):
    scratch_op["fast"] = None
    registry._CALLS["demo"]["fast"] = registry.CallImpl("demo", "fast", lambda: 1 / 0, "x")
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        assert not registry.enabled("demo", "fast")
    assert "ZeroDivisionError" in caplog.text


def test_registering_twice_or_a_second_plain_backend_is_refused(scratch_op):
    with pytest.raises(ValueError, match="already has a 'plain'"):
        registry.register_call("demo", "plain", lambda: True, "nothing")
    with pytest.raises(ValueError, match="already has the plain backend 'plain'"):
        registry.register_call("demo", "other", lambda: True, "nothing", plain=True)


def test_a_backend_the_table_leaves_out_never_runs(scratch_op):
    registry.register_call("demo", "other", lambda: True, "nothing")
    assert registry.backends_of("demo") == ("fast", "plain", "other")
    assert registry.state("demo", "other") == (False, "not in the chain")
    with registry.call_chains({"demo": ("other", "plain")}):
        assert registry.chain("demo") == ("other", "plain")
    assert registry.chain("demo") == ("fast", "plain")


def test_every_switch_names_a_backend_of_a_chain():
    for switch in SWITCHES.values():
        assert switch.default in switch.values
        if switch.name == switches.MASTER:  # the master switch covers every op
            assert (switch.op, switch.backend) == (None, None)
            continue
        assert switch.backend in DEFAULT_CALL_CHAINS[switch.op], switch.name


def test_an_off_switch_takes_its_backend_out_of_the_chain():
    assert "batched" in registry.chain("packed_attention")
    with switched({"TWINKLE_BATCHED_ATTENTION": "0"}):
        assert "batched" not in registry.chain("packed_attention")
        assert registry.state("packed_attention", "batched") == (
            False,
            "switched off (TWINKLE_BATCHED_ATTENTION=off)",
        )
    assert "batched" in registry.chain("packed_attention")


def test_switches_are_read_from_the_environment_once_and_checked(monkeypatch):
    monkeypatch.setenv("TWINKLE_LORA_QKV", "false")
    switches.reread()
    assert switches.value("TWINKLE_LORA_QKV") == "off"
    monkeypatch.setenv("TWINKLE_LORA_QKV", "on")
    assert switches.value("TWINKLE_LORA_QKV") == "off"  # read once
    monkeypatch.setenv("TWINKLE_BATCHED_ATTENTION", "sometimes")
    switches.reread()
    with pytest.raises(
        UserError, match="TWINKLE_BATCHED_ATTENTION='sometimes' is not a switch: set it to one of"
    ):
        switches.value("TWINKLE_LORA_QKV")  # every switch is checked at the first question
    monkeypatch.delenv("TWINKLE_BATCHED_ATTENTION")
    switches.reread()


def test_unknown_switch_names_are_refused():
    with pytest.raises(
        UserError, match="unknown kernel switch TWINKLE_TURBO; switches: TWINKLE_KERNELS, TWINKLE_ONEDNN"
    ):
        set_switches({"TWINKLE_TURBO": "on"})


def _packed_row():
    torch.manual_seed(0)
    spans, start = [], 3
    for n in (20, 9, 30):
        spans.append((start, start + n))
        start += n
    leaves = [torch.randn(1, start, h, 16).transpose(1, 2) for h in (4, 2, 2)]
    return leaves, Segments(tuple(spans), 3)


def test_every_attention_chain_gives_the_same_row():
    """Each backend switched on alone (with sdpa last) computes the row the sdpa calls compute."""
    leaves, segments = _packed_row()
    only_sdpa = {
        "TWINKLE_NATIVE_ATTENTION": "off",
        "TWINKLE_POOLED_ATTENTION": "off",
        "TWINKLE_BATCHED_ATTENTION": "off",
    }
    with switched(only_sdpa):
        expected = segment_attention(*leaves, segments)
    for name, value in (
        ("TWINKLE_NATIVE_ATTENTION", "on"),
        ("TWINKLE_POOLED_ATTENTION", "always"),
        ("TWINKLE_BATCHED_ATTENTION", "always"),
    ):
        with switched({**only_sdpa, name: value}):
            # the same terms summed in other orders: attention's chain of fp32 sums (tolerances.py)
            tol = chain_tolerances(attention_sums(segments.length, 16, 2), expected)
            torch.testing.assert_close(segment_attention(*leaves, segments), expected, **tol)


def test_describe_reports_every_op_and_switch_state(tiny_llama):
    with switched({"TWINKLE_LORA_QKV": "off"}):
        text = describe(tiny_llama())
    for op, chain in DEFAULT_CALL_CHAINS.items():
        assert f"  {op}: {' -> '.join(chain)}" in text
    assert "switched off (TWINKLE_LORA_QKV=off)" in text
    assert "TWINKLE_LORA_QKV=off  (default on)" in text
    assert "x LlamaRMSNorm -> rms_norm [torch]" in text
    assert "unavailable (needs CUDA and the liger-kernel package)" in text or torch.cuda.is_available()
    assert "cpu_gemm per" in text
