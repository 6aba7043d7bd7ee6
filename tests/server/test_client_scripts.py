"""Client scripts of the shapes of upstream's client cookbooks (SFT with gradient accumulation,
DPO with the reference from ``disable_lora``, GRPO with advantages and the sampler's log-probs,
sampling), run through ``twinkle_client`` against a server without keys (upstream's default
``EMPTY_TOKEN``), each checked against the same steps computed in-process.

The bound: the server and the local model compute the same sums of fp32 terms, in orders that
may differ (the server's loss is ``C(logp)`` chained through ``-sum(w * logp)``; padding and
row order differ). Reordering a sum of ``n`` terms moves it by at most ``n * eps * sum|terms|``;
here ``n`` is at most the batch's tokens times the hidden size (64 x 64), so a loss or a
gradient entry of size ~1 moves by ~``4096 * 1.2e-7 ~ 5e-4`` relative in the worst case, and by
``sqrt(n) * eps ~ 1e-5`` in the usual random-walk case, which is the bound taken (on the loss,
relative; on the adapter, absolute after steps of ``lr = 1e-2``, whose Adam updates are of size
``lr``)."""

import numpy as np
import pytest
import torch
from peft import LoraConfig
from serving import Running, free_port

from twinkle.model import MultiLoraTransformersModel as LocalModel

