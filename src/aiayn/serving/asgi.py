"""The plain ASGI pieces in front of `aiayn serve`'s FastAPI app (``aiayn.serving.app``):
the body limit (``RefuseLargeBodies``), the fast path of its hottest route
(``JsonFastPath``: POST /translate without FastAPI's layers), and the one map from what a
request's handling raises to its answer (``refusal``), which FastAPI's exception handlers
share. No model here: the route's answer is a function the app passes in.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn.errors import AiaynError, SettingError
from aiayn.serving.batcher import ClientGone
from aiayn.serving.lanes import LaneLost
from aiayn.serving.service import TooLarge

log = logging.getLogger("aiayn.serve")  # one name for the server's log lines (app's too)


# What a request's handling may raise that has an answer of its own (``refusal``); any
# other exception is a 500 through Starlette's ServerErrorMiddleware, which logs it too.
REFUSALS = (StarletteHTTPException, TooLarge, ClientGone, LaneLost, AiaynError)


def refusal(exc: Exception, request_line: str) -> JSONResponse:
    """The answer to an exception a request's handling raised: for FastAPI's handlers and
    ``JsonFastPath`` alike (which leaves any but ``REFUSALS`` to Starlette, as the route
    does). ``request_line``: method and path, for the server's log."""
    if isinstance(exc, StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))
    if isinstance(exc, TooLarge):
        return error_response(413, str(exc))
    if isinstance(exc, ClientGone):
        return error_response(499, "the client closed the connection before the answer")
    if isinstance(exc, LaneLost):  # worth sending again
        log.error("%s", exc)
        return error_response(503, str(exc))
    if isinstance(exc, AiaynError):
        return error_response(422, exc.spelled(json_field) if isinstance(exc, SettingError)
                              else str(exc))
    log.error("unexpected error on %s", request_line, exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the server's log")


class JsonFastPath:
    """A POST to ``path`` whose JSON body validates as ``model``, answered by
    ``answer(body, receive)`` without FastAPI's layers of routing, request objects and
    dependencies: on the server's hottest route they cost ~0.17 ms of its ~0.8 ms of CPU a
    request, CPU its lanes share (docs/serving.md#batching). Any other request, and a body
    that does not validate, goes on to FastAPI (the body handed on as it came), whose
    route and error answers are the word-for-word reference."""

    def __init__(self, app, path: str, model: type[BaseModel],
                 answer: Callable[[BaseModel, Callable], Awaitable[dict]]):
        self.app, self.path, self.model, self.answer = app, path, model, answer

    async def __call__(self, scope, receive, send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"] == self.path and _sends_json(scope)):
            await self.app(scope, receive, send)
            return
        try:
            body = await _whole_body(receive)
        except StarletteHTTPException as exc:  # RefuseLargeBodies' count: a 413
            await refusal(exc, f"POST {self.path}")(scope, receive, send)
            return
        if body is None:
            return  # gone before its request was whole: no one to answer
        try:
            request = self.model.model_validate_json(body)
        except ValidationError:
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            response = JSONResponse(await self.answer(request, receive))
        except REFUSALS as exc:
            response = refusal(exc, f"POST {self.path}")
        await response(scope, receive, send)


async def _whole_body(receive) -> bytes | None:
    """A request's body, read to its end (None: the client hung up first)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _sends_json(scope) -> bool:
    """Whether the request's Content-Type is application/json (parameters aside)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def _replay(body: bytes, receive):
    """``receive`` for an app after the body was read: the body first, then ``receive``."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay


class RefuseLargeBodies:
    """413 for a body whose Content-Length is over the limit, before it is read; a body sent
    without one (chunked) is counted as it arrives, its reader raising a 413 HTTPException
    once it passes the limit (the one exception FastAPI's body parsing passes on as it is).
    Plain ASGI (not FastAPI's @app.middleware, which hides a client's hanging up from the
    endpoint)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
            if length.isdigit() and int(length) > self.max_bytes:
                response = error_response(413, f"request body of {length} bytes; the limit is "
                                       f"{self.max_bytes}")
                await response(scope, receive, send)
                return
            if not length.isdigit():
                receive = self._counted(receive)
        await self.app(scope, receive, send)

    def _counted(self, receive):
        """``receive``, raising a 413 once the body's bytes pass the limit."""
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise StarletteHTTPException(
                    413, f"request body of over {self.max_bytes} bytes (sent without a "
                         f"Content-Length); the limit is {self.max_bytes}")
            return message
        return counted


def error_response(status: int, message: str) -> JSONResponse:
    """Every error's answer: ``{"error": one line}``."""
    return JSONResponse({"error": message}, status_code=status)


def json_field(name: str) -> str:
    """A setting as a request names it (``SettingError.spelled``): its JSON field; those a
    request cannot set, as the server's run or command line does."""
    return {"sampling": "sample", "decode_tokens": "the server's --decode-tokens",
            "max_len_a": "the run's decode.max_len_a",
            "max_len_b": "the run's decode.max_len_b"}.get(name, name)
