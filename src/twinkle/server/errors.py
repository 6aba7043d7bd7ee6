"""The errors a request can end in, each an HTTP status with a one-line message."""


class ServerError(Exception):
    """A request refused with ``status`` and a message saying what is wrong and how to fix it."""

    status = 400

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(ServerError):
    status = 400


class Unauthorized(ServerError):
    status = 401


class NotFound(ServerError):
    status = 404


class TooMany(ServerError):
    status = 429
