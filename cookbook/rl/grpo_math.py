"""GRPO with LoRA on arithmetic word problems, the sampler sharing the trainer's weights.

    python cookbook/rl/grpo_math.py
    python cookbook/rl/grpo_math.py --max-steps 40 --num-generations 8 --lr 2e-4 --output-dir output/grpo
    torchrun --nproc_per_node 2 cookbook/rl/grpo_math.py --fsdp-size 2

With no flags it trains the bundled SmolLM2-135M-Instruct on the bundled ``arithmetic-gsm8k``
problems (two-step sums in GSM8K form, ``#### N`` answers) and measures the greedy accuracy on
their 100 held-out problems before training, every ``--eval-interval`` steps and at the end.

Every step, as upstream's ``short_math_grpo.py``: ``sync_weights()`` (the sampler runs the
trainer's own modules, so this copies nothing), sample ``--num-generations`` completions per
prompt of the batch (``--batch-size`` prompts, each rank its share under torchrun), score them
(accuracy + format), ``GRPOAdvantage`` per prompt group, then per mini-batch
(``--mini-batch-size``, default all) ``forward_backward(inputs=rows, old_logps=..., advantages=...)``
over micro-batches of ``--micro-batch-size`` and ``clip_grad_and_step()``. ``--epsilon`` /
``--epsilon-high`` set ``GRPOLoss``; the KL term to the base model is off unless ``--beta`` is
given (then each micro-batch runs a reference pass with the adapter off). ``CompletionRewardMetric``
writes ``train/accuracy_reward``, ``train/format_reward``, ``train/total_reward`` (and their std)
and ``train/completion_length`` with the step's numbers to ``OUTPUT_DIR/metrics.jsonl`` (curves
in ``curves.png``); ``eval/greedy_accuracy`` joins them at each evaluation. The adapter of the
last step is ``OUTPUT_DIR/last-checkpoint``.
"""

import random
import sys
import time

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.cli import CLI
from twinkle.data_format import SamplingParams
from twinkle.distributed.collectives import all_reduce_sum
from twinkle.hub.dataset import resolve_dataset
from twinkle.loss import GRPOLoss
from twinkle.metric import CompletionRewardMetric, Metric
from twinkle.model import TransformersModel
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.runtime import get_runtime
from twinkle.sampler import TorchSampler

BUNDLED = "arithmetic-gsm8k"
# One worked example: without it the base model never writes '#### N' and every reward is 0
SYSTEM = (
    "You solve math word problems. Reply with the calculation, then the final answer after '####'.\n"
    "Example: Tom has 5 apples and gets 3 more. How many apples does Tom have?\n5 + 3 = 8\n#### 8"
)
# Defaults sized for a CPU (a step: 4 prompts x 8 completions of at most 64 tokens); docs/grpo.md says
# what a run of them has and has not shown
DEFAULTS = {"max_steps": 30, "max_tokens": 64, "eval_interval": 10, "learning_rate": 5e-4}

logger = get_logger()
args = CLI.from_args()
twinkle.initialize(
    mode=args.infra.mode,
    global_device_mesh=DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size),
)


def given(flag: str) -> bool:
    """Whether ``--flag`` was on the command line (a shared default then does not apply)."""
    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


MAX_STEPS = args.training.max_steps or DEFAULTS["max_steps"]
MAX_TOKENS = args.sampling.max_tokens or DEFAULTS["max_tokens"]
EVAL_INTERVAL = args.training.eval_interval or DEFAULTS["eval_interval"]
LR = args.optimizer.learning_rate if given("--lr") or given("--learning-rate") else DEFAULTS["learning_rate"]
BETA = args.loss.beta if given("--beta") else 0.0  # the shared default (0.1) is DPO's
G = args.rl.num_generations


def prompts(split: str, limit: int | None) -> list[dict]:
    """The split's problems as sampler prompts (``GSM8KProcessor``)."""
    dataset_id = args.dataset.dataset_id or BUNDLED
    rows = resolve_dataset(dataset_id, subset_name=args.dataset.subset_name, split=split)
    processor = GSM8KProcessor(system=args.template.default_system or SYSTEM)
    out = [processor(dict(row), i) for i, row in enumerate(rows)]
    return out[:limit] if limit else out


def my_share(rows: list) -> list:
    """This rank's rows: every rank samples its own share of the prompts."""
    rt = get_runtime()
    return rows[rt.rank :: rt.world_size]


def evaluate(sampler: TorchSampler, held_out: list[dict]) -> float:
    """Greedy accuracy on the held-out problems, over all ranks."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    mine = my_share(held_out)
    rows = [r.sequences[0].new_input_feature for r in sampler.sample(mine, params)] if mine else []
    correct, total = all_reduce_sum([sum(GSM8KAccuracyReward()(rows)), float(len(rows))])
    return correct / max(1.0, total)


class HeldOut(Metric):
    """The last held-out accuracy, reported once with the step's metrics (``metrics.jsonl``)."""

    def __init__(self, device_mesh=None, process_group=None):
        super().__init__(device_mesh, process_group)
        self.value = None

    def accumulate(self, inputs, outputs, **kwargs) -> None:
        pass  # set by the loop, not per micro-batch

    def calculate(self) -> dict:
        value, self.value = self.value, None
        return {} if value is None else {"eval/greedy_accuracy": value}


