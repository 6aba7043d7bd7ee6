"""The JSON fields each route takes, and the check that refuses any other by name.

A field a route does not know is a 400 naming it (``field 'lora_config.bogus' is not one
create_model takes; it takes ...``) rather than a value the server drops without a word: a
client that misspells ``ttl_seconds`` learns it at once. ``FIELDS`` maps each route's path to
its fields, and each field to what the server does with it:

- ``READ``: the route reads it (and checks it where it reads it);
- ``FREE``: an object whose keys are the client's own (``user_metadata``), kept as sent;
- ``Inert(reason)``: a field the Tinker SDK sends whose job this server does anyway or has no
  use for (a request's ``seq_id``: each key's requests already run in order);
- ``Only(values, reason)``: accepted only with one of ``values`` (the one the server does);
  any other value is a 400 naming the field and saying why;
- a dict: an object with fields of its own; ``[dict]``: a list of such objects.

``requests.body`` runs the check for the route it serves; a route that reads a JSON body and
has no entry here is a programming error (``tests/server/test_request_fields.py`` enumerates
the SDK's request models against this table)."""

from dataclasses import dataclass
from typing import Any

from twinkle.server.checks import Fields, shown
from twinkle.server.errors import BadRequest

READ = "read"
FREE = "free"


@dataclass(frozen=True)
class Inert:
    reason: str


@dataclass(frozen=True)
class Only:
    values: tuple
    reason: str


SEQ = Inert("each key's requests run in the order they arrive")
TYPE = Inert("the request's kind, which its route names")
SDK = Inert("the SDK's version; the routes are tinker 0.38.0's")
CLIENT = Inert("the SDK client sending it; runs and samplers belong to the key")
NO_PROJECTS = Only((None,), "projects are not implemented by twinkle server")
NO_TOKEN = Only((None,), "a checkpoint here is read by its key, or by any key once published")
ADAM = {"type": Only(("adamw",), "the server's optimizer is AdamW")}
IMAGE_CHUNK = {"data": READ, "format": READ, "expected_tokens": READ}  # an ImageChunk's
LORA = {
    "rank": READ,
    "seed": READ,
    # the SDK sends True unless told otherwise (twinkle.init_tinker_client makes False its default)
    "train_unembed": Only(
        (False,),
        "LoRA here is on the linear layers of the blocks, never on the unembedding (lm_head); "
        "pass train_unembed=False to create_lora_training_client",
    ),
    "train_mlp": Only((True,), "LoRA is on every linear layer, the MLP's included"),
    "train_attn": Only((True,), "LoRA is on every linear layer, the attention's included"),
}
ADAM_PARAMS = {
    name: READ for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
} | {"type": Only(("adam", "adamw", None), "the step is AdamW")}
TENSOR = {name: READ for name in ("data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices")}
SAVE = {
    "model_id": READ,
    "path": READ,
    "seq_id": SEQ,
    "ttl_seconds": READ,
    "user_metadata": FREE,
    "type": TYPE,
}

