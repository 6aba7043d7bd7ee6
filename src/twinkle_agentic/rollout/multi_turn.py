"""``MultiTurnRollout``: the model and its tools take turns until the model answers.

Each turn samples every live trajectory in one batched ``sampler.sample`` call, then runs the
tool calls of all of them concurrently (threads: an environment on a Ray worker or behind HTTP
waits without holding the others up), appends the results and the next generation prompt, and
samples again; a trajectory ends when a reply calls no tool, when an environment says the
episode is done, at ``max_turns`` replies or at ``max_trajectory_tokens`` tokens.

What is trained is exactly what the model sampled: its tokens go into the row with their labels
and the sampler's log-probs, and everything else (prompt, tool results, the template's tokens
between turns) has label -100. The prompt a turn is sampled from is the row's own tokens, so the
log-probs are those of a forward pass over the finished trajectory."""

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from twinkle.data_format.sampling import SamplingParams
from twinkle.utils.errors import UserError
from twinkle_agentic.rollout.base import Rollout
from twinkle_agentic.rollout.bridge import bridge_text, closing
from twinkle_agentic.rollout.metrics import RolloutMetrics
from twinkle_agentic.rollout.state import Episode
from twinkle_agentic.tools.base import ToolOutcome
from twinkle_agentic.tools.manager import ToolManager

LAST_TURN_NOTICE = "(This was your last tool call: reply with your answer now.)"


