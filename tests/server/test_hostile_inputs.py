"""Hostile input over HTTP: every bad field, name, id, nesting or page is a 4xx whose ``detail``
is one line naming the field and the limit; unknown routes, methods and unexpected exceptions
answer one line; no error a client gets carries a server path. The server keeps serving after
each."""

import json
import re
from pathlib import Path

import httpx
import pytest
import tinker
from serving import KEY_A, start
from tinker import types

from twinkle.server.checks import MAX_DEPTH, for_client, load_json, one_line, scrub
from twinkle.server.errors import BadRequest

V1 = "/api/v1"
HEAD = {"X-API-Key": KEY_A}
ABSOLUTE = re.compile(r"(?<![\w:/.<>-])/(?!api/)[\w.-]+/")  # an absolute path (not a route, not a URL)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One server for the module (a high rate limit: the cases come fast)."""
    running = start(tiny_model_dir, tmp_path_factory.mktemp("hostile") / "srv", rate=10_000.0)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def trained(server, tiny_model_dir):
    """A training run of key A with a saved state, sampler weights, and its SDK client's id."""
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = client.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1, 1, 1]},
    )
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("good").result().path
    weights = tc.save_weights_for_sampler("good").result().path
    s = server.app.state.server
    client_id = next(c for c, t in s.clients.items() if t == s.tenants[KEY_A].id)
    return {"tc": tc, "state": state, "weights": weights, "client_id": client_id, "model_id": tc.model_id}


def one_line_detail(r: httpx.Response, *words: str, url: bool = False) -> str:
    """The response's ``detail``: one line of text holding each of ``words``, no server path (but
    the request's own ``url`` path, when it echoes that)."""
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "\r" not in detail, r.text
    assert len(detail) <= 2000, len(detail)
    for word in words:
        assert word in detail, (word, detail)
    assert url or not ABSOLUTE.search(detail), detail
    return detail


def healthy(server) -> None:
    assert httpx.get(f"{server.url}{V1}/healthz").json() == {"status": "ok"}


def post(server, route: str, payload, **kw) -> httpx.Response:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {**HEAD, "Content-Type": "application/json"}
    return httpx.post(f"{server.url}{V1}/{route}", content=raw, headers=headers, timeout=60, **kw)


def future_of(server, r: httpx.Response) -> dict:
    """The result (or error) of a queued request."""
    assert r.status_code == 200, r.text
    while True:
        out = post(server, "retrieve_future", {"request_id": r.json()["request_id"]})
        if out.status_code != 408:
            return out.json()


# ---------------------------------------------------------------- 1. names, in characters and bytes
BAD_NAMES = [
    pytest.param("a" * 129, "129 characters", id="129-chars"),
    pytest.param("x" * 300, "300 characters", id="300-bytes"),
    pytest.param("é" * 128, "256 bytes", id="128-two-byte-chars"),
    pytest.param("é" * 101, "202 bytes", id="202-bytes"),
    pytest.param("a\x00b", "'a\\x00b'", id="nul"),
    pytest.param("tab\there", "'tab\\there'", id="control"),
    pytest.param("a\\b", "'a\\\\b'", id="backslash"),
    pytest.param(".hidden", "'.hidden'", id="leading-dot"),
    pytest.param("../escape", "'../escape'", id="dot-dot"),
]


@pytest.mark.parametrize("route", ["save_weights", "save_weights_for_sampler"])
@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
def test_a_bad_checkpoint_name_is_a_400_before_it_reaches_the_disk(server, trained, route, name, why):
    r = post(server, route, {"model_id": trained["model_id"], "path": name})
    assert r.status_code == 400, r.text
    one_line_detail(r, "'path'", "128 characters", "200 UTF-8 bytes", why)
    healthy(server)


