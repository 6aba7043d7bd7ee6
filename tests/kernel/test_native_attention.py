"""The C kernel for a packed row's attention: the masked row's results, the same bits on any
thread count, and a fallback with one warning where it cannot be built."""

import logging
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tolerances import attention_sums, chain_tolerances

from twinkle.kernel import native_build, registry, set_switches
from twinkle.kernel.attention import native as native_attention
from twinkle.kernel.attention.packed import Segments, segment_attention


@pytest.fixture
def fresh_library(monkeypatch):
    """A library() call that builds or loads again, as a new process would."""
    monkeypatch.setattr(native_attention, "_state", {})
    registry.forget()
    yield
    registry.forget()  # the next test asks this process's own library again


def _row(prefix: int, lengths: list[int], heads=(6, 2), dim=16, seed=0):
    spans, start = [], prefix
    for n in lengths:
        spans.append((start, start + n))
        start += n
    torch.manual_seed(seed)
    # as the model hands them over: (1, T, heads, D) transposed
    leaves = [
        torch.randn(1, start, h, dim).transpose(1, 2).requires_grad_() for h in (heads[0], *heads[1:] * 2)
    ]
    return Segments(tuple(spans), prefix), leaves


def _grouped_row(groups: list[tuple[int, list[int]]], heads=(6, 2), dim=16, seed=0):
    """A row of blocks: each group's prefix once, then its samples."""
    spans, blocks, start = [], [], 0
    for prefix, lengths in groups:
        blocks.append((start, prefix, len(lengths)))
        start += prefix
        for n in lengths:
            spans.append((start, start + n))
            start += n
    torch.manual_seed(seed)
    leaves = [
        torch.randn(1, start, h, dim).transpose(1, 2).requires_grad_() for h in (heads[0], heads[1], heads[1])
    ]
    return Segments(tuple(spans), 0, tuple(blocks)), leaves


def _masked(query, key, value, segments: Segments):
    """The row as one masked SDPA call: a query sees its prefix and its own sample's past."""
    t = segments.length
    seen = torch.zeros(t, t, dtype=torch.bool)
    for start, n in segments.prefixes():
        seen[start : start + n, start : start + n] = True
    for (start, end), (first, n) in zip(segments.spans, segments.contexts(), strict=True):
        seen[start:end, start:end] = True
        seen[start:end, first : first + n] = True
    pos = torch.arange(t)
    allowed = (pos[None, :] <= pos[:, None]) & seen
    rep = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1), attn_mask=allowed
    )
    return out.transpose(1, 2)


def _results(fn, leaves):
    out = fn(*leaves)
    grad = torch.linspace(-1, 1, out.numel()).reshape(out.shape)  # any fixed output gradient
    return [out, *torch.autograd.grad(out, leaves, grad)]


