"""The errors a request can end in, each an HTTP status with a one-line message.

Every refusal carries the headers the Tinker SDK reads to decide whether to send it again:
``x-should-retry: false`` for one that fails the same way every time (a limit the key has
reached, a body too large, a bad field), so the SDK raises at once instead of retrying for about
a minute; ``x-should-retry: true`` with ``retry-after`` (and ``retry-after-ms``) for one that
passes later (the request rate, a full queue, no free adapter slot)."""

import math


class ServerError(Exception):
    """A request refused with ``status`` and a message saying what is wrong and how to fix it;
    ``retry_after`` (seconds) when the same request succeeds later."""

    status = 400

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        if status is not None:
            self.status = status

    @property
    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {"x-should-retry": "false"}
        wait = max(self.retry_after, 0.001)
        return {
            "x-should-retry": "true",
            "retry-after": str(math.ceil(wait)),
            "retry-after-ms": str(math.ceil(wait * 1000)),
        }


class BadRequest(ServerError):
    status = 400


class Unauthorized(ServerError):
    status = 401


class NotFound(ServerError):
    status = 404


class TooMany(ServerError):
    status = 429