@pytest.mark.parametrize("name", ["a" * 128, "é" * 100, "日本語 ok-name_1"])
def test_a_name_at_the_limits_saves_and_loads(server, trained, name):
    r = post(server, "save_weights_for_sampler", {"model_id": trained["model_id"], "path": name})
    path = future_of(server, r)["path"]
    assert path.endswith("/sampler_weights/" + name)
    r = post(server, "create_sampling_session", {"model_path": path})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("name", "why"), BAD_NAMES[:4] + [pytest.param("\ud800", "'\\ud800'", id="surrogate")]
)
def test_a_bad_name_in_a_looked_up_checkpoint_path_is_a_400(server, trained, name, why):
    run = trained["model_id"]
    path = f"tinker://{run}/weights/{name}"
    requests = [
        post(server, "load_weights", {"path": path, "optimizer": False, "session_id": trained["client_id"]}),
        post(server, "weights_info", {"tinker_path": path}),
        post(server, "create_sampling_session", {"model_path": path}),
        post(server, "asample", {"model_path": path, "prompt": {"chunks": [{"tokens": [5]}]}}),
    ]
    if "\x00" not in name and "\ud800" not in name:  # the REST routes (a URL takes neither)
        rest = f"{server.url}{V1}/training_runs/{run}/checkpoints/weights/{name}"
        requests.append(httpx.delete(rest, headers=HEAD))
        requests.append(httpx.put(rest + "/ttl", json={"ttl_seconds": 60}, headers=HEAD))
    for r in requests:
        assert r.status_code == 400, (r.request.url, r.text)
        one_line_detail(r, "checkpoint name", "128 characters", "200 UTF-8 bytes")
    healthy(server)


@pytest.mark.parametrize(
    ("route", "payload", "words"),
    [
        pytest.param(
            "optim_step", {"model_id": "m" * 5000}, ["'model_id'", "128 characters"], id="long-model-id"
        ),
        pytest.param("optim_step", {"model_id": "a\x00b"}, ["'model_id'", "printable"], id="nul-model-id"),
        pytest.param("get_info", {"model_id": "../../etc"}, ["'model_id'", "'/'"], id="slash-model-id"),
        pytest.param(
            "retrieve_future", {"request_id": "r" * 200}, ["'request_id'", "128"], id="long-request-id"
        ),
        pytest.param("cancel_future", {"request_id": "x\ny"}, ["'request_id'"], id="newline-request-id"),
        pytest.param(
            "asample",
            {"sampling_session_id": "s" * 1000, "prompt": {"chunks": [{"tokens": [5]}]}},
            ["'sampling_session_id'", "128"],
            id="long-sampler-id",
        ),
        pytest.param(
            "load_weights",
            {"path": "TRAINED", "session_id": "c" * 300, "model_seq_id": 0},
            ["'session_id'", "128"],
            id="long-client-id",
        ),
        pytest.param(
            "load_weights",
            {"path": "tinker://" + "r" * 300 + "/weights/x"},
            ["run id", "128 characters"],
            id="long-run-in-path",
        ),
    ],
)
def test_an_absurd_id_is_a_400_naming_the_field(server, trained, route, payload, words):
    payload = {k: trained["state"] if v == "TRAINED" else v for k, v in payload.items()}
    r = post(server, route, payload)
    assert r.status_code == 400, r.text
    one_line_detail(r, *words)
    healthy(server)


@pytest.mark.parametrize(
    "url",
    [
        "/training_runs/" + "r" * 5000,
        "/training_runs/" + "r" * 5000 + "/checkpoints",
        "/sessions/" + "c" * 5000,
        "/samplers/" + "s" * 5000,
        "/training_runs/%00%0A",
    ],
)
def test_an_absurd_id_in_a_rest_route_is_a_404_of_one_short_line(server, url):
    r = httpx.get(f"{server.url}{V1}{url}", headers=HEAD)
    assert r.status_code == 404, r.text[:300]
    one_line_detail(r)
    healthy(server)


