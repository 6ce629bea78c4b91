"""The review page's HTTP side: a Starlette app served by uvicorn on 127.0.0.1, behind a token.

    with serving(data, thumbs, host="127.0.0.1", port=0) as url:   # http://127.0.0.1:PORT/?token=...
        ...

Every request needs the session's token: the printed URL carries it (``?token=``), the page keeps it in
``sessionStorage`` and sends it as the ``X-Bucketeer-Token`` header. So that ``<img>`` tags (and a reload)
can load, the first load also sets an HttpOnly SameSite=Strict cookie named for the port
(``bucketeer_review_<port>``: a second review on another port never overwrites it). Cookies ignore ports, so
every other service on 127.0.0.1 receives it too: it holds not the token but an *image pass* derived from it
(:func:`image_pass`), which opens only the page, its static files and the images, never the JSON API and
never a change. Without the token (or the pass, there) the answer is 403. Beyond the token (:class:`Gate`):

- **Changes need the header.** A POST (a decision, a caption, an undo) is taken only with the token in the
  header, ``Content-Type: application/json`` and no foreign ``Origin``: the cookie alone never changes
  anything. SameSite does not separate ports, so a page on another port of 127.0.0.1 sends the cookie; it
  cannot send the header or that content type without a CORS preflight, which is never answered.
- **Only this server's names.** The ``Host`` must be 127.0.0.1, localhost, ::1 or the ``--host`` given, with
  the bound port (a DNS-rebinding page's ``Host`` is its own name); a request another site's page made
  (``Origin`` not this server, ``Sec-Fetch-Site: cross-site`` or ``same-site``) is refused.
- **Every answer** carries ``Content-Security-Policy: default-src 'self'; frame-ancestors 'none'``,
  ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy: no-referrer``.
- **Bodies are checked**: JSON of at most :data:`BODY_LIMIT` bytes, each field of its type (400 otherwise).

Images are asked for by sample id and found among the manifest's rows; an id the manifest does not hold is
404, and no part of a request becomes a path. The page itself is three fixed files of package data
(:data:`STATIC`). Answers carry no storage options and no credentials. docs/review.md states the threat model.
"""

from __future__ import annotations

import contextlib
import hmac
import html
import importlib.resources
import json
import secrets
import socket
import threading
import time
from typing import Any, Iterator

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from manifests.errors import UsageError
from manifests.storage import redact
from pipeline.review.data import ReviewData
from pipeline.review.thumbs import FULL_SIZE, THUMB_SIZE, PreviewRefused, ThumbCache

__all__ = ["TOKEN_COOKIE", "TOKEN_HEADER", "STATIC", "SECURITY_HEADERS", "BODY_LIMIT", "cookie_name", "image_pass",
           "build_app", "serving"]

TOKEN_COOKIE = "bucketeer_review"  # + "_<port>": :func:`cookie_name`; it holds the :func:`image_pass`
TOKEN_HEADER = "x-bucketeer-token"
STATIC = {"app.js": "text/javascript", "app.css": "text/css"}  # the only files served besides index.html
PAGE_LIMIT = 1000  # rows per /api/view answer at most
BODY_LIMIT = 1 << 20  # bytes of a POST's JSON body (a caption, or the ids of one page of decisions)
TEXT_LIMIT = 10_000  # characters of a filter or caption in a body
LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")
PASS_PATHS = ("/static/", "/thumb/", "/image/")  # with "/": what the cookie's image pass opens (GET only)
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def cookie_name(port: int) -> str:
    """The cookie of the server on ``port``: cookies ignore ports, so each server names its own."""
    return f"{TOKEN_COOKIE}_{port}"


def image_pass(token: str) -> str:
    """The cookie's value: derived from the token, but not it (every service on 127.0.0.1 receives the cookie,
    and the pass it holds opens only the page and the images: :data:`PASS_PATHS`)."""
    return hmac.new(token.encode(), b"bucketeer review: images", "sha256").hexdigest()


def _static(name: str) -> bytes:
    return importlib.resources.files("pipeline.review").joinpath("static", name).read_bytes()


