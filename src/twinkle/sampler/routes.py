"""``RouteLog``: the experts each sampled sequence's tokens ran through, recorded as the decoder
runs them (``engine_args['enable_return_routed_experts']``; ``twinkle.model.router_replay``).

The decoder's forwards do not run one sequence each: the prompts' common prefix runs once in a
row of its own, the rest of each prompt once (left-padded) before its ``num_samples`` rows are
repeated from it, and each step then runs the rows still generating, one token each. The log
follows that layout back to the sequences: a sequence's routes are the prefix's, its prompt's own
and one per sampled token that was run (every one but the last)."""

import torch

from twinkle.model.router_replay import RouterReplay


class RouteLog:
    """The routes of one ``Decoder`` run over ``replay``'s routers (which record every forward
    while ``replay.recording_all()`` is on); ``num_samples`` rows per prompt."""

    def __init__(self, replay: RouterReplay, num_samples: int):
        self.replay = replay
        self.num_samples = num_samples
        self.prefix: torch.Tensor | None = None  # (shared, layers, k)
        self.rows: list[list[torch.Tensor]] = []

    def prefix_ran(self) -> None:
        """The common prefix's forward (one row) just ran."""
        self.prefix = self.replay.take()

    def prompts_ran(self, lengths: list[int], width: int) -> None:
        """The prompts' forward just ran: ``lengths`` tokens of each (after the prefix), each row
        left-padded to ``width``; each prompt's routes go to its ``num_samples`` rows."""
        taken = self.replay.take().reshape(len(lengths), width, self.replay.layers, -1)
        for i, n in enumerate(lengths):
            own = taken[i, width - n :]
            prompt = own if self.prefix is None else torch.cat([self.prefix, own])
            self.rows += [[prompt] for _ in range(self.num_samples)]

    def step_ran(self, alive: list[int]) -> None:
        """A decoding step just ran one token of each row in ``alive`` (in that order)."""
        taken = self.replay.take()
        for position, row in enumerate(alive):
            self.rows[row].append(taken[position : position + 1])

    def routes(self, row: int) -> torch.Tensor:
        """Row ``row``'s routes, ``(tokens, moe_layers, top_k)`` on the CPU."""
        return torch.cat(self.rows[row]).cpu()
