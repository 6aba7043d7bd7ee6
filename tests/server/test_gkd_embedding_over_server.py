"""Distillation (``GKDLoss`` on a teacher's top-k) and embedding training (``task='embedding'``,
``InfonceLoss``, ``EmbeddingMetric``) over ``twinkle server``, through the Tinker SDK and through
``twinkle_client``: the losses, embeddings, metric numbers and trained adapter equal the same
steps on the local API (``twinkle.server.model_steps`` runs the model's own step)."""

import numpy as np
import pytest
import tinker
import torch
from peft import LoraConfig
from serving import KEY_A
from tinker import types
from tolerances import adamw_weight_atol, run_loss_rtol

from twinkle.loss import GKDLoss, InfonceLoss
from twinkle.model import MultiLoraTransformersModel

LR, STEPS, K = 1e-2, 3, 5
ADAM = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}  # Tinker's defaults
GKD_ARGS = {"beta": 0.5, "temperature": 2.0, "topk": 4}  # top-4 of the teacher's 5 tokens
ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, -100, 7, 8, 9, 10]},
    {"input_ids": [11, 12, 13, 14], "labels": [-100, -100, 13, 14]},
]
TEXTS = [[30, 31, 32, 33], [40, 41, 42], [50, 51, 52, 53, 54], [60, 61], [70, 71, 72], [80, 81, 82, 83]]
PAIRS = [{"input_ids": t, "labels": [1 - i % 2]} for i, t in enumerate(TEXTS)]  # anchor, positive, ...
METRIC_KEYS = ("pos_sim", "pos_sim_min", "pos_sim_max", "neg_sim", "retrieval_accuracy")


def teacher(vocab: int) -> dict[str, torch.Tensor]:
    """A teacher's top-K in the local layout ``(B, L, K)``: position i scores token i + 1."""
    g = torch.Generator().manual_seed(0)
    logps = torch.log_softmax(3 * torch.randn(len(ROWS), 6, vocab, generator=g), -1).topk(K, -1)
    return {"teacher_topk_logprobs": logps.values, "teacher_topk_indices": logps.indices}


def local_model(tiny_model_dir, adapter: str) -> MultiLoraTransformersModel:
    """The server's model and LoRA (rank 4, alpha 32, every linear layer), AdamW as it steps."""
    model = MultiLoraTransformersModel(str(tiny_model_dir), max_loras=2, max_r=8)
    config = LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
    model.add_adapter_to_model(adapter, config)
    model.set_optimizer("AdamW", adapter_name=adapter, **ADAM)
    return model


def local_steps(model, adapter: str, step) -> list[float]:
    losses = []
    for _ in range(STEPS):
        losses.append(float(step()))
        model.clip_grad_norm(0.0, adapter_name=adapter)
        model.step(adapter_name=adapter)
        model.zero_grad(adapter_name=adapter)
    return losses


def assert_same_run(server, run_id: str, losses, expected, expected_state, rows: int, tokens: int) -> None:
    s = server.app.state.server
    state = s.engine.core.adapter_state(s.registry.runs[run_id].adapter)
    np.testing.assert_allclose(losses, expected, rtol=run_loss_rtol(rows, tokens), atol=0)
    assert losses[-1] < losses[0]  # it trained
    assert state.keys() == expected_state.keys()
    # the later steps' losses already check the adapters they ran under; a weight may still be
    # apart by what AdamW can move one whose gradient is within its rounding of zero
    atol = adamw_weight_atol(LR, STEPS, (0.9, 0.95))
    for k, v in expected_state.items():
        torch.testing.assert_close(state[k], v, atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def adapter_of(server, run_id: str) -> str:
    return server.app.state.server.registry.runs[run_id].adapter


def gkd_datum(row: dict, b: int, tensors: dict) -> types.Datum:
    """The Tinker datum of row ``b``: shifted, and the teacher's (n, k) arrays on its inputs."""
    ids, n = row["input_ids"], len(row["input_ids"]) - 1
    weights = [float(lab != -100) for lab in row["labels"][1:]]
    logps = tensors["teacher_topk_logprobs"][b, :n].numpy()
    indices = tensors["teacher_topk_indices"][b, :n].numpy()
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": weights,
            "teacher_topk_logprobs": types.TensorData.from_numpy(np.ascontiguousarray(logps)),
            "teacher_topk_indices": types.TensorData.from_numpy(np.ascontiguousarray(indices)),
        },
    )


