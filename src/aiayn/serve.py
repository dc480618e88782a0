"""`aiayn serve RUN_DIR`: a translation API and a page to watch the model work.

One process loads the run's model once (``Translator.from_pretrained``) and serves:

    POST /translate   {"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1}
                      -> translations in input order, the n-best lists with their scores,
                         the warnings `aiayn translate` would print (truncation), and the
                         beam and alpha used (without them in the request: the run's, its
                         config's decode section)
    POST /attention   {"text": "...", "beam": 1, "alpha": 0.6}
                      -> the translation, source and target tokens and every layer x head
                         map of encoder self-, decoder self- and cross-attention, as
                         `aiayn attention` computes them (rows = queries, columns = keys)
    GET  /health, /info (model sizes, vocabulary, training steps, the best and last dev
                      scores as `aiayn info` gives them)
    GET  /            the page (static/index.html, app.js, style.css: no build step, no CDN)
    GET  /figures/positional_encoding.png, /figures/schedule.png   the plots.py pictures
    GET  /docs        the OpenAPI page (FastAPI's)

Rules a client can rely on:

- The model runs under one lock (``ModelService``): the web server answers requests on
  several threads, but decoding and attention capture (which sets flags on the model's
  attention modules) never run on two at once; requests wait their turn, in order.
- Requests over the limits (``ServeLimits``: body bytes, sentences, characters) get 413
  with a message; malformed JSON or values out of range get 422; a problem with the input
  that the library finds (``AiaynError``) gets 422 with its one line; anything else a 500
  with one line and no traceback (the traceback goes to the server's log).
- Only the files of ``static/`` are served, by their names (no paths from the URL reach the
  file system).

FastAPI and uvicorn are the optional extra ``aiayn[serve]``; `aiayn serve` says so in one
line when they are missing.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import socket
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn import plots
from aiayn.config import Config
from aiayn.errors import AiaynError
from aiayn.rundir import load_run, resolve_weights
from aiayn.runinfo import run_info
from aiayn.translator import SentenceAttention, Translator, TruncationWarning

STATIC_DIR = Path(__file__).parent / "static"
MAX_BEAM = 16  # a wider beam is refused (422): its cost grows with the beam
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".png": "image/png"}
log = logging.getLogger("aiayn.serve")


# ---------------------------------------------------------------- limits and errors
@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for; more is refused with 413 (or 422 for search settings)."""

    max_body_bytes: int = 1_000_000
    max_sentences: int = 64  # sentences in one /translate request
    max_chars: int = 20_000  # characters in one request, all sentences together


class TooLarge(Exception):
    """A request over a ``ServeLimits`` limit: answered with 413 and this message."""


def check_size(texts: list[str], limits: ServeLimits) -> None:
    """Refuse (``TooLarge``) more sentences or characters than the limits allow."""
    if len(texts) > limits.max_sentences:
        raise TooLarge(f"{len(texts)} sentences in one request; the limit is "
                       f"{limits.max_sentences}: send them in several requests")
    chars = sum(len(t) for t in texts)
    if chars > limits.max_chars:
        raise TooLarge(f"{chars} characters in one request; the limit is {limits.max_chars}")


# ---------------------------------------------------------------- request bodies
class SearchSettings(BaseModel):
    """Beam search settings, as `aiayn translate` takes them."""

    model_config = ConfigDict(extra="forbid")
    beam: int | None = Field(None, ge=1, le=MAX_BEAM,
                             description="beam size (1: greedy; default: the run's decode.beam)")
    alpha: float | None = Field(None, ge=0.0, le=10.0, description="length penalty (GNMT; "
                                "default: the run's decode.alpha)")


class TranslateRequest(SearchSettings):
    text: list[str] | str = Field(description="sentences (or one sentence) to translate")
    nbest: int = Field(1, ge=1, description="hypotheses per sentence, at most beam")


class AttentionRequest(SearchSettings):
    text: str = Field(description="one sentence")
    beam: int = Field(1, ge=1, le=MAX_BEAM,
                      description="beam size (1, greedy, as `aiayn attention`)")