class Gate:
    """ASGI middleware: the Host check, the token (header or query; this port's cookie holds only the image
    pass), the header-only rule for changes, the refusal of requests other sites' pages make, and the security
    headers on every answer."""

    def __init__(self, app, token: str, host: str, port: int):
        self.app, self.token, self.port, self.image_pass = app, token.encode(), port, image_pass(token).encode()
        self.hosts = {h.strip("[]").lower() for h in (*LOCAL_NAMES, host, *_machine_names(host))}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_secured(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        refusal = self._refusal(Request(scope))
        if refusal is not None:
            status, text = refusal
            return await PlainTextResponse(text, status_code=status)(scope, receive, send_secured)
        await self.app(scope, receive, send_secured)

    def _refusal(self, request: Request) -> tuple[int, str] | None:
        """``(status, text)`` of a refused request, None for an allowed one."""
        host = request.headers.get("host", "")
        name, _, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
        if name.strip("[]").lower() not in self.hosts or (port and port != str(self.port)):
            return 421, f"421: this server answers to 127.0.0.1:{self.port} or localhost:{self.port} only"
        origin = request.headers.get("origin")
        # a link followed from another page (a notebook's output) is a navigation, which may open the page
        navigation = request.method == "GET" and request.headers.get("sec-fetch-mode") == "navigate"
        if (origin is not None and origin != f"http://{host}") or \
                (request.headers.get("sec-fetch-site") in ("cross-site", "same-site") and not navigation):
            return 403, "403: a request from another site's page"
        header = request.headers.get(TOKEN_HEADER)
        if request.method not in ("GET", "HEAD"):
            if header is None or not hmac.compare_digest(header.encode(), self.token):
                return 403, f"403: a change needs the token in the {TOKEN_HEADER} header"
            if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
                return 415, "415: send the body as application/json"
            return None
        given = [header, request.query_params.get("token")]
        if any(g is not None and hmac.compare_digest(g.encode(), self.token) for g in given):
            return None
        cookie, path = request.cookies.get(cookie_name(self.port)), request.scope["path"]
        if cookie is not None and (path == "/" or path.startswith(PASS_PATHS)) and \
                hmac.compare_digest(cookie.encode(), self.image_pass):
            return None
        return 403, "403: open the URL bucketeer review printed (it carries the token)"


def _machine_names(host: str) -> list[str]:
    """Bound to every address (``--host 0.0.0.0`` or ``::``): this machine's names and addresses, the names a
    person on the network reaches it by. None for one address (it is its own name)."""
    if host not in ("0.0.0.0", "::", ""):
        return []
    names = [socket.gethostname(), socket.getfqdn()]
    with contextlib.suppress(OSError):
        names += socket.gethostbyname_ex(socket.gethostname())[2]
    return names


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object, at most :data:`BODY_LIMIT` bytes; UsageError (400) for anything else."""
    raw = await request.body()
    if len(raw) > BODY_LIMIT:
        raise UsageError(f"the body is {len(raw)} bytes; at most {BODY_LIMIT}")
    try:
        body = json.loads(raw)
    except ValueError:
        raise UsageError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise UsageError("the body is not a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    """``body[name]`` if it is of ``kind`` (never a bool for an int); UsageError (400) naming the field otherwise."""
    if name not in body:
        if required:
            raise UsageError(f"the body has no {name!r}")
        return None
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise UsageError(f"{name!r} must be {wanted}, not {type(value).__name__}")
    if isinstance(value, str) and len(value) > TEXT_LIMIT:
        raise UsageError(f"{name!r} is {len(value)} characters; at most {TEXT_LIMIT}")
    return value


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


def build_app(data: ReviewData, thumbs: ThumbCache, token: str, where: str | None = None, host: str = "127.0.0.1",
              port: int = 0) -> Starlette:  # fmt: skip
    """The app: the page, its JSON API and the images, behind :class:`Gate` (``host``, ``port``: where it is
    served, the only names and port it answers to)."""

    def index(request: Request) -> Response:
        page = _static("index.html").replace(b'<meta name="bucketeer-where" content="">',
                                             f'<meta name="bucketeer-where" content="{html.escape(where or "")}">'
                                             .encode())  # fmt: skip
        response = Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})
        if request.query_params.get("token"):  # for the <img> tags; the page sends the header for everything else
            response.set_cookie(cookie_name(port), image_pass(token), httponly=True, samesite="strict", path="/")
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
            try:
                jpeg = thumbs.jpeg(_position(data, request.path_params["sid"]), size)
            except PreviewRefused as e:
                return PlainTextResponse(str(e), status_code=422)
            if jpeg is None:
                return PlainTextResponse("the image cannot be read", status_code=422)
            return Response(jpeg, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})
        return endpoint

    async def decide(request: Request) -> Response:
        return await _run(_decide, await _body(request))

    def _decide(body: dict) -> dict:
        keep = _field(body, "keep", bool)
        if "where" in body:  # "reject all that the filter shows": the count the person confirmed must match
            where, expected = _field(body, "where", (str, type(None))), _field(body, "expected", int)
            rows = data.view(where, None)
            if expected != len(rows):
                raise UsageError(f"the filter now shows {len(rows)} samples, not the {expected} confirmed: look "
                                 "again")  # fmt: skip
        else:
            ids = _field(body, "ids", list)
            if not all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in ids):
                raise UsageError("'ids' must be a list of sample ids (decimal strings)")
            rows = np.array([_position(data, str(i)) for i in ids], np.int64)
        n = data.log.decide(rows, keep)  # none: nothing written, no undo step
        return {"changed": n, "counts": data.log.counts()}

    async def caption(request: Request) -> Response:
        body = await _body(request)

        def edit(body: dict) -> dict:
            sid, text = _field(body, "id", (str, int)), _field(body, "caption", (str, type(None)))
            data.log.edit_caption(_position(data, str(sid)), text.strip() if text and text.strip() else None)
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
    app.add_middleware(Gate, token=token, host=host, port=port)
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
    config = uvicorn.Config(build_app(data, thumbs, token, where, host, bound), log_level="warning",
                            access_log=False, lifespan="off")  # fmt: skip
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
