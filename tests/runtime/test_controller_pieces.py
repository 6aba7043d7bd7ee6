"""Pieces of the single controller that need no cluster: what an attribute read on a remote
object returns, how values held on the driver go back to the ranks, and how ``--max-restarts``
runs a script again (``controller_restarts``, with a stand-in script instead of a training run)."""

import json
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from twinkle.distributed.mesh import DeviceMesh
from twinkle.runtime import controller_restarts, remote
from twinkle.runtime.actors import Itself, Local
from twinkle.runtime.run_config import RunDefaults
from twinkle.utils.errors import UserError


@dataclass
class Group:
    cur_step: int = 3
    names: list = field(default_factory=lambda: ["a", "b"])


class Holder:
    def __init__(self) -> None:
        self.groups = {"default": Group()}
        self.keys = {"q_proj", "v_proj"}

    def bump(self, by: int) -> "Holder":
        self.groups["default"].cur_step += by
        return self


def test_plain_attributes_come_back_and_others_are_read_step_by_step():
    obj = Holder()
    assert remote._read_at(obj, (("attr", "keys"),)) == ("value", {"q_proj", "v_proj"})
    assert remote._read_at(obj, (("attr", "groups"),)) == ("view", "dict")  # holds a Group
    assert remote._read_at(obj, (("attr", "groups"), ("item", "default"))) == ("view", "Group")
    path = (("attr", "groups"), ("item", "default"), ("attr", "cur_step"))
    assert remote._read_at(obj, path) == ("value", 3)
    assert remote._call_at(obj, (("attr", "bump"),), (2,), {}) is obj
    assert remote._read_at(obj, path) == ("value", 5)  # read again: the current value
    assert not remote._plain(object()) and remote._plain({"a": [1, 2.0, None, ("x", b"y")]})


def _state(name: str, world: int) -> SimpleNamespace:
    return SimpleNamespace(
        spec=SimpleNamespace(name=name), world=world, mesh=DeviceMesh(fsdp_size=world, dp_size=1)
    )


def test_parts_held_on_the_driver_go_back_to_their_ranks_and_objects_of_the_group_are_local():
    state = _state("model", 2)
    held = remote.Parts("model", [{"logps": [1.0]}, {"logps": [2.0, 3.0]}])
    per_rank = [remote._arguments(None, state, r, "forward_only", (), {"ref_outputs": held}) for r in (0, 1)]
    assert [kwargs["ref_outputs"] for _, kwargs in per_rank] == held.parts  # not sliced, not joined
    assert held["logps"] == [1.0, 2.0, 3.0]  # read on the driver: joined
    with pytest.raises(
        UserError, match=r"group 'model' \(2 parts\) cannot go to group 'sampler' \(1 ranks\)"
    ):
        remote._arguments(None, _state("sampler", 1), 0, "sample", (held,), {})
    other = remote.RemoteObject.__new__(remote.RemoteObject)
    vars(other).update(_group="model", _oid="abc")
    assert remote._arguments(None, state, 1, "add_metric", (other,), {})[0] == (Local("abc"),)
    vars(other).update(_group="sampler")
    with pytest.raises(
        UserError, match="an object of group 'sampler' cannot be an argument of a method of group"
    ):
        remote._arguments(None, state, 0, "add_metric", (other,), {})
    assert Itself() == Itself()  # the marker survives a round trip by value


STAND_IN = """
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
calls = json.loads(out.read_text()) if out.exists() else []
calls.append({"argv": sys.argv[2:], "left": os.environ["TWINKLE_CONTROLLER_RESTARTS_LEFT"]})
out.write_text(json.dumps(calls))
if len(calls) == 1:
    (Path(sys.argv[3]) / "checkpoint-2").mkdir(parents=True)  # this run's checkpoint
sys.exit({codes}[len(calls) - 1])
"""


def _supervise(tmp_path, monkeypatch, codes: list[int], max_restarts: int) -> tuple[int, list]:
    script, calls = tmp_path / "stand_in.py", tmp_path / "calls.json"
    script.write_text(STAND_IN.replace("{codes}", repr(codes)))
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [str(script), str(calls), "--output-dir", str(out), "--lr", "1"])
    monkeypatch.delenv(controller_restarts.ATTEMPT, raising=False)
    run = RunDefaults(output_dir=str(out), max_restarts=max_restarts)
    assert controller_restarts.supervising(run)
    return controller_restarts.supervise(run), json.loads(calls.read_text())


def test_a_dead_rank_restarts_the_script_from_its_newest_checkpoint(tmp_path, monkeypatch):
    restart = controller_restarts.RESTART_EXIT_CODE
    code, calls = _supervise(tmp_path, monkeypatch, [restart, 0], max_restarts=2)
    assert code == 0
    first = ["--output-dir", str(tmp_path / "out"), "--lr", "1"]
    assert calls == [
        {"argv": first, "left": "2"},
        {"argv": [*first, "--resume-from-checkpoint", "auto"], "left": "1"},
    ]


def test_any_other_exit_of_an_attempt_is_the_run_s_exit(tmp_path, monkeypatch):
    code, calls = _supervise(tmp_path, monkeypatch, [2, 0], max_restarts=1)
    assert code == 2 and len(calls) == 1  # a usage error: no restart


def test_an_attempt_takes_no_lock_and_asks_for_a_restart_only_while_one_is_left(monkeypatch):
    run = RunDefaults(lock_output_dir=True, max_restarts=1)
    monkeypatch.setenv(controller_restarts.ATTEMPT, "1")
    assert not controller_restarts.supervising(run)
    assert controller_restarts.for_attempt(run).lock_output_dir is False
    with pytest.raises(SystemExit) as exited:
        controller_restarts.after_death("ray: group 'model' rank 1: the worker process died (x)")
    assert exited.value.code == controller_restarts.RESTART_EXIT_CODE
    monkeypatch.setenv(controller_restarts.ATTEMPT, "0")
    controller_restarts.after_death("the last attempt reports it itself")  # returns
    monkeypatch.delenv(controller_restarts.ATTEMPT)
    assert controller_restarts.for_attempt(run).lock_output_dir is True


def test_a_script_given_with_dash_c_cannot_be_run_again(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["-c"])
    with pytest.raises(UserError, match="run it from a file"):
        controller_restarts.supervise(RunDefaults(max_restarts=1))


def _raise(exc: Exception):
    def fn():
        raise exc

    return fn


def test_a_worker_keeps_a_traceback_for_its_own_error_but_not_for_a_dead_peers(capsys):
    """Ray streams a worker's log to the driver's terminal, where the driver reports a dead rank in
    one line: the ranks left, cut off in a collective, add no traceback after it."""
    from twinkle.runtime.actors import _guard

    gone = RuntimeError(
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:49838: Connection reset by peer"
    )
    assert _guard(_raise(gone))[0] == "error"
    assert "Traceback" not in capsys.readouterr().err
    kind, line = _guard(_raise(RuntimeError("shape mismatch")))
    assert (kind, line) == ("error", "RuntimeError: shape mismatch")
    assert "Traceback" in capsys.readouterr().err
    assert _guard(_raise(UserError("bad\n flag"))) == ("user", "bad flag")
