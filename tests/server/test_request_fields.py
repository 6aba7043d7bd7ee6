"""No JSON field a request sends is dropped without a word: every request model of the Tinker
SDK (pinned 0.38.0), which ``twinkle_client`` sends too, is either served by a route whose field
table (``twinkle.server.fields.FIELDS``) gives each of its fields a rule, or answered 404 by
name; on every route an unknown field, top-level or nested, is a 400 naming it; an ``Only``
field with another value is a 400 saying why; and a field said to be read is read."""

import ast
import inspect
import json
from pathlib import Path

import httpx
import pydantic
import pytest
import tinker.types as types
from serving import KEY_A

from twinkle.server.fields import FIELDS, FREE, READ, Inert, Only

V1 = "/api/v1"
SERVER = Path(__file__).resolve().parents[2] / "src" / "twinkle" / "server"
# each SDK request model the server serves -> its route
SERVED = {
    "ClientConfigRequest": "/client/config",
    "CreateSessionRequest": "/create_session",
    "SessionHeartbeatRequest": "/session_heartbeat",
    "TelemetrySendRequest": "/telemetry",
    "CreateModelRequest": "/create_model",
    "GetInfoRequest": "/get_info",
    "UnloadModelRequest": "/unload_model",
    "OptimStepRequest": "/optim_step",
    "SaveWeightsRequest": "/save_weights",
    "SaveWeightsForSamplerRequest": "/save_weights_for_sampler",
    "LoadWeightsRequest": "/load_weights",
    "CreateSamplingSessionRequest": "/create_sampling_session",
    "SampleRequest": "/asample",
    "FutureRetrieveRequest": "/retrieve_future",
}
# each SDK request model of a route answered 404 by name -> that route
UNSERVED = {
    "CopyWeightsRequest": "/copy_weights",
    "CreateCustomLossRequest": "/create_custom_loss",
    "FuturesRetrieveRequest": "/retrieve_futures",
    "JoinSamplingSessionRequest": "/join_sampling_session",
    "SaveWeightsExternalRequest": "/save_weights_external",
    "SessionSearchRequest": "/sessions/search",
    "GetBillingUsageRequest": None,  # GET routes: no body
    "GetCurrentCheckpointStorageUsageRequest": None,
}
# the SDK's objects inside a request -> where the field table keeps their fields
NESTED = {
    "LoraConfig": ("/create_model", "lora_config"),
    "AdamOptimizerConfig": ("/create_model", "optimizer_config"),
    "AdamParams": ("/optim_step", "adam_params"),
    "SamplingParams": ("/asample", "sampling_params"),
    "ModelInput": ("/asample", "prompt"),
}


def request_models() -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(types).items()
        if name.endswith("Request") and inspect.isclass(obj) and issubclass(obj, pydantic.BaseModel)
    }


def test_every_sdk_request_model_is_served_or_refused_by_name():
    assert set(request_models()) == set(SERVED) | set(UNSERVED)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_each_field_of_a_served_request_has_a_rule(name):
    model, spec = request_models()[name], FIELDS[V1 + SERVED[name]]
    wire = set()
    for field_name, info in model.model_fields.items():
        aliases = getattr(info.validation_alias, "choices", None) or [field_name]
        wire |= set(aliases)
        assert any(a in spec for a in aliases), f"{name}.{field_name} has no rule in FIELDS"
    assert set(spec) <= wire, f"FIELDS names fields {sorted(set(spec) - wire)} that {name} does not have"


@pytest.mark.parametrize("name", sorted(NESTED))
def test_each_field_of_an_object_in_a_request_has_a_rule(name):
    route, key = NESTED[name]
    spec = FIELDS[V1 + route][key]
    model = getattr(types, name)
    for field_name in model.model_fields:
        assert field_name in spec, f"{name}.{field_name} has no rule under {route} {key}"
    chunk = FIELDS[V1 + "/asample"]["prompt"]["chunks"][0]
    assert set(types.EncodedTextChunk.model_fields) <= set(chunk)


def _string_constants() -> set[str]:
    """Every string literal of the server's code other than the field table."""
    found = set()
    for path in SERVER.rglob("*.py"):
        if path.name != "fields.py":
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
    return found