# ---------------------------------------------------------------- 2. nesting
@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"[" * 100_000, id="100000-brackets"),
        pytest.param(b'{"a":' * 100_000, id="100000-objects"),
        pytest.param(b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), id="one-too-deep"),
        pytest.param(b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", id="deep-list"),
    ],
)
@pytest.mark.parametrize("route", ["create_model", "asample", "retrieve_future"])
def test_a_deeply_nested_body_is_a_400_naming_the_limit(server, route, raw):
    r = post(server, route, raw)
    assert r.status_code == 400, r.text[:500]
    one_line_detail(r, f"{MAX_DEPTH} levels")
    healthy(server)


def test_a_body_at_the_depth_limit_is_read(server):
    # the client's own labels nest as deep as the limit allows
    raw = b'{"user_metadata":' + b'{"a":' * (MAX_DEPTH - 2) + b"1" + b"}" * (MAX_DEPTH - 1)
    r = post(server, "create_session", raw)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- 3. every field named
PROMPT = {"chunks": [{"tokens": [5, 6]}]}
FIELD_CASES = [
    (
        "asample",
        {"prompt": PROMPT, "sampling_params": {"seed": 2**64}},
        "sampling_params.seed must be an integer in 0..2**63-1",
    ),
    (
        "asample",
        {"prompt": PROMPT, "sampling_params": {"seed": -1}},
        "sampling_params.seed must be an integer in 0..2**63-1",
    ),
    (
        "create_model",
        {"lora_config": {"rank": 2, "seed": 2**64}},
        "lora_config.seed must be an integer in 0..2**63-1",
    ),
    (
        "create_model",
        {"lora_config": {"rank": 2**70}},
        "lora_config.rank must be an integer in -2**63..2**63-1",
    ),
    ("create_model", {"lora_config": {"rank": "two"}}, "'lora_config.rank' must be int"),
    ("create_model", {"lora_config": {}}, "'lora_config.rank' is missing"),
    ("asample", {"prompt": PROMPT, "num_samples": 2**64}, "num_samples must be an integer in"),
    (
        "asample",
        {"prompt": PROMPT, "sampling_params": {"max_tokens": 2**64}},
        "sampling_params.max_tokens must be",
    ),
    (
        "asample",
        {"prompt": PROMPT, "sampling_params": {"temperature": 10**400}},
        "sampling_params.temperature must be a finite number",
    ),
    (
        "asample",
        {"prompt": PROMPT, "sampling_params": {"top_p": "high"}},
        "'sampling_params.top_p' must be int/float",
    ),
    ("asample", {"prompt": PROMPT, "sampling_params": {"top_p": 2}}, "top_p must be in (0, 1]"),
    ("asample", {"prompt": PROMPT, "sampling_params": {"top_k": 1.5}}, "'sampling_params.top_k' must be int"),
    (
        "asample",
        {"prompt": PROMPT, "sampling_params": {"stop": 7}},
        "'sampling_params.stop' must be str/list",
    ),
    ("asample", {"prompt": {"chunks": [{"type": "encoded_text"}]}}, "'prompt.chunks[0].tokens' is missing"),
    (
        "asample",
        {"prompt": PROMPT, "topk_prompt_logprobs": 2**63},
        "topk_prompt_logprobs must be an integer in",
    ),
    (
        "optim_step",
        {"model_id": "MODEL", "adam_params": {"learning_rate": 10**400}},
        "adam_params.learning_rate must be a finite number",
    ),
    (
        "optim_step",
        {"model_id": "MODEL", "adam_params": {"beta1": "NaN"}},
        "'adam_params.beta1' must be int/float",
    ),
    (
        "save_weights",
        {"model_id": "MODEL", "path": "ok", "ttl_seconds": 2**64},
        "ttl_seconds must be an integer in",
    ),
    ("save_weights", {"model_id": "MODEL", "path": "ok", "ttl_seconds": -5}, "ttl_seconds must be 1.."),
    (
        "load_weights",
        {"path": "TRAINED", "session_id": "CLIENT", "model_seq_id": 2**64},
        "model_seq_id must be an integer in 0..2**63-1",
    ),
    (
        "load_weights",
        {"path": "TRAINED", "session_id": "CLIENT", "model_seq_id": -3},
        "model_seq_id must be an integer in 0..2**63-1",
    ),
]