def build_model() -> TransformersModel:
    mini = args.training.mini_batch_size or args.training.batch_size * G
    micro = args.training.micro_batch_size or mini
    model = TransformersModel(model_id=args.model.model_id)
    lora = LoraConfig(**args.get_lora_args())
    model.add_adapter_to_model(args.lora.adapter_name, lora, gradient_accumulation_steps=-(-mini // micro))
    model.set_optimizer(args.optimizer.optimizer_cls, lr=LR)
    model.set_lr_scheduler(args.scheduler.scheduler_cls, num_warmup_steps=args.scheduler.num_warmup_steps,
                           num_training_steps=MAX_STEPS * -(-args.training.batch_size * G // mini))  # fmt: skip
    model.set_loss(GRPOLoss(epsilon=args.loss.epsilon, epsilon_high=args.loss.epsilon_high, beta=BETA))
    return model


def train_on(model: TransformersModel, rows: list, old: list, advantages: list) -> None:
    """Mini-batches of the rollouts, each an optimizer step over its micro-batches."""
    mini = args.training.mini_batch_size or len(rows)
    micro = args.training.micro_batch_size or mini
    for start in range(0, len(rows), mini):
        for m in range(start, min(start + mini, len(rows)), micro):
            part = slice(m, min(m + micro, start + mini, len(rows)))
            ref = model.forward_only(inputs=rows[part], disable_lora=True) if BETA > 0 else None
            model.forward_backward(inputs=rows[part], old_logps=old[part], advantages=advantages[part],
                                   ref_outputs=ref)  # fmt: skip
        model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)


def main() -> None:
    train_set = prompts("train", args.training.train_samples)
    held_out = prompts("eval", args.training.eval_samples)
    model = build_model()
    sampler = TorchSampler(model)  # colocated: the trainer's modules, its adapter
    engine = CheckpointEngineManager(model=model, sampler=sampler)
    rewards = {"accuracy": GSM8KAccuracyReward(), "format": GSM8KFormatReward()}
    metric = CompletionRewardMetric()
    model.add_metric(metric, is_training=True)
    held_out_metric = HeldOut()
    model.add_metric(held_out_metric, is_training=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, num_samples=G, temperature=args.sampling.temperature,
                            top_p=args.sampling.top_p, top_k=args.sampling.top_k)  # fmt: skip
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    base = held_out_metric.value = evaluate(sampler, held_out)  # reported with step 1's numbers
    logger.info(f"held-out greedy accuracy before training: {base:.3f}")
    order = random.Random(args.infra.seed)
    batch_size = args.training.batch_size
    for step in range(1, MAX_STEPS + 1):
        batch = order.sample(train_set, batch_size)  # the same prompts on every rank, then split
        t0 = time.perf_counter()
        engine.sync_weights()
        t1 = time.perf_counter()
        params.seed = args.infra.seed * 100_003 + step * 31 + get_runtime().rank
        responses = sampler.sample(my_share(batch), params)
        t2 = time.perf_counter()
        seqs = [s for r in responses for s in r.sequences]
        rows = [s.new_input_feature for s in seqs]
        old = [[lp[0][1] for lp in s.logprobs] for s in seqs]
        scores = {name: fn(rows) for name, fn in rewards.items()}
        total = [sum(parts) for parts in zip(*scores.values(), strict=True)]
        advantages = GRPOAdvantage()(total, num_generations=G, scale=args.rl.advantage_scale).tolist()
        metric.accumulate(rewards={**scores, "total": total}, completion_lengths=[len(s.tokens) for s in seqs],
                          generate_time=t2 - t1, weight_sync_time=t1 - t0)  # fmt: skip
        train_on(model, rows, old, advantages)
        if step % EVAL_INTERVAL == 0 or step == MAX_STEPS:
            accuracy = evaluate(sampler, held_out)
            if held_out_metric.value is None:
                held_out_metric.value = accuracy
            logger.info(f"step {step}: held-out greedy accuracy {accuracy:.3f}")
        out = model.calculate_metric(is_training=True)
        logger.info(f"step {step}/{MAX_STEPS} ({time.perf_counter() - t0:.1f}s): " + ", ".join(
            f"{k}={v:.3f}" for k, v in out.items() if k.startswith(("train/", "eval/")) or k in ("loss", "grad_norm")))  # fmt: skip
    model.save("last-checkpoint", output_dir=args.training.output_dir)
    logger.info(f"held-out greedy accuracy: {base:.3f} before, {accuracy:.3f} after")


if __name__ == "__main__":
    main()
