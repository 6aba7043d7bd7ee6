"""``OpenAI``: a client of any endpoint that speaks OpenAI's ``POST {base_url}/chat/completions``
(OpenAI, vLLM's and SGLang's servers, Ollama, ...), on the standard library's HTTP client, so it
needs no extra package.

``OpenAI(model, api_key=None, base_url=None, client_kwargs=None)``; ``client_kwargs`` takes the
keys ``timeout`` (seconds per request, default 600), ``max_retries`` (default 2: a refused
connection, HTTP 408, 409, 429 and 5xx are retried with a doubling pause) and ``default_headers``.
``api(trajectory, sampling_params, extra_body=None, **fields)`` sends the trajectory's
``messages`` and ``tools``, the sampling parameters (``num_samples`` as ``n``; vLLM's integer
stop ids, ``top_k`` and ``prompt_logprobs`` have no field there: a warning names them), then ``fields`` and
``extra_body`` merged into the request as they are (the server refuses what it does not know)."""

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, SamplingParams
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger
from twinkle_agentic.protocol.base import API

DEFAULT_BASE_URL = "https://api.openai.com/v1"
CLIENT_KEYS = ("timeout", "max_retries", "default_headers")
RETRIED = {408, 409, 429}


class OpenAI(API):
    """A chat-completions client bound to one ``model``."""

    def __init__(
        self,
        model: str,
        api_key: str | None = None,
        base_url: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        options = dict(client_kwargs or {})
        unknown = sorted(set(options) - set(CLIENT_KEYS))
        if unknown:
            raise UserError(
                f"OpenAI(client_kwargs=...): unknown keys {unknown}; known: {', '.join(CLIENT_KEYS)}"
            )
        if not model:
            raise UserError("OpenAI(model=...): name the model the endpoint serves")
        self.model = model
        self.base_url = (base_url or DEFAULT_BASE_URL).rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise UserError(f"OpenAI(base_url=...): an http(s) URL, got {base_url!r}")
        self.timeout = float(options.get("timeout", 600))
        self.max_retries = int(options.get("max_retries", 2))
        self.headers = {"Content-Type": "application/json", **dict(options.get("default_headers") or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def __call__(  # type: ignore[override]
        self,
        trajectory: Mapping[str, Any],
        sampling_params: SamplingParams,
        extra_body: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> Message | list[Message]:
        body = self.request_body(trajectory, sampling_params)
        body.update(fields)
        body.update(extra_body or {})
        reply = self._post("/chat/completions", body)
        messages = [to_message(choice) for choice in reply.get("choices") or []]
        if not messages:
            raise UserError(
                f"OpenAI: {self.base_url}/chat/completions answered without choices: {str(reply)[:200]}"
            )
        return messages[0] if sampling_params.num_samples == 1 else messages

    def request_body(self, trajectory: Mapping[str, Any], params: SamplingParams) -> dict[str, Any]:
        """The JSON body for ``trajectory`` sampled with ``params`` (before the call's fields)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in trajectory.get("messages") or []],
            "n": params.num_samples,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if trajectory.get("tools"):
            body["tools"] = list(trajectory["tools"])
        if params.max_tokens is not None:
            body["max_tokens"] = params.max_tokens
        if params.seed is not None:
            body["seed"] = params.seed
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        if stop and all(isinstance(s, str) for s in stop):
            body["stop"] = stop
        ignored = [
            name
            for name, used in (
                ("stop (token ids)", stop and not all(isinstance(s, str) for s in stop)),
                ("top_k", params.top_k not in (-1, 0)),
                ("prompt_logprobs", bool(params.prompt_logprobs)),
            )
            if used
        ]
        if ignored:
            get_logger().warning(
                f"OpenAI: {', '.join(ignored)} of SamplingParams has no chat-completions field; not sent"
            )
        if params.logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, params.logprobs
        if params.repetition_penalty != 1.0:
            # the protocol's nearest knob: 0 is no penalty, as repetition_penalty 1 is
            body["frequency_penalty"] = params.repetition_penalty - 1.0
        return body

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode("utf-8")
        url = self.base_url + path
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(url, data=data, headers=self.headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as exc:
                detail = " ".join(exc.read().decode("utf-8", "replace").split())[:300]
                if attempt < self.max_retries and (exc.code in RETRIED or exc.code >= 500):
                    time.sleep(0.5 * 2**attempt)
                    continue
                raise UserError(f"OpenAI: {url} answered HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt < self.max_retries:
                    time.sleep(0.5 * 2**attempt)
                    continue
                reason = getattr(exc, "reason", exc)
                raise UserError(
                    f"OpenAI: no answer from {url} ({reason}); check base_url and that the server runs"
                ) from None
        raise AssertionError("unreachable: the last attempt returns or raises")


def to_message(choice: Mapping[str, Any]) -> Message:
    """One ``choices[i]`` of a chat-completions reply as an assistant ``Message`` (its
    ``finish_reason`` kept, so that a caller sees a reply cut at ``max_tokens``)."""
    got = choice.get("message") or {}
    message: dict[str, Any] = {"role": "assistant"}
    if got.get("content") is not None:
        message["content"] = got["content"]
    if got.get("reasoning_content"):
        message["reasoning_content"] = got["reasoning_content"]
    if got.get("tool_calls"):
        message["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call.get("function", {}).get("name"),
                    "arguments": call.get("function", {}).get("arguments"),
                },
            }
            for call in got["tool_calls"]
        ]
    if choice.get("finish_reason") is not None:
        message["finish_reason"] = choice["finish_reason"]
    return message  # type: ignore[return-value]
