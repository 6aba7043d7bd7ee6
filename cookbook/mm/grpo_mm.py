"""GRPO with LoRA on image prompts: the bundled digits and shapes, rewarded when the answer is the
picture's label.

    python cookbook/mm/grpo_mm.py
    python cookbook/mm/fsdp2.py --output-dir output/mm && \
        python cookbook/mm/grpo_mm.py --init-adapter output/mm/last-checkpoint
    python cookbook/mm/grpo_mm.py --model-id PATH/TO/Qwen2.5-VL-3B-Instruct --lr 1e-5 --max-steps 200

Upstream's ``rl/grpo/grpo_mm.py`` loop, on a CPU: every step ``sync_weights()`` (the sampler runs
the trainer's own modules, so nothing is copied), each prompt of the batch repeated
``--num-generations`` times and sampled (``TorchSampler`` prefills each picture's pixels and its
M-RoPE positions), the completions rewarded, ``GRPOAdvantage`` per group of copies, then
``forward_backward(inputs=rows, old_logps=..., advantages=...)`` over mini-batches of
``--mini-batch-size`` rows (default: all), each a ``clip_grad_and_step()``. Each sampled row
(``new_input_feature``) carries its prompt's image, so training sees the picture the completion
answered.

Rewards: ``accuracy`` 1 when the reply is the picture's answer (a digit, or a colour and a shape
such as ``a red square``), ``parts`` the share of the answer's words the reply names (partial
credit: the right colour with the wrong shape is half), ``format`` 1 when the reply is one of the
set's 22 answers at all. The held-out greedy accuracy is logged before GRPO and at the end,
against chance (1 in 22); each step's line counts the groups whose copies earned different
rewards, the only ones GRPO learns from.

With no ``--model-id`` it trains the small Qwen2.5-VL that ``fsdp2.py`` makes at first use
(``vl_checkpoint.py``: SmolLM2-135M-Instruct's first layers and a random vision tower); its tower
starts random, so ``--train-vision true`` (the default then) trains the whole tower beside the
LoRA. From there no reply is an answer and every reward would be 0, so the run first takes
``--sft-steps`` (15) steps of ``fsdp2.py``'s supervised recipe on the training pictures (8 a step,
``--sft-lr`` 2e-3): a start on the answers' form, about a fifth of the sampled replies one of
the answers, so the copies of a prompt earn different rewards. GRPO (4 pictures x 8 completions
of at most 8 tokens a step, 40 steps at 3e-4: about 2.5 minutes on two shared CPU cores) then
raises the share of well-formed answers to nearly all; the pictures' content it learns little of
in that time (held-out accuracy stays near chance). Its rate is low because the whole vision
tower trains: at 1e-3 the replies collapse to one answer per picture and the groups stop
differing. ``--init-adapter FOLDER`` starts from an adapter that ``fsdp2.py`` saved (its LoRA
settings and trained tower), and skips the warm-up."""

import json
import random
import sys
import time
from pathlib import Path

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.cli import CLI
from twinkle.data_format import Message, SamplingParams, Trajectory
from twinkle.dataloader import DataLoader
from twinkle.dataset import DatasetMeta, LazyDataset
from twinkle.dataset.digits import digit_trajectory, digits_file
from twinkle.loss import CrossEntropyLoss, GRPOLoss
from twinkle.metric import CompletionRewardMetric
from twinkle.model import TransformersModel
from twinkle.optim import build_scheduler
from twinkle.sampler import TorchSampler
from twinkle.utils.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vl_checkpoint import vl_checkpoint  # noqa: E402  (beside this script)

TEMPLATE = "Qwen2_5VLTemplate"
MODEL_CLS = "Qwen2_5_VLForConditionalGeneration"
DEFAULTS = {"max_steps": 40, "batch_size": 4, "num_generations": 8, "max_tokens": 8, "learning_rate": 3e-4}
DEFAULT_SFT_STEPS = 15  # the answers' form half learnt: rewards differ within groups
SFT_BATCH_SIZE, SFT_LR = 8, 2e-3  # fsdp2.py's defaults

logger = get_logger()
args = CLI.from_args()
twinkle.initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes())


def given(flag: str) -> bool:
    """Whether ``--flag`` was on the command line (a shared default then does not apply)."""
    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


MAX_STEPS = args.training.max_steps if given("--max-steps") else DEFAULTS["max_steps"]
BATCH_SIZE = args.training.batch_size if given("--batch-size") else DEFAULTS["batch_size"]
NUM_GENERATIONS = args.rl.num_generations if given("--num-generations") else DEFAULTS["num_generations"]
MAX_TOKENS = args.sampling.max_tokens or DEFAULTS["max_tokens"]
LR = args.optimizer.learning_rate if given("--lr") or given("--learning-rate") else DEFAULTS["learning_rate"]
MINI_BATCH_SIZE = args.training.mini_batch_size or BATCH_SIZE * NUM_GENERATIONS
ADAPTER_NAME = args.lora.adapter_name
ANSWERS = sorted({json.loads(line)["answer"] for line in digits_file("train").read_text().splitlines()})


