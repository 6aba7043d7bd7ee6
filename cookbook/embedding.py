"""Train a LoRA embedding model with InfoNCE on the bundled query/passage pairs.

    python cookbook/embedding.py
    python cookbook/embedding.py --max-steps 40 --batch-size 8 --lr 5e-4 --pooling mean

With no flags, on a CPU: the bundled SmolLM2-135M-Instruct as a sentence encoder
(``forward_backward(inputs=rows, task='embedding')``: the last token's final hidden state,
L2-normalised; ``--pooling mean`` for the mean over tokens), LoRA r 8, ``InfonceLoss`` with
in-batch negatives at temperature ``--temperature`` (0.05), batches of ``--batch-size`` pairs
from the 48 training pairs of ``retrieval_pairs.jsonl`` (``twinkle/hub/assets``: short factual
questions and the passage that answers each). ``EmbeddingMetric`` logs the in-batch retrieval
accuracy of each step; the held-out retrieval accuracy (each of the 16 held-out questions against
all 16 held-out passages: is its own the most similar?) is measured before and after training.
Each row is one text ending with the end-of-sequence token; its ``labels`` mark a group's start
(1 on the question, 0 on its passage), upstream's layout."""

import json
import random
from pathlib import Path

from peft import LoraConfig

import twinkle
import twinkle.hub
from twinkle import get_logger
from twinkle.cli import CLI
from twinkle.loss import InfonceLoss
from twinkle.metric import EmbeddingMetric
from twinkle.model import TransformersModel

logger = get_logger()
args = CLI.from_args()
twinkle.initialize(mode="local")

STEPS = args.training.max_steps or 24
PAIRS_PER_STEP = 8
LR = 5e-4
TEMPERATURE = float(args.extra.get("temperature", 0.05))
POOLING = args.extra.get("pooling", "last")


def pairs(split: str) -> list[tuple[str, str]]:
    path = Path(twinkle.hub.__file__).parent / "assets" / "retrieval_pairs.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["query"], r["passage"]) for r in rows if r["split"] == split]


def encoder(model: TransformersModel):
    tok = model.tokenizer

    def row(text: str, mark: int) -> dict:
        return {"input_ids": tok.encode(text, add_special_tokens=False) + [tok.eos_token_id], "labels": mark}

    return row


def retrieval_accuracy(model: TransformersModel, held_out: list[tuple[str, str]]) -> float:
    row = encoder(model)
    queries = model.forward_only(inputs=[row(q, 0) for q, _ in held_out], task="embedding")["embeddings"]
    passages = model.forward_only(inputs=[row(p, 0) for _, p in held_out], task="embedding")["embeddings"]
    best = (queries @ passages.T).argmax(-1)
    return float((best == best.new_tensor(range(len(held_out)))).float().mean())


def main() -> None:
    train, held_out = pairs("train"), pairs("eval")
    model = TransformersModel(model_id=args.model.model_id)
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=LR)
    model.set_loss(InfonceLoss(temperature=TEMPERATURE, pooling=POOLING))
    model.add_metric(EmbeddingMetric, is_training=True)
    before = retrieval_accuracy(model, held_out)
    logger.info(f"held-out retrieval accuracy before training: {before:.3f} ({len(held_out)} pairs)")
    row, order = encoder(model), random.Random(args.infra.seed)
    for step in range(1, STEPS + 1):
        batch = order.sample(train, PAIRS_PER_STEP)
        rows = [r for q, p in batch for r in (row(q, 1), row(p, 0))]
        model.forward_backward(inputs=rows, task="embedding")
        model.clip_grad_and_step(max_grad_norm=1.0)
        metrics = model.calculate_metric(is_training=True)
        logger.info(f"step {step}/{STEPS}: loss {metrics.get('loss', float('nan')):.4f}, in-batch retrieval "
                    f"{metrics.get('retrieval_accuracy', float('nan')):.3f}")  # fmt: skip
    after = retrieval_accuracy(model, held_out)
    logger.info(f"held-out retrieval accuracy: {before:.3f} -> {after:.3f}")
    print(json.dumps({"retrieval_accuracy_before": before, "retrieval_accuracy_after": after}))


if __name__ == "__main__":
    main()