EPS_BOUND = 1e-5
LR = 1e-2
PAIRS = [  # [chosen, rejected] of two prompts: labels on the answer only
    {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
    {"input_ids": [5, 6, 17, 18], "labels": [-100, -100, 17, 18]},
    {"input_ids": [11, 12, 13, 14, 15], "labels": [-100, -100, -100, 14, 15]},
    {"input_ids": [11, 12, 13, 24, 25, 26], "labels": [-100, -100, -100, 24, 25, 26]},
]


@pytest.fixture
def keyless(tiny_model_dir, tmp_path):
    from twinkle.server import ServerConfig, create_app
    from twinkle.server.config import keyless_keys
    from twinkle.server.state import Limits

    torch.manual_seed(0)
    config = ServerConfig(
        model_id=str(tiny_model_dir),
        max_loras=4,
        max_r=8,
        output_dir=tmp_path / "srv",
        keys=keyless_keys("127.0.0.1", Limits()),
        keyless=True,
    )
    running = Running(create_app(config), free_port())
    yield running
    running.stop()


def _client(server):
    import twinkle

    return twinkle.init_twinkle_client(base_url=server.url, api_key="EMPTY_TOKEN")


def _local(tiny_model_dir, adapter: str, loss: str, gas: int = 1, **loss_args) -> LocalModel:
    model = LocalModel(str(tiny_model_dir), max_loras=2, max_r=8)
    config = LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model.add_adapter_to_model(adapter, config, gradient_accumulation_steps=gas)
    model.set_loss(loss, adapter_name=adapter, **loss_args)
    model.set_optimizer("AdamW", lr=LR, adapter_name=adapter)
    return model


def _adapter(server, remote) -> tuple[str, dict]:
    s = server.app.state.server
    run = s.registry.runs[remote.run.model_id]
    return run.adapter, s.engine.core.adapter_state(run.adapter)


def _same_adapter(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(actual[k], v, atol=EPS_BOUND, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_sft_with_accumulation_matches_in_process(keyless, tiny_model_dir):
    from twinkle_client.model import MultiLoraTransformersModel

    _client(keyless)
    model = MultiLoraTransformersModel(model_id=str(tiny_model_dir))
    model.add_adapter_to_model("default", LoraConfig(r=4), gradient_accumulation_steps=2)
    model.set_optimizer("AdamW", lr=LR)
    micro = [PAIRS[:2], PAIRS[2:], PAIRS[1:3], PAIRS[:1]]
    remote_losses, stepped = [], []
    for rows in micro:
        remote_losses.append(float(model.forward_backward(inputs=rows)))
        stepped.append(model.clip_grad_and_step(max_grad_norm=0.0))
    assert stepped == [False, True, False, True]  # gradient_accumulation_steps=2 is honoured
    name, state = _adapter(keyless, model.adapters["default"])
    local = _local(tiny_model_dir, name, "CrossEntropyLoss", gas=2)
    local_losses = []
    for rows in micro:
        local_losses.append(float(local.forward_backward(inputs=rows, adapter_name=name)))
        local.clip_grad_and_step(max_grad_norm=0.0, adapter_name=name)
    np.testing.assert_allclose(remote_losses, local_losses, rtol=EPS_BOUND, atol=0)
    _same_adapter(state, local.slots.export(name))
    assert model.calculate_metric(is_training=True).result["lr"] == LR


def test_dpo_with_reference_from_disable_lora_matches_in_process(keyless, tiny_model_dir):
    from twinkle_client.model import MultiLoraTransformersModel

    _client(keyless)
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    model.set_loss("DPOLoss", beta=0.1, sft_weight=0.5)
    model.set_optimizer("AdamW", lr=LR)
    remote = []
    for _ in range(2):
        ref = model.forward_only(inputs=PAIRS, disable_lora=True)
        remote.append(float(model.forward_backward(inputs=PAIRS, ref_outputs=ref.result)))
        assert model.clip_grad_and_step(max_grad_norm=0.0)
    name, state = _adapter(keyless, model.adapters["default"])
    local = _local(tiny_model_dir, name, "DPOLoss", beta=0.1, sft_weight=0.5)
    expected = []
    for _ in range(2):
        ref = local.forward_only(inputs=PAIRS, adapter_name=name, disable_lora=True)
        expected.append(float(local.forward_backward(inputs=PAIRS, adapter_name=name, ref_outputs=ref)))
        local.clip_grad_and_step(max_grad_norm=0.0, adapter_name=name)
    np.testing.assert_allclose(remote, expected, rtol=EPS_BOUND, atol=0)
    _same_adapter(state, local.slots.export(name))
    # the reference is the base model's: after training, it differs from the adapter's log-probs
    after = model.forward_only(inputs=PAIRS).result["logps"]
    base = model.forward_only(inputs=PAIRS, disable_lora=True).result["logps"]
    torch.testing.assert_close(base, ref_logps_of(local, name), atol=EPS_BOUND, rtol=0)
    assert not torch.allclose(after, base)


def ref_logps_of(local: LocalModel, name: str) -> torch.Tensor:
    return local.forward_only(inputs=PAIRS, adapter_name=name, disable_lora=True)["logps"]


def test_grpo_with_sampled_rows_matches_in_process(keyless, tiny_model_dir):
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import vLLMSampler

    _client(keyless)
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_optimizer("AdamW", lr=LR)
    sampler = vLLMSampler()
    uri = model.save(name="for-sampler", is_sampler=True).twinkle_path
    assert uri.startswith("twinkle://")
    params = {"max_tokens": 4, "temperature": 1.0, "num_samples": 2, "seed": 3, "logprobs": 1}
    responses = sampler.sample(inputs=[{"input_ids": [5, 6, 7]}], sampling_params=params, adapter_uri=uri)
    rows = [seq.new_input_feature for seq in responses[0].sequences]
    old = [[lp[0][1] for lp in seq.logprobs] for seq in responses[0].sequences]
    advantages = [1.0, -1.0]
    loss = float(model.forward_backward(inputs=rows, advantages=advantages, old_logps=old))
    assert model.clip_grad_and_step(max_grad_norm=0.0)
    name, state = _adapter(keyless, model.adapters["default"])
    local = _local(tiny_model_dir, name, "GRPOLoss", epsilon=0.2, beta=0.0)
    expected = float(
        local.forward_backward(inputs=rows, adapter_name=name, advantages=advantages, old_logps=old)
    )
    local.clip_grad_and_step(max_grad_norm=0.0, adapter_name=name)
    np.testing.assert_allclose(loss, expected, rtol=EPS_BOUND, atol=EPS_BOUND)
    _same_adapter(state, local.slots.export(name))


def test_equal_prompts_in_one_call_draw_different_samples(keyless):
    """Each row is a request of its own: a seeded call seeds row i with seed + i (a GRPO group's
    rows are the same prompt; one seed for all would draw the same tokens for each)."""
    from twinkle_client.sampler import vLLMSampler

    _client(keyless)
    sampler = vLLMSampler()
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 3}
    group = sampler.sample(inputs=[{"input_ids": [5, 6, 7]}] * 3, sampling_params=params)
    tokens = [tuple(r.sequences[0].tokens) for r in group]
    assert len(set(tokens)) == 3, tokens
    again = sampler.sample(inputs=[{"input_ids": [5, 6, 7]}] * 3, sampling_params=params)
    assert [tuple(r.sequences[0].tokens) for r in again] == tokens  # still seeded: the same draws


def test_misread_keywords_are_refused(keyless):
    from twinkle_client.model import MultiLoraTransformersModel

    _client(keyless)
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    with pytest.raises(ValueError, match="CrossEntropyLoss does not read ref_logps"):
        model.forward_backward(inputs=PAIRS, ref_outputs={"logps": torch.zeros(4, 6)})
    with pytest.raises(ValueError, match="does not read advantages, old_logps"):
        model.forward_backward(inputs=PAIRS, advantages=[1.0] * 4, old_logps=[[0.0]] * 4)
    model.set_loss("GRPOLoss")
    with pytest.raises(ValueError, match="GRPOLoss needs advantages, old_logps"):
        model.forward_backward(inputs=PAIRS)
    with pytest.raises(Exception, match="save_dir .* must be an absolute path to an existing folder"):
        model.add_adapter_to_model("other", LoraConfig(r=4), save_dir="/nonexistent/twinkle-save-dir")
    with pytest.raises(TypeError, match="'bogus'"):
        model.save("x", bogus=1)
    with pytest.raises(ValueError, match="Accuracy.*argmax"):
        model.add_metric("Accuracy")


def test_dpo_metric_added_by_name_matches_in_process(keyless, tiny_model_dir):
    from twinkle_client.model import MultiLoraTransformersModel

    _client(keyless)
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    model.set_loss("DPOLoss", beta=0.1)
    model.add_metric("DPOMetric", beta=0.1)
    model.set_optimizer("AdamW", lr=LR)
    for _ in range(2):
        ref = model.forward_only(inputs=PAIRS, disable_lora=True)
        model.forward_backward(inputs=PAIRS, ref_outputs=ref.result)
        model.clip_grad_and_step(max_grad_norm=0.0)
        remote = model.calculate_metric(is_training=True).result
    name, _ = _adapter(keyless, model.adapters["default"])
    local = _local(tiny_model_dir, name, "DPOLoss", beta=0.1)
    local.add_metric("DPOMetric", adapter_name=name, beta=0.1)
    for _ in range(2):
        ref = local.forward_only(inputs=PAIRS, adapter_name=name, disable_lora=True)
        local.forward_backward(inputs=PAIRS, adapter_name=name, ref_outputs=ref)
        local.clip_grad_and_step(max_grad_norm=0.0, adapter_name=name)
        expected = local.calculate_metric(is_training=True, adapter_name=name)
    for key in ("chosen_logps", "rejected_logps", "reward_margin", "reward_accuracy", "pairs"):
        np.testing.assert_allclose(remote[key], expected[key], rtol=EPS_BOUND, atol=EPS_BOUND, err_msg=key)
    assert remote["reward_margin"] != 0.0  # the second step's policy is not the reference


def test_save_without_optimizer_and_progress_and_save_dir_are_honoured(keyless, tmp_path):
    from twinkle_client.model import MultiLoraTransformersModel

    client = _client(keyless)
    (tmp_path / "mine").mkdir()  # upstream's rule: the folder exists on the server
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4), save_dir=str(tmp_path / "mine"))
    model.set_optimizer("AdamW", lr=LR)
    model.forward_backward(inputs=PAIRS)
    model.clip_grad_and_step()
    light = model.save("light", save_optimizer=False, consumed_train_samples=40)
    full = model.save("full")
    assert "/sampler_weights/light" in light.twinkle_path and "/weights/full" in full.twinkle_path
    kinds = {
        c.tinker_path.rsplit("/", 2)[-2] + "/" + c.checkpoint_id.split("/")[-1]
        for c in client.list_checkpoints()
    }
    assert {"sampler_weights/light", "weights/full"} <= kinds
    with pytest.raises(ValueError, match="holds no optimizer state"):
        model.load("light", load_optimizer=True)
    assert model.resume_from_checkpoint("light") == {"cur_step": 1, "consumed_train_samples": 40}
    assert model.resume_from_checkpoint(full.twinkle_path) == {"cur_step": 1, "consumed_train_samples": 40}
    # save_dir: each checkpoint is also written to the folder given (a keyless server's own)
    assert (tmp_path / "mine" / "weights" / "full" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "mine" / "sampler_weights" / "light").is_dir()


def test_what_the_client_cannot_serve_yet_is_refused_naming_it(keyless):
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.rollout import ClientMultiTurnRollout

    _client(keyless)
    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("default", LoraConfig(r=4))
    with pytest.raises(ValueError, match="task='embedding'.*embedding training"):
        model.forward_backward(inputs=PAIRS, task="embedding")
    with pytest.raises(ValueError, match="CompletionRewardMetric"):
        model.add_metric("CompletionRewardMetric")
    # upstream's import path gives twinkle_agentic's rollout, loaded only when asked for
    from twinkle_agentic.rollout import ClientMultiTurnRollout as agentic_rollout

    assert ClientMultiTurnRollout is agentic_rollout