def digit_prompt(row: dict) -> Trajectory:
    """A bundled row as a prompt: the user's question about the picture; its answer in user_data."""
    question = digit_trajectory(row)["messages"][0]
    return Trajectory(
        messages=[Message(role="user", content=question["content"], images=question["images"])],
        user_data={"answer": row["answer"]},
    )


def create_dataset(split: str, samples: int | None) -> LazyDataset:
    meta = DatasetMeta(str(digits_file(split)), data_slice=range(samples) if samples else None)
    dataset = LazyDataset(dataset_meta=meta)  # each picture decoded when its row is read
    dataset.map(digit_prompt)
    return dataset


def extra_number(name: str, default: float, kind: type) -> float:
    """``--sft-steps`` / ``--sft-lr`` (free-form flags, read as text): a number >= 0, else one line."""
    value = args.extra.get(name, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        flag = "--" + name.replace("_", "-")
        raise UserError(f"{flag} takes a number >= 0 ({kind.__name__}), got {value!r}")
    return number


def reply(trajectory: dict) -> str:
    return trajectory["messages"][-1]["content"].strip().lower().rstrip(".")


def answer_words(text: str) -> set[str]:
    """What an answer names: the digit, or the colour and the shape (``a`` left out)."""
    return set(text.split()) - {"a"}


def compute_rewards(trajectories: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """``accuracy``: the reply is the picture's answer; ``parts``: the share of the answer's words
    (its colour, its shape; a digit is one word) that the reply names, partial credit so that a
    reply with the right colour and the wrong shape beats one with neither; ``format``: the reply
    is one of the set's answers. The total is their sum (0 to 3)."""
    replies = [reply(t) for t in trajectories]
    answers = [t["user_data"]["answer"] for t in trajectories]
    accuracy = [float(r == a) for r, a in zip(replies, answers, strict=True)]
    parts = [
        len(answer_words(a) & answer_words(r)) / len(answer_words(a)) if r in ANSWERS else 0.0
        for r, a in zip(replies, answers, strict=True)
    ]
    format_reward = [float(r in ANSWERS) for r in replies]
    total = [a + p + f for a, p, f in zip(accuracy, parts, format_reward, strict=True)]
    return total, {"accuracy": accuracy, "parts": parts, "format": format_reward}


def held_out_accuracy(sampler: TorchSampler, held_out: LazyDataset) -> float:
    prompts = [held_out[i] for i in range(len(held_out))]
    responses = sampler.sample(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    rows = [r.sequences[0].new_input_feature for r in responses]
    return sum(compute_rewards(rows)[1]["accuracy"]) / max(1, len(rows))


def sft_warm_up(model: TransformersModel, model_id: str, steps: int, lr: float) -> None:
    """``steps`` of ``fsdp2.py``'s supervised recipe on the training pictures, in this process,
    before GRPO: from the made checkpoint (a random tower, SmolLM2's first layers) no sampled
    reply is an answer, every group's rewards are equal and GRPO's advantages are all 0. A short
    warm-up teaches the answers' form and a first, unsure link to the pictures, so the copies of a
    prompt disagree and GRPO has something to sharpen."""
    dataset = LazyDataset(dataset_meta=DatasetMeta(str(digits_file("train"))))
    dataset.set_template(TEMPLATE, model_id=model_id)
    dataset.map(digit_trajectory)
    dataset.encode()
    model.set_loss(CrossEntropyLoss())
    model.set_optimizer(args.optimizer.optimizer_cls, lr=lr)
    loader = DataLoader(dataset=dataset, batch_size=SFT_BATCH_SIZE, shuffle=True, seed=args.infra.seed)
    step = 0
    while step < steps:
        for batch in loader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
            step += 1
            if step == steps:
                break
    loss = model.calculate_metric(is_training=True)["loss"]
    logger.info(f"supervised warm-up: {steps} steps of {SFT_BATCH_SIZE} pictures, last loss {loss:.3f}")


def main() -> None:
    model_id = args.model.model_id or vl_checkpoint(seed=args.infra.seed)
    train_vision = str(args.extra.get("train_vision", args.model.model_id is None)).lower() == "true"
    init_adapter = args.extra.get("init_adapter")  # a folder fsdp2.py (or PEFT) saved
    model = TransformersModel(model_id=model_id, model_cls=MODEL_CLS)
    lora = LoraConfig(
        r=args.lora.lora_r,
        lora_alpha=args.lora.lora_alpha,
        target_modules=args.lora.target_modules,  # all-linear: the language model's linear layers
        modules_to_save=["visual"] if train_vision else None,  # Qwen2.5-VL's tower and projector
    )
    if init_adapter:  # the saved adapter's own settings, then its weights
        lora = LoraConfig.from_pretrained(str(init_adapter))
    model.add_adapter_to_model(ADAPTER_NAME, lora, gradient_accumulation_steps=1)
    if init_adapter:
        model.load(str(init_adapter), adapter_name=ADAPTER_NAME)
    model.set_template(TEMPLATE, model_id=model_id)
    # the warm-up is for the made checkpoint, whose replies start as gibberish (--sft-steps N)
    sft_steps = extra_number(
        "sft_steps", 0 if init_adapter or args.model.model_id else DEFAULT_SFT_STEPS, int
    )
    if sft_steps:
        sft_warm_up(model, model_id, sft_steps, extra_number("sft_lr", SFT_LR, float))
    model.set_optimizer(args.optimizer.optimizer_cls, lr=LR)
    grpo_steps = MAX_STEPS * -(-BATCH_SIZE * NUM_GENERATIONS // MINI_BATCH_SIZE)  # forward_backward calls

    def grpo_schedule(optimizer):
        """The schedule over GRPO's steps alone: it starts after the warm-up."""
        return build_scheduler(
            args.scheduler.scheduler_cls, optimizer, args.scheduler.num_warmup_steps, grpo_steps
        )

    # num_training_steps is the run's length, which the progress line counts against: the
    # warm-up's steps and GRPO's (they share the step counter); the schedule is GRPO's own
    model.set_lr_scheduler(grpo_schedule, num_training_steps=sft_steps + grpo_steps)
    model.set_loss(GRPOLoss(epsilon=args.loss.epsilon, epsilon_high=args.loss.epsilon_high))

    sampler = TorchSampler(model)  # the trainer's own modules, its adapter
    sampler.set_template(TEMPLATE, model_id=model_id)
    sampler.reset_mm_cache()
    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)

    dataloader = DataLoader(dataset=create_dataset("train", args.training.train_samples),
                            batch_size=BATCH_SIZE, shuffle=True, seed=args.infra.seed)  # fmt: skip
    held_out = create_dataset("eval", args.training.eval_samples or 44)
    advantage_fn = GRPOAdvantage()
    metrics = CompletionRewardMetric()
    model.add_metric(metrics, is_training=True)  # its rewards join the step's numbers (metrics.jsonl)
    sampling_params = SamplingParams(max_tokens=MAX_TOKENS, num_samples=1, logprobs=1,
                                     temperature=args.sampling.temperature)  # fmt: skip
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    before = held_out_accuracy(sampler, held_out)
    logger.info(f"held-out greedy accuracy before training: {before:.3f} (chance {1 / len(ANSWERS):.3f})")

    optim_step, order = 0, random.Random(args.infra.seed)
    while optim_step < MAX_STEPS:
        for batch in dataloader:
            t0 = time.perf_counter()
            ckpt_manager.sync_weights(merge_and_sync=False)
            sampler.reset_prefix_cache()
            sampler.reset_encoder_cache()
            # each prompt repeated NUM_GENERATIONS times in a row: GRPOAdvantage's groups
            expand_prompts = [prompt for prompt in batch for _ in range(NUM_GENERATIONS)]
            sampling_params.seed = order.randrange(2**31)
            sample_responses = sampler.sample(expand_prompts, sampling_params)
            sequences = [seq for response in sample_responses for seq in response.sequences]
            all_input_data = [seq.new_input_feature for seq in sequences]  # each with its picture
            all_old_logps = [[logprob[0][1] for logprob in seq.logprobs] for seq in sequences]
            total_rewards, reward_dict = compute_rewards(all_input_data)
            metrics.accumulate(completion_lengths=[len(seq.tokens) for seq in sequences],
                               rewards={"total": total_rewards, **reward_dict})  # fmt: skip
            advantages = advantage_fn(total_rewards, num_generations=NUM_GENERATIONS, scale="group").tolist()
            for start in range(0, len(all_input_data), MINI_BATCH_SIZE):
                part = slice(start, start + MINI_BATCH_SIZE)
                model.forward_backward(inputs=all_input_data[part], old_logps=all_old_logps[part],
                                       advantages=advantages[part], micro_batch_size=args.training.micro_batch_size)  # fmt: skip
                model.clip_grad_and_step(max_grad_norm=args.optimizer.max_grad_norm)
            optim_step += 1
            groups = [
                total_rewards[i : i + NUM_GENERATIONS] for i in range(0, len(total_rewards), NUM_GENERATIONS)
            ]
            varied = sum(len(set(group)) > 1 for group in groups)  # the groups GRPO learns from
            log_dict = model.calculate_metric(is_training=True)
            shown = {
                k: v for k, v in log_dict.items() if k.startswith("train/") or k in ("loss", "grad_norm")
            }
            logger.info(f"step {optim_step}/{MAX_STEPS} ({time.perf_counter() - t0:.1f}s, "
                        f"{varied}/{len(groups)} groups with differing rewards): "
                        + ", ".join(f"{k}={v:.3f}" for k, v in shown.items()))  # fmt: skip
            if optim_step >= MAX_STEPS:
                break
    after = held_out_accuracy(sampler, held_out)
    logger.info(
        f"held-out greedy accuracy: {before:.3f} before, {after:.3f} after (chance {1 / len(ANSWERS):.3f})"
    )
    model.save("last-checkpoint", output_dir=args.training.output_dir, adapter_name=ADAPTER_NAME)


if __name__ == "__main__":
    main()
