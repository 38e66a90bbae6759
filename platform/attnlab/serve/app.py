"""The web layer of ``attnlab serve``: a Starlette application over :mod:`attnlab.serve.data`.

Routes (all GET, all read-only)::

    /                              every study: trials by status, last change, whether it has results
    /study/<name>[?metric=&at=&page=]  one study: trials (50 a page), live training curves, extrapolation curves,
                                   Table 4, best
    /api/studies                   the index as JSON
    /api/study/<name>/trials       a page of trials (+ ``html``, the rendered table) and training curves
                                   (?curves=running|all&page=N)
    /api/study/<name>/results      results (+ ``html``, the rendered section) for ?metric= and ?at=
    /static/plotly.min.js          Plotly's bundle, from the installed ``plotly`` wheel
    /static/page.css, study.js     this package's own files

Pages are rendered on the server (Jinja2, autoescaped); the study page's script polls its JSON endpoints. The
page loads nothing from another origin (no CDN, no web font), so it works on a cluster with no internet.
A store, runs folder or study that does not exist answers 404 with one sentence, other bad input 400, and an
unexpected error 500 with one line (the traceback goes to the server's console, never to the page). Never
writes, never imports Ray.
"""

from __future__ import annotations

import functools
import logging
import threading
import traceback
from importlib import resources

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from attnlab.errors import UserError
from attnlab.results import StudyRows
from attnlab.serve import data
from attnlab.serve.data import NotFound, Sources

log = logging.getLogger("attnlab.serve")
INDEX_REFRESH_S = 15
_STATIC_TYPES = {"page.css": "text/css; charset=utf-8", "study.js": "text/javascript; charset=utf-8"}


@functools.lru_cache(maxsize=1)
def plotly_js() -> bytes:
    """Plotly's JavaScript bundle as shipped inside the ``plotly`` wheel (no network)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs().encode("utf-8")


def _static_file(name: str) -> bytes:
    return resources.files("attnlab.serve").joinpath("static", name).read_bytes()


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.PackageLoader("attnlab.serve", "templates"),
                              autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)


class ResultsCache:
    """The last few :func:`attnlab.serve.data.results`, keyed by study, metric, length and the study's results
    signature, and each study's rows as they were last read (:class:`attnlab.results.StudyRows`): a page reloaded
    while nothing new landed costs a directory listing, and when rows land only the changed files are read
    (:meth:`attnlab.results.ResultsStore.read_since`) before the tables are made again."""

    def __init__(self, sources: Sources, size: int = 32):
        self.sources, self.size = sources, size
        self._entries: dict[tuple, dict] = {}
        self._rows: dict[str, StudyRows] = {}  # by study: the latest read
        self._lock = threading.Lock()

    def get(self, name: str, metric: str | None, at: str | None) -> dict:
        data.check_study_name(name)
        key = (name, metric, at, data.results_signature(self.sources, name))
        with self._lock:
            hit = self._entries.pop(key, None)
            if hit is not None:
                self._entries[key] = hit  # most recently used last
                return hit
            previous = self._rows.get(name)
        rows = self.rows(name, previous)
        value = data.results(self.sources, name, metric=metric, at=at, rows=rows)
        with self._lock:
            self._entries[(name, metric, at, value["signature"])] = value
            while len(self._entries) > self.size:
                self._entries.pop(next(iter(self._entries)))
        return value

    def rows(self, name: str, previous: StudyRows | None = None) -> StudyRows | None:
        """The study's rows, re-reading only what changed since ``previous``; None when the store is not there."""
        if not self.sources.store.exists():
            return None
        rows = self.sources.store.read_since(name, previous)
        with self._lock:
            self._rows[name] = rows
            while len(self._rows) > self.size:
                self._rows.pop(next(iter(self._rows)))
        return rows