class MultiTurnRollout(Rollout):
    """``sampler``: anything with ``sample(rows, sampling_params)`` returning one response per
    row whose ``sequences[0]`` has ``tokens``, ``logprobs`` and ``stop_reason``
    (``TorchSampler``, ``vLLMSampler``); ``template``: the chat template the turns are rendered
    with (default: the sampler's); ``tool_manager``: the tools, one manager for every trajectory
    or one per trajectory at call time; ``sampling_params``: per reply (``logprobs`` is set to at
    least 1: training needs them); ``max_turns``: replies per trajectory; ``max_trajectory_tokens``:
    the most tokens a trajectory may hold; ``reward_fn(trajectory) -> float``: added to the
    environments' rewards once a trajectory ends; ``tools_in_system``: put the tool list and call
    format into the system turn (the template does not see ``tools``); ``last_turn_notice``: text
    added to the observations before the last reply (None: nothing)."""

    def __init__(
        self,
        sampler: Any,
        template: Any = None,
        tool_manager: ToolManager | list[ToolManager] | None = None,
        sampling_params: SamplingParams | None = None,
        max_turns: int = 6,
        max_trajectory_tokens: int | None = None,
        reward_fn: Any = None,
        tools_in_system: bool = True,
        last_turn_notice: str | None = LAST_TURN_NOTICE,
        max_threads: int = 32,
    ):
        if max_turns < 1:
            raise UserError(f"MultiTurnRollout(max_turns={max_turns}): at least one reply is needed")
        if max_trajectory_tokens is not None and max_trajectory_tokens < 1:
            raise UserError(
                f"MultiTurnRollout(max_trajectory_tokens={max_trajectory_tokens}): must be >= 1 or None"
            )
        self.sampler = sampler
        self.template = template if template is not None else _template_of(sampler)
        self.tool_manager = tool_manager
        params = sampling_params or SamplingParams(max_tokens=256)
        if params.num_samples != 1:
            raise UserError(
                f"MultiTurnRollout: num_samples={params.num_samples}; each trajectory samples one reply per "
                "turn: repeat a trajectory G times for a group"
            )
        self.sampling_params = dataclasses.replace(params, logprobs=max(1, params.logprobs or 1))
        self.max_turns, self.max_trajectory_tokens = max_turns, max_trajectory_tokens
        self.reward_fn, self.tools_in_system = reward_fn, tools_in_system
        self.last_turn_notice, self.max_threads = last_turn_notice, max_threads
        self.metrics = RolloutMetrics()
        self._close = closing(self.template)
        self._stop_ids = _stop_ids(self.template.tokenizer)

    # ----------------------------------------------------------------- the loop
    def __call__(
        self,
        trajectories: list[dict[str, Any]],
        tool_manager: ToolManager | list[ToolManager] | None = None,
        sampling_params: SamplingParams | None = None,
    ) -> list[dict[str, Any]]:
        """Play out ``trajectories`` (each ``{'messages': [...], ...}``); returns one record per
        trajectory, in order (``Episode.record``). ``self.metrics`` holds this call's counts."""
        if isinstance(trajectories, dict):
            raise UserError("MultiTurnRollout takes a list of trajectories; wrap one as [trajectory]")
        start = time.perf_counter()
        self.metrics = metrics = RolloutMetrics(trajectories=len(trajectories))
        managers = self._managers(tool_manager, len(trajectories))
        params = self._params(sampling_params)
        episodes = [self._start(t, m) for t, m in zip(trajectories, managers, strict=True)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_threads, len(episodes)))) as pool:
            for turn in range(self.max_turns):
                for e in episodes:
                    if not e.done and self._room(e) <= 0:  # a prompt already at the token limit
                        metrics.token_limit += 1
                        e.finish("max_tokens", truncated=True)
                live = [e for e in episodes if not e.done]
                if not live:
                    break
                replies = self._sample(live, params, turn)
                acting = [(e, r) for e, r in zip(live, replies, strict=True) if self._take_reply(e, *r)]
                t0 = time.perf_counter()
                outcomes = list(pool.map(lambda pair: pair[0].manager.execute_reply(pair[1][3]), acting))
                metrics.env_seconds += time.perf_counter() - t0
                for (episode, _), (results, _) in zip(acting, outcomes, strict=True):
                    self._observe(episode, results, last=turn + 2 == self.max_turns)
        records = [e.record(self._reward(e)) for e in episodes]
        metrics.total_seconds = time.perf_counter() - start
        return records

    def _sample(self, live: list[Episode], params: SamplingParams, turn: int) -> list[tuple]:
        """One batched call for every live trajectory: per trajectory (tokens, logprobs,
        stop_reason, text)."""
        budget = max(self._room(e) for e in live)
        limit = budget if params.max_tokens is None else min(params.max_tokens, budget)
        seed = None if params.seed is None else params.seed + 7_919 * turn
        call = dataclasses.replace(params, max_tokens=max(1, limit), seed=seed)
        t0 = time.perf_counter()
        responses = self.sample_rows([{"input_ids": list(e.ids)} for e in live], call)
        self.metrics.sample_seconds += time.perf_counter() - t0
        out = []
        for episode, response in zip(live, responses, strict=True):
            seq = response.sequences[0]
            tokens, logprobs, reason = list(seq.tokens), list(seq.logprobs), seq.stop_reason
            room = self._room(episode)
            if len(tokens) > room:  # a shared call's budget is the largest: cut this one to its own
                tokens, logprobs, reason = tokens[:room], logprobs[:room], "max_tokens"
            out.append((tokens, logprobs, reason, self.template.decode(tokens, skip_special_tokens=True)))
        return out

    def _take_reply(self, e: Episode, tokens: list[int], logprobs: list, reason: str, text: str) -> bool:
        """Append a reply; whether its tool calls are to be run."""
        e.add_generated(tokens, logprobs)
        e.messages.append({"role": "assistant", "content": text})
        e.turns += 1
        e.turn_rewards.append(0.0)
        self.metrics.turns += 1
        self.metrics.generated_tokens += len(tokens)
        if reason == "max_tokens":
            self.metrics.token_limit += 1
            e.finish("max_tokens", truncated=True)
        elif reason == "length":
            self.metrics.length_cut += 1
            e.finish("length", truncated=True)
        calls, errors = e.manager.parse(text)
        if e.done:
            return False
        if not calls and not errors:
            e.finish("answer")
            return False
        if e.turns >= self.max_turns:
            self.metrics.turn_limit += 1
            e.finish("max_turns", truncated=True)
            return False
        return True

    def _observe(self, e: Episode, results: list[ToolOutcome], last: bool) -> None:
        """Append one reply's tool results and, unless the episode ended, the next prompt."""
        for r in results:
            self.metrics.tool_calls += r.error != "malformed"
            if r.error is not None:
                self.metrics.errors[r.error] += 1
        e.tool_calls += sum(r.error != "malformed" for r in results)
        e.tool_errors += sum(r.error is not None for r in results)
        e.turn_rewards[-1] += sum(r.reward for r in results)
        ended = any(r.done for r in results)
        texts = [r.content for r in results]
        if last and not ended and self.last_turn_notice:
            texts[-1] = f"{texts[-1]}\n{self.last_turn_notice}"
        observations = e.manager.format.observation_messages(texts)
        end = self._reply_end(e)
        text = bridge_text(self.template, e.messages, observations, end, self._close, next_turn=not ended)
        tokens = self.template.tokenizer(text, add_special_tokens=False)["input_ids"]
        e.add_context(tokens)
        e.messages.extend(observations)
        self.metrics.observation_tokens += len(tokens)
        if ended:
            e.finish("env_done")
        elif self._room(e) <= 0:
            self.metrics.token_limit += 1
            e.finish("max_tokens", truncated=True)

    def sample_rows(self, rows: list[dict[str, Any]], params: SamplingParams) -> list[Any]:
        """The sampler's call (a client over HTTP takes its parameters another way)."""
        return self.sampler.sample(rows, params)

    # ----------------------------------------------------------------- pieces
    def _start(self, trajectory: dict[str, Any], manager: ToolManager) -> Episode:
        if not isinstance(trajectory, dict) or not trajectory.get("messages"):
            raise UserError("MultiTurnRollout: each trajectory needs 'messages' (a system and/or user turn)")
        messages = [dict(m) for m in trajectory["messages"]]
        if self.tools_in_system and manager.names():
            prompt = manager.tools_prompt()
            if messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0].get('content', '')}\n\n{prompt}".strip()
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        ids = self.template.prompt_ids(messages)
        return Episode(source=dict(trajectory), manager=manager, messages=messages, ids=list(ids))

    def _room(self, e: Episode) -> int:
        if self.max_trajectory_tokens is None:
            return 1 << 30
        return self.max_trajectory_tokens - len(e.ids)

    def _reply_end(self, e: Episode) -> str:
        last = e.ids[-1] if e.ids else None
        return self.template.decode([last]) if last in self._stop_ids else ""

    def _reward(self, e: Episode) -> float:
        total = float(sum(e.turn_rewards))
        if self.reward_fn is not None:
            total += float(self.reward_fn(e.record(total)))
        return total

    def _managers(self, given: Any, n: int) -> list[ToolManager]:
        given = self.tool_manager if given is None else given
        if given is None:
            given = ToolManager()
        if isinstance(given, list):
            if len(given) != n:
                raise UserError(
                    f"MultiTurnRollout: {len(given)} tool managers for {n} trajectories; pass one per trajectory"
                )
            return given
        return [given] * n

    def _params(self, given: SamplingParams | None) -> SamplingParams:
        if given is None:
            return self.sampling_params
        if isinstance(given, dict):
            given = SamplingParams.from_dict(given)
        return dataclasses.replace(given, logprobs=max(1, given.logprobs or 1))


def _template_of(sampler: Any) -> Any:
    getter = getattr(sampler, "_template", None)
    template = getter() if callable(getter) else getattr(sampler, "template", None)
    if template is None:
        raise UserError("MultiTurnRollout: the sampler has no template; pass template=")
    return template


def _stop_ids(tokenizer: Any) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return ids | set(getattr(tokenizer, "all_special_ids", []) or [])
