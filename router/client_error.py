"""ClientError: a mistake in the client's request, and the OpenAI error body it becomes.

Its own module so that the readers of request fields (router/lax_fields.py) and the
request edge (router/request.py), which uses them, can both raise it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ClientError(Exception):
    """A mistake in the client's request: an OpenAI-style 4xx error naming the bad param."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.headers = dict(headers or {})

    def payload(self) -> dict[str, Any]:
        """The JSON body clients get."""
        return error_payload(self.message, self.type, param=self.param, code=self.status)


def error_payload(message: str, err_type: str, *, param: str | None = None,
                  code: int | None = None) -> dict[str, Any]:
    """OpenAI's error object; `code` is the HTTP status, as vLLM sends it."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
