"""``forward_only(inputs=..., micro_batch_size=N)``: an evaluation or reference pass run N rows
at a time, its ``logps`` joined in row order, as upstream's scripts call it to bound memory on a
large batch of rollouts. The parts record no evaluation loss (``calculate_loss`` refuses after
it): a pass run in parts serves its log-probabilities."""

from typing import Any

import torch

from twinkle.model.forward import causal_lm_of, task_loss
from twinkle.model.inputs import prepare_inputs
from twinkle.model.loss_inputs import keyword_inputs, split_rows, with_loss_inputs
from twinkle.model.outputs import ModelOutputs, joined_logps
from twinkle.model.vision import check_reads_images

PARTS_RECORD_NOTHING = (
    "the last forward_only ran in parts (micro_batch_size=...), which record no evaluation loss; "
    "call forward_only without micro_batch_size before calculate_loss()"
)


def forward_only_in_parts(
    model: Any,
    inputs: Any,
    micro_batch_size: int,
    task: str,
    adapter_name: str | None,
    disable_lora: bool,
    ref_outputs: Any,
    loss_inputs: dict[str, Any],
) -> ModelOutputs:
    """Every rank runs as many parts (``split_rows``); a rank's empty part is its pad row, which
    adds no log-probabilities."""
    group = model._group(adapter_name)
    loss_fn = task_loss(group, task)
    # each part runs under the call's routing replay action (twinkle.model.router_replay)
    replay = {k: loss_inputs.pop(k) for k in ("router_replay_action",) if k in loss_inputs}
    extras = keyword_inputs(loss_fn, ref_outputs, loss_inputs)
    batch = with_loss_inputs(loss_fn, prepare_inputs(group, inputs, model.tokenizer), extras, required=False)
    check_reads_images(causal_lm_of(model.model), batch)  # before the first part runs
    loss_sum, tokens, logps, routes = 0.0, 0, [], []
    for part in split_rows(batch, micro_batch_size, loss_fn):
        out = model.forward_only(
            part, task=task, adapter_name=group.adapter_name, disable_lora=disable_lora, **replay
        )
        model._pending_eval = None  # a part is not an evaluation batch (module docstring)
        if part["input_ids"].shape[0]:
            logps.append(out["logps"])
            routes.append(out.get("routed_experts"))
        loss_sum, tokens = loss_sum + float(out) * out["num_tokens"], tokens + out["num_tokens"]
    model._pending_eval = None
    model._eval_without = PARTS_RECORD_NOTHING
    routed = torch.cat(routes) if routes and all(r is not None for r in routes) else None
    model.last_outputs = ModelOutputs(loss_sum / max(1, tokens), tokens, joined_logps(logps), routed)
    return model.last_outputs
