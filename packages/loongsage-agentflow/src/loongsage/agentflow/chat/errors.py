"""The one error type of the gateway: an HTTP status and a one-line message.

Every layer (request parsing, budgets, session lookup, the engine call) raises :class:`APIError`;
the HTTP layer writes it in the protocol of the endpoint (OpenAI's ``{"error": {...}}`` or
Anthropic's ``{"type": "error", "error": {...}}``). Hostile input always ends here with a 4xx.
"""

from __future__ import annotations

# OpenAI's error types by status; Anthropic's differ only in name (see anthropic_type)
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    410: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """A request answered with ``status`` and a one-line ``message`` (``param`` names the field)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = int(status), message, param, code

    def openai_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPES.get(self.status, "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message},
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
