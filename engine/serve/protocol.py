"""The OpenAI API's request bodies and error bodies, checked strictly (pure; no torch).

A body is a JSON object; fields have the API's types without coercion (``"5"`` is not an integer);
an unknown field is an error, as the OpenAI API answers "Unrecognized request argument". Fields the
API defines but this server does not implement are accepted only at their no-op values (``n=1``,
``logprobs`` null, penalties 0, ...) and are otherwise a 400 naming the field. Two widely used
extensions of vLLM's are accepted: ``top_k``, ``ignore_eos`` and ``return_token_ids``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

#: The OpenAI API's default ``max_tokens`` for /v1/completions (chat has none: the context's rest).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4  # the OpenAI API's limit


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 401: "invalid_request_error",
                              404: "invalid_request_error", 405: "invalid_request_error",
                              413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_common(self) -> None:
        """Ranges and unsupported values; raises :class:`ApiError` 400 naming the field."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad_request(f"max_tokens={self.max_tokens}: must be at least 1", "max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise bad_request(f"temperature={self.temperature}: must be between 0 and 2", "temperature")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise bad_request(f"top_p={self.top_p}: must be in (0, 1]", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise bad_request(f"top_k={self.top_k}: must be -1 or 0 (all tokens) or positive", "top_k")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad_request(f"seed={self.seed}: must be in [0, 2^63)", "seed")
        if self.n is not None and self.n != 1:
            raise bad_request(f"n={self.n}: this server returns one choice per request (n=1)", "n")
        stops = self.stops()
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise bad_request(f"{name}={value}: penalties are not supported (only 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias: not supported", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Any
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        # One prompt: text, token ids, or a list holding exactly one of those (the API's batch forms).
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and len(v) > 1 and all(isinstance(t, (str, list)) for t in v):
            raise ValueError(f"{len(v)} prompts in one request; send one prompt per request")
        if isinstance(v, list) and not v:
            raise ValueError("empty")
        raise ValueError("must be a string or a list of integer token ids")

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise bad_request("echo=true: not supported", "echo")
        if self.logprobs is not None:
            raise bad_request("logprobs: not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of={self.best_of}: only 1 is supported", "best_of")
        if self.suffix:
            raise bad_request("suffix: not supported", "suffix")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages: must hold at least one message", "messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise bad_request(f"max_completion_tokens={self.max_completion_tokens}: must be at least 1",
                              "max_completion_tokens")
        if self.logprobs:
            raise bad_request("logprobs: not supported", "logprobs")
        if self.top_logprobs is not None:
            raise bad_request("top_logprobs: not supported", "top_logprobs")
        if self.tools:
            raise bad_request("tools: not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice: not supported", "tool_choice")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _shown(value: Any) -> str:
    return json.dumps(value)[:80] if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__


def _input_at(data: Any, path: list[str]) -> Any:
    for p in path:
        data = data[int(p)] if isinstance(data, list) else data.get(p) if isinstance(data, dict) else None
    return data


# pydantic names the member of a union in an error's location ("str", "list[str]", "TextPart"): not a field.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z]+\[.*\]|[A-Z]\w*)$")


def parse_body(raw: bytes, model: type[_Sampling]) -> Any:
    """A request body as ``model``; a 400 :class:`ApiError` naming the field otherwise."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise bad_request(f"the request body is not valid JSON{where}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        loc = [str(p) for p in err["loc"]]
        tag = next((i for i, p in enumerate(loc) if _UNION_TAG.match(p)), None)
        if tag is not None:  # a union: name the field that holds it and every type it takes
            param = ".".join(loc[:tag]) or None
            tags = [str(x["loc"][tag]) for x in errors if len(x["loc"]) > tag and [str(p) for p in x["loc"][:tag]]
                    == loc[:tag]]
            got = _input_at(data, loc[:tag])
            raise bad_request(f"{param}: expected {' or '.join(dict.fromkeys(tags))} (got {_shown(got)})", param,
                              "invalid_type") from None
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unrecognized request argument supplied: {param}", param,
                              "unknown_parameter") from None
        if err["type"] == "missing":
            raise bad_request(f"{param}: required", param, "missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {msg} (got {_shown(err.get('input'))})", param, "invalid_type") from None
    req.check()
    return req