V1 = "/api/v1"
FIELDS: dict[str, dict[str, Any]] = {
    V1 + "/client/config": {"sdk_version": SDK},
    V1 + "/client/dynamic_config": {"sdk_version": SDK},
    V1 + "/create_session": {
        "tags": Inert("labels for the SDK's client search, which twinkle server does not have"),
        "user_metadata": Inert("labels for the SDK's client search, which twinkle server does not have"),
        "sdk_version": SDK,
        "project_id": NO_PROJECTS,
        "display_name": Inert("labels for the SDK's client search, which twinkle server does not have"),
        "type": TYPE,
    },
    V1 + "/session_heartbeat": {"session_id": CLIENT, "type": TYPE},
    V1 + "/telemetry": {
        name: Inert("the SDK's telemetry is taken and not kept")
        for name in ("events", "platform", "sdk_version", "session_id", "process_uuid")
    },
    V1 + "/create_model": {
        "session_id": CLIENT,
        "model_seq_id": Inert("the run's id is the server's"),
        "base_model": READ,
        "user_metadata": FREE,
        "lora_config": LORA,
        "optimizer_config": ADAM,
        "type": TYPE,
    },
    V1 + "/get_info": {"model_id": READ, "type": TYPE},
    V1 + "/unload_model": {"model_id": READ, "type": TYPE},
    V1 + "/optim_step": {
        "model_id": READ,
        "adam_params": ADAM_PARAMS,
        "optim_params": ADAM_PARAMS,
        "optimizer_params": ADAM_PARAMS,
        "seq_id": SEQ,
        "type": TYPE,
    },
    V1 + "/save_weights": SAVE | {"overwrite": READ},
    V1 + "/save_weights_for_sampler": SAVE
    | {
        "sampling_session_seq_id": Inert("the sampler's id is the server's"),
        # a snapshot is what every save writes; 'inflight' asks for no more than that
        "kind": Only(("snapshot", "inflight"), "a save is a snapshot"),
    },
    V1 + "/load_weights": {
        "model_id": READ,
        "seq_id": SEQ,
        "session_id": READ,
        "model_seq_id": READ,
        "base_model": READ,
        "user_metadata": FREE,
        "path": READ,
        "optimizer": READ,
        "optimizer_config": ADAM,
        "weights_access_token": NO_TOKEN,
        "type": TYPE,
    },
    V1 + "/create_sampling_session": {
        "session_id": CLIENT,
        "sampling_session_seq_id": Inert("the sampler's id is the server's"),
        "base_model": READ,
        "model_path": READ,
        "type": TYPE,
    },
    V1 + "/asample": {
        "num_samples": READ,
        "prompt": {"chunks": [{"tokens": READ, "type": READ, **IMAGE_CHUNK}]},
        "sampling_params": {
            name: READ for name in ("max_tokens", "seed", "stop", "temperature", "top_k", "top_p")
        },
        "base_model": READ,
        "model_path": READ,
        "sampling_session_id": READ,
        "seq_id": SEQ,
        "prompt_logprobs": READ,
        "topk_prompt_logprobs": READ,
        "topk_sample_logprobs": READ,
        "target_prompt_logprobs": TENSOR,
        "prompt_alt_tokens_k": READ,
        "prompt_logprobs_last_n": READ,
        "record_stability_info": READ,
        "type": TYPE,
    },
    V1 + "/retrieve_future": {
        "request_id": READ,
        # it allows a shorter answer; the full one is always sent
        "allow_metadata_only": Inert("the whole result is always sent"),
    },
    V1 + "/cancel_future": {"request_id": READ, "type": TYPE},
    V1 + "/weights_info": {"tinker_path": READ},
    V1 + "/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl": {"ttl_seconds": READ},
    V1 + "/sessions/{client_id}/finish": {"reason": Inert("the client's runs and samplers stay usable")},
}


def check_fields(data: Any, spec: dict[str, Any], route: str) -> None:
    """Refuse a field of ``data`` (a request body, or an object in it) that ``spec`` lacks, and
    an ``Only`` field with another value; walked with a stack, every object a ``Fields``."""
    stack: list[tuple[Any, dict[str, Any]]] = [(data, spec)]
    while stack:
        obj, fields = stack.pop()
        if not isinstance(obj, Fields):
            continue  # a wrong kind is refused by the route that reads it, naming it
        for name, value in obj.items():
            rule = fields.get(name)
            where = obj.path(name)
            if rule is None:
                raise BadRequest(
                    f"field {shown(where, 120)} is not one {route} takes; it takes "
                    f"{', '.join(sorted(fields))}"
                )
            if isinstance(rule, Only) and value not in rule.values:
                raise BadRequest(f"field {where!r} = {shown(value)} is not supported: {rule.reason}")
            if isinstance(rule, dict):
                stack.append((value, rule))
            elif isinstance(rule, list) and isinstance(value, list):
                stack.extend((item, rule[0]) for item in value)


__all__ = ["FIELDS", "FREE", "READ", "Inert", "Only", "check_fields"]
