"""GRPO with LoRA on arithmetic word problems, the sampler sharing the trainer's weights.

    python cookbook/rl/grpo_math.py
    python cookbook/rl/grpo_math.py --max-steps 40 --num-generations 8 --lr 2e-4 --output-dir output/grpo
    torchrun --nproc_per_node 2 cookbook/rl/grpo_math.py --fsdp-size 2
    python cookbook/rl/grpo_math.py --mode ray --fsdp-size 2

With no flags it trains the bundled SmolLM2-135M-Instruct on the bundled ``arithmetic-gsm8k``
problems (one addition or subtraction of numbers up to 20 in GSM8K form, ``#### N`` answers;
``--dataset-id arithmetic-gsm8k-two-step`` for two steps on numbers below 100) and measures the
greedy accuracy on their 100 held-out problems before training, every ``--eval-interval`` steps
and at the end: 20 steps raise it from 0.09 to 0.40 (docs/grpo.md).

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

``--mode ray`` runs this loop as a single controller (``twinkle.runtime.controller``): this
process drives it; the model lives on a device group ``model`` of ``--fsdp-size`` x
``--dp-size`` ranks (``--model-gpus N``: N; FSDP2 among them), the sampler on a group
``sampler`` of ``--sampler-gpus`` ranks (default 1) with a copy of the base model, which
``sync_weights()`` brings up to the trainer's LoRA weights before every step. The sampler's
rank 0 samples every prompt with the seed one process uses, so a run samples what one process
samples and trains on it with the same losses.
"""

import random
import sys
import time

from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh, get_device_placement, get_logger
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
from twinkle.runtime.remote import remote_class
from twinkle.sampler import TorchSampler
from twinkle.utils.framework import Torch

BUNDLED = "arithmetic-gsm8k"
# One worked example: without it the base model never writes '#### N' and every reward is 0
SYSTEM = (
    "You solve math word problems. Reply with the calculation, then the final answer after '####'.\n"
    "Example: Tom has 5 apples and gets 3 more. How many apples does Tom have?\n5 + 3 = 8\n#### 8"
)
# Defaults sized for a CPU (a step: 8 prompts x 8 completions of at most 32 tokens; a one-step answer
# takes about 12): docs/grpo.md and bench/results/grpo-cookbook-*.md hold runs of them. With 4 prompts
# a step, most groups' rewards were all equal and one seed of two did not learn the sums
DEFAULTS = {"max_steps": 20, "max_tokens": 32, "eval_interval": 10, "learning_rate": 1e-3, "batch_size": 8}

MODEL_GROUP, SAMPLER_GROUP = "model", "sampler"  # --mode ray: the device groups

logger = get_logger()
args = CLI.from_args()
RAY = args.infra.mode == "ray"
MESH = DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size,
                             world_size=args.infra.model_gpus if RAY else None)  # fmt: skip
GROUPS = [
    DeviceGroup(name=MODEL_GROUP, ranks=MESH.world_size, device_type=Torch.device_type()),
    DeviceGroup(name=SAMPLER_GROUP, ranks=args.infra.sampler_gpus or 1, device_type=Torch.device_type()),
]
twinkle.initialize(mode=args.infra.mode, global_device_mesh=MESH, groups=GROUPS if RAY else None)


def given(flag: str) -> bool:
    """Whether ``--flag`` was on the command line (a shared default then does not apply)."""
    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


MAX_STEPS = args.training.max_steps or DEFAULTS["max_steps"]
MAX_TOKENS = args.sampling.max_tokens or DEFAULTS["max_tokens"]
EVAL_INTERVAL = args.training.eval_interval or DEFAULTS["eval_interval"]
LR = args.optimizer.learning_rate if given("--lr") or given("--learning-rate") else DEFAULTS["learning_rate"]
BETA = args.loss.beta if given("--beta") else 0.0  # the shared default (0.1) is DPO's
BATCH = args.training.batch_size if given("--batch-size") else DEFAULTS["batch_size"]
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


@remote_class  # --mode ray: one on each rank of the model's group, beside the model
class HeldOut(Metric):
    """The last held-out accuracy, reported once with the step's metrics (``metrics.jsonl``)."""

    def __init__(self, device_mesh=None, process_group=None):
        super().__init__(device_mesh, process_group)
        self.value = None

    def accumulate(self, inputs, outputs, **kwargs) -> None:
        pass  # set by the loop (``record``), not per micro-batch

    def record(self, value: float) -> None:
        """Report ``value`` with the next metrics, unless an earlier one still waits (the base
        model's, reported with step 1's numbers)."""
        if self.value is None:
            self.value = value

    def calculate(self) -> dict:
        value, self.value = self.value, None
        return {} if value is None else {"eval/greedy_accuracy": value}


def build_model() -> TransformersModel:
    mini = args.training.mini_batch_size or BATCH * G
    micro = args.training.micro_batch_size or mini
    model = TransformersModel(model_id=args.model.model_id, device_mesh=MESH, remote_group=MODEL_GROUP)
    lora = LoraConfig(**args.get_lora_args())
    model.add_adapter_to_model(args.lora.adapter_name, lora, gradient_accumulation_steps=-(-mini // micro))
    model.set_optimizer(args.optimizer.optimizer_cls, lr=LR)
    model.set_lr_scheduler(args.scheduler.scheduler_cls, num_warmup_steps=args.scheduler.num_warmup_steps,
                           num_training_steps=MAX_STEPS * -(-BATCH * G // mini))  # fmt: skip
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
    # colocated: the trainer's modules, its adapter; --mode ray: a copy on the sampler's group
    sampler = TorchSampler(args.model.model_id, remote_group=SAMPLER_GROUP) if RAY else TorchSampler(model)
    engine = CheckpointEngineManager(model=model, sampler=sampler)
    rewards = {"accuracy": GSM8KAccuracyReward(), "format": GSM8KFormatReward()}
    # --mode ray: on every rank of the model's group, each fed the whole step (its means and
    # population stds over the ranks' copies are one process's)
    metric = CompletionRewardMetric(remote_group=MODEL_GROUP)
    model.add_metric(metric, is_training=True)
    held_out_metric = HeldOut(remote_group=MODEL_GROUP)
    model.add_metric(held_out_metric, is_training=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, num_samples=G, temperature=args.sampling.temperature,
                            top_p=args.sampling.top_p, top_k=args.sampling.top_k)  # fmt: skip
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    base = evaluate(sampler, held_out)
    held_out_metric.record(base)  # reported with step 1's numbers
    logger.info(f"held-out greedy accuracy before training: {base:.3f}")
    order = random.Random(args.infra.seed)
    batch_size = BATCH
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
            held_out_metric.record(accuracy)
            logger.info(f"step {step}: held-out greedy accuracy {accuracy:.3f}")
        out = model.calculate_metric(is_training=True)
        logger.info(f"step {step}/{MAX_STEPS} ({time.perf_counter() - t0:.1f}s): " + ", ".join(
            f"{k}={v:.3f}" for k, v in out.items() if k.startswith(("train/", "eval/")) or k in ("loss", "grad_norm", "clip_fraction")))  # fmt: skip
    model.save("last-checkpoint", output_dir=args.training.output_dir)
    logger.info(f"held-out greedy accuracy: {base:.3f} before, {accuracy:.3f} after")


if __name__ == "__main__":
    main()
