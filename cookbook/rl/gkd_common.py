"""What the two GKD cookbooks share: a teacher made in the same process by a short LoRA SFT of
the bundled model, the student, and the held-out divergence.

A teacher must share the student's tokenizer (GKD compares distributions token by token), so the
CPU cookbooks make one from the bundled SmolLM2-135M-Instruct: a few steps of supervised LoRA
training give it answers the base model does not have, and a fresh adapter on the same base model
is the student that learns them from the teacher's distributions alone."""

import random

from peft import LoraConfig

from twinkle import get_logger
from twinkle.loss import GKDLoss
from twinkle.model import TransformersModel
from twinkle.model.teacher import check_same_vocabulary, teacher_topk

logger = get_logger()


def lora(r: int = 8) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=4 * r, target_modules="all-linear", lora_dropout=0.0)


def sft_teacher(
    model_id: str | None, rows: list[dict], steps: int, batch: int, lr: float, seed: int
) -> TransformersModel:
    """The bundled model after ``steps`` LoRA SFT steps on ``rows`` (chat rows with the answer)."""
    teacher = TransformersModel(model_id=model_id)
    teacher.add_adapter_to_model("teacher", lora(), gradient_accumulation_steps=1)
    teacher.set_optimizer("AdamW", lr=lr)
    order = random.Random(seed)
    for step in range(1, steps + 1):
        loss = teacher.forward_backward(inputs=order.sample(rows, batch))
        teacher.clip_grad_and_step(max_grad_norm=1.0)
        logger.info(f"teacher SFT step {step}/{steps}: loss {float(loss):.3f}")
    return teacher


def student_model(
    model_id: str | None, lr: float, loss: GKDLoss, teacher: TransformersModel
) -> TransformersModel:
    student = TransformersModel(model_id=model_id)
    check_same_vocabulary(student.tokenizer, teacher.tokenizer)
    student.add_adapter_to_model("default", lora(), gradient_accumulation_steps=1)
    student.set_optimizer("AdamW", lr=lr)
    student.set_loss(loss)
    return student


def divergence(student: TransformersModel, teacher: TransformersModel, rows: list[dict], k: int) -> float:
    """The student's mean per-token divergence to the teacher on ``rows`` (no gradients)."""
    scores = teacher_topk(teacher, rows, k, pad_id=teacher.tokenizer.pad_token_id or 0)
    return float(student.forward_only(inputs=rows, **scores)["loss"])
