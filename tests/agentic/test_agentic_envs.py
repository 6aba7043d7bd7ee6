"""Environments: the pool's slots and seeds, the bundled calculator task, OpenSpiel's blackjack,
OpenEnv over HTTP (a local server) and its one-line refusal when nothing answers."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from scripted import CountingEnv

from twinkle.utils.errors import UserError
from twinkle_agentic.envs import ArithmeticEnv, EnvPool, EnvTool, OpenEnv, answer_reward, calculate
from twinkle_agentic.tools import ToolManager


def test_pool_slots_are_separate_and_seeded():
    pool = EnvPool(4, env_cls=ArithmeticEnv, seed=5)
    first = [a.reset().observation for a in pool.get_adapters(4)]
    again = EnvPool(4, env_cls="twinkle_agentic.envs.arithmetic:ArithmeticEnv", seed=5)
    assert [again.reset(i).observation for i in range(4)] == first
    assert len(set(first)) == 4  # each slot its own episode
    assert pool.reset(0).observation != first[0]  # the next episode of a slot is another
    step = pool.step_batch(
        [1, 2], ["calculator", "calculator"], [{"expression": "6 * 7"}, {"expression": "1/0"}]
    )
    assert step[0].observation == "42" and step[1].observation.startswith("Error:")
    with pytest.raises(UserError, match="the pool has 4 slots"):
        pool.get_adapters(5)
    with pytest.raises(UserError, match="outside the pool"):
        pool.step(9, "calculator", {})
    with pytest.raises(UserError, match="has no 'Nope'"):
        EnvPool(1, env_cls="twinkle_agentic.envs:Nope")


def test_env_tool_and_rewards():
    env = CountingEnv(goal=2)
    (tool,) = EnvTool.from_env(env)
    manager = ToolManager([tool])
    first = manager.execute({"function": {"name": "add", "arguments": {"n": 1}}})
    second = manager.execute({"function": {"name": "add", "arguments": {"n": 1}}})
    assert (first.content, first.done, second.done, second.reward) == ("total=1", False, True, 1.0)
    assert tool.episode_reward == 1.0 and tool.done


def test_calculator_task():
    assert calculate("12 * (3 + 4)") == 84 and calculate("7 / 2") == 3.5
    for bad in ("__import__('os')", "2 ** 99999", "x"):
        with pytest.raises(ValueError):
            calculate(bad)
    env = ArithmeticEnv()
    start = env.reset(seed=1)
    a, b = start.info["question"]
    assert start.observation == f"What is {a} * {b}?" and start.info["answer"] == a * b
    assert answer_reward(f"so {a} * {b} = {a * b}", a * b) == 1.0
    assert answer_reward(f"{a * b + 1}", a * b) == 0.0 and answer_reward("no idea", a * b) == 0.0


def test_openspiel_blackjack():
    pytest.importorskip("pyspiel")
    from twinkle_agentic.envs import OpenSpielEnv

    env = OpenSpielEnv("blackjack")
    assert env.tools()[0]["function"]["parameters"]["properties"]["action"]["enum"] == ["hit", "stand"]
    first = env.reset(seed=3)
    assert "Your actions: hit, stand" in first.observation and not first.done
    assert env.reset(seed=3).observation == first.observation  # a seed replays the deal
    bad = env.step("play", {"action": "fold"})
    assert bad.observation.startswith("Error:") and not bad.done
    end = env.step("play", {"action": "stand"})
    assert end.done and end.reward in (-1.0, 0.0, 1.0) and "Game over" in end.observation


class _Handler(BaseHTTPRequestHandler):
    """An OpenEnv-style server: /reset and /step answer {observation, reward, done}."""

    count = 0

    def do_POST(self):  # noqa: N802 (the stdlib's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/reset":
            _Handler.count = 0
            answer = {"observation": {"text": "ready"}, "reward": 0.0, "done": False}
        else:
            _Handler.count += body["action"]["n"]
            answer = {
                "observation": {"text": f"at {_Handler.count}"},
                "reward": 1.0,
                "done": _Handler.count >= 2,
            }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_openenv_over_http_to_a_local_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = OpenEnv(
            base_url=f"http://127.0.0.1:{server.server_port}", action_mapper=lambda name, args: args
        )
        assert env.reset().observation == "ready"
        step = env.step("move", {"n": 2})
        assert (step.observation, step.reward, step.done) == ("at 2", 1.0, True)
    finally:
        server.shutdown()


def test_openenv_without_a_server_is_one_line():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UserError, match="no environment server answers") as info:
        OpenEnv(base_url=f"http://127.0.0.1:{port}", timeout=2)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="one of them"):
        OpenEnv()
    with pytest.raises(UserError, match="not supported yet"):
        OpenEnv(env_name="openspiel_env")


def test_openenv_in_process_class():
    class Game:
        def reset(self):
            return {"observation": "go", "reward": 0, "done": False}

        def step(self, action):
            return {"observation": {"message": f"did {action['move']}"}, "reward": 2, "done": True}

    env = OpenEnv(env_cls=Game, action_mapper=lambda name, args: {"move": args["to"]})
    assert env.reset(seed=1).observation == "go"
    assert env.step("m", {"to": "north"}) == type(env.step("m", {"to": "north"}))("did north", 2.0, True)
