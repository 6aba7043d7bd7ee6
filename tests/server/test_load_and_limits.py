"""The server under load and against a tenant who asks for too much: one tenant's largest legal
sample does not hold up another's training step; sliced sampling draws the tokens a whole one
does; a sample's cost and a runaway learning rate are refused or undone with a message; refusals
carry the SDK's retry headers; ``/metrics`` is the operator's, ``/usage`` each tenant's own."""

import time

import httpx
import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A, KEY_B, Running, free_port, start
from test_server import datum
from tinker import types

from twinkle.server.state import Limits

V1 = "/api/v1"
OPERATOR = "tml-operator-0123456789"


def _post(server, route: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{V1}/{route}", json=body, headers={"X-API-Key": key}, timeout=30)


def _result(server, key: str, request_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = _post(server, "retrieve_future", key, {"request_id": request_id})
        if r.status_code != 408:
            return r
    raise AssertionError("no answer in time")


def _slow_model(tmp_path):
    """A Llama wide enough that 64 samples of 1500 tokens take tens of seconds on one core, whose
    stop tokens are nearly never drawn (so every row runs its whole budget)."""
    from tiny import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path / "slow-model"
    tok = build_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharp next-token distributions, the stop tokens' logits at 0
        model.lm_head.weight.mul_(40)
        model.lm_head.weight[[tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]] = 0
    model.save_pretrained(out)
    return out


@pytest.mark.slow
def test_another_tenants_step_finishes_within_2_s_of_the_largest_legal_sample(tmp_path):
    model = _slow_model(tmp_path)
    big = Limits(max_tokens=64 * 1500 + 100)
    server = start(model, tmp_path / "srv", keys={KEY_A: big, KEY_B: Limits()})
    try:
        s = server.app.state.server
        sampler = _post(server, "create_sampling_session", KEY_A, {"base_model": str(model)}).json()
        body = {
            "sampling_session_id": sampler["sampling_session_id"],
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
            "num_samples": 64,
            "sampling_params": {"max_tokens": 1500, "temperature": 1.0, "seed": 1},
        }
        r = _post(server, "asample", KEY_A, body)
        assert r.status_code == 200, r.text
        big_request = r.json()["request_id"]
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        trainer = client.create_lora_training_client(
            base_model=str(model), rank=4, train_unembed=False
        ).result()
        d = datum([5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1])
        trainer.forward_backward([d], "cross_entropy").result()  # its first step makes the optimizer
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        deadline = time.monotonic() + 30
        while not s.queue.started and time.monotonic() < deadline:  # A's sample is decoding
            time.sleep(0.01)
        assert s.queue.started
        latencies = []
        for _ in range(3):
            start_ = time.monotonic()
            trainer.forward_backward([d], "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            latencies.append(time.monotonic() - start_)
        assert max(latencies) < 2.0, latencies
        assert not s.queue.futures[big_request].done.is_set()  # A's sample was under way all along
    finally:
        server.stop()


def test_a_sliced_sample_draws_the_tokens_of_a_whole_one_with_training_between_slices(tiny_model_dir):
    from twinkle.server.core import ModelCore
    from twinkle.server.wire import Datum

    torch.manual_seed(0)
    core = ModelCore(str(tiny_model_dir), max_loras=3, max_r=8)
    core.add("sampled", 4)
    core.add("trained", 4)
    prompt, params = [5, 6, 7, 8, 9], {"max_tokens": 24, "temperature": 1.0}
    whole = core.sample("sampled", prompt, params, 4, 7)
    steps, slices = core.sample_steps("sampled", prompt, params, 4, 7, slice_seconds=0.0), 0
    tokens = np.arange(5, 15)
    data = [Datum(tokens, {"target_tokens": tokens + 1, "weights": np.ones(10, dtype=np.float32)})]
    while True:
        try:
            next(steps)
        except StopIteration as end:
            sliced = end.value
            break
        slices += 1
        core.run_datums("trained", data, "cross_entropy", {}, forward_only=False)
        core.optim_step("trained", {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}, 0.0)
    assert slices > 10  # one per decoding step at slice 0
    assert [t for t, _, _ in sliced] == [t for t, _, _ in whole]
    assert [r for _, _, r in sliced] == [r for _, _, r in whole]
    for (_, got, _), (_, want, _) in zip(sliced, whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # another summation order at most


def test_a_sample_is_refused_before_it_queues_when_it_costs_too_much(tiny_model_dir, tmp_path):
    server = start(tiny_model_dir, tmp_path / "srv", max_tokens=1000)
    try:
        sampler = _post(server, "create_sampling_session", KEY_A, {"base_model": str(tiny_model_dir)}).json()
        base = {"sampling_session_id": sampler["sampling_session_id"], "sampling_params": {"max_tokens": 8}}
        long_prompt = {"chunks": [{"type": "encoded_text", "tokens": [5] * 600}]}
        r = _post(server, "asample", KEY_A, {**base, "prompt": long_prompt, "prompt_logprobs": True})
        assert r.status_code == 400 and "at most 512 positions" in r.json()["detail"]
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
        body = {**base, "prompt": prompt, "num_samples": 64, "sampling_params": {"max_tokens": 100}}
        r = _post(server, "asample", KEY_A, body)
        assert r.status_code == 413 and r.headers["x-should-retry"] == "false"
        assert "costs 6403 tokens" in r.json()["detail"] and "max_tokens of 1000" in r.json()["detail"]
        # the SDK raises at once instead of retrying
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        sc = client.create_sampling_client(base_model=str(tiny_model_dir))
        start_ = time.monotonic()
        with pytest.raises(Exception, match="max_tokens of 1000"):
            sc.sample(
                types.ModelInput.from_ints([5, 6, 7]), 64, types.SamplingParams(max_tokens=100)
            ).result()
        assert time.monotonic() - start_ < 10
        assert not server.app.state.server.queue.futures  # nothing was queued
    finally:
        server.stop()


def test_a_runaway_learning_rate_is_an_error_and_the_adapter_goes_back(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    d = datum([5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1])

    def loss() -> float:
        return tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"]

    loss()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    good = loss()
    tc.optim_step(types.AdamParams(learning_rate=1e30)).result()  # finite weights, a broken model
    with pytest.raises(Exception, match="rolled back to before that step; lower the learning rate"):
        loss()
    again = loss()
    assert again == pytest.approx(good, rel=1e-6)  # the weights of before the 1e30 step
    # a step that overflows the weights themselves is undone at once
    with pytest.raises(Exception, match="made the adapter's weights non-finite: the step was undone"):
        tc.optim_step(types.AdamParams(learning_rate=1e39)).result()
    assert loss() == pytest.approx(good, rel=1e-6)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert np.isfinite(loss())


def test_a_rate_limited_request_says_when_to_retry(tiny_model_dir, tmp_path):
    server = start(tiny_model_dir, tmp_path / "srv", rate=1.0)
    try:
        answers = [_post(server, "create_session", KEY_A, {}) for _ in range(6)]
        refused = [r for r in answers if r.status_code == 429]
        assert refused, [r.status_code for r in answers]
        headers = refused[0].headers
        assert headers["x-should-retry"] == "true" and 0 < float(headers["retry-after-ms"]) <= 1000
        assert "rate limit of 1 requests/s" in refused[0].json()["detail"]
    finally:
        server.stop()


def _with_operator(tiny_model_dir, tmp_path):
    from twinkle.server import ServerConfig, create_app

    config = ServerConfig(
        model_id=str(tiny_model_dir),
        max_loras=4,
        max_r=8,
        output_dir=tmp_path / "srv",
        keys={KEY_A: Limits(), KEY_B: Limits()},
        operator_keys=(OPERATOR,),
    )
    return Running(create_app(config), free_port())


def test_metrics_are_the_operators_and_usage_is_each_tenants_own(tiny_model_dir, tmp_path, server):
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(f"{server.url}/metrics").status_code == 404  # no operator key: off
    running = _with_operator(tiny_model_dir, tmp_path)
    try:
        url = running.url
        client = tinker.ServiceClient(base_url=url, api_key=KEY_A)
        tc = client.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=4, train_unembed=False
        ).result()
        tc.forward_backward([datum([5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1])], "cross_entropy").result()
        for headers in ({}, {"X-API-Key": KEY_A}, {"Authorization": f"Bearer {KEY_A}"}):
            assert httpx.get(f"{url}/metrics", headers=headers).status_code == 401
        r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }
        assert samples[("twinkle_server_tokens_total", (("kind", "trained"),))] == 5
        assert samples[("twinkle_server_runs", (("state", "live"),))] == 1
        assert samples[("twinkle_server_adapter_slots", (("state", "used"),))] == 1
        assert samples[("twinkle_server_request_seconds_count", (("lane", "train"),))] == 2
        assert ("twinkle_server_queue_depth", (("lane", "sample"),)) in samples
        tenant_a = running.app.state.server.tenants[KEY_A].id
        assert tenant_a not in r.text and KEY_A not in r.text  # no tenant is named
        mine = httpx.get(f"{url}{V1}/usage", headers={"X-API-Key": KEY_A}).json()
        theirs = httpx.get(f"{url}{V1}/usage", headers={"X-API-Key": KEY_B}).json()
        assert mine["runs"] == {"live": 1, "parked": 0} and mine["tokens"]["trained"] == 5
        assert mine["requests"]["train"] == 2
        assert theirs["runs"] == {"live": 0, "parked": 0} and theirs["tokens"]["trained"] == 0
        assert httpx.get(f"{url}{V1}/usage", headers={"X-API-Key": OPERATOR}).status_code == 401
    finally:
        running.stop()


def test_a_temperature_too_small_to_divide_by_is_refused_before_it_queues(server, tiny_model_dir):
    sampler = _post(server, "create_sampling_session", KEY_A, {"base_model": str(tiny_model_dir)}).json()
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    for temperature in (1e-45, 1e-7):
        body = {
            "sampling_session_id": sampler["sampling_session_id"],
            "prompt": prompt,
            "sampling_params": {"max_tokens": 4, "temperature": temperature},
        }
        r = _post(server, "asample", KEY_A, body)
        assert (
            r.status_code == 400
            and "temperature must be 0 (greedy) or a number >= 1e-06" in r.json()["detail"]
        )
    body["sampling_params"]["temperature"] = 1e-6  # the smallest accepted: the argmax, no error
    rid = _post(server, "asample", KEY_A, body).json()["request_id"]
    assert _result(server, KEY_A, rid).status_code == 200
