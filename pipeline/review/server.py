"""The review page's HTTP side: a Starlette app served by uvicorn on 127.0.0.1, behind a token.

    with serving(data, thumbs, host="127.0.0.1", port=0) as url:   # http://127.0.0.1:PORT/?token=...
        ...

Every request needs the session's token: the printed URL carries it (``?token=``), the page's first load
sets it as an HttpOnly SameSite=Strict cookie, and a script may send it as the ``X-Bucketeer-Token`` header;
without it the answer is 403. Images are asked for by sample id and found among the manifest's rows; an id
the manifest does not hold is 404, and no part of a request becomes a path. The page itself is three
fixed files of package data (:data:`STATIC`). Answers carry no storage options and no credentials.
"""

from __future__ import annotations

import contextlib
import hmac
import html
import importlib.resources
import secrets
import socket
import threading
import time
from typing import Iterator

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from manifests.errors import UsageError
from manifests.storage import redact
from pipeline.review.data import ReviewData
from pipeline.review.thumbs import FULL_SIZE, THUMB_SIZE, ThumbCache

__all__ = ["TOKEN_COOKIE", "TOKEN_HEADER", "STATIC", "build_app", "serving"]

TOKEN_COOKIE = "bucketeer_review"
TOKEN_HEADER = "x-bucketeer-token"
STATIC = {"app.js": "text/javascript", "app.css": "text/css"}  # the only files served besides index.html
PAGE_LIMIT = 1000  # rows per /api/view answer at most


def _static(name: str) -> bytes:
    return importlib.resources.files("pipeline.review").joinpath("static", name).read_bytes()


