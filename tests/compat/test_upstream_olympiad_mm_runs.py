"""Upstream's multimodal RL cookbooks' shapes (``rl/grpo/grpo_mm.py`` and
``rl/gkd/gkd_on_policy.py``) run in this process on a tiny Qwen3.5 with its vision tower: OlympiadBench
subsets mapped with ``OlympiadBenchProcessor`` and mixed, ``Qwen3_5Template`` with
``enable_thinking=False``, ``TransformersModel(model_cls=Qwen3_5ForConditionalGeneration)`` with
LoRA, ``vLLMSampler`` (here on ``TorchSampler``) with ``limit_mm_per_prompt``, weights synced
by ``CheckpointEngineManager``, then GRPO steps scored by the three OlympiadBench rewards, and a
GKD step against a teacher sampler's top-k prompt log-probabilities. The data puts image rows in
the first batches, so the images go through sampling, scoring and training."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))

SUBSETS = ["OE_MM_maths_zh_CEE", "OE_MM_physics_zh_CEE", "OE_TO_maths_zh_CEE"]
ENGINE_ARGS = {"gpu_memory_utilization": 0.8, "enable_lora": True, "limit_mm_per_prompt": {"image": 9}}


@pytest.fixture(scope="module")
def tiny_q35(tmp_path_factory):
    from tiny_qwen3_5_vl import build_tiny_qwen3_5_vl

    return str(build_tiny_qwen3_5_vl(tmp_path_factory.mktemp("q35")))


@pytest.fixture(scope="module")
def olympiad_file(tmp_path_factory):
    """An image row (its picture a file, as a dataset export stores it) then a text row."""
    from tiny_qwen3_vl import picture

    folder = tmp_path_factory.mktemp("olympiad")
    (folder / "figure.png").write_bytes(picture((64, 64), (40, 160, 90)))
    rows = [
        {
            "question": "图中的数是多少？",
            "final_answer": ["7"],
            "image_1": str(folder / "figure.png"),
            "image_2": None,
        },
        {"question": "求 x^2 = 9 的实数解。", "final_answer": ["3", "-3"], "image_1": None, "image_2": None},
    ]
    path = folder / "olympiad.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _dataset(path, model_id):
    from twinkle.dataset import DatasetMeta, LazyDataset
    from twinkle.preprocessor.olympiad_bench import OlympiadBenchProcessor

    meta = DatasetMeta(path, subset_name=SUBSETS[0], split="train")
    dataset = LazyDataset(meta)
    dataset.map(OlympiadBenchProcessor(language="zh"), dataset_meta=meta)
    for subset in SUBSETS[1:]:
        meta = DatasetMeta(path, subset_name=subset, split="train")
        dataset.add_dataset(meta)
        dataset.map(OlympiadBenchProcessor(language="zh"), dataset_meta=meta)
    dataset.set_template("Qwen3_5Template", model_id=model_id, max_length=2048, enable_thinking=False)
    dataset.mix_dataset(interleave=True)
    return dataset


def _student(model_id, loss, **loss_kwargs):
    from peft import LoraConfig
    from transformers import Qwen3_5ForConditionalGeneration

    from twinkle.model import TransformersModel

    model = TransformersModel(model_id=model_id, model_cls=Qwen3_5ForConditionalGeneration)
    lora = LoraConfig(target_modules=["all-linear"], r=4, lora_alpha=8, lora_dropout=0.05)
    model.add_adapter_to_model("default", lora, gradient_accumulation_steps=1)
    model.set_optimizer("AdamW", lr=1e-3)
    model.set_lr_scheduler("CosineAnnealingLR", T_max=2, eta_min=0)
    model.set_loss(loss, **loss_kwargs)
    model.set_template("Qwen3_5Template", model_id=model_id, enable_thinking=False)
    return model


def _sampler(model_id, **engine_args):
    from twinkle.sampler import vLLMSampler

    sampler = vLLMSampler(model_id=model_id, engine_args={**ENGINE_ARGS, **engine_args})
    sampler.set_template("Qwen3_5Template", model_id=model_id, enable_thinking=False)
    sampler.reset_mm_cache()
    return sampler


def _lora_weights(model):
    return {n: p.detach().clone() for n, p in model.model.named_parameters() if "lora_" in n}


@pytest.mark.slow  # two models, sampling and training: about 20 s
def test_grpo_mm_steps_with_image_prompts(tiny_q35, olympiad_file):
    from twinkle.advantage import GRPOAdvantage
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.dataloader import DataLoader
    from twinkle.metric import CompletionRewardMetric
    from twinkle.reward.olympiad_bench import (
        OlympiadBenchAccuracyReward,
        OlympiadBenchFormatReward,
        OlympiadBenchQualityReward,
    )

    torch.manual_seed(0)
    model = _student(tiny_q35, "GRPOLoss", epsilon=0.2)
    sampler = _sampler(tiny_q35)
    assert sampler.lm.config.model_type == "qwen3_5" and hasattr(sampler.lm.model, "visual")
    manager = CheckpointEngineManager(model=model, sampler=sampler)
    loader = DataLoader(dataset=lambda: _dataset(olympiad_file, tiny_q35), batch_size=2, min_batch_size=2)
    metrics, advantage_fn, generations = CompletionRewardMetric(), GRPOAdvantage(), 2
    params = SamplingParams(max_tokens=8, num_samples=1, logprobs=1, temperature=1.0, seed=0)
    start, images_seen = _lora_weights(model), 0
    for step, batch in enumerate(loader):
        if step == 2:
            break
        manager.sync_weights(merge_and_sync=False)
        sampler.reset_prefix_cache()
        sampler.reset_encoder_cache()
        responses = sampler.sample([p for p in batch for _ in range(generations)], params)
        rows = [seq.new_input_feature for r in responses for seq in r.sequences]
        old_logps = [[lp[0][1] for lp in seq.logprobs] for r in responses for seq in r.sequences]
        images_seen += sum("pixel_values" in row for row in rows)
        scores = [
            f()(rows)
            for f in (OlympiadBenchAccuracyReward, OlympiadBenchFormatReward, OlympiadBenchQualityReward)
        ]
        total = [(2 * a + f + q) / 4 for a, f, q in zip(*scores, strict=True)]
        assert all(0.0 <= t <= 1.0 for t in total)
        metrics.accumulate(completion_lengths=[8] * len(rows), rewards={"total": total})
        advantages = advantage_fn(total, num_generations=generations, scale="group").tolist()
        model.forward_backward(inputs=rows, old_logps=old_logps, advantages=advantages, micro_batch_size=1)
        model.clip_grad_and_step()
        log = {**metrics.calculate(), **model.calculate_metric(is_training=True)}
        assert torch.isfinite(torch.tensor(float(log["loss"])))
    assert images_seen == 6  # the mix's first three rows are the image row, once per subset
    moved = _lora_weights(model)
    assert any(not torch.equal(moved[n], w) for n, w in start.items())


@pytest.mark.slow  # three models, sampling, scoring and a step: about 20 s
def test_gkd_on_policy_step_with_image_prompts(tiny_q35, olympiad_file):
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.dataloader import DataLoader
    from twinkle.loss import GKDLoss

    topk = 4
    model = _student(tiny_q35, GKDLoss(beta=0.5, temperature=1.0))
    student, teacher = _sampler(tiny_q35, max_loras=1), _sampler(tiny_q35, logprobs_mode="raw_logprobs")
    CheckpointEngineManager(model=model, sampler=student).sync_weights(merge_and_sync=False)
    batch = next(
        iter(DataLoader(dataset=lambda: _dataset(olympiad_file, tiny_q35), batch_size=2, min_batch_size=2))
    )
    sampled = student.sample(batch, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    rows = [seq.new_input_feature for r in sampled for seq in r.sequences]
    assert all("pixel_values" in row for row in rows)
    scored = teacher.sample(rows, SamplingParams(max_tokens=0, temperature=1.0, prompt_logprobs=topk))
    # upstream's conversion: each position's top-k (the first, predicted by nothing, as zeros),
    # padded to the batch's longest row and rolled so that position t holds token t+1's
    tables = [
        [[0.0] * topk if e is None else [lp for _, lp in e] for e in r.topk_prompt_logprobs] for r in scored
    ]
    ids = [[[0] * topk if e is None else [i for i, _ in e] for e in r.topk_prompt_logprobs] for r in scored]
    longest = max(len(t) for t in tables)
    for t, i in zip(tables, ids, strict=True):
        t += [[0.0] * topk] * (longest - len(t))
        i += [[0] * topk] * (longest - len(i))
    assert [len(r.topk_prompt_logprobs) for r in scored] == [len(row["input_ids"]) for row in rows]
    teacher_output = {
        "teacher_topk_logprobs": torch.roll(torch.tensor(tables), shifts=-1, dims=1),
        "teacher_topk_indices": torch.roll(torch.tensor(ids), shifts=-1, dims=1),
    }
    model.forward_backward(inputs=rows, **teacher_output)
    model.clip_grad_and_step()
    metric = model.calculate_metric(is_training=True)
    # student and teacher are one checkpoint: the divergence is 0 up to rounding, the top-1 agrees
    assert abs(float(metric["loss"])) < 1e-4 and metric["top1_agreement"] == 1.0
