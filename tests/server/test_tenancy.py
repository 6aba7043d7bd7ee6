"""Keys, isolation of tenants' checkpoints, limits, malformed requests, and a kill -9."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import tinker
from serving import KEY_A, KEY_B, free_port, start
from tinker import types

V1 = "/api/v1"


def trained_client(url: str, key: str, base: str):
    client = tinker.ServiceClient(base_url=url, api_key=key)
    tc = client.create_lora_training_client(base_model=base, rank=4, train_unembed=False).result()
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1, 1, 1]},
    )
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return client, tc


def test_a_wrong_or_missing_key_is_refused(server):
    for headers in ({}, {"X-API-Key": "tml-not-a-key"}, {"X-API-Key": KEY_A + "x"}):
        r = httpx.post(f"{server.url}{V1}/create_session", json={}, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["detail"]
    with pytest.raises(Exception, match="401|API key"):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").get_server_capabilities()


def test_one_tenant_cannot_read_load_or_sample_anothers_checkpoint(server, tiny_model_dir):
    _, tc = trained_client(server.url, KEY_A, str(tiny_model_dir))
    state = tc.save_state("mine").result().path
    weights = tc.save_weights_for_sampler("mine").result().path
    intruder = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    head = {"X-API-Key": KEY_B}
    assert httpx.get(f"{server.url}{V1}/training_runs/{tc.model_id}", headers=head).status_code == 404
    assert (
        httpx.get(f"{server.url}{V1}/training_runs/{tc.model_id}/checkpoints", headers=head).status_code
        == 404
    )
    assert intruder.create_rest_client().list_training_runs().result().training_runs == []
    for path in (state, weights):
        r = httpx.post(
            f"{server.url}{V1}/load_weights", json={"path": path, "optimizer": False}, headers=head
        )
        assert r.status_code == 404 and "does not exist for this key" in r.json()["detail"]
        r = httpx.post(
            f"{server.url}{V1}/create_sampling_session",
            json={"session_id": "x", "sampling_session_seq_id": 0, "model_path": path},
            headers=head,
        )
        assert r.status_code == 404
    with pytest.raises(Exception, match="404|does not exist"):
        intruder.create_training_client_from_state(state).result()
    r = httpx.post(
        f"{server.url}{V1}/forward_backward",
        content=b"",
        headers={**head, "Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 400
    # the owner still can
    own = (
        tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        .create_training_client_from_state(state)
        .result()
    )
    assert own.model_id != tc.model_id


def test_per_key_limits_answer_429(tiny_model_dir, tmp_path):
    from twinkle.server.state import Limits

    running = start(tiny_model_dir, tmp_path / "srv", keys={KEY_A: Limits(max_adapters=1, rate=2.0)})
    try:
        head = {"X-API-Key": KEY_A}
        body = {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": str(tiny_model_dir),
            "lora_config": {"rank": 2},
        }
        assert httpx.post(f"{running.url}{V1}/create_model", json=body, headers=head).status_code == 200
        time.sleep(0.5)  # the run is live once its future ran
        r = httpx.post(f"{running.url}{V1}/create_model", json=body, headers=head)
        assert r.status_code == 429 and "max_adapters" in r.json()["detail"]
        codes = [httpx.get(f"{running.url}{V1}/training_runs", headers=head).status_code for _ in range(12)]
        assert 429 in codes  # a bucket of 4 s at 2 requests/s
    finally:
        running.stop()


def _fwdbwd_body(model_id: str, tokens=(5, 6, 7), targets=(6, 7, 8), weights=(1.0, 1.0, 1.0)) -> bytes:
    import numpy as np
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    for name, values, dtype, code in (
        ("target_tokens", targets, np.int64, pb.DTYPE_INT64),
        ("weights", weights, np.float32, pb.DTYPE_FLOAT32),
    ):
        t = d.loss_fn_inputs[name]
        t.dtype = code
        t.shape.append(len(values))
        t.dense = np.asarray(values, dtype=dtype).tobytes()
    return msg.SerializeToString()


def test_twenty_malformed_requests_each_get_a_4xx_and_the_server_keeps_serving(server, tiny_model_dir):
    _, tc = trained_client(server.url, KEY_A, str(tiny_model_dir))
    mid = tc.model_id
    head = {"X-API-Key": KEY_A}
    proto = {**head, "Content-Type": "application/x-protobuf"}
    url = server.url + V1
    json_cases = [
        ("create_model", b"{not json", "not valid JSON"),
        ("create_model", b"[1, 2]", "JSON object"),
        ("create_model", b'{"base_model": "gpt-9", "lora_config": {"rank": 2}}', "not served here"),
        ("create_model", b'{"lora_config": {"rank": "four"}}', "must be int"),
        ("create_model", b'{"lora_config": {"rank": 999}}', "out of range"),
        ("optim_step", b'{"model_id": "nope", "adam_params": {}}', "not one of this key"),
        (
            "optim_step",
            b'{"model_id": "%s", "adam_params": {"learning_rate": "fast"}}' % mid.encode(),
            "must be",
        ),
        ("optim_step", b'{"model_id": "%s", "adam_params": {"learning_rate": NaN}}' % mid.encode(), "finite"),
        ("optim_step", b'{"model_id": 7}', "must be str"),
        ("save_weights", b'{"model_id": "%s", "path": "../escape"}' % mid.encode(), "plain name"),
        (
            "asample",
            b'{"prompt": {"chunks": [{"tokens": [1, -3]}]}, "sampling_params": {}}',
            "tokens must be",
        ),
        ("asample", b'{"prompt": {"chunks": []}, "sampling_params": {"max_tokens": 5}}', "no tokens"),
        ("retrieve_future", b'{"request_id": "does-not-exist"}', "not one of this key"),
    ]
    codes = []
    for route, raw, expect in json_cases:
        r = httpx.post(f"{url}/{route}", content=raw, headers={**head, "Content-Type": "application/json"})
        codes.append(r.status_code)
        assert 400 <= r.status_code < 500 and expect in r.json()["detail"], (route, r.status_code, r.text)
    proto_cases = [
        (b"\xff\xff\xff", "not a ForwardBackwardRequest"),
        (_fwdbwd_body("unknown"), "not one of this key"),
        (_fwdbwd_body(mid, targets=(6, 7)), "has 2 values for 3 input tokens"),
        (_fwdbwd_body(mid, weights=(1.0, float("nan"), 1.0)), "NaN"),
        (_fwdbwd_body(mid, tokens=(5, 6, 10**6)), "outside the vocabulary"),
        (
            _fwdbwd_body(mid, tokens=tuple(range(5, 5 + 3000)), targets=(6,) * 3000, weights=(1.0,) * 3000),
            None,
        ),
        (_fwdbwd_body(mid, targets=(6, 7, 10**6)), "target token id"),
    ]
    for raw, expect in proto_cases:
        r = httpx.post(f"{url}/forward_backward", content=raw, headers=proto)
        if r.status_code == 200:  # checked on the model's side: the future fails, the request only
            fut = httpx.post(
                f"{url}/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=head
            ).json()
            assert "error" in fut and (expect is None or expect in fut["error"]), fut
            codes.append(400)
            continue
        codes.append(r.status_code)
        assert 400 <= r.status_code < 500 and (expect is None or expect in r.json()["detail"]), r.text
    assert len(json_cases) + len(proto_cases) == 20 and all(400 <= c < 500 for c in codes)
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6]),
        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]},
    )
    assert tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0


def test_an_exception_in_a_step_fails_that_request_only(server, tiny_model_dir):
    _, tc_a = trained_client(server.url, KEY_A, str(tiny_model_dir))
    _, tc_b = trained_client(server.url, KEY_B, str(tiny_model_dir))
    core = server.app.state.server.engine.core
    real, broken = core.run_datums, server.app.state.server.registry.runs[tc_a.model_id].adapter

    def flaky(name, *args, **kwargs):
        if name == broken:
            raise RuntimeError("boom inside the step")
        return real(name, *args, **kwargs)

    core.run_datums = flaky
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6]),
        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]},
    )
    with pytest.raises(Exception, match="boom inside the step"):
        tc_a.forward_backward([d], "cross_entropy").result()
    assert tc_b.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0
    core.run_datums = real
    assert tc_a.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0


def test_the_queue_takes_tenants_in_turn():
    from twinkle.server.queue import Queue

    queue, ran, gate, running = Queue(), [], threading.Event(), threading.Event()
    queue.submit("a", lambda: (running.set(), gate.wait()))  # holds the worker while the rest queue up
    assert running.wait(10)
    ids = [queue.submit("a", lambda i=i: ran.append(f"a{i}")) for i in range(4)]
    ids += [queue.submit("b", lambda i=i: ran.append(f"b{i}")) for i in range(2)]
    gate.set()
    for rid in ids:
        assert queue.futures[rid].done.wait(10)
    queue.stop()
    assert ran == ["a0", "b0", "a1", "b1", "a2", "a3"]


@pytest.mark.slow
def test_kill_9_during_a_step_then_restart_keeps_every_saved_checkpoint(tiny_model_dir, tmp_path):
    """``twinkle server`` as its own process, killed with requests in flight; a new server on
    the same folder (in this process) lists every saved checkpoint, and each loads."""
    out = tmp_path / "srv"
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "twinkle.cli.main",
        "server",
        "--model-id",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--output-dir",
        str(out),
        "--max-r",
        "8",
    ]
    env = {**os.environ, "TWINKLE_API_KEYS": f"{KEY_A},{KEY_B}", "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"

    def launch() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}{V1}/healthz").status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.2)
        proc.kill()
        raise AssertionError("the server did not start: " + proc.stderr.read().decode()[-2000:])

    proc = launch()
    try:
        _, tc = trained_client(url, KEY_A, str(tiny_model_dir))
        saved = [tc.save_state("s1").result().path, tc.save_weights_for_sampler("w1").result().path]
        d = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3},
        )
        tc.forward_backward([d] * 8, "cross_entropy")  # in flight
        tc.save_state("s2")  # perhaps half written when the kill comes
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    restarted = start(tiny_model_dir, out)  # the same folder, a new process's state
    try:
        client = tinker.ServiceClient(base_url=restarted.url, api_key=KEY_A)
        rest = client.create_rest_client()
        listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert set(saved) <= set(listed)
        for path in listed:
            if "/weights/" in path:
                client.create_training_client_from_state_with_optimizer(path).result()
            else:
                sampler = client.create_sampling_client(model_path=path).result()
                assert len(sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()) == 3
    finally:
        restarted.stop()
