"""Upstream's Tinker DPO through the official SDK (the reference from ``disable_lora``, then
``importance_sampling`` with ``ref_logps``): ``forward_backward`` and ``optim_step`` report the DPO
metrics, the same numbers the local ``DPOMetric`` computes for the same step in-process. And the
request fields the SDK sends that the server could otherwise misread: ``train_unembed`` (True
refused by name, False honoured), ``optimizer_params`` (read like ``adam_params``), a datum's
provenance spans (refused by name)."""

import numpy as np
import pytest
import tinker
import torch
from serving import KEY_A
from test_client_scripts import EPS_BOUND, PAIRS
from test_server import adapter_of
from tinker import types

from twinkle.server.common import input_feature_to_datum

LR = 1e-2
BETA = 0.1
# what DPOMetric reports with a reference, and the window's mean loss
DPO_KEYS = {"chosen_logps", "rejected_logps", "chosen_reward", "rejected_reward", "reward_margin"}
DPO_KEYS |= {"reward_accuracy", "pairs", "loss"}
ADAM = {"learning_rate": LR, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}


def _trainer(server, tiny_model_dir, **lora):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    return client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, **lora).result()


def _dpo_step(tc, calls: int = 1) -> tuple[dict, list[dict]]:
    """Upstream's ``client/tinker/dpo.py`` step on ``PAIRS``, its forward_backward sent ``calls``
    times before the step: (optim_step's metrics, each forward_backward's metrics)."""
    data = [input_feature_to_datum(row) for row in PAIRS]
    ref = tc.forward(data, "cross_entropy", loss_fn_config={"disable_lora": True}).result()
    for datum, out in zip(data, ref.loss_fn_outputs, strict=True):
        datum.loss_fn_inputs["ref_logps"] = types.TensorData.from_numpy(
            np.asarray(out["logprobs"].tolist(), dtype=np.float32)
        )
    config = {"dpo_beta": BETA, "dpo_sft_weight": 0.0}
    calls_out = [
        tc.forward_backward(data, "importance_sampling", loss_fn_config=config).result() for _ in range(calls)
    ]
    optim = tc.optim_step(types.AdamParams(**ADAM)).result()
    return optim.metrics, [c.metrics for c in calls_out]


def test_tinker_dpo_reports_the_local_dpo_metric_at_optim_step(server, tiny_model_dir):
    from peft import LoraConfig

    from twinkle.model import MultiLoraTransformersModel

    tc = _trainer(server, tiny_model_dir, train_unembed=False)
    remote = [_dpo_step(tc) for _ in range(2)]
    name, _ = adapter_of(server, tc.model_id)
    local = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=8)
    config = LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    local.add_adapter_to_model(name, config)
    local.set_loss("DPOLoss", adapter_name=name, beta=BETA)
    local.add_metric("DPOMetric", adapter_name=name, beta=BETA)
    local.set_optimizer("AdamW", lr=LR, adapter_name=name, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    expected = []
    for _ in range(2):
        ref = local.forward_only(inputs=PAIRS, adapter_name=name, disable_lora=True)
        local.forward_backward(inputs=PAIRS, adapter_name=name, ref_outputs=ref)
        local.clip_grad_and_step(max_grad_norm=0.0, adapter_name=name)
        expected.append(local.calculate_metric(is_training=True, adapter_name=name))
    for (metrics, (call,)), want in zip(remote, expected, strict=True):
        assert DPO_KEYS <= set(metrics), sorted(DPO_KEYS - set(metrics))
        for key in DPO_KEYS:
            np.testing.assert_allclose(metrics[key], want[key], rtol=EPS_BOUND, atol=EPS_BOUND, err_msg=key)
            suffixed = key + (":sum" if key == "pairs" else ":mean")
            if key != "loss":  # the call reports its own pairs, under the SDK's suffixes
                np.testing.assert_allclose(call[suffixed], metrics[key], rtol=1e-6, atol=1e-7, err_msg=key)
        # one call in the window: the window's mean loss per pair is the call's
        assert metrics["pairs"] == 2 and call["loss:mean"] == pytest.approx(metrics["loss"], rel=1e-6)
    first, second = remote[0][0], remote[1][0]
    # at the first step the adapter adds nothing yet: the policy is the reference, each pair's
    # sigmoid loss -log sigmoid(0) = ln 2
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] == pytest.approx(np.log(2), rel=1e-5)
    assert second["reward_margin"] != 0.0  # the second step's policy is not the reference