def _assert_same_results(got, expected, leaves) -> None:
    """The kernel and SDPA sum the same terms in other orders: each result within the bound of
    attention's chain of fp32 sums (tolerances.attention_sums, ~2e-4 of each tensor's scale at
    64 channels); a query that sees another sample's keys is off by ~1e-1 of the scale."""
    query, key = leaves[0], leaves[1]
    sums = attention_sums(query.shape[2], query.shape[3], query.shape[1] // key.shape[1])
    for name, a, b in zip(("out", "grad q", "grad k", "grad v"), got, expected, strict=True):
        torch.testing.assert_close(a, b, **chain_tolerances(sums, b), msg=lambda m, n=name: f"{n}: {m}")


def _native_runs(monkeypatch) -> list:
    calls = []
    apply = native_attention.NativeSegmentAttention.apply

    def spy(*args):
        calls.append(args[3])
        return apply(*args)

    monkeypatch.setattr(native_attention.NativeSegmentAttention, "apply", spy)
    return calls


@pytest.mark.parametrize(
    "prefix, lengths, heads, dim",
    [
        (14, [58, 31, 42, 31], (9, 3), 64),  # a W1 row at SmolLM2's heads
        (0, [5, 1, 12], (6, 2), 16),  # no prefix; a one-token sample
        (3, [130, 70, 2], (4, 4), 32),  # samples past one block of queries; no grouped heads
        (5, [9], (8, 1), 16),  # one sample: the tasks split by query head
        (20, [1, 1], (2, 1), 128),
    ],
)
def test_equals_the_masked_row(prefix, lengths, heads, dim, monkeypatch):
    segments, leaves = _row(prefix, lengths, heads, dim)
    calls = _native_runs(monkeypatch)
    got = _results(lambda *x: segment_attention(*x, segments), leaves)
    assert calls == [segments]
    expected = _results(lambda *x: _masked(*x, segments), leaves)
    _assert_same_results(got, expected, leaves)


GROUPS = [
    [(14, [58, 31]), (9, [42]), (0, [7]), (20, [1, 12, 5])],  # prefixes of their own; a group without
    [(0, [5, 6]), (3, [130, 2])],  # a first group without a prefix; past one block of queries
]


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("native", ["on", "off"])
def test_a_row_of_groups_equals_the_masked_row(groups, native, monkeypatch):
    """Each group's samples see their own prefix only: in one kernel call, or block by block
    through the other backends where the kernel is off."""
    set_switches({"TWINKLE_NATIVE_ATTENTION": native})
    segments, leaves = _grouped_row(groups, (9, 3), 64)
    calls = _native_runs(monkeypatch)
    got = _results(lambda *x: segment_attention(*x, segments), leaves)
    assert len(calls) == (1 if native == "on" else 0)
    _assert_same_results(got, _results(lambda *x: _masked(*x, segments), leaves), leaves)


def test_a_group_sees_nothing_of_another_groups_prefix():
    """Changing group 0's prefix keys moves group 0's outputs only."""
    segments, leaves = _grouped_row([(6, [4, 3]), (5, [4])], (6, 2), 16)
    before = segment_attention(*leaves, segments).detach()
    key = leaves[1].detach().clone()
    key[:, :, :6] += 1.0
    after = segment_attention(leaves[0], key, leaves[2], segments).detach()
    second = segments.blocks[1][0]
    assert torch.equal(after[:, second:], before[:, second:])
    assert not torch.allclose(after[:, 6:13], before[:, 6:13])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 compiler flag")
def test_the_eight_float_build_equals_the_masked_row_too(fresh_library, monkeypatch, tmp_path):
    """The build this machine does not pick by itself where it has AVX-512 (the other is
    covered by the tests above wherever they run)."""
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path))
    monkeypatch.setattr(native_attention, "FLAGS", [*native_attention.FLAGS, "-mno-avx512f"])
    assert native_attention.lanes() == 8
    segments, leaves = _row(14, [58, 31, 130, 3], (9, 3), 64)
    calls = _native_runs(monkeypatch)
    got = _results(lambda *x: segment_attention(*x, segments), leaves)
    assert len(calls) == 1
    _assert_same_results(got, _results(lambda *x: _masked(*x, segments), leaves), leaves)


def test_scaling_is_the_one_given():
    segments, leaves = _row(2, [6, 3])
    out = segment_attention(*leaves, segments, scaling=0.5)
    expected = _masked(leaves[0] * (0.5 * 16**0.5), *leaves[1:], segments)
    # attention's chain of fp32 sums (tolerances.py); a scaling of 1/4 instead of 1/2 is off by ~1e-1
    torch.testing.assert_close(out, expected, **chain_tolerances(attention_sums(11, 16, 3), expected))


def test_the_same_bits_on_one_thread_and_on_two():
    segments, leaves = _row(14, [58, 31, 80, 3], (9, 3), 64)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _results(lambda *x: segment_attention(*x, segments), leaves)
        torch.set_num_threads(2)
        two = _results(lambda *x: segment_attention(*x, segments), leaves)
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "case",
    ["switched off", "one long sample", "dropout", "window", "head dim", "float64"],
)
def test_rows_it_does_not_take(case, monkeypatch):
    prefix, lengths, dim, dtype, kwargs = 2, [6, 3], 16, torch.float32, {}
    if case == "switched off":
        set_switches({"TWINKLE_NATIVE_ATTENTION": "off"})
    elif case == "one long sample":  # on 8-float vectors (AVX2)
        monkeypatch.setattr(native_attention, "lanes", lambda: 8)
        prefix, lengths = 0, [native_attention.LONG_SAMPLE]
    elif case == "dropout":
        kwargs = {"dropout": 0.1}
    elif case == "window":
        kwargs = {"sliding_window": 4}
    elif case == "head dim":
        dim = 8
    else:
        dtype = torch.float64
    segments, leaves = _row(prefix, lengths, dim=dim)
    leaves = [t.detach().to(dtype).requires_grad_() for t in leaves]
    calls = _native_runs(monkeypatch)
    out = segment_attention(*leaves, segments, **kwargs)
    assert calls == []
    assert out.shape == (1, segments.length, 6, dim)