def training_client(server, tiny_model_dir):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    return client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()


def test_gkd_through_the_sdk_and_twinkle_client_equals_the_local_step(server, tiny_model_dir):
    vocab = server.app.state.server.engine.vocab
    tensors = teacher(vocab)
    config = {"twinkle_loss": "GKDLoss", **{k: float(v) for k, v in GKD_ARGS.items()}}

    tc = training_client(server, tiny_model_dir)
    data = [gkd_datum(row, b, tensors) for b, row in enumerate(ROWS)]
    sdk_losses = []
    for _ in range(STEPS):
        out = tc.forward_backward(data, "cross_entropy", loss_fn_config=config).result()
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        sdk_losses.append(out.metrics["loss:mean"])
        assert out.metrics["num_tokens:sum"] == 6  # the trained targets
        assert out.loss_fn_outputs[0]["logprobs"].shape == [5]  # the student's, per target

    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel as ClientModel

    init_twinkle_client(server.url, KEY_A)
    remote = ClientModel()
    remote.add_adapter_to_model("student", LoraConfig(r=4))
    remote.set_optimizer("AdamW", lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    remote.set_loss("GKDLoss", **GKD_ARGS)
    client_losses = []
    for _ in range(STEPS):
        client_losses.append(float(remote.forward_backward(inputs=ROWS, **tensors)))
        assert remote.clip_grad_and_step(0.0)
    with pytest.raises(ValueError, match="needs the teacher"):
        remote.forward_backward(inputs=ROWS)

    for run_id, losses in ((tc.model_id, sdk_losses), (remote.runs["student"].model_id, client_losses)):
        adapter = adapter_of(server, run_id)
        model = local_model(tiny_model_dir, adapter)
        model.set_loss(GKDLoss(**GKD_ARGS), adapter_name=adapter)
        expected = local_steps(
            model, adapter, lambda m=model, a=adapter: m.forward_backward(ROWS, adapter_name=a, **tensors)
        )
        assert_same_run(server, run_id, losses, expected, model.slots.export(adapter), len(ROWS), 6)


def test_embedding_training_and_metric_over_twinkle_client_equal_the_local_ones(server, tiny_model_dir):
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel as ClientModel

    init_twinkle_client(server.url, KEY_A)
    remote = ClientModel()
    remote.add_adapter_to_model("emb", LoraConfig(r=4))
    remote.set_optimizer("AdamW", lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    remote.set_loss("InfonceLoss", temperature=0.07, use_batch=True, hard_negatives=None)
    remote.add_metric("EmbeddingMetric", is_training=True)
    losses, metrics = [], []
    for _ in range(STEPS):
        out = remote.forward_backward(inputs=PAIRS, task="embedding")
        assert out.result["embeddings"].shape[0] == len(PAIRS)
        losses.append(float(out))
        assert remote.clip_grad_and_step(0.0)
        metrics.append(remote.calculate_metric(is_training=True).result)
    searched = remote.forward_only([{"input_ids": t} for t in TEXTS], task="embedding").result

    run_id = remote.runs["emb"].model_id
    adapter = adapter_of(server, run_id)
    model = local_model(tiny_model_dir, adapter)
    model.set_loss(InfonceLoss(temperature=0.07), adapter_name=adapter)
    model.add_metric("EmbeddingMetric", is_training=True, adapter_name=adapter)
    expected, expected_metrics = [], []
    for _ in range(STEPS):
        expected.append(float(model.forward_backward(PAIRS, task="embedding", adapter_name=adapter)))
        model.clip_grad_norm(0.0, adapter_name=adapter)
        model.step(adapter_name=adapter)
        model.zero_grad(adapter_name=adapter)
        expected_metrics.append(model.calculate_metric(is_training=True, adapter_name=adapter))
    assert_same_run(server, run_id, losses, expected, model.slots.export(adapter), len(PAIRS), 5)
    for got, want in zip(metrics, expected_metrics, strict=True):
        for key in METRIC_KEYS:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    local = model.forward_only([{"input_ids": t} for t in TEXTS], task="embedding", adapter_name=adapter)
    torch.testing.assert_close(searched["embeddings"], local["embeddings"].cpu(), atol=1e-5, rtol=0)
    assert np.isnan(searched["loss"]) and np.isnan(local["loss"])  # texts for search: no loss


def test_embedding_through_the_sdk_returns_the_local_embeddings_and_refuses_by_name(server, tiny_model_dir):
    tc = training_client(server, tiny_model_dir)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row["input_ids"]),
            loss_fn_inputs={"labels": types.TensorData.from_numpy(np.asarray(row["labels"], dtype=np.int64))},
        )
        for row in PAIRS
    ]
    config = {"twinkle_task": "embedding", "twinkle_loss": "InfonceLoss", "temperature": 0.07}
    out = tc.forward(data, "cross_entropy", loss_fn_config=config).result()
    embeddings = torch.stack([torch.tensor(o["embeddings"].tolist()) for o in out.loss_fn_outputs])

    model = local_model(tiny_model_dir, adapter_of(server, tc.model_id))
    model.set_loss(InfonceLoss(temperature=0.07), adapter_name=adapter_of(server, tc.model_id))
    local = model.forward_only(PAIRS, task="embedding", adapter_name=adapter_of(server, tc.model_id))
    torch.testing.assert_close(embeddings, local["embeddings"].cpu(), atol=1e-5, rtol=0)
    assert out.metrics["loss:mean"] == pytest.approx(local["loss"], rel=1e-5)
    assert out.metrics["num_tokens:sum"] == 3  # three groups

    def refused(data, config, forward_only=False) -> str:
        call = tc.forward if forward_only else tc.forward_backward
        with pytest.raises(Exception) as err:
            call(data, "cross_entropy", loss_fn_config=config).result()
        return str(err.value)

    bad = types.Datum(
        model_input=data[0].model_input,
        loss_fn_inputs={**data[0].loss_fn_inputs, "weights": [1.0] * len(PAIRS[0]["input_ids"])},
    )
    assert "'weights' is not read by task 'embedding'" in refused([bad, *data[1:]], config)
    unmarked = [types.Datum(model_input=d.model_input, loss_fn_inputs={}) for d in data]
    assert "needs loss_fn_inputs['labels']" in refused(unmarked, config)
    assert "takes no argument 'gamma'" in refused(data, {**config, "gamma": 1.0})
    assert "trains embeddings" in refused(data, {"twinkle_loss": "InfonceLoss"})
    zero = types.TensorData.from_numpy(np.zeros(1, dtype=np.int64))
    anchorless = [types.Datum(model_input=d.model_input, loss_fn_inputs={"labels": zero}) for d in data]
    assert "first row must start a group" in refused(anchorless, config)

    tensors = teacher(server.app.state.server.engine.vocab)
    gkd = {"twinkle_loss": "GKDLoss"}
    scored = tc.forward(
        [gkd_datum(r, b, tensors) for b, r in enumerate(ROWS)], "cross_entropy", loss_fn_config=gkd
    )
    model.set_loss(GKDLoss(), adapter_name=adapter_of(server, tc.model_id))
    evaluated = model.forward_only(ROWS, adapter_name=adapter_of(server, tc.model_id), **tensors)
    assert scored.result().metrics["loss:mean"] == pytest.approx(float(evaluated), rel=1e-5)
    datum = gkd_datum(ROWS[0], 0, tensors)
    flat = {**datum.loss_fn_inputs}
    flat["teacher_topk_indices"] = types.TensorData.from_numpy(
        tensors["teacher_topk_indices"][0, :5].reshape(-1).numpy()
    )
    assert "send (5, k)" in refused([types.Datum(model_input=datum.model_input, loss_fn_inputs=flat)], gkd)
    extra = {**datum.loss_fn_inputs, "advantages": [0.0] * 5}
    assert "'advantages' is not read by GKDLoss" in refused(
        [types.Datum(model_input=datum.model_input, loss_fn_inputs=extra)], gkd
    )
