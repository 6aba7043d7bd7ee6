"""``twinkle_agentic.protocol.openai.OpenAI`` against a local stand-in for an OpenAI-compatible
server: the request it sends, the messages it returns, retries, and one-line failures."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from twinkle.data_format import SamplingParams
from twinkle.utils.errors import UserError
from twinkle_agentic.protocol.openai import OpenAI


class Server:
    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, dict(self.headers), body))
                status, reply = server.replies.pop(0)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def choice(content, **message):
    return {"message": {"role": "assistant", "content": content, **message}, "finish_reason": "stop"}


def test_a_request_carries_the_trajectory_and_the_sampling_parameters():
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    server = Server([(200, {"choices": [choice(None, tool_calls=[call], reasoning_content="think")]})])
    try:
        api = OpenAI(model="qwen", api_key="k-1", base_url=server.url + "/")
        trajectory = {"messages": [{"role": "user", "content": "find x"}], "tools": [{"type": "function"}]}
        params = SamplingParams(
            max_tokens=32, temperature=0.5, top_p=0.9, seed=3, stop=["</a>"], repetition_penalty=1.1
        )
        message = api(trajectory, params, extra_body={"enable_thinking": True}, presence_penalty=0.2)
    finally:
        server.close()
    path, headers, body = server.requests[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k-1"
    assert body == {
        "model": "qwen",
        "messages": trajectory["messages"],
        "tools": trajectory["tools"],
        "n": 1,
        "temperature": 0.5,
        "top_p": 0.9,
        "max_tokens": 32,
        "seed": 3,
        "stop": ["</a>"],
        "frequency_penalty": pytest.approx(0.1),
        "presence_penalty": 0.2,
        "enable_thinking": True,
    }
    assert message == {
        "role": "assistant",
        "reasoning_content": "think",
        "tool_calls": [call],
        "finish_reason": "stop",
    }


def test_several_samples_come_back_as_a_list_after_a_retried_overload():
    server = Server([(503, {"error": "busy"}), (200, {"choices": [choice("a"), choice("b")]})])
    try:
        api = OpenAI(model="m", base_url=server.url, client_kwargs={"max_retries": 1})
        replies = api(
            {"messages": [{"role": "user", "content": "q"}]}, SamplingParams(num_samples=2, stop=[7])
        )
    finally:
        server.close()
    assert [r["content"] for r in replies] == ["a", "b"]
    assert (
        len(server.requests) == 2 and "stop" not in server.requests[1][2]
    )  # token ids are not the protocol's
    assert "Authorization" not in server.requests[1][1]


def test_failures_are_one_line():
    server = Server([(400, {"error": {"message": "model 'm' does not exist"}})])
    try:
        with pytest.raises(UserError, match=r"answered HTTP 400: .*does not exist") as info:
            OpenAI(model="m", base_url=server.url)({"messages": []}, SamplingParams())
    finally:
        server.close()
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="no answer from http://127.0.0.1:9/v1/chat/completions"):
        OpenAI(model="m", base_url="http://127.0.0.1:9/v1", client_kwargs={"max_retries": 0, "timeout": 5})(
            {"messages": []}, SamplingParams()
        )
    with pytest.raises(UserError, match=r"unknown keys \['organization'\]"):
        OpenAI(model="m", client_kwargs={"organization": "o"})
