"""The huge-page allocator: large CPU tensors get 2 MiB-aligned blocks marked for huge pages,
small ones stay with torch, it can be put back, and where it cannot be had training goes on.
Training with it gives the same numbers as without: ``tests/model/test_step_semantics.py``."""

import os
import threading

import pytest
import torch

from twinkle.utils import huge_pages
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

MIB = 1 << 20


def floats(mib: float) -> torch.Tensor:
    return torch.empty(int(mib * MIB) // 4)


def test_a_large_tensor_gets_a_huge_page_aligned_marked_block(huge_pages_on):
    before = huge_pages.stats()
    block = floats(5)
    after = huge_pages.stats()
    assert after["made"] == before["made"] + 1 and after["marked"] == before["marked"] + 1
    assert after["live"] == before["live"] + 5 * MIB
    assert block.data_ptr() % (2 * MIB) == 0
    block.fill_(3.0)  # the memory is usable
    assert float(block.sum()) == 3.0 * block.numel()
    del block
    assert huge_pages.stats()["live"] == before["live"]


def test_small_tensors_stay_with_torch(huge_pages_on):
    before = huge_pages.stats()
    small = torch.ones(1000)
    assert huge_pages.stats() == before
    assert small.sum() == 1000


def test_uninstall_gives_torchs_allocator_back_and_frees_its_blocks_later(huge_pages_on):
    made_here = floats(4)
    huge_pages.disable()
    assert not huge_pages.installed()
    before = huge_pages.stats()
    torchs = floats(4)
    assert huge_pages.stats() == before  # torch's own allocator made it
    del made_here  # made by ours, freed after the uninstall: freed by ours
    assert huge_pages.stats()["live"] == before["live"] - 4 * MIB
    del torchs


def test_threads_allocating_at_once_leave_the_books_balanced(huge_pages_on):
    before = huge_pages.stats()["live"]

    def churn(seed: int) -> None:
        for i in range(40):
            block = floats(2 + (seed + i) % 5)
            block.fill_(seed)
            assert block[-1] == seed
            del block

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert huge_pages.stats()["live"] == before


def test_a_forked_child_can_allocate_and_free(huge_pages_on):
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if a block can be made, used and freed
        try:
            block = floats(6)
            block.fill_(1.0)
            ok = float(block.sum()) == block.numel()
            del block
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_an_unknown_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("TWINKLE_HUGE_PAGES", "yes")
    with pytest.raises(UserError, match="TWINKLE_HUGE_PAGES must be 0, 1 or auto"):
        huge_pages.enable()


def test_off_means_off(monkeypatch):
    monkeypatch.setattr(huge_pages, "_state", {"library": None, "failed": None, "warned": False})
    monkeypatch.setenv("TWINKLE_HUGE_PAGES", "0")
    assert huge_pages.enable() is False and huge_pages._state["library"] is None  # not even built


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """The module as a new process has it, with an empty cache folder."""
    monkeypatch.setattr(huge_pages, "_state", {"library": None, "failed": None, "warned": False})
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def warnings_seen(caplog):
    logger = get_logger()
    logger.addHandler(caplog.handler)  # the 'twinkle' logger does not propagate to caplog's root
    yield caplog
    logger.removeHandler(caplog.handler)


def test_without_a_compiler_training_goes_on_and_says_so_once(
    fresh_process, monkeypatch, tmp_path, warnings_seen
):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert huge_pages.enable() is False
    assert huge_pages.enable() is False
    messages = [r.getMessage() for r in warnings_seen.records if "4 KiB pages" in r.getMessage()]
    assert len(messages) == 1
    assert "no-such-compiler" in messages[0] and "TWINKLE_HUGE_PAGES=0" in messages[0]


def test_a_kernel_without_huge_pages_is_not_asked(fresh_process, monkeypatch, tmp_path, warnings_seen):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert huge_pages.enable() is False
    assert huge_pages._state["library"] is None  # nothing built for a kernel that would ignore it
    assert any("'never'" in r.getMessage() for r in warnings_seen.records)
    setting.write_text("always [madvise] never\n")
    assert huge_pages.kernel_offers()


def test_required_but_unbuildable_is_an_error(fresh_process, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TWINKLE_HUGE_PAGES", "1")
    with pytest.raises(
        UserError, match="TWINKLE_HUGE_PAGES=1, but it could not be built: .*no-such-compiler"
    ):
        huge_pages.enable()


def test_a_failed_build_leaves_no_library_behind(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(huge_pages, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="failed"):
        huge_pages.build(tmp_path / "native")
    left = [p.name for p in (tmp_path / "native").iterdir()]
    assert not [name for name in left if name.endswith(".so") or ".tmp-" in name], left
