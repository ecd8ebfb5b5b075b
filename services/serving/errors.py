"""Error replies that name what was wrong and never echo the input: 422s with short field paths
(`validation_error`), 400s that say why a body could not be parsed (`parse_error`), and the models a 503 from
/healthz names (`ModelsNotAnswering`)."""

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from steadyrl.services.serving.schemas import MAX_REPORTED_ERRORS

MAX_NAME_CHARS = 40  # a key longer than this is shown cut, with its length
MAX_LOC_PARTS = 8  # a deeper field path is shown cut
MAX_MSG_CHARS = 200
HEALTH_TIMEOUT_S = 3.0  # /healthz answers 503 when a model takes longer: a probe should not wait on a restart


class ModelsNotAnswering(RuntimeError):
    """Reward models that failed or did not answer in time (a replica died and Serve is replacing it)."""

    def __init__(self, names: list[str], timeout_s: float | None):
        within = "" if timeout_s is None else f" within {timeout_s:g} s"
        super().__init__(f"reward models not answering{within}: {', '.join(names)} (a replica is being replaced)")
        self.names = names


def short_name(part: object) -> str | int:
    """A field path element as a 422 shows it: a list index, or a key of at most MAX_NAME_CHARS characters."""
    if isinstance(part, int):
        return part
    text = str(part)
    return text if len(text) <= MAX_NAME_CHARS else f"{text[:MAX_NAME_CHARS - 8]}...({len(text)} chars)"


def short_loc(loc: tuple | list) -> list[str | int]:
    parts = [short_name(p) for p in loc[:MAX_LOC_PARTS]]
    return parts + (["..."] if len(loc) > MAX_LOC_PARTS else [])


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field by a short path (`loc`), without the input: pydantic's default echoes it (a
    NaN from JSON's non-standard literal cannot be encoded back: it was a 500; a 20,000-sample body, or a
    10 MiB key, should not come back)."""
    errors = exc.errors()
    detail = []
    for e in errors[:MAX_REPORTED_ERRORS]:
        msg = str(e["msg"])
        if e["type"] == "json_invalid":  # the parser's own words, e.g. "Expecting ',' delimiter"
            msg = f"{msg}: {(e.get('ctx') or {}).get('error', '')} at character {e['loc'][-1]}"
        detail.append({"loc": short_loc(e["loc"]), "msg": msg[:MAX_MSG_CHARS], "type": str(e["type"])[:60]})
    if len(errors) > MAX_REPORTED_ERRORS:
        detail.append({"loc": ["body"], "msg": f"... and {len(errors) - MAX_REPORTED_ERRORS} more errors",
                       "type": "too_many_errors"})
    return JSONResponse(status_code=422, content={"detail": detail})


def parse_failure(cause: BaseException | None) -> str | None:
    """Why JSON parsing failed, where Python's parser says: nesting depth, a number's size, the encoding."""
    if isinstance(cause, RecursionError):
        return "the body's JSON is nested too deeply to parse (Python's parser stops near 1000 levels)"
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not UTF-8 (byte {cause.start} cannot be decoded)"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "a number in the body has over 4300 digits (the most Python's JSON parser reads)"
    return None


async def parse_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's 400 "There was an error parsing the body", saying why (`parse_failure`); other HTTP errors
    as FastAPI answers them."""
    reason = parse_failure(exc.__cause__) if exc.status_code == 400 else None
    if reason is None:
        return await http_exception_handler(request, exc)
    return JSONResponse(status_code=400, content={"detail": reason})
