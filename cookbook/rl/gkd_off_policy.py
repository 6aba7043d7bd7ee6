"""Off-policy GKD: the student matches the teacher's top-k distributions on the dataset's own
completions; nothing is sampled, and each row's teacher log-probabilities are computed once.

    python cookbook/rl/gkd_off_policy.py
    python cookbook/rl/gkd_off_policy.py --max-steps 40 --gkd-beta 0.5 --gkd-topk 64 --teacher-model-id PATH

With no flags, on a CPU: the bundled ``arithmetic-gsm8k`` problems with their worked answers as
the assistant turn (``GSM8KProcessor(add_assistant=True)``, upstream's off-policy form); the
teacher is the bundled SmolLM2-135M-Instruct after ``--teacher-steps`` LoRA SFT steps on those
answers (or ``--teacher-model-id``, a model of the same tokenizer, as it is); the student is the
base model with a fresh adapter. Each step takes ``--batch-size`` rows from a pool of
``--train-samples`` rows, so rows come back every few steps: ``TeacherCache`` scores a row the
first time only (``twinkle.model.teacher``), and ``forward_backward(inputs=rows,
teacher_topk_logprobs=..., teacher_topk_indices=...)`` trains the student. The divergence on
held-out problems' answers is logged before and after training, with the rows the teacher
scored."""

import json
import random

from gkd_common import divergence, sft_teacher, student_model  # beside this script

import twinkle
from twinkle import get_logger
from twinkle.cli import CLI
from twinkle.hub.dataset import resolve_dataset
from twinkle.loss import GKDLoss
from twinkle.model import TransformersModel
from twinkle.model.teacher import TeacherCache
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.template import Template

logger = get_logger()
args = CLI.from_args()
twinkle.initialize(mode="local")

STEPS = args.training.max_steps or 12
BATCH = 8
POOL = args.training.train_samples or 32  # rows the steps draw from: each comes back ~3 times
HELD_OUT = args.training.eval_samples or 16
TEACHER_STEPS = int(args.extra.get("teacher_steps", 16))
LR = 2e-3
SYSTEM = "Reply with the calculation, then the final answer after '####'."


def rows(split: str, limit: int) -> list[dict]:
    """The split's first ``limit`` problems with their answers, encoded (labels on the answer)."""
    processor = GSM8KProcessor(system=SYSTEM, add_assistant=True)
    template = Template(args.model.model_id, max_length=256)
    data = resolve_dataset(args.dataset.dataset_id or "arithmetic-gsm8k", split=split)
    return [template.encode(processor(dict(r), i), index=i) for i, r in enumerate(data) if i < limit]


def main() -> None:
    train, held_out = rows("train", POOL), rows("eval", HELD_OUT)
    if args.rl.teacher_model_id:
        teacher = TransformersModel(model_id=args.rl.teacher_model_id)
    else:
        teacher = sft_teacher(args.model.model_id, rows("train", 400), TEACHER_STEPS, 8, LR, args.infra.seed)
    k = args.rl.gkd_topk
    loss = GKDLoss(beta=args.rl.gkd_beta, temperature=args.rl.gkd_temperature, topk=k)
    student = student_model(args.model.model_id, LR, loss, teacher)
    cache = TeacherCache(teacher, k, pad_id=teacher.tokenizer.pad_token_id or 0)
    before = divergence(student, teacher, held_out, k)
    logger.info(f"held-out divergence before: {before:.4f}")
    order = random.Random(args.infra.seed)
    for step in range(1, STEPS + 1):
        batch = order.sample(train, BATCH)
        value = student.forward_backward(inputs=batch, **cache.inputs(batch))
        student.clip_grad_and_step(max_grad_norm=1.0)
        logger.info(
            f"step {step}/{STEPS}: divergence {float(value):.4f} (teacher scored {cache.scored} rows)"
        )
    after = divergence(student, teacher, held_out, k)
    logger.info(f"held-out divergence {before:.4f} -> {after:.4f}; the teacher scored {cache.scored} rows "
                f"for {STEPS * BATCH} row-steps")  # fmt: skip
    print(
        json.dumps(
            {"divergence_before": before, "divergence_after": after, "teacher_rows_scored": cache.scored}
        )
    )


if __name__ == "__main__":
    main()
