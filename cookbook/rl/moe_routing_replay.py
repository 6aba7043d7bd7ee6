"""GRPO on a mixture-of-experts model with routing replay: the experts each sampled token ran
through are recorded while sampling and replayed in training, so the trained policy's
log-probabilities are those of the routes the samples were drawn with.

    python cookbook/rl/moe_routing_replay.py
    python cookbook/rl/moe_routing_replay.py --model-id PATH/TO/Qwen3-MoE --max-steps 20 --max-tokens 64

With no ``--model-id`` it builds a small random Qwen3-MoE (2 layers of 8 experts, top-2) on the
bundled SmolLM2 tokenizer, so it runs anywhere in a minute or two; its completions are noise, so
besides the answer's accuracy and format a shaping reward for brevity (shorter replies score
higher, as in upstream's routing-replay script) gives the groups different rewards: it shows the mechanism, not learning. Any Qwen3-MoE,
Qwen3.5-MoE or Qwen2-MoE checkpoint works the same (``twinkle.model.router_replay``).

Every step: the sampler runs the trainer's own modules and records each token's experts
(``engine_args={'enable_return_routed_experts': True}``: each sequence's ``routed_experts``, also
in its ``new_input_feature``); the rows are scored on the bundled arithmetic problems and
``forward_backward(..., router_replay_action=RouterReplayAction.REPLAY_FORWARD)`` trains on
them routed through the recorded experts (upstream's R3 mode). After the step, ``route_drift``
is the share of (token, MoE layer) routes the updated policy would choose differently
(``forward_only(..., router_replay_action=RouterReplayAction.RECORD)``): the routes a step
without replay would have trained on instead of the sampled ones."""

import random
import shutil
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig

import twinkle
from twinkle import get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.hub import resolve_model
from twinkle.hub.dataset import resolve_dataset
from twinkle.loss import GRPOLoss
from twinkle.model import TransformersModel
from twinkle.model.transformers.moe.router_replay import RouterReplayAction
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.sampler import TorchSampler

DEFAULTS = {"max_steps": 4, "max_tokens": 16, "batch_size": 4, "learning_rate": 1e-3}
logger = get_logger()
args = CLI.from_args()
twinkle.initialize()


def tiny_moe(folder: Path) -> str:
    """A random Qwen3-MoE with the bundled model's tokenizer, saved in ``folder``."""
    import transformers

    tokenizer_dir = resolve_model(None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(args.infra.seed)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    for path in tokenizer_dir.iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, folder / path.name)
    return str(folder)


def brevity(rows: list[dict]) -> list[float]:
    """1 for an empty reply, down to 0 at 200 characters: a reward a random model's replies differ in."""
    return [max(0.0, 1.0 - len(row["messages"][-1]["content"]) / 200) for row in rows]


def route_drift(model: TransformersModel, rows: list[dict]) -> float:
    """The share of the rows' recorded routes (token x MoE layer) the model now routes elsewhere."""
    plain = [{k: v for k, v in row.items() if k != "routed_experts"} for row in rows]
    now = model.forward_only(inputs=plain, router_replay_action=RouterReplayAction.RECORD)["routed_experts"]
    changed = total = 0
    for i, row in enumerate(rows):
        sampled = torch.tensor(row["routed_experts"])
        current = now[i, : sampled.shape[0]]
        ran = (current >= 0).all(-1)  # positions the forward ran (a packed row leaves tails out)
        same = (current.sort(-1).values == sampled.sort(-1).values).all(-1)
        changed, total = changed + int((ran & ~same).sum()), total + int(ran.sum())
    return changed / max(1, total)


def main() -> None:
    steps = args.training.max_steps or DEFAULTS["max_steps"]
    max_tokens = args.sampling.max_tokens or DEFAULTS["max_tokens"]
    batch = DEFAULTS["batch_size"]
    group = args.rl.num_generations
    with tempfile.TemporaryDirectory() as scratch:
        model_id = args.model.model_id or tiny_moe(Path(scratch))
        model = TransformersModel(model_id=model_id, enable_router_replay=True)
        model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=DEFAULTS["learning_rate"])
        model.set_loss(GRPOLoss(epsilon=0.2))
        sampler = TorchSampler(model, engine_args={"enable_return_routed_experts": True})

        rows = resolve_dataset("arithmetic-gsm8k", split="train")
        processor = GSM8KProcessor()
        prompts = [processor(dict(row), i) for i, row in enumerate(rows)]
        rewards = (GSM8KAccuracyReward(), GSM8KFormatReward(), brevity)
        order = random.Random(args.infra.seed)
        params = SamplingParams(max_tokens=max_tokens, num_samples=group, temperature=1.0)
        for step in range(1, steps + 1):
            params.seed = args.infra.seed + step
            responses = sampler.sample(order.sample(prompts, batch), params)
            seqs = [s for r in responses for s in r.sequences]
            samples = [s.new_input_feature for s in seqs]  # each carries its routed_experts
            old = [[lp[0][1] for lp in s.logprobs] for s in seqs]
            scores = [sum(parts) for parts in zip(*(fn(samples) for fn in rewards), strict=True)]
            advantages = GRPOAdvantage()(scores, num_generations=group).tolist()
            loss = model.forward_backward(inputs=samples, old_logps=old, advantages=advantages,
                                          router_replay_action=RouterReplayAction.REPLAY_FORWARD)  # fmt: skip
            model.clip_grad_and_step()
            drift = route_drift(model, samples)
            logger.info(
                f"step {step}/{steps}: loss={float(loss):.3e} reward={sum(scores) / len(scores):.3f} "
                f"route_drift={drift:.3f} (routes replayed: {sum(len(s.routed_experts) for s in seqs)} tokens)"
            )


if __name__ == "__main__":
    main()