# ---------------------------------------------------------------- the model, one at a time
class ModelService:
    """A Translator behind one lock, with what /info tells about its run."""

    def __init__(self, translator: Translator, config: Config, info: dict[str, Any]):
        self.translator = translator
        self.config = config
        self.info = info
        self.lock = threading.Lock()
        self.requests = 0
        self._figures: dict[str, bytes] = {}

    @classmethod
    def from_run(cls, run_dir: str | Path, weights: str = "best",
                 device: str | torch.device = "cpu") -> ModelService:
        """Load ``run_dir`` once (see ``load_run``) and gather what /info reports."""
        config, model, tokenizers = load_run(run_dir, weights)
        translator = Translator(model, tokenizers, device=device, decode=config.decode)
        return cls(translator, config, serve_info(run_dir, weights, config, model,
                                                  translator.device))

    def translate(self, texts: list[str], beam: int | None, alpha: float | None, nbest: int
                  ) -> dict:
        """`aiayn translate`'s answer for ``texts``: translations in input order, the n-best
        lists (an empty sentence gives "" and an empty list), the warnings raised, and the
        search run (None: the run's, ``Translator.search``)."""
        beam, alpha = self.translator.search(beam, alpha)
        if beam > MAX_BEAM:  # only the run's own can be: a request's is checked on arrival
            raise AiaynError(f"the run's decode.beam {beam} is over this server's limit of "
                             f"{MAX_BEAM}; give \"beam\" in the request")
        # catch_warnings changes the process's warning filters: only under the lock.
        with self.lock, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TruncationWarning)
            start = time.perf_counter()
            hyps = self.translator.translate_nbest(texts, beam, alpha, nbest)
            seconds = time.perf_counter() - start
            self.requests += 1
        return {
            "translations": [h[0][0] if h else "" for h in hyps],
            "nbest": [[{"text": text, "score": score} for text, score in h] for h in hyps],
            "warnings": [str(w.message) for w in caught if w.category is TruncationWarning],
            "beam": beam, "alpha": alpha, "seconds": seconds,
        }

    def attention(self, text: str, beam: int, alpha: float | None) -> dict:
        """`aiayn attention`'s maps for one sentence, as nested lists (see ``attention_json``)."""
        with self.lock:
            att = self.translator.attention(text, beam=beam, alpha=alpha)
            self.requests += 1
        return attention_json(att)

    def figure(self, name: str) -> bytes:
        """The PNG of a plots.py picture of this run (rendered once, then kept)."""
        with self.lock:
            if name not in self._figures:
                d_model = self.info["model"]["d_model"]
                if name == "positional_encoding":
                    fig = plots.positional_encoding_figure(100, d_model)
                else:
                    fig = plots.schedule_figure(*self.schedule_drawn())
                buffer = io.BytesIO()
                fig.savefig(buffer, dpi=plots.DPI, format="png")
                self._figures[name] = buffer.getvalue()
            return self._figures[name]


    def schedule_drawn(self) -> tuple[Config, str]:
        """The run's config for its schedule picture, and the picture's label. A linear
        schedule whose time budget ended the run reached 0 at its last step: drawn so."""
        train, steps = self.config.train, self.info["training_steps"]
        if train.schedule == "linear" and train.max_minutes and steps and steps < train.max_steps:
            shortened = dataclasses.replace(train, max_steps=steps)
            return (dataclasses.replace(self.config, train=shortened),
                    f"this run: its {train.max_minutes:g} minutes ended at step {steps:,}")
        return self.config, "this run"


def attention_json(att: SentenceAttention, decimals: int = 5) -> dict:
    """A SentenceAttention as JSON: ``maps[kind][layer][head][query][key]``, with the shape
    of each kind as (layers, heads, queries, keys)."""
    maps = {kind: np.stack(layers).astype(np.float64).round(decimals).tolist()
            for kind, layers in att.maps.items()}
    shapes = {kind: list(np.stack(layers).shape) for kind, layers in att.maps.items()}
    return {"source": att.source, "translation": att.translation,
            "src_tokens": att.src_tokens, "tgt_tokens": att.tgt_tokens,
            "maps": maps, "shapes": shapes,
            "axes": {"encoder": ["src_tokens", "src_tokens"],
                     "decoder_self": ["tgt_tokens", "tgt_tokens"],
                     "cross": ["tgt_tokens", "src_tokens"]}}