class TokenGate:
    """ASGI middleware: 403 for a request without the token (query, cookie or header)."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self._allowed(Request(scope)):
            await PlainTextResponse("403: open the URL bucketeer review printed (it carries the token)",
                                    status_code=403)(scope, receive, send)  # fmt: skip
            return
        await self.app(scope, receive, send)

    def _allowed(self, request: Request) -> bool:
        given = [request.query_params.get("token"), request.cookies.get(TOKEN_COOKIE),
                 request.headers.get(TOKEN_HEADER)]
        return any(g is not None and hmac.compare_digest(g.encode(), self.token.encode()) for g in given)


def _position(data: ReviewData, text: str) -> int:
    """The manifest row of sample id ``text``; UsageError (404) for one the manifest does not hold."""
    try:
        sid = int(text)
        if not 0 <= sid < 2**64:
            raise ValueError(text)
    except ValueError:
        raise LookupError(f"{text!r} is not a sample id") from None
    (position,) = data.log.positions(np.array([sid], np.uint64))
    if position < 0:
        raise LookupError(f"sample {sid} is not in this manifest")
    return int(position)


async def _run(fn, body) -> Response:
    """``fn(body)`` in the thread pool (a decision writes to storage), as a JSON answer."""
    from starlette.concurrency import run_in_threadpool

    return JSONResponse(await run_in_threadpool(fn, body))


def _bad_request(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=400)


def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc.args[0]) if exc.args else "not found"}, status_code=404)


def build_app(data: ReviewData, thumbs: ThumbCache, token: str, where: str | None = None) -> Starlette:
    """The app: the page, its JSON API and the images, behind :class:`TokenGate`."""

    def index(request: Request) -> Response:
        page = _static("index.html").replace(b'<meta name="bucketeer-where" content="">',
                                             f'<meta name="bucketeer-where" content="{html.escape(where or "")}">'
                                             .encode())  # fmt: skip
        response = Response(page, media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})  # fmt: skip
        if request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
        return response

    def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("404", status_code=404)
        return Response(_static(name), media_type=STATIC[name])

    def info(request: Request) -> Response:
        return JSONResponse({"manifest": redact(data.manifest.url), "samples": data.manifest.samples.num_rows,
                             "columns": list(data.columns), "numeric": sorted(data.numeric), "where": where or "",
                             "reviewer": data.log.reviewer, "counts": data.log.counts()})  # fmt: skip

    def _view(params) -> tuple[np.ndarray, str | None]:
        sort = params.get("sort") or None
        rows = data.view(params.get("where"), sort, params.get("desc") in ("1", "true"))
        return rows, sort

    def view(request: Request) -> Response:
        started = time.perf_counter()
        rows, sort = _view(request.query_params)
        offset = int(request.query_params.get("offset") or 0)
        limit = min(PAGE_LIMIT, int(request.query_params.get("limit") or 200))
        body = {"count": int(len(rows)), "offset": offset, "rows": data.page(rows, offset, limit, sort),
                "counts": data.log.counts()}  # fmt: skip
        if request.query_params.get("histogram") == "1":
            body["histogram"] = data.histogram(rows, sort)
        body["seconds"] = round(time.perf_counter() - started, 4)
        return JSONResponse(body)

    def sample(request: Request) -> Response:
        return JSONResponse(data.sample(_position(data, request.path_params["sid"])))

    def image(size: int):
        def endpoint(request: Request) -> Response:
            jpeg = thumbs.jpeg(_position(data, request.path_params["sid"]), size)
            if jpeg is None:
                return PlainTextResponse("the image cannot be read", status_code=422)
            return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})
        return endpoint

    async def decide(request: Request) -> Response:
        body = await request.json()
        return await _run(_decide, body)

    def _decide(body: dict) -> dict:
        keep = bool(body["keep"])
        if "where" in body:  # "reject all that the filter shows": the count the person confirmed must match
            rows = data.view(body.get("where"), None)
            if int(body.get("expected", -1)) != len(rows):
                raise UsageError(f"the filter now shows {len(rows)} samples, not the {body.get('expected')} "
                                 "confirmed: look again")  # fmt: skip
            n = data.log.decide(rows, keep)
        else:
            n = data.log.decide(np.array([_position(data, s) for s in body["ids"]], np.int64), keep)
        return {"changed": n, "counts": data.log.counts()}

    async def caption(request: Request) -> Response:
        body = await request.json()

        def edit(body: dict) -> dict:
            text = body.get("caption")
            data.log.edit_caption(_position(data, str(body["id"])), text.strip() if text and text.strip() else None)
            return {"counts": data.log.counts()}
        return await _run(edit, body)

    async def undo(request: Request) -> Response:
        return await _run(lambda _: {"undone": data.log.undo(), "counts": data.log.counts()}, None)

    routes = [Route("/", index), Route("/static/{name}", static), Route("/api/info", info),
              Route("/api/view", view), Route("/api/sample/{sid}", sample),
              Route("/thumb/{sid}", image(THUMB_SIZE)), Route("/image/{sid}", image(FULL_SIZE)),
              Route("/api/decide", decide, methods=["POST"]), Route("/api/caption", caption, methods=["POST"]),
              Route("/api/undo", undo, methods=["POST"])]  # fmt: skip
    # UsageError (a bad filter) and a body that is not the JSON asked for (ValueError, KeyError, TypeError): 400
    app = Starlette(routes=routes, exception_handlers={UsageError: _bad_request, ValueError: _bad_request,
                                                       KeyError: _bad_request, TypeError: _bad_request,
                                                       LookupError: _not_found})  # fmt: skip
    app.add_middleware(TokenGate, token=token)
    return app


@contextlib.contextmanager
def serving(data: ReviewData, thumbs: ThumbCache, host: str = "127.0.0.1", port: int = 0,
            where: str | None = None) -> Iterator[str]:  # fmt: skip
    """Serve the page on ``host:port`` (0: a free port) in a thread for the ``with`` block; yields the URL
    with the token. Raises UsageError when the port cannot be bound."""
    import uvicorn

    token = secrets.token_urlsafe(24)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port")
    bound = sock.getsockname()[1]
    config = uvicorn.Config(build_app(data, thumbs, token, where), log_level="warning", access_log=False,
                            lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="bucketeer-review")
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    shown = f"[{host}]" if ":" in host else host
    try:
        yield f"http://{shown}:{bound}/?token={token}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