@pytest.mark.parametrize(("route", "payload", "expect"), FIELD_CASES, ids=[c[2][:40] for c in FIELD_CASES])
def test_every_bad_field_is_a_400_naming_it(server, trained, route, payload, expect):
    swap = {"MODEL": trained["model_id"], "TRAINED": trained["state"], "CLIENT": trained["client_id"]}
    payload = {k: swap.get(v, v) if isinstance(v, str) else v for k, v in payload.items()}
    r = post(server, route, payload)
    assert r.status_code == 400, r.text
    one_line_detail(r, expect)
    healthy(server)


def test_a_huge_ttl_on_the_rest_route_is_a_400(server, trained):
    url = f"{server.url}{V1}/training_runs/{trained['model_id']}/checkpoints/weights/good/ttl"
    r = httpx.put(url, json={"ttl_seconds": 2**64}, headers=HEAD)
    assert r.status_code == 400
    one_line_detail(r, "ttl_seconds must be an integer in")


# ---------------------------------------------------------------- 4. pages, routes, handlers
LISTINGS = ["/training_runs", "/checkpoints", "/sessions"]


@pytest.mark.parametrize("listing", LISTINGS)
@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("limit=-1", "limit"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=abc", "limit"),
        ("limit=1.5", "limit"),
        ("limit=" + "9" * 40, "limit"),
        ("offset=-5", "offset"),
        ("offset=x", "offset"),
        ("limit=5&offset=" + "9" * 25, "offset"),
    ],
)
def test_a_bad_page_is_a_one_line_400(server, trained, listing, query, name):
    r = httpx.get(f"{server.url}{V1}{listing}?{query}", headers=HEAD)
    assert r.status_code == 400, r.text
    detail = one_line_detail(r, f"'{name}'")
    assert ("1..1000" if name == "limit" else "0..2**63-1") in detail
    healthy(server)


@pytest.mark.parametrize("listing", LISTINGS)
def test_a_good_page_is_that_page(server, trained, listing):
    key = {"/training_runs": "training_runs", "/checkpoints": "checkpoints", "/sessions": "sessions"}[listing]
    whole = httpx.get(f"{server.url}{V1}{listing}?limit=1000", headers=HEAD).json()[key]
    assert whole
    r = httpx.get(f"{server.url}{V1}{listing}?limit=1&offset=0", headers=HEAD)
    assert r.status_code == 200 and r.json()[key] == whole[:1]
    beyond = httpx.get(f"{server.url}{V1}{listing}?offset={len(whole)}", headers=HEAD)
    assert beyond.status_code == 200 and beyond.json()[key] == []


@pytest.mark.parametrize(
    ("method", "url", "status", "words"),
    [
        ("GET", "/api/v1/no_such_route", 404, ["GET /api/v1/no_such_route", "not a route"]),
        ("POST", "/etc/passwd", 404, ["POST /etc/passwd is not a route"]),
        ("GET", "/api/v1/create_model", 405, ["method not allowed", "POST"]),
        ("DELETE", "/api/v1/healthz", 405, ["method not allowed"]),
    ],
)
def test_unknown_routes_and_methods_are_one_line(server, method, url, status, words):
    r = httpx.request(method, server.url + url, headers=HEAD)
    assert r.status_code == status and r.headers["x-should-retry"] == "false"
    one_line_detail(r, *words, url=True)


def test_fastapi_validation_is_a_one_line_400(server):
    async def probe(n: int) -> dict:
        return {"n": n}

    server.app.add_api_route("/api/v1/_probe", probe, methods=["GET"])
    r = httpx.get(f"{server.url}/api/v1/_probe?n=abc")
    assert r.status_code == 400, r.text
    one_line_detail(r, "query.n")
    assert httpx.get(f"{server.url}/api/v1/_probe?n=3").json() == {"n": 3}


