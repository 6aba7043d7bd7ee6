"""``twinkle_client``: the local API's names over the server give the local API's training."""

import numpy as np
import torch
from peft import LoraConfig
from serving import KEY_A
from test_server import assert_same_adapter, local_train

# encoded rows in the local API's form: labels aligned with input_ids, -100 where not trained
ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, -100, 7, 8, 9, 10]},
    {"input_ids": [11, 12, 13, 14], "labels": [-100, -100, 13, 14]},
]
AS_WEIGHTS = [([5, 6, 7, 8, 9, 10], [0, 1, 1, 1, 1]), ([11, 12, 13, 14], [0, 1, 1])]


def test_the_local_names_over_the_server_train_as_the_local_api(server, tiny_model_dir):
    from twinkle_client import init_twinkle_client

    client = init_twinkle_client(server.url, KEY_A)
    assert client.base_model == str(tiny_model_dir)
    from twinkle_client.model import MultiLoraTransformersModel

    model = MultiLoraTransformersModel()
    model.add_adapter_to_model("mine", LoraConfig(r=4))
    model.set_optimizer("AdamW", lr=1e-2, adapter_name="mine", betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(inputs=ROWS, adapter_name="mine"))
        assert model.clip_grad_and_step(0.0, adapter_name="mine")
        model.zero_grad(adapter_name="mine")
    s = server.app.state.server
    run = s.registry.runs[model.runs["mine"].model_id]
    expected_state, expected_sums = local_train(
        tiny_model_dir, run.adapter, AS_WEIGHTS, steps=3, sum_gradient=False
    )
    np.testing.assert_allclose(losses, np.array(expected_sums) / 6, atol=1e-5, rtol=0)
    assert_same_adapter(s.engine.core.adapter_state(run.adapter), expected_state)

    sampler = client.Sampler(model.save_for_sampler("s1", adapter_name="mine"))
    (out,) = sampler.sample([5, 6, 7], max_tokens=4, temperature=0.0, stop=[])
    scored = sampler.compute_logprobs([5, 6, 7] + out["tokens"])
    np.testing.assert_allclose(scored[3:], out["logprobs"], atol=1e-4, rtol=0)
    assert torch.tensor(out["logprobs"]).le(0).all()
