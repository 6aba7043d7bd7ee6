"""``ClientMultiTurnRollout`` against a running ``twinkle server`` (the tiny model, no keys): a
multi-turn trajectory sampled over HTTP, whose log-probs equal a local forward of the same
weights over the whole trajectory."""

import sys
from pathlib import Path

import pytest
import torch
from test_agentic_rollout_model import STOPS, EveryReplyCalls

from twinkle.data_format import SamplingParams
from twinkle_agentic.rollout import ClientMultiTurnRollout

pytest.importorskip("fastapi")
pytest.importorskip("tinker")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


@pytest.fixture(scope="module", autouse=True)
def _sdk_clients_closed():
    """The SDK clients made here are closed after the module: no session heartbeat outlives its
    server (``sdk_sessions``)."""
    from sdk_sessions import closing_module_clients

    yield from closing_module_clients()


@pytest.fixture
def keyless(tiny_model_dir, tmp_path):
    from serving import Running, free_port

    from twinkle.server import ServerConfig, create_app
    from twinkle.server.config import keyless_keys
    from twinkle.server.state import Limits

    config = ServerConfig(
        model_id=str(tiny_model_dir), max_loras=2, max_r=8, output_dir=tmp_path / "srv",
        keys=keyless_keys("127.0.0.1", Limits()), keyless=True,
    )  # fmt: skip
    running = Running(create_app(config), free_port())
    yield running
    running.stop()


def test_a_rollout_over_http_trains_on_what_the_server_sampled(keyless, tiny_model_dir, template):
    from transformers import AutoModelForCausalLM

    import twinkle
    from twinkle_client.sampler import vLLMSampler

    twinkle.init_twinkle_client(base_url=keyless.url, api_key="EMPTY_TOKEN")
    sampler = vLLMSampler()
    params = SamplingParams(max_tokens=6, seed=2, stop=STOPS)
    rollout = ClientMultiTurnRollout(sampler, template, sampling_params=params, max_turns=3)
    prompts = [{"messages": [{"role": "user", "content": "Who are you?"}]}]
    (out,) = rollout(prompts, tool_manager=[EveryReplyCalls()])
    assert out["turns"] == 3 and "you see room 2" in out["messages"][-2]["content"]
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([out["input_ids"]])
    with torch.no_grad():
        logps = torch.log_softmax(lm(input_ids=ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])[
            :, 0
        ]
    generated = torch.tensor(out["labels"][1:]) != -100
    torch.testing.assert_close(logps[generated], torch.tensor(out["old_logps"]), atol=2e-4, rtol=1e-4)
