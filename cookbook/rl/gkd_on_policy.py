"""On-policy GKD: the student samples, the teacher scores the sampled tokens, the student matches
the teacher's top-k distributions (generalized JSD, ``twinkle.loss.GKDLoss``).

    python cookbook/rl/gkd_on_policy.py
    python cookbook/rl/gkd_on_policy.py --max-steps 30 --gkd-beta 0.5 --gkd-topk 64 --teacher-model-id PATH

With no flags, on a CPU: the teacher is the bundled SmolLM2-135M-Instruct after ``--teacher-steps``
LoRA SFT steps on the bundled self-cognition rows (it answers as ``--model-name`` by
``--model-author``), or ``--teacher-model-id`` (a model of the same tokenizer) taken as it is;
the student is the same base model with a fresh adapter. Each step, as upstream's
``gkd_on_policy.py``: the student's sampler (its own modules) writes one completion per prompt at
temperature 1, the teacher scores those tokens with its top ``--gkd-topk`` log-probabilities
(in process: ``teacher_topk``; a teacher on its own device group would be a ``TorchSampler`` with
``SamplingParams(max_tokens=0, prompt_logprobs=k)`` and ``topk_prompt_inputs``), and
``forward_backward(inputs=rows, teacher_topk_logprobs=..., teacher_topk_indices=...)`` trains the
student. The held-out divergence (on the teacher's greedy answers to identity questions the SFT
never saw) and the share of the student's greedy held-out answers that name the teacher's
identity are logged before and after training."""

import json
import random
from pathlib import Path

from gkd_common import divergence, sft_teacher, student_model  # beside this script

import twinkle
import twinkle.hub
from twinkle import get_logger
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.hub.dataset import resolve_dataset
from twinkle.loss import GKDLoss
from twinkle.model import TransformersModel
from twinkle.model.teacher import teacher_topk
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.sampler import TorchSampler

logger = get_logger()
args = CLI.from_args()
twinkle.initialize(mode="local")

NAME = args.extra.get("model_name") or "Twinkle"
AUTHOR = args.extra.get("model_author") or "ModelScope"
STEPS = args.training.max_steps or 10
BATCH = 4
MAX_TOKENS = args.sampling.max_tokens or 16
TEACHER_STEPS = int(args.extra.get("teacher_steps", 16))
LR = 2e-3


def identity_rows() -> tuple[list[dict], list[dict]]:
    """English self-cognition chats (SFT rows) and their prompts (the user's turn only)."""
    processor = SelfCognitionProcessor(NAME, AUTHOR)
    rows = [
        processor(dict(r), i) for i, r in enumerate(resolve_dataset("self-cognition")) if r.get("tag") == "en"
    ]
    chats = [r for r in rows if r["messages"][-1]["role"] == "assistant"]
    prompts = [{"messages": r["messages"][:-1]} for r in chats]
    return chats, prompts


def held_out_prompts(n: int = 6) -> list[dict]:
    """Identity questions the SFT rows do not hold (``identity_check.jsonl``)."""
    path = Path(twinkle.hub.__file__).parent / "assets" / "identity_check.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    queries = [r["query"] for r in rows if r.get("tag") == "en" and r.get("kind") == "identity"][:n]
    return [{"messages": [{"role": "user", "content": q}]} for q in queries]


def named(sampler: TorchSampler, prompts: list[dict]) -> tuple[float, list[str]]:
    """The share of greedy answers that name the teacher's identity, and the answers."""
    out = sampler.sample(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    texts = [r.sequences[0].decoded for r in out]
    return sum(NAME.lower() in t.lower() for t in texts) / len(texts), texts


def main() -> None:
    chats, prompts = identity_rows()
    if args.rl.teacher_model_id:
        teacher = TransformersModel(model_id=args.rl.teacher_model_id)
    else:
        teacher = sft_teacher(args.model.model_id, chats, TEACHER_STEPS, 8, LR, args.infra.seed)
    k = args.rl.gkd_topk
    loss = GKDLoss(beta=args.rl.gkd_beta, temperature=args.rl.gkd_temperature, topk=k)
    student = student_model(args.model.model_id, LR, loss, teacher)
    sampler = TorchSampler(student)  # the student's own modules and adapter
    held_out = held_out_prompts()
    teacher_answers = TorchSampler(teacher).sample(
        held_out, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    )
    held_rows = [r.sequences[0].new_input_feature for r in teacher_answers]
    before = divergence(student, teacher, held_rows, k)
    share_before, _ = named(sampler, held_out)
    logger.info(f"held-out: divergence {before:.4f}, answers naming {NAME}: {share_before:.2f}")
    order = random.Random(args.infra.seed)
    pad = teacher.tokenizer.pad_token_id or 0
    for step in range(1, STEPS + 1):
        batch = order.sample(prompts, BATCH)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=args.infra.seed * 1000 + step)
        rows = [s.new_input_feature for r in sampler.sample(batch, params) for s in r.sequences]
        scores = teacher_topk(teacher, rows, k, pad_id=pad)  # the teacher on the student's tokens
        value = student.forward_backward(inputs=rows, **scores)
        student.clip_grad_and_step(max_grad_norm=1.0)
        logger.info(f"step {step}/{STEPS}: divergence {float(value):.4f}")
    after = divergence(student, teacher, held_rows, k)
    share_after, texts = named(sampler, held_out)
    logger.info(f"held-out: divergence {before:.4f} -> {after:.4f}, answers naming {NAME}: "
                f"{share_before:.2f} -> {share_after:.2f}")  # fmt: skip
    for prompt, text in zip(held_out[:3], texts, strict=False):
        logger.info(f"  {prompt['messages'][-1]['content']!r} -> {text!r}")
    print(json.dumps({"divergence_before": before, "divergence_after": after,
                      "named_before": share_before, "named_after": share_after}))  # fmt: skip


if __name__ == "__main__":
    main()
