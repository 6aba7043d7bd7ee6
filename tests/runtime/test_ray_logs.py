"""The driver's wait for every rank's last lines (``runtime/ray_logs.py``), on Ray's own dispatcher."""

import importlib.util
import threading

import pytest

from twinkle.runtime.ray_logs import END, Drain

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")


@pytest.fixture
def dispatcher():
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    printed = []
    global_worker_stdstream_dispatcher.add_handler(
        "test_print", lambda data: printed.append(list(data["lines"]))
    )
    drain = Drain.install()
    yield global_worker_stdstream_dispatcher, drain, printed
    drain.remove()
    global_worker_stdstream_dispatcher.remove_handler("test_print")


def _batch(lines, is_err):
    return {"lines": lines, "is_err": is_err, "pid": 1, "ip": "127.0.0.1"}


def test_end_lines_are_stripped_before_printing_and_counted_per_rank_and_stream(dispatcher):
    ray_dispatcher, drain, printed = dispatcher
    ray_dispatcher.emit(_batch(["eval loss 1.0", f"{END} 0"], is_err=False))
    ray_dispatcher.emit(_batch([f"{END} 0"], is_err=True))
    assert printed == [["eval loss 1.0"], []]
    assert drain.wait(1, timeout=0.5)
    assert not drain.wait(2, timeout=0.2)  # rank 1 has not ended


def test_wait_returns_when_the_last_end_arrives_and_reset_forgets(dispatcher):
    ray_dispatcher, drain, _ = dispatcher
    ray_dispatcher.emit(_batch([f"{END} 0"], is_err=False))
    later = threading.Timer(0.2, lambda: ray_dispatcher.emit(_batch([f"{END} 0"], is_err=True)))
    later.start()
    assert drain.wait(1, timeout=5)
    later.join()
    drain.reset()
    assert not drain.wait(1, timeout=0.1)


def test_removed_drain_leaves_the_lines_alone(dispatcher):
    ray_dispatcher, drain, printed = dispatcher
    drain.remove()
    ray_dispatcher.emit(_batch([f"{END} 3"], is_err=False))
    assert printed == [[f"{END} 3"]]