def test_an_unexpected_exception_is_a_one_line_500_without_details(server, trained, monkeypatch):
    registry = server.app.state.server.registry

    def broken(run):
        raise RuntimeError("boom at /home/operator/secret/state.json\nTraceback ...")

    monkeypatch.setattr(registry, "checkpoints", broken)
    r = httpx.get(f"{server.url}{V1}/checkpoints", headers=HEAD)
    assert r.status_code == 500
    assert r.json() == {"detail": "internal error: RuntimeError"}
    monkeypatch.undo()
    healthy(server)
    assert httpx.get(f"{server.url}{V1}/checkpoints", headers=HEAD).status_code == 200


# ---------------------------------------------------------------- 5. no server path in any error
def test_a_damaged_checkpoint_is_named_by_its_tinker_path(server, trained, tiny_model_dir):
    """A saved state and sampler weights whose adapter file is damaged on disk: loading and
    sampling fail with the checkpoint's tinker path, never the server's folders."""
    tc = trained["tc"]
    state = tc.save_state("to-damage").result().path
    weights = tc.save_weights_for_sampler("to-damage").result().path
    root = server.app.state.server.config.output_dir
    for path in (state, weights):
        run, kind, name = path[len("tinker://") :].split("/")
        (adapter,) = (root).glob(f"*/{run}/{kind}/{name}/adapter_model.safetensors")
        raw = bytearray(adapter.read_bytes())
        raw[-8:] = bytes(8) if raw[-8:] != bytes(8) else b"\xff" * 8
        adapter.write_bytes(bytes(raw))
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    errors = []
    with pytest.raises(Exception) as caught:
        client.create_training_client_from_state(state).result()
    errors.append(str(caught.value))
    with pytest.raises(Exception) as caught:
        sampler = client.create_sampling_client(model_path=weights).result()
        sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result()
    errors.append(str(caught.value))
    for error, path in zip(errors, (state, weights), strict=True):
        assert f"{path}/adapter_model.safetensors" in error and "damaged" in error, error
        assert str(root) not in error and str(root.resolve()) not in error, error
        assert str(Path.home()) not in error and str(tiny_model_dir) not in error, error
        assert not ABSOLUTE.search(error.replace("tinker://", "")), error
    healthy(server)
    d = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6]),
        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]},
    )
    assert tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_server_error_message_is_scrubbed_before_it_leaves(server, trained, monkeypatch):
    """A refusal and a failed step whose messages name server files reach the client without
    them."""
    s = server.app.state.server
    root = s.config.output_dir
    folder = s.registry.folder(s.registry.runs[trained["model_id"]])
    real = s.engine.core.optim_step

    def failing(name, params, clip):
        raise OSError(f"[Errno 28] No space left on device: '{folder}/weights/x/optimizer.pt'")

    monkeypatch.setattr(s.engine.core, "optim_step", failing)
    r = post(server, "optim_step", {"model_id": trained["model_id"], "adam_params": {"learning_rate": 0.0}})
    error = future_of(server, r)["error"]
    assert f"tinker://{trained['model_id']}/weights/x/optimizer.pt" in error, error
    assert str(root) not in error
    monkeypatch.setattr(s.engine.core, "optim_step", real)

    def refusing(tenant, run_id, live=True):
        raise BadRequest(f"cannot read {tiny_model_dir_of(s)}/config.json or {root}/x/y/run.json")

    monkeypatch.setattr(s.registry, "run_of", refusing)
    r = post(server, "get_info", {"model_id": trained["model_id"]})
    assert r.status_code == 400
    detail = one_line_detail(r, "<server path>/config.json", "<server path>/run.json")
    assert str(root) not in detail


def tiny_model_dir_of(s) -> str:
    return str(s.config.model_id)