def create_app(sources: Sources, refresh_s: float = 3.0) -> Starlette:
    """The application reading ``sources``; the study page polls every ``refresh_s`` seconds."""
    env = _environment()
    cache = ResultsCache(sources)
    # the header's Ray dashboard: a study page's own (data.study_info), the index's the latest study's
    common = {"store": sources.store.uri, "runs": sources.runs.uri,
              "ray_dashboard": data.header_dashboard(sources)}

    def render(template: str, status_code: int = 200, **context) -> HTMLResponse:
        return HTMLResponse(env.get_template(template).render({**common, **context}), status_code=status_code)

    def fragment(template: str, **context) -> str:
        return env.get_template(template).render({**common, **context})

    def one(request: Request, name: str) -> str | None:
        value = request.query_params.get(name)
        return value if value not in (None, "") else None

    # ------------------------------------------------------------------------------------------- pages
    def index(request: Request) -> Response:
        overview = data.overview(sources)
        return render("index.html", data=overview, index_refresh=INDEX_REFRESH_S,
                      ray_dashboard=data.header_dashboard(sources, overview["studies"]))

    def study(request: Request) -> Response:
        name = request.path_params["name"]
        info = data.study_info(sources, name)
        trials = data.trials(sources, name, curves="none", page=data.page_number(one(request, "page")))
        res = cache.get(name, one(request, "metric"), one(request, "at"))
        page_config = {"study": name, "refresh_ms": int(refresh_s * 1000), "signature": trials["signature"],
                       "page": trials["page"],
                       "results": res, "api": {"trials": f"/api/study/{name}/trials",
                                               "results": f"/api/study/{name}/results"}}
        return render("study.html", info=info, data=trials, res=res, refresh=f"{refresh_s:g}",
                      page_config=page_config, ray_dashboard=info["links"]["ray_dashboard"])

    # ------------------------------------------------------------------------------------------- JSON
    def api_studies(request: Request) -> Response:
        return JSONResponse(data.overview(sources))

    def api_trials(request: Request) -> Response:
        name = request.path_params["name"]
        info = data.study_info(sources, name)
        trials = data.trials(sources, name, curves=one(request, "curves") or data.CURVES[0],
                             page=data.page_number(one(request, "page")))
        return JSONResponse({**trials, "html": fragment("_trials.html", info=info, data=trials)})

    def api_results(request: Request) -> Response:
        name = request.path_params["name"]
        info = data.study_info(sources, name)
        res = cache.get(name, one(request, "metric"), one(request, "at"))
        return JSONResponse({"results": res, "html": fragment("_results.html", info=info, res=res)})

    # ------------------------------------------------------------------------------------------- files
    def static(request: Request) -> Response:
        name = request.path_params["file"]
        headers = {"Cache-Control": "public, max-age=3600"}
        if name == "plotly.min.js":
            return Response(plotly_js(), media_type="text/javascript; charset=utf-8", headers=headers)
        if name not in _STATIC_TYPES:
            raise HTTPException(404, f"no static file {name!r}")
        return Response(_static_file(name), media_type=_STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------------------------------- errors
    def error(request: Request, status: int, title: str, message: str) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message, "status": status}, status_code=status)
        return render("error.html", status_code=status, status=status, title=title, message=message)

    def handle(endpoint):
        @functools.wraps(endpoint)
        def wrapped(request: Request) -> Response:
            try:
                return endpoint(request)
            except NotFound as exc:
                return error(request, 404, "Not found", str(exc))
            except UserError as exc:
                return error(request, 400, "Bad request", str(exc))
            except OSError as exc:  # a store or runs folder that cannot be read (permissions, an unreachable endpoint)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                return error(request, 503, "Cannot read the store or runs folder", f"{type(exc).__name__}: {first}")
            except HTTPException:
                raise
            except Exception as exc:  # noqa: BLE001 - the page gets one line, the console the traceback
                log.error("attnlab serve: %s %s failed:\n%s", request.method, request.url.path, traceback.format_exc())
                first = (str(exc).strip().splitlines() or [""])[0][:300]
                return error(request, 500, "Internal error",
                             f"{type(exc).__name__}: {first} (the traceback is on the server's console)")
        return wrapped

    async def http_error(request: Request, exc: HTTPException) -> Response:
        messages = {404: f"nothing at {request.url.path}; the studies are listed at /",
                    405: f"{request.method} is not allowed here: this server only reads (GET)"}
        detail = exc.detail if exc.detail and exc.detail not in ("Not Found", "Method Not Allowed") else None
        return error(request, exc.status_code, "Not found" if exc.status_code == 404 else "Error",
                     detail or messages.get(exc.status_code, str(exc.detail)))

    routes = [
        Route("/", handle(index)),
        Route("/study/{name}", handle(study)),
        Route("/api/studies", handle(api_studies)),
        Route("/api/study/{name}/trials", handle(api_trials)),
        Route("/api/study/{name}/results", handle(api_results)),
        Route("/static/{file}", handle(static)),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


__all__ = ["create_app", "plotly_js"]