def serve_info(run_dir: str | Path, weights: str, config: Config, model, device: torch.device
               ) -> dict:
    """What GET /info reports: the served weights, sizes, vocabularies, and the run as
    `aiayn info` describes it (aiayn.runinfo.run_info): the steps trained, the best dev
    score by the run's ``train.best_metric`` (what best.safetensors holds) and the last."""
    run = run_info(run_dir)
    return {
        "run_dir": str(run_dir),
        "weights": str(resolve_weights(run_dir, weights)),
        "device": str(device),
        "model": asdict(model.cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": config.data.tokenizer,
        "joint_vocab": config.data.joint_vocab,
        "corpus": config.data.corpus,
        "decode": run["decode"],  # the search a request without beam/alpha gets
        "training_steps": (run["training"] or {}).get("step"),
        "best": run["best"],
        "last_dev": run["last_dev"],
    }


# ---------------------------------------------------------------- the app
def create_app(service: ModelService, limits: ServeLimits = ServeLimits()) -> FastAPI:
    """The FastAPI application around one loaded model."""
    app = FastAPI(title="aiayn", summary="Translate with an aiayn run and look at its attention",
                  version="0.1.0")
    static_files = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in CONTENT_TYPES}

    @app.middleware("http")
    async def refuse_large_bodies(request: Request, call_next):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_body_bytes:
            return _error(413, f"request body of {length} bytes; the limit is "
                               f"{limits.max_body_bytes}")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return _error(422, _validation_line(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405, ...
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(TooLarge)
    async def too_large(request: Request, exc: TooLarge):
        return _error(413, str(exc))

    @app.exception_handler(AiaynError)
    async def bad_input(request: Request, exc: AiaynError):
        return _error(422, str(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error ({type(exc).__name__}); see the server's log")

    @app.post("/translate", summary="Translate sentences (beam search, n-best lists)")
    def translate(body: TranslateRequest) -> dict:
        texts = [body.text] if isinstance(body.text, str) else body.text
        check_size(texts, limits)
        return service.translate(texts, body.beam, body.alpha, body.nbest)

    @app.post("/attention", summary="Translate one sentence and return every attention map")
    def attention(body: AttentionRequest) -> dict:
        check_size([body.text], limits)
        return service.attention(body.text, body.beam, body.alpha)

    @app.get("/health", summary="Is the model loaded?")
    def health() -> dict:
        return {"status": "ok", "requests": service.requests}

    @app.get("/info", summary="The model, its vocabulary and its training so far")
    def info() -> dict:
        return {**service.info, "limits": asdict(limits), "max_beam": MAX_BEAM}

    @app.get("/figures/{name}.png", summary="positional_encoding or schedule, as PNG")
    def figure(name: str) -> Response:
        if name not in ("positional_encoding", "schedule"):
            return _error(404, f"no figure {name!r}; there are positional_encoding and schedule")
        return Response(service.figure(name), media_type="image/png")

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return _static(static_files, "index.html")

    @app.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        return _static(static_files, name)

    return app


def _static(files: dict[str, Path], name: str) -> Response:
    """One of the page's own files, looked up by name (never a path from the URL)."""
    path = files.get(name)
    if path is None:
        return _error(404, f"no file {name!r}")
    return FileResponse(path, media_type=CONTENT_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache"})


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _validation_line(errors) -> str:
    """Pydantic's list of errors as one line: 'body.beam: Input should be ...; ...'."""
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------- the command
def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
          weights: str = "best", device: str | torch.device = "cpu",
          limits: ServeLimits = ServeLimits()) -> None:
    """Load the run once and serve it until interrupted (`aiayn serve`; port 0: any free one)."""
    sock = listening_socket(host, port)  # before loading: a busy port is one line, at once
    service = ModelService.from_run(run_dir, weights, device)
    app = create_app(service, limits)
    info = service.info
    port = sock.getsockname()[1]
    print(f"aiayn serve: {info['weights']} ({info['parameters']:,} parameters) on "
          f"{info['device']}; open http://{_url_host(host)}:{port}/", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, or an AiaynError that says why it cannot be."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise AiaynError(f"--host {host}: not an address of this machine ({exc})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise AiaynError(f"--host {host} --port {port}: cannot listen there "
                         f"({exc.strerror or exc}); choose another --port") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