# ---------------------------------------------------------------- units
@pytest.mark.parametrize(
    ("message", "expect"),
    [
        (
            "ROOT/abc123/run9/weights/ck/adapter_model.safetensors is damaged (size 3 of 5 bytes): resave it",
            "tinker://run9/weights/ck/adapter_model.safetensors is damaged (size 3 of 5 bytes): resave it",
        ),
        (
            "[Errno 36] File name too long: 'ROOT/t/c0ffee:train:0/sampler_weights/.n.tmp'",
            "[Errno 36] File name too long: 'tinker://c0ffee:train:0/sampler_weights/.n.tmp'",
        ),
        ("cannot open /home/me/.cache/model/config.json.", "cannot open <server path>/config.json."),
        (
            'File "/usr/lib/python3.11/site-packages/torch/nn.py", line 3',
            'File "<server path>/nn.py", line 3',
        ),
        ("path=/opt/x/y:", "path=<server path>/y:"),
        ("ROOT/t/run.json", "<server path>/run.json"),
        (
            "see http://host:8000/a/b and tinker://r/weights/x",
            "see http://host:8000/a/b and tinker://r/weights/x",
        ),
        ("POST /api/v1/copy_weights is not implemented", "POST /api/v1/copy_weights is not implemented"),
        ("1/2 of weights|sampler_weights/<name>", "1/2 of weights|sampler_weights/<name>"),
        ("GET /metrics failed", "GET /metrics failed"),
    ],
)
def test_scrub(tmp_path, message, expect):
    root = tmp_path / "out"
    assert scrub(message.replace("ROOT", str(root)), root) == expect


def test_scrub_takes_the_root_as_given_and_resolved(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    message = f"{real}/t/r/weights/n/f.bin and {tmp_path}/link/t/r/weights/m/g.bin"
    assert scrub(message, tmp_path / "link") == "tinker://r/weights/n/f.bin and tinker://r/weights/m/g.bin"
    monkeypatch.chdir(tmp_path)
    assert scrub("out/t/r/weights/n/f.bin is damaged", Path("out")) == "tinker://r/weights/n/f.bin is damaged"


def test_one_line_and_for_client():
    assert one_line("a\nb\r\nc") == "a b  c"
    assert len(one_line("x" * 10_000)) == 2000
    assert one_line("\ud800") == "\\ud800"
    assert for_client("bad /srv/a/b\nTraceback", Path("/srv")) == "bad <server path>/b Traceback"


def test_load_json_depth_and_paths():
    for raw in (b"[" * 100_000, b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)):
        with pytest.raises(BadRequest, match=f"limit of {MAX_DEPTH} levels"):
            load_json(raw)
    at_limit = b'{"a":' * (MAX_DEPTH - 1) + b"[1]" + b"}" * (MAX_DEPTH - 1)
    assert load_json(at_limit)["a"]["a"]
    data = load_json(b'{"prompt": {"chunks": [{"tokens": [1]}, [{"x": 1}]]}, "sampling_params": {}}')
    assert data["prompt"]["chunks"][0].where == "prompt.chunks[0]"
    assert data["prompt"]["chunks"][1][0].where == "prompt.chunks[1][0]"
    assert data["sampling_params"].path("seed") == "sampling_params.seed"
    for raw, expect in (
        (b"[1]", "JSON object"),
        (b"{nope", "not valid JSON"),
        (b"1" * 5000, "not valid JSON"),
    ):
        with pytest.raises(BadRequest, match=expect):
            load_json(raw)


def test_the_sdks_deepest_request_is_well_under_the_limit():
    """A sample request with chunks and a sparse target (what the SDK nests deepest)."""
    from tinker.types import SampleRequest

    target = {
        "data": [-1, 42],
        "dtype": "int64",
        "shape": [2, 3],
        "sparse_crow_indices": [0, 1, 2],
        "sparse_col_indices": [2, 0],
    }
    request = SampleRequest(
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=2, stop=["x"]),
        sampling_session_id="s",
        seq_id=0,
        target_prompt_logprobs=target,
    )
    data = load_json(json.dumps(request.model_dump(mode="json")).encode())
    depth, stack = 0, [(data, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict | list):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    assert depth <= 6 < MAX_DEPTH
