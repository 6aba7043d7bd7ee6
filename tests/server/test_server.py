"""``twinkle server`` driven by the official Tinker SDK: the same training as the local API, two
tenants isolated from each other, sampling consistent with ``compute_logprobs``."""

import threading

import numpy as np
import tinker
import torch
from peft import LoraConfig
from serving import KEY_A, KEY_B
from tinker import types

from twinkle.loss.token_weighted_ce import TokenWeightedCrossEntropyLoss
from twinkle.model import MultiLoraTransformersModel

LR = 1e-2
# (tokens, weights): the first target of each row is not trained (weight 0)
ROWS = {
    "a": [([5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1]), ([11, 12, 13, 14], [0, 1, 0.5])],
    "b": [([20, 21, 22, 23, 24, 25, 26], [0, 0, 1, 1, 1, 1])],
}


def datum(tokens: list[int], weights: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def sdk_train(url: str, key: str, base: str, rows, steps: int, schedule=None) -> tuple[str, list[float]]:
    """``steps`` cross-entropy steps on ``rows`` (or one step per entry of ``schedule``) through
    the SDK; (model id, loss:sum of each step)."""
    client = tinker.ServiceClient(base_url=url, api_key=key)
    tc = client.create_lora_training_client(base_model=base, rank=4, train_unembed=False).result()
    losses = []
    for step_rows in schedule or [rows] * steps:
        out = tc.forward_backward([datum(*r) for r in step_rows], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        losses.append(out.metrics["loss:sum"])
    return tc.model_id, losses


def _batch(rows) -> tuple[dict, torch.Tensor]:
    """The local API's batch of Tinker rows (tokens, weights): labels where the weight is not 0,
    and the weights aligned with the labels."""
    width = max(len(t) for t, _ in rows)
    batch = {
        k: torch.zeros(len(rows), width, dtype=torch.long)
        for k in ("input_ids", "attention_mask", "position_ids")
    }
    batch["labels"] = torch.full((len(rows), width), -100)
    weights = torch.zeros(len(rows), width)
    for b, (tokens, w) in enumerate(rows):
        n = len(tokens)
        batch["input_ids"][b, :n] = torch.tensor(tokens)
        batch["attention_mask"][b, :n] = 1
        batch["position_ids"][b, :n] = torch.arange(n)
        for i, wi in enumerate(w):  # target tokens[i + 1] has weight w[i]
            weights[b, i + 1] = wi
            if wi:
                batch["labels"][b, i + 1] = tokens[i + 1]
    return batch, weights


def local_train(
    tiny_model_dir, adapter: str, rows, steps: int, sum_gradient: bool = True, schedule=None
) -> tuple[dict, list[float]]:
    """The same steps on the local API: a multi-LoRA model, the token-weighted loss, AdamW with
    Tinker's defaults; (adapter, the summed loss of each step).

    The local step divides the summed gradient by the window's trained-token count T. Tinker's
    (``sum_gradient``) is the gradient of ``-sum(w * logp)`` itself, so the local loop trains on
    the weights ``T * w``: its step then applies ``(1/T) * grad(-sum(T * w * logp))``, the same
    gradient, and its mean loss ``sum(T * w * -logp) / T`` is the summed loss. Without
    ``sum_gradient`` it is the local API as it is (what ``twinkle_client`` asks the server for)."""
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=8)
    config = LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model.add_adapter_to_model(adapter, config)
    model.set_loss(TokenWeightedCrossEntropyLoss(reduction="sum"), adapter_name=adapter)
    model.set_optimizer("AdamW", lr=LR, adapter_name=adapter, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    losses = []
    for step_rows in schedule or [rows] * steps:
        batch, weights = _batch(step_rows)
        trained = int((weights != 0).sum())
        if sum_gradient:
            weights = weights * trained
        mean = model.forward_backward(batch, adapter_name=adapter, loss_weights=weights)
        losses.append(mean if sum_gradient else mean * trained)
        model.clip_grad_norm(0.0, adapter_name=adapter)
        model.step(adapter_name=adapter)
        model.zero_grad(adapter_name=adapter)
    return model.slots.export(adapter), losses


def adapter_of(server, model_id: str) -> tuple[str, dict]:
    s = server.app.state.server
    name = s.registry.runs[model_id].adapter
    return name, s.engine.core.adapter_state(name)


def assert_same_adapter(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(actual[k], v, atol=1e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def test_sdk_loop_matches_the_local_api(server, tiny_model_dir):
    """Steps of 6, 4 and 6 trained tokens: Adam is blind to one constant scale of the gradient,
    not to a scale that changes from step to step, so only Tinker's summed gradient (not the
    token mean) gives the local loop's adapter."""
    schedule = [ROWS["a"], ROWS["a"][:1], ROWS["a"]]
    model_id, losses = sdk_train(server.url, KEY_A, str(tiny_model_dir), None, 0, schedule=schedule)
    name, state = adapter_of(server, model_id)
    expected_state, expected_losses = local_train(tiny_model_dir, name, None, 0, schedule=schedule)
    np.testing.assert_allclose(losses, expected_losses, atol=1e-5, rtol=0)
    assert losses[-1] < losses[0]  # it trained (the first and last steps are on the same rows)
    assert_same_adapter(state, expected_state)


def test_two_tenants_at_once_each_get_their_solo_adapter(server, tiny_model_dir):
    client_b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    probe_b = client_b.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    probe = [datum(*ROWS["b"][0])]
    before = probe_b.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    results: dict[str, tuple] = {}

    def train(tag: str, key: str) -> None:
        results[tag] = sdk_train(server.url, key, str(tiny_model_dir), ROWS[tag], steps=3)

    threads = [threading.Thread(target=train, args=(t, k)) for t, k in (("a", KEY_A), ("b", KEY_B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = probe_b.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after == before  # B's untouched run: A's (and B's other run's) steps changed nothing

    for tag in ("a", "b"):
        name, state = adapter_of(server, results[tag][0])
        expected_state, expected_losses = local_train(tiny_model_dir, name, ROWS[tag], steps=3)
        np.testing.assert_allclose(results[tag][1], expected_losses, atol=1e-5, rtol=0)
        assert_same_adapter(state, expected_state)


def test_samples_log_probs_match_compute_logprobs(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    tc.forward_backward([datum(*r) for r in ROWS["a"]], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=LR)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = [5, 6, 7]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 6 and (seq.stop_reason == "length") == (len(seq.tokens) == 6)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(seq.tokens))).result()
        assert scored[0] is None
        np.testing.assert_allclose(scored[len(prompt) :], seq.logprobs, atol=1e-4, rtol=0)
