"""What the two multi-turn GRPO cookbooks share: the arithmetic tool task's prompt, its reward,
and how a batch of episodes is played and the held-out questions scored.

``multi_turn_grpo.py`` trains in this process; ``multi_turn_grpo_client.py`` trains the same task
through ``twinkle_client`` against ``twinkle server``. The rollout passed in is either's
(``MultiTurnRollout`` or ``ClientMultiTurnRollout``): the episodes, prompts and rewards are the
same."""

import sys

from twinkle.data_format import SamplingParams
from twinkle_agentic.envs import EnvPool, EnvTool, answer_reward
from twinkle_agentic.rollout import MultiTurnRollout
from twinkle_agentic.tools import ToolManager

SYSTEM = "You answer arithmetic questions with the calculator tool: call it, then reply with its result."
# Defaults sized for a CPU: a step plays 4 questions x 4 trajectories of at most 3 replies of 40 tokens
DEFAULTS = {
    "max_steps": 6,
    "max_tokens": 40,
    "batch_size": 4,
    "num_generations": 4,
    "warmup": 2,
    "held_out": 24,
}
MAX_TURNS = 3
HELD_OUT_SEED = 1_000_000  # held-out questions' seeds start here, apart from the training ones


def given(flag: str) -> bool:
    """Whether ``--flag`` was on the command line (a shared default then does not apply)."""
    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


def sizes(args, defaults: dict = DEFAULTS) -> tuple[int, int, int, int, int, int]:
    """Steps, tokens per reply, questions per step, trajectories per question, warm-up steps,
    held-out questions: the flags given, else ``defaults``."""
    return (
        args.training.max_steps or defaults["max_steps"],
        args.sampling.max_tokens or defaults["max_tokens"],
        args.training.batch_size if given("--batch-size") else defaults["batch_size"],
        args.rl.num_generations if given("--num-generations") else defaults["num_generations"],
        args.scheduler.num_warmup_steps if given("--num-warmup-steps") else defaults["warmup"],
        args.training.eval_samples or defaults["held_out"],
    )


def solved(a: int, b: int) -> list[dict]:
    """One solved question as conversation turns: the call, the result, the answer."""
    call = f'<tool_call>[{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}]</tool_call>'
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"{a} * {b} = {a * b}"},
    ]


def trajectory(question: str, answer: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, *solved(12, 34), *solved(57, 21)]
    return {"messages": [*messages, {"role": "user", "content": question}], "user_data": {"answer": answer}}


def success(record: dict) -> float:
    """1.0 when the trajectory ends with an answer whose last number is the product."""
    if record["stop_reason"] != "answer":
        return 0.0
    return answer_reward(record["messages"][-1]["content"], record["user_data"]["answer"])


def play(rollout: MultiTurnRollout, pool: EnvPool, seeds: list[int], params: SamplingParams) -> list[dict]:
    """One episode per seed, each in its own slot, played out."""
    adapters = pool.get_adapters(len(seeds))
    starts = [a.reset(seed=s) for a, s in zip(adapters, seeds, strict=True)]
    managers = [ToolManager(EnvTool.from_env(a), format="smollm2", timeout=5) for a in adapters]
    prompts = [trajectory(s.observation, s.info["answer"]) for s in starts]
    return rollout(prompts, tool_manager=managers, sampling_params=params)


def evaluate(rollout: MultiTurnRollout, pool: EnvPool, questions: int, max_tokens: int) -> float:
    """Greedy success on ``questions`` held-out questions."""
    seeds = [HELD_OUT_SEED + i for i in range(questions)]
    records = []
    for start in range(0, questions, pool.pool_size):
        records += play(
            rollout,
            pool,
            seeds[start : start + pool.pool_size],
            SamplingParams(max_tokens=max_tokens, temperature=0),
        )
    return sum(success(r) for r in records) / len(records)