def test_with_wide_vectors_it_takes_one_long_sample(monkeypatch):
    monkeypatch.setattr(native_attention, "lanes", lambda: native_attention.WIDE)
    segments, leaves = _row(0, [native_attention.LONG_SAMPLE], (6, 2), 16)
    calls = _native_runs(monkeypatch)
    got = _results(lambda *x: segment_attention(*x, segments), leaves)
    assert len(calls) == 1
    _assert_same_results(got, _results(lambda *x: _masked(*x, segments), leaves), leaves)


def test_without_a_compiler_the_row_runs_on_torch_with_one_warning(fresh_library, monkeypatch, caplog):
    monkeypatch.setattr(native_attention, "COMPILER", "no-such-compiler-here")
    segments, leaves = _row(2, [6, 3])
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        first = segment_attention(*leaves, segments)
        segment_attention(*leaves, segments)
    warnings = [r.getMessage() for r in caplog.records if "native attention" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler-here" in warnings[0]
    expected = _masked(*leaves, segments)  # the same SDPA call, maybe in other orders (tolerances.py)
    torch.testing.assert_close(first, expected, **chain_tolerances(attention_sums(11, 16, 3), expected))


def test_a_failed_build_says_why_and_leaves_nothing_behind(fresh_library, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_attention, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        assert native_attention.library() is None
    assert any("failed" in r.getMessage() for r in caplog.records)
    assert [p.name for p in (tmp_path / "native").iterdir() if not p.name.endswith(".lock")] == []


def test_built_once_then_loaded_and_a_damaged_file_built_again(fresh_library, monkeypatch, tmp_path):
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path))
    builds = []
    compile_ = native_build.compile_library
    monkeypatch.setattr(native_build, "compile_library", lambda *a: builds.append(a) or compile_(*a))
    assert native_attention.library() is not None
    (built,) = [p for p in (tmp_path / "native").iterdir() if p.suffix == ".so"]
    assert len(builds) == 1
    monkeypatch.setattr(native_attention, "_state", {})  # a later process: loads the file
    registry.forget()
    assert native_attention.library() is not None
    assert len(builds) == 1
    # e.g. a disk that filled up mid-write; checked in a new process, since this one holds the
    # library (a new file: writing into the one this process has mapped would crash it)
    damaged = tmp_path / "damaged"
    damaged.write_bytes(b"not a shared library")
    damaged.replace(built)
    check = "from twinkle.kernel.attention import native as n; assert n.library() is not None"
    env = {**os.environ, "TWINKLE_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=300)
    assert built.read_bytes()[:4] == b"\x7fELF"
    segments, leaves = _row(2, [6, 3])
    expected = _masked(*leaves, segments)  # attention's chain of fp32 sums (tolerances.py)
    torch.testing.assert_close(
        segment_attention(*leaves, segments),
        expected,
        **chain_tolerances(attention_sums(11, 16, 3), expected),
    )


def test_a_row_first_run_under_inference_mode_still_trains(monkeypatch):
    """The row's task plan is cached; a plan made under ``inference_mode`` (teacher scoring of
    the rows the student trains on) must not be an inference tensor the backward cannot save."""
    native_attention.tasks.cache_clear()
    segments, leaves = _row(3, [5, 4], seed=7)
    calls = _native_runs(monkeypatch)
    with torch.inference_mode():
        segment_attention(*(t.detach() for t in leaves), segments)
    segment_attention(*leaves, segments).sum().backward()
    assert calls == [segments, segments]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
