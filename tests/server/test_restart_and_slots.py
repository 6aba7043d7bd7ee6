"""A client that outlives a server restart goes on with the same ids; training and sampling go on
when every adapter slot is taken (the least recently used run is parked and comes back whole)."""

import httpx
import numpy as np
import tinker
from serving import KEY_A, KEY_B, free_port, start
from test_server import ROWS, adapter_of, assert_same_adapter, datum, local_train
from tinker import types

LR = 1e-2
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


def step(tc, rows) -> float:
    out = tc.forward_backward([datum(*r) for r in rows], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    return out.metrics["loss:sum"]


def test_a_client_goes_on_with_the_same_ids_after_a_restart(tiny_model_dir, tmp_path):
    """One step, ``save_state``, the server stopped (nothing is written at shutdown, so this is
    what a kill leaves) and started again on the same folder and port: the same SDK objects
    train on from the saved state, sample from the same sampler id, and make new clients."""
    out, port = tmp_path / "srv", free_port()
    running = start(tiny_model_dir, out, port=port)
    client = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
    tc = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    losses = [step(tc, ROWS["a"])]
    saved = tc.save_state("s1").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    scored = sampler.compute_logprobs(PROMPT).result()
    running.stop()

    running = start(tiny_model_dir, out, port=port)
    try:
        assert not running.app.state.server.registry.runs[tc.model_id].live  # loaded on demand
        losses.append(step(tc, ROWS["a"]))  # the same model id: restored from s1 (with AdamW)
        name, state = adapter_of(running, tc.model_id)
        expected_state, expected_losses = local_train(tiny_model_dir, name, ROWS["a"], steps=2)
        np.testing.assert_allclose(losses, expected_losses, atol=1e-5, rtol=0)
        assert_same_adapter(state, expected_state)
        np.testing.assert_allclose(
            sampler.compute_logprobs(PROMPT).result()[1:], scored[1:], atol=1e-5, rtol=0
        )  # the same sampler id, the same weights
        again = client.create_training_client_from_state(saved).result()  # the same client id
        assert again.model_id != tc.model_id
        runs = (
            tinker.RestClient(base_url=running.url, api_key=KEY_A).list_training_runs().result().training_runs
        )
        assert {r.training_run_id for r in runs} == {tc.model_id, again.model_id}
    finally:
        running.stop()


def test_a_run_without_a_saved_state_is_a_clear_404_after_a_restart(tiny_model_dir, tmp_path):
    """One run never saved; another saved once, and its save is deleted after the restart."""
    out, port = tmp_path / "srv", free_port()
    running = start(tiny_model_dir, out, port=port)
    client = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
    never = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    once = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    saved = once.save_state("s1").result().path
    running.stop()
    running = start(tiny_model_dir, out, port=port)
    try:
        tinker.RestClient(base_url=running.url, api_key=KEY_A).delete_checkpoint_from_tinker_path(
            saved
        ).result()
        head = {"X-API-Key": KEY_A}

        def optim_step(tc) -> httpx.Response:
            body = {"model_id": tc.model_id, "adam_params": {"learning_rate": 1e-3}}
            return httpx.post(f"{running.url}/api/v1/optim_step", json=body, headers=head)

        r = optim_step(never)
        assert r.status_code == 404 and "no saved state to resume from" in r.json()["detail"]
        r = optim_step(once)  # queued: restoring it fails in the worker, and its future says why
        fut = httpx.post(
            f"{running.url}/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=head
        ).json()
        assert "no saved state left to resume from" in fut["error"]
    finally:
        running.stop()


def test_sampling_and_training_when_every_slot_is_taken(tiny_model_dir, tmp_path):
    """One slot: tenant A's run holds it; sampling the base model, tenant B's new run and B's
    steps each park the run that holds it, and A's run comes back whole each time, so A ends
    with the adapter of its solo run."""
    running = start(tiny_model_dir, tmp_path / "srv", max_loras=1)
    try:
        client_a = tinker.ServiceClient(base_url=running.url, api_key=KEY_A)
        tc_a = client_a.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=4, train_unembed=False
        ).result()
        losses = [step(tc_a, ROWS["a"])]
        base = client_a.create_sampling_client(base_model=str(tiny_model_dir)).result()
        params = types.SamplingParams(max_tokens=3, seed=1, stop=[])
        assert len(base.sample(PROMPT, 1, params).result().sequences[0].tokens) == 3
        runs = running.app.state.server.registry.runs
        assert runs[tc_a.model_id].parked is not None  # parked for the sampler's slot
        losses.append(step(tc_a, ROWS["a"]))
        client_b = tinker.ServiceClient(base_url=running.url, api_key=KEY_B)
        tc_b = client_b.create_lora_training_client(
            base_model=str(tiny_model_dir), rank=4, train_unembed=False
        ).result()
        step(tc_b, ROWS["b"])
        losses.append(step(tc_a, ROWS["a"]))
        assert runs[tc_b.model_id].parked is not None and runs[tc_a.model_id].live
        name, state = adapter_of(running, tc_a.model_id)
        expected_state, expected_losses = local_train(tiny_model_dir, name, ROWS["a"], steps=3)
        np.testing.assert_allclose(losses, expected_losses, atol=1e-5, rtol=0)
        assert_same_adapter(state, expected_state)
        weights = running.app.state.server.registry.folder(runs[tc_a.model_id]) / "weights"
        assert len(list(weights.glob("parked-*"))) == 1  # only the newest park is kept
    finally:
        running.stop()