def test_the_window_of_several_calls_is_reported_once(server, tiny_model_dir):
    tc = _trainer(server, tiny_model_dir, train_unembed=False)
    metrics, calls = _dpo_step(tc, calls=2)
    assert metrics["pairs"] == 4 and len(calls) == 2
    assert metrics["loss"] == pytest.approx(calls[0]["loss:mean"], rel=1e-6)  # the same pairs twice
    ce = [input_feature_to_datum(row) for row in PAIRS]
    tc.forward_backward(ce, "cross_entropy").result()
    after = tc.optim_step(types.AdamParams(learning_rate=0.0)).result().metrics
    assert not DPO_KEYS & set(after)  # the DPO window ended with its step


def test_train_unembed_true_is_refused_by_name_and_false_is_honoured(server, tiny_model_dir):
    assert types.LoraConfig(rank=4).train_unembed is True  # the SDK's default, as sent without patch
    with pytest.raises(tinker.BadRequestError, match=r"lora_config\.train_unembed' = True is not supported"):
        _trainer(server, tiny_model_dir, train_unembed=True)
    tc = _trainer(server, tiny_model_dir, train_unembed=False)
    _, state = adapter_of(server, tc.model_id)
    assert state and not any("lm_head" in k or "embed" in k for k in state), sorted(state)


def test_init_tinker_client_makes_train_unembed_false_the_sdks_default(server, tiny_model_dir):
    """Upstream's scripts call ``init_tinker_client`` and leave ``train_unembed`` out; an explicit
    True is still refused."""
    from twinkle_client.tinker_patch import patch_tinker

    patch_tinker()
    tc = _trainer(server, tiny_model_dir)
    assert tc.model_id in server.app.state.server.registry.runs
    with pytest.raises(tinker.BadRequestError, match="train_unembed"):
        _trainer(server, tiny_model_dir, train_unembed=True)


def test_optimizer_params_are_read_as_adam_params_are(server, tiny_model_dir):
    """The SDK's third name for the step's parameters is read (a learning rate of 0 leaves the
    adapter as it was), and two names at once are refused."""
    import httpx

    tc = _trainer(server, tiny_model_dir, train_unembed=False)
    data = [input_feature_to_datum(row) for row in PAIRS]
    tc.forward_backward(data, "cross_entropy").result()
    _, before = adapter_of(server, tc.model_id)
    before = {k: v.clone() for k, v in before.items()}
    headers = {"X-API-Key": KEY_A}
    params = {"type": "adamw", "learning_rate": 0.0}
    with httpx.Client(base_url=server.url + "/api/v1", headers=headers, timeout=30) as http:
        body = {"model_id": tc.model_id, "optimizer_params": params}
        request_id = http.post("/optim_step", json=body).json()["request_id"]
        done = http.post("/retrieve_future", json={"request_id": request_id})
        while done.status_code == 408:  # not done yet
            done = http.post("/retrieve_future", json={"request_id": request_id})
        assert "metrics" in done.json(), done.text
        both = {"model_id": tc.model_id, "adam_params": params, "optimizer_params": params}
        refused = http.post("/optim_step", json=both)
    assert refused.status_code == 400 and "not several" in refused.text
    _, after = adapter_of(server, tc.model_id)
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, atol=0, rtol=0)


def test_a_datum_with_provenance_spans_is_refused_by_name(server, tiny_model_dir):
    tc = _trainer(server, tiny_model_dir, train_unembed=False)
    datum = input_feature_to_datum(PAIRS[0])
    n = datum.model_input.length
    span = types.SampledProvenanceSpan(sequence_id="s-0", length=n)
    with pytest.raises(Exception, match="provenance spans"):
        tc.forward_backward([datum.with_provenance([span], [span])], "cross_entropy").result()


def test_twinkle_client_warns_of_each_lora_field_the_server_does_not_apply():
    import warnings

    from peft import LoraConfig

    from twinkle_client.adapter import warn_unapplied

    with pytest.warns(UserWarning, match=r"lora_dropout=0\.05 is not applied over twinkle server"):
        warn_unapplied(
            "default", LoraConfig(target_modules="all-linear", r=8, lora_alpha=32, lora_dropout=0.05)
        )
    with pytest.warns(UserWarning, match=r"lora_alpha=8, target_modules=\['q_proj'\]"):
        warn_unapplied("default", {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unapplied("default", LoraConfig(target_modules="all-linear", r=8, lora_alpha=32))
