"""The server's errors, in OpenAI's body: {"error": {"message", "type", "param", "code"}}. An endpoint raises
`APIError`; the handlers `install_error_handlers` adds write it, FastAPI's invalid bodies and starlette's HTTP errors
(an unknown path, a wrong method) in the same body."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# How many of an invalid body's problems the 400's message names.
MAX_BODY_PROBLEMS = 5


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


def install_error_handlers(app: FastAPI):
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _api_error(request, e: APIError):
    return error_response(e.status, e.message, e.type, e.param)


async def _invalid_body(request, e: RequestValidationError):
    # err["loc"] starts with where the field was ("body"); the rest is its path in the body
    problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}"
                         for err in e.errors()[:MAX_BODY_PROBLEMS])
    return error_response(400, f"invalid request body: {problems}", "BadRequestError")


async def _http_error(request, e: StarletteHTTPException):
    return error_response(e.status_code, str(e.detail), "NotFoundError" if e.status_code == 404 else "Error")
