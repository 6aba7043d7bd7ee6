"""Tinker's semantics through the official SDK: the step applies the gradient of the summed loss;
sampling scores prompt log-probs, their top-k, chosen prompt tokens and the sampled tokens'
top-k; checkpoint TTLs, listing and deletion; an unimplemented route is a 404 naming it."""

import threading
import time

import httpx
import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A
from test_server import ROWS, adapter_of, assert_same_adapter, datum, local_train
from tinker import types

V1 = "/api/v1"


def _client(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    return client, client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()


def test_the_step_applies_the_gradient_of_the_summed_loss(server, tiny_model_dir):
    """At learning rate 0 the weights stay put, so two windows on the same rows have the same
    gradient up to the reduction: the default (Tinker's sum) is T times twinkle_client's token
    mean, T = 6 trained tokens (weights 1, 1, 1, 1 and 1, 0.5; the zeros do not count)."""
    _, tc = _client(server, tiny_model_dir)
    data = [datum(*r) for r in ROWS["a"]]
    norms = []
    for config in (None, {"twinkle_reduction": "token_mean"}):
        tc.forward_backward(data, "cross_entropy", config).result()
        metrics = tc.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics
        norms.append(metrics["grad_norm"])
    assert norms[1] > 0 and norms[0] == pytest.approx(6 * norms[1], rel=1e-5)
    tc.forward_backward(data, "cross_entropy").result()
    with pytest.raises(Exception, match="call optim_step first"):  # one reduction per window
        tc.forward_backward(data, "cross_entropy", {"twinkle_reduction": "token_mean"}).result()


def test_a_client_side_custom_loss_gets_its_exact_gradient(server, tiny_model_dir):
    """``forward_backward_custom`` sends ``weights = -dC/dlogp`` with the cross-entropy loss: with
    the summed gradient the step is C's own, so C = -sum(w * logp) trains as cross_entropy does,
    over steps of 6, 4 and 6 trained tokens."""

    def neg_ll(data, logprobs):
        loss = sum(
            -(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True)
        )
        return loss, {}

    _, tc = _client(server, tiny_model_dir)
    schedule = [ROWS["a"], ROWS["a"][:1], ROWS["a"]]
    losses = []
    for rows in schedule:
        out = tc.forward_backward_custom([datum(*r) for r in rows], neg_ll).result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(out.metrics["loss:sum"])
    name, state = adapter_of(server, tc.model_id)
    expected_state, expected_losses = local_train(tiny_model_dir, name, None, 0, schedule=schedule)
    np.testing.assert_allclose(losses, expected_losses, atol=1e-5, rtol=0)
    assert_same_adapter(state, expected_state)


def _reference_logps(server, tiny_model_dir, ids: list[int]) -> torch.Tensor:
    """Row i: log p(next | ids[:i + 1]) of the base model, loaded by transformers in the server
    model's dtype (a base-model sampler's LoRA B is zero)."""
    from transformers import AutoModelForCausalLM

    dtype = next(server.app.state.server.engine.core.model.model.parameters()).dtype
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=dtype).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_sampling_scores_topk_targets_and_the_last_n(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    sampler = client.create_sampling_client(base_model=str(tiny_model_dir)).result()
    prompt = [5, 6, 7, 8, 9]
    target = np.array([[6, -1], [7, 100], [8, 0], [9, 42]], dtype=np.int64)  # (len(prompt) - 1, K)
    out = sampler.sample(
        types.ModelInput.from_ints(prompt),
        2,
        types.SamplingParams(max_tokens=3, seed=7, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=2,
        target_prompt_logprobs=types.TensorData.from_numpy(target),
    ).result()
    ref = _reference_logps(server, tiny_model_dir, prompt)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = out.topk_prompt_logprobs[i]
        expected = torch.topk(ref[i - 1], 3)
        assert [t for t, _ in top] == expected.indices.tolist()
        np.testing.assert_allclose([lp for _, lp in top], expected.values.numpy(), atol=1e-4)
    assert out.topk_prompt_logprobs[0] is None
    got = np.asarray(out.target_prompt_logprobs.data, dtype=np.float32).reshape(target.shape)
    for (i, j), t in np.ndenumerate(target):
        assert got[i, j] == (0.0 if t < 0 else pytest.approx(ref[i, t].item(), abs=1e-4))
    for seq in out.sequences:
        full = _reference_logps(server, tiny_model_dir, prompt + list(seq.tokens))
        for pos, entry in enumerate(seq.topk_logprobs):
            row = full[len(prompt) - 1 + pos]
            assert [t for t, _ in entry] == torch.topk(row, 2).indices.tolist()
            assert seq.logprobs[pos] == pytest.approx(row[seq.tokens[pos]].item(), abs=1e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=2).result()
    assert last[:3] == [None] * 3
    np.testing.assert_allclose(last[3:], out.prompt_logprobs[3:], atol=1e-5, rtol=0)


def test_checkpoint_ttl_listing_metadata_and_deletion(server, tiny_model_dir):
    client, tc = _client(server, tiny_model_dir)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    keep = tc.save_state("keep", user_metadata={"note": "mine"}).result().path
    brief = tc.save_weights_for_sampler("brief", ttl_seconds=1).result().path
    gone = tc.save_state("gone").result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed.keys() == {keep, brief, gone}
    assert listed[keep].user_metadata == {"note": "mine"} and listed[keep].expires_at is None
    assert listed[brief].expires_at is not None
    with pytest.raises(Exception, match="exists already"):  # the SDK's overwrite=False
        tc.save_state("keep").result()
    rest.delete_checkpoint_from_tinker_path(gone).result()
    rest.set_checkpoint_ttl_from_tinker_path(keep, 3600).result()
    time.sleep(1.2)  # past brief's TTL
    mine = rest.list_user_checkpoints().result().checkpoints
    assert [c.tinker_path for c in mine] == [keep] and mine[0].expires_at is not None
    with pytest.raises(Exception, match="does not exist"):
        client.create_sampling_client(model_path=brief).result()
    r = httpx.put(
        f"{server.url}{V1}/training_runs/{tc.model_id}/checkpoints/weights/keep/ttl",
        json={"ttl_seconds": -5},
        headers={"X-API-Key": KEY_A},
    )
    assert r.status_code == 400 and "ttl_seconds must be" in r.json()["detail"]


def test_an_unimplemented_route_is_a_404_naming_it(server):
    r = httpx.post(f"{server.url}{V1}/copy_weights", json={}, headers={"X-API-Key": KEY_A})
    assert r.status_code == 404 and r.headers["x-should-retry"] == "false"
    assert r.json()["detail"].startswith("POST /api/v1/copy_weights (copy_weights) is not implemented")
    assert httpx.get(f"{server.url}{V1}/healthz").json() == {"status": "ok"}


def test_a_queued_request_can_be_cancelled():
    from twinkle.server.queue import Queue

    queue, gate, running = Queue(), threading.Event(), threading.Event()
    queue.submit("a", lambda: (running.set(), gate.wait()))  # holds the worker
    assert running.wait(10)
    ran = []
    rid = queue.submit("a", lambda: ran.append(1))
    assert queue.cancel("a", rid) and queue.futures[rid].error == ("the request was cancelled", "user")
    gate.set()
    done = queue.submit("a", lambda: ran.append(2))
    assert queue.futures[done].done.wait(10) and ran == [2]
    assert not queue.cancel("a", done)  # finished already
    queue.stop()