def _rules(spec: dict, where: str = ""):
    for key, rule in spec.items():
        if isinstance(rule, dict):
            yield from _rules(rule, f"{where}{key}.")
        elif isinstance(rule, list):
            yield from _rules(rule[0], f"{where}{key}[].")
        else:
            yield f"{where}{key}", key, rule


def test_a_field_said_to_be_read_is_named_by_the_code_and_an_inert_one_says_why():
    constants = _string_constants()
    for route, spec in FIELDS.items():
        for path, key, rule in _rules(spec):
            if rule in (READ, FREE):
                assert key in constants, f"{route} {path}: said to be read, never named by the server's code"
            else:
                assert isinstance(rule, Inert | Only) and len(rule.reason) > 10, (route, path)


def _post(server, route: str, payload: dict) -> httpx.Response:
    headers = {"X-API-Key": KEY_A, "Content-Type": "application/json"}
    method = "PUT" if route.endswith("/ttl") else "POST"
    return httpx.request(
        method, f"{server.url}{route}", content=json.dumps(payload), headers=headers, timeout=60
    )


BODY_ROUTES = sorted(
    r.replace("{run_id}", "r1")
    .replace("{kind}", "weights")
    .replace("{name}", "n")
    .replace("{client_id}", "c1")
    for r in FIELDS
)


@pytest.mark.parametrize("route", BODY_ROUTES)
def test_an_unknown_field_is_a_400_naming_it_on_every_route(server, route):
    r = _post(server, route, {"zz_not_a_field": 1})
    assert r.status_code == 400, (route, r.status_code, r.text)
    assert "'zz_not_a_field' is not one" in r.json()["detail"], r.text


@pytest.mark.parametrize(
    "route, payload, named",
    [
        (
            "/create_model",
            {"base_model": "x", "lora_config": {"rank": 4, "dropout": 0.1}},
            "lora_config.dropout",
        ),
        (
            "/optim_step",
            {"model_id": "m", "adam_params": {"learning_rate": 1e-4, "momentum": 0.9}},
            "adam_params.momentum",
        ),
        ("/asample", {"prompt": {"chunks": [{"tokens": [1], "text": "hi"}]}}, "prompt.chunks[0].text"),
        (
            "/asample",
            {"prompt": {"chunks": [{"tokens": [1]}]}, "sampling_params": {"min_p": 0.1}},
            "sampling_params.min_p",
        ),
        (
            "/asample",
            {
                "prompt": {"chunks": [{"tokens": [1]}]},
                "target_prompt_logprobs": {"data": [], "device": "cpu"},
            },
            "target_prompt_logprobs.device",
        ),
    ],
)
def test_an_unknown_field_inside_an_object_is_named_by_its_path(server, route, payload, named):
    r = _post(server, V1 + route, payload)
    assert r.status_code == 400 and f"'{named}' is not one" in r.json()["detail"], r.text


@pytest.mark.parametrize(
    "route, payload, named",
    [
        ("/create_model", {"lora_config": {"rank": 4, "train_mlp": False}}, "lora_config.train_mlp"),
        ("/create_model", {"lora_config": {"rank": 4, "train_attn": False}}, "lora_config.train_attn"),
        ("/create_model", {"lora_config": {"rank": 4, "train_unembed": True}}, "lora_config.train_unembed"),
        ("/optim_step", {"model_id": "m", "optimizer_params": {"type": "dimuon"}}, "optimizer_params.type"),
        ("/create_model", {"optimizer_config": {"type": "sgd"}}, "optimizer_config.type"),
        ("/create_session", {"project_id": "p1"}, "project_id"),
        (
            "/load_weights",
            {"path": "tinker://r/weights/n", "weights_access_token": "t"},
            "weights_access_token",
        ),
        ("/save_weights_for_sampler", {"model_id": "m", "kind": "delta"}, "kind"),
    ],
)
def test_a_value_the_server_cannot_honour_is_a_400_saying_why(server, route, payload, named):
    r = _post(server, V1 + route, payload)
    assert r.status_code == 400, r.text
    assert f"field '{named}'" in r.json()["detail"] and "is not supported" in r.json()["detail"], r.text


@pytest.mark.parametrize("name", sorted(n for n, r in UNSERVED.items() if r))
def test_a_request_of_a_route_not_served_is_a_404_naming_it(server, name):
    r = _post(server, V1 + UNSERVED[name], {})
    assert r.status_code == 404 and "not implemented by twinkle server" in r.json()["detail"], r.text
