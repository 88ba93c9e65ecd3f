"""Typed errors for bad requests, raised before any work is queued.

Every one is a ``ValueError`` so callers that only care about "the request is bad" can
catch that; services map them to HTTP 400 (or 404 for an unknown model) with ``code``.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as given. ``param`` names the offending field."""

    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidSamplingParamsError(InvalidRequestError):
    code = "invalid_sampling_params"


class PromptTooLongError(InvalidRequestError):
    code = "context_length_exceeded"


class TokenOutOfRangeError(InvalidRequestError):
    code = "invalid_token_id"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"
