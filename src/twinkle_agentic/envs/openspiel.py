"""``OpenSpielEnv``: a single-player OpenSpiel game (blackjack by default) as an ``Env``.

The model plays through one tool (``play``, its ``action`` one of the game's action names in
lower case: ``hit``/``stand`` for blackjack); chance events (cards dealt) are drawn from the
episode's seed, so a seed replays the same game. The reward comes when the game ends: the
player's return (blackjack: 1 win, 0 push, -1 loss). ``open-spiel`` is an optional dependency
(``pip install 'twinkle[agentic]'``)."""

import random
from typing import Any

from twinkle.utils.errors import UserError
from twinkle_agentic.envs.base import Environment, StepResult
from twinkle_agentic.tools.base import function_info


def _pyspiel() -> Any:
    try:
        import pyspiel
    except ImportError as exc:
        raise UserError("OpenSpielEnv needs open-spiel: pip install 'twinkle[agentic]'") from exc
    return pyspiel


class OpenSpielEnv(Environment):
    """``game_name``: an OpenSpiel game with one player and chance nodes; ``tool_name``: the
    tool the model plays through."""

    def __init__(self, game_name: str = "blackjack", tool_name: str = "play"):
        self.game = _pyspiel().load_game(game_name)
        if self.game.num_players() != 1:
            raise UserError(
                f"OpenSpielEnv: {game_name!r} has {self.game.num_players()} players; one is supported"
            )
        self.game_name, self.tool_name = game_name, tool_name
        self.rng = random.Random(0)
        self.state = None
        names = self._action_names(self.game.new_initial_state())
        self.actions = sorted(set(names.values()))

    def _action_names(self, state: Any) -> dict[int, str]:
        """Every action id the game lists, by its lower-case name (from an initial state's
        player turn, reached by resolving chance with a fixed draw)."""
        probe = state.clone()
        rng = random.Random(0)
        while probe.is_chance_node():
            self._chance(probe, rng)
        if probe.is_terminal():
            return {}
        return {a: probe.action_to_string(0, a).lower() for a in probe.legal_actions()}

    @staticmethod
    def _chance(state: Any, rng: random.Random) -> None:
        outcomes = state.chance_outcomes()
        actions, weights = zip(*outcomes, strict=True)
        state.apply_action(rng.choices(actions, weights=weights)[0])

    def _settle(self) -> None:
        while self.state.is_chance_node():
            self._chance(self.state, self.rng)

    def _observe(self, reward: float = 0.0) -> StepResult:
        done = self.state.is_terminal()
        text = str(self.state) if done else self.state.observation_string(0)
        if done:
            reward = float(self.state.returns()[0])
            text += f"Game over. Your reward: {reward:g}"
        else:
            legal = [self.state.action_to_string(0, a).lower() for a in self.state.legal_actions()]
            text += f"Your actions: {', '.join(legal)}"
        return StepResult(text.strip(), reward, done)

    def reset(self, trajectory: Any = None, seed: int | None = None) -> StepResult:
        if seed is not None:
            self.rng = random.Random(seed)
        self.state = self.game.new_initial_state()
        self._settle()
        return self._observe()

    def step(self, tool_name: str, arguments: dict[str, Any]) -> StepResult:
        if self.state is None or self.state.is_terminal():
            return StepResult("The game is over; reply without calling a tool.", 0.0, True)
        wanted = str(arguments.get("action", "")).lower().strip()
        legal = {self.state.action_to_string(0, a).lower(): a for a in self.state.legal_actions()}
        if wanted not in legal:
            return StepResult(f"Error: {wanted!r} is not a legal action; choose one of {', '.join(legal)}")
        self.state.apply_action(legal[wanted])
        self._settle()
        return self._observe()

    def tools(self) -> list[dict[str, Any]]:
        parameters = {
            "type": "object",
            "properties": {"action": {"type": "string", "enum": self.actions}},
            "required": ["action"],
        }
        return [function_info(self.tool_name, f"Take an action in {self.game_name}.", parameters)]
