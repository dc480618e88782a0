"""`aiayn serve RUN_DIR`: a translation API and a page to watch the model work.

One process loads the run's model once (``Translator.from_pretrained``) and serves:

    POST /translate   {"text": ["...", ...], "beam": 4, "alpha": 0.6, "nbest": 1,
                       "alignments": false}
                      -> translations in input order, the n-best lists with their scores,
                         the warnings `aiayn translate` would print (truncation), and the
                         beam and alpha used (without them in the request: the run's, its
                         config's decode section); with "alignments": true, each
                         translation's word alignment, [source word, target word] pairs
    POST /translate   ... "to": "es"
                      -> for a model that translates into several languages (/info's
                         "targets"), the one to write: required there (a request without
                         it, or naming a language the model lacks, gets 422 and one line),
                         refused for a model of one direction; /next and /attention take it
                         too. Requests of every direction batch together (the direction
                         is the source's first piece, its tag: aiayn.data.directions)
    POST /translate   ... "no_repeat_ngram": 3, "sample": {"temperature": 0.8, "top_k": 0,
                      "top_p": 0.9}, "seed": 1
                      -> with "sample", "nbest" random samples per sentence instead of the
                         search, and the seed they were drawn with ("sample" in the answer)
    POST /next        {"text": "...", "target": "...", "step": 2, "temperature": 0.8,
                       "top": 10}
                      -> the likeliest pieces a sample would draw as the target's piece
                         number "step" (after the pieces before it), with their
                         probabilities at that temperature (top_k, top_p too): the page's
                         temperature slider
    POST /attention   {"text": "...", "beam": 1, "alpha": 0.6, "step": null}
                      -> the translation, source and target tokens and every layer x head
                         map of encoder self-, decoder self- and cross-attention, as
                         `aiayn attention` computes them (rows = queries, columns = keys);
                         with a "step" (one of /info's "steps"), the maps of that step
                         checkpoint's weights over the same translation (the served
                         model's), to watch the attention learn to align
    GET  /health, /info (model sizes, vocabulary, training steps, the best and last dev
                      scores as `aiayn info` gives them, the target languages "to" may
                      name: "targets", [] for a model of one direction)
    GET  /stats       what the batcher has decoded: requests, joins, sentences per step, waits
    GET  /            the page (static/index.html, app.js, style.css: no build step, no CDN)
    GET  /figures/positional_encoding.png, /figures/schedule.png   the plots.py pictures
    GET  /docs        the OpenAPI page (FastAPI's)

Rules a client can rely on:

- Batching is continuous (``Batcher``): a translate request joins the running search of
  its settings (beam, alpha) at its next step, within a token budget (--decode-tokens; an idle
  server first waits --max-wait-ms for more), and is answered as soon as its last sentence
  is done; each answer is the one the request would get alone (``JoinableSearch``). With
  --engine ctranslate2 it is per pass. Attention capture (which sets flags on the model's
  attention modules) runs while no search steps on this process's model (on a CPU of two
  or more cores the searches run in lane processes, on copies of their own:
  ``aiayn.serving.lanes``). A step's maps come from a model of its own (loaded when first asked
  for, the last few kept: ``CheckpointModels``): the served weights never change.
  /health and /info never wait for the model.
- Requests over the limits (``ServeLimits``: body bytes, sentences, characters) get 413
  with a message; malformed JSON, a value of the wrong type (strict: ``"beam": "4"`` or
  ``true`` is no number), NaN or infinity, or values out of range get 422; a problem with
  the input that the library finds (``AiaynError``) gets 422 with its one line, a setting
  named by its JSON field (``asgi.json_field``); anything else a 500 with one line and no
  traceback (the traceback goes to the server's log).
- Only the files of ``static/`` are served, by their names (no paths from the URL reach the
  file system).

The batcher (``aiayn.serving.batcher``) and the model service (``aiayn.serving.service``)
need neither; FastAPI and uvicorn are the optional extra ``aiayn[serve]``; `aiayn serve` says so in one
line when they are missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import asdict
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from aiayn.config import INF, RANGES
from aiayn.errors import AiaynError
from aiayn.inference.engines import engine_class
from aiayn.inference.settings import Sampling
from aiayn.serving.asgi import (
    REFUSALS,
    JsonFastPath,
    RefuseLargeBodies,
    error_response,
    refusal,
)
from aiayn.serving.batcher import MAX_WAIT_MS, check_batching, check_lanes, check_max_wait
from aiayn.serving.service import (
    MAX_BEAM,
    MAX_TOP,
    ModelService,
    ServeLimits,
    check_size,
    hung_up,
)
from aiayn.util.threads import batch_policy

STATIC_DIR = Path(__file__).parent / "static"


CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".png": "image/png"}


# ---------------------------------------------------------------- request bodies
# Strict: a number is a JSON number ("4" and true are refused, not converted), never NaN
# or infinity; nothing the model does not name.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def bounds(section: str, name: str, high: float | None = None) -> dict:
    """A field's bounds, ``aiayn.config.RANGES``' (``high``: a lower limit of this server's)."""
    low, top, open_low = RANGES[section][name]
    top = top if high is None else high
    return {"gt" if open_low else "ge": low, **({} if top == INF else {"le": top})}


class SearchSettings(BaseModel):
    """Beam search settings, as `aiayn translate` takes them: the wire's shape of a request's
    search, which ``ModelService.resolve`` turns into its one ``Search`` value."""

    model_config = STRICT
    beam: int | None = Field(None, **bounds("decode", "beam", MAX_BEAM),
                             description="beam size (1: greedy; default: the run's decode.beam)")
    alpha: float | None = Field(None, **bounds("decode", "alpha"), description="length penalty "
                                "(GNMT; default: the run's decode.alpha)")


class SamplingSettings(BaseModel):
    """Random sampling, as `aiayn translate --sample` takes it (aiayn.inference.search.Sampling)."""

    model_config = STRICT
    temperature: float = Field(1.0, **bounds("sample", "temperature"),
                               description="the logits are divided by it (towards 0: greedy)")
    top_k: int = Field(0, **bounds("sample", "top_k"),
                       description="draw among the k likeliest pieces only (0: all)")
    top_p: float = Field(1.0, **bounds("sample", "top_p"), description="draw among the fewest "
                         "likeliest pieces whose probabilities sum to top_p (1: all)")

    def sampling(self, seed: int | None = None) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, seed)


TO = ("the language to translate into, for a model that translates into several (/info's "
      "targets; required there, refused for a model of one direction)")


class TranslateRequest(SearchSettings):
    text: list[str] | str = Field(description="sentences (or one sentence) to translate")
    to: str | None = Field(None, description=TO)
    nbest: int = Field(1, ge=1, description="hypotheses per sentence, at most beam (with "
                       "sample: the samples per sentence)")
    no_repeat_ngram: int | None = Field(None, **bounds("decode", "no_repeat_ngram"),
                                        description="repetition guard: no translation holds "
                                        "an n-gram of pieces twice (0: off; default: the run's "
                                        "decode.no_repeat_ngram)")
    sample: SamplingSettings | None = Field(None, description="draw nbest random samples per "
                                            "sentence instead of searching (no beam then)")
    seed: int | None = Field(None, **bounds("sample", "seed"), description="with sample: the "
                             "same seed, sentence and settings draw the same samples (default: "
                             "a random one, given in the answer)")
    alignments: bool = Field(False, description="also the word alignment of each "
                             "translation: [source word, target word] pairs (whitespace-"
                             "separated words, from 0), as `aiayn translate --alignments`")
    prefix: list[str | None] | str | None = Field(
        None, description="the start of each translation, which the search completes: one "
        "per sentence (null or \"\" for none), or one string with one sentence")


class NextPieceRequest(SamplingSettings):
    text: str = Field(description="one sentence")
    to: str | None = Field(None, description=TO)
    target: str | None = Field(None, description="its translation (default: the served "
                               "model's greedy translation)")
    step: int | None = Field(None, ge=0, description="the distribution of the target's piece "
                             "number step (from 0), given the pieces before it (default: the "
                             "piece after the whole target)")
    top: int = Field(10, ge=1, le=MAX_TOP, description="how many of the likeliest pieces")
    no_repeat_ngram: int | None = Field(None, **bounds("decode", "no_repeat_ngram"),
                                        description="the repetition guard's bans included")


class AttentionRequest(SearchSettings):
    text: str = Field(description="one sentence")
    to: str | None = Field(None, description=TO)
    beam: int = Field(1, **bounds("decode", "beam", MAX_BEAM),
                      description="beam size (1, greedy, as `aiayn attention`)")
    step: int | None = Field(None, description="the maps of this step checkpoint (one of "
                             "/info's steps) over the served model's translation; default: "
                             "the served model's own")


# ---------------------------------------------------------------- the app
def create_app(service: ModelService, limits: ServeLimits | None = None) -> FastAPI:
    """The FastAPI application around one loaded model."""
    limits = limits or ServeLimits()
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # While the loop runs, it reads the lanes' answers itself (docs/serving.md#lanes).
        service.batcher.read_on(asyncio.get_running_loop())
        try:
            yield
        finally:
            service.batcher.read_on(None)

    app = FastAPI(title="aiayn", summary="Translate with an aiayn run and look at its attention",
                  version="0.1.0", lifespan=lifespan)
    static_files = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in CONTENT_TYPES}

    async def answer_translate(body: TranslateRequest, receive) -> dict:
        """POST /translate's answer, for FastAPI's route and for ``JsonFastPath`` alike."""
        texts = [body.text] if isinstance(body.text, str) else body.text
        check_size(texts, limits)
        if body.sample is None and body.seed is not None:
            raise AiaynError("seed goes with sample")
        sampling = None if body.sample is None else body.sample.sampling(body.seed)
        search = service.resolve(beam=body.beam, alpha=body.alpha, nbest=body.nbest,
                                 no_repeat_ngram=body.no_repeat_ngram,
                                 sampling=sampling)  # the request's search, resolved once
        return await service.translate(texts, search, lambda: hung_up(receive), body.alignments,
                                       request_prefixes(body, len(texts)), body.to)

    # Added first, so inside RefuseLargeBodies (a body over the limit is refused there).
    app.add_middleware(JsonFastPath, path="/translate", model=TranslateRequest,
                       answer=answer_translate)
    app.add_middleware(RefuseLargeBodies, max_bytes=limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        line = _validation_line(exc.errors())
        if "json" not in request.headers.get("content-type", ""):  # curl -d sends a form type
            line += "; send the body as JSON with the header Content-Type: application/json"
        return error_response(422, line)

    async def refused(request: Request, exc: Exception) -> JSONResponse:
        return refusal(exc, f"{request.method} {request.url.path}")

    for kind in (*REFUSALS, Exception):  # (Starlette's HTTPException: 404, 405, 413, ...)
        app.add_exception_handler(kind, refused)

    # Async: a request waiting for the batcher holds no thread, and /health, /info and
    # /stats answer at once however long a pass runs.
    # The answer goes out as it is: it holds plain JSON types already, and FastAPI's checking
    # and re-encoding of a returned dict is CPU the lanes share (docs/serving.md#batching).
    # A JSON body that validates is answered by JsonFastPath before it gets here.
    @app.post("/translate", summary="Translate sentences (beam search, n-best lists)",
              response_model=dict)
    async def translate(body: TranslateRequest, request: Request) -> JSONResponse:
        return JSONResponse(await answer_translate(body, request.receive))

    @app.post("/next", summary="The distribution of the next piece of a translation, at a "
              "temperature")
    async def next_piece(body: NextPieceRequest, request: Request) -> dict:
        check_size([body.text, body.target or ""], limits)
        search = service.resolve(no_repeat_ngram=body.no_repeat_ngram, sampling=body.sampling())
        return await service.next_piece(body.text, body.target, body.step, search, body.top,
                                        lambda: hung_up(request.receive), body.to)

    @app.post("/attention", summary="Translate one sentence and return every attention map")
    async def attention(body: AttentionRequest, request: Request) -> dict:
        check_size([body.text], limits)
        search = service.resolve(beam=body.beam, alpha=body.alpha)
        return await service.attention(body.text, search, lambda: hung_up(request.receive), body.step,
                                       body.to)

    @app.get("/health", summary="Is the model loaded?")
    async def health() -> dict:
        return {"status": "ok", "requests": service.requests}

    @app.get("/info", summary="The model, its vocabulary and its training so far")
    async def info() -> dict:
        return {**service.info, "limits": asdict(limits), "max_beam": MAX_BEAM,
                "batching": {"decode_tokens": service.batcher.decode_tokens,
                             "max_wait_ms": service.batcher.max_wait * 1000}}

    @app.get("/stats", summary="The decoding passes so far: requests per pass, waits")
    async def stats() -> dict:
        return service.stats()

    @app.get("/figures/{name}.png", summary="positional_encoding or schedule, as PNG")
    def figure(name: str) -> Response:
        if name not in ("positional_encoding", "schedule"):
            return error_response(404, f"no figure {name!r}; there are positional_encoding and schedule")
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
        return error_response(404, f"no file {name!r}")
    return FileResponse(path, media_type=CONTENT_TYPES[path.suffix],
                        headers={"Cache-Control": "no-cache"})


def request_prefixes(body: TranslateRequest, sentences: int) -> list[str | None] | None:
    """A request's "prefix" as one per sentence (None: none), or an AiaynError (422) where
    its shape does not match "text"'s."""
    if body.prefix is None:
        return None
    if isinstance(body.prefix, str) != isinstance(body.text, str):
        raise AiaynError('"prefix" must be a string where "text" is one, and a list where '
                         '"text" is a list')
    prefixes = [body.prefix] if isinstance(body.prefix, str) else body.prefix
    if len(prefixes) != sentences:
        raise AiaynError(f'"prefix" has {len(prefixes)} entries for {sentences} sentences in '
                         '"text": give one per sentence (null for none)')
    return prefixes


EXAMPLE_BODY = '{"text": "The Lord is my shepherd."}'


def _validation_line(errors) -> str:
    """Pydantic's list of errors as one line: 'body.beam: Input should be ...; ...'; a body
    that is no JSON, none, or no JSON object said as such, with a body that would do."""
    parts = []
    for error in errors:
        loc, kind = tuple(error.get("loc", ())), error.get("type")
        if kind == "json_invalid":  # loc: ("body", character)
            said = [(error.get("ctx") or {}).get("error", "")]
            if len(loc) > 1 and isinstance(loc[1], int):
                said.append(f"at character {loc[1] + 1}")
            said = ", ".join(part for part in said if part)
            parts.append(f"the body is not valid JSON{f' ({said})' if said else ''}; send an "
                         f"object such as {EXAMPLE_BODY}")
        elif loc == ("body",) and kind == "missing":
            parts.append(f"the request has no body; send a JSON object such as {EXAMPLE_BODY}")
        elif loc == ("body",) and isinstance(error.get("input"), bytes):  # not read as JSON
            parts.append("the body was not read as JSON")
        elif loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
            parts.append(f"the body must be a JSON object, such as {EXAMPLE_BODY}")
        else:
            where = ".".join(str(part) for part in loc)
            parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------- the command
def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000,
          weights: str = "best", device: str | torch.device = "cpu",
          limits: ServeLimits | None = None, engine: str = "aiayn",
          decode_tokens: int | None = None, max_wait_ms: float = MAX_WAIT_MS,
          batching: str | None = None, lanes: str | None = None, int8: bool = False,
          scheduling: str | None = None) -> None:
    """Load the run once and serve it until interrupted (`aiayn serve`; port 0: any free
    one). ``engine``, ``decode_tokens``, ``max_wait_ms``, ``batching``, ``lanes``, ``int8``:
    see ``ModelService.from_run``. ``scheduling``: "batch" puts the server's threads and
    its lanes under Linux's batch policy (``batch_policy``; None: on a CPU), "inherited"
    leaves them as the process was started. The calling process keeps the policy, a start
    that fails after the port is bound included: `aiayn serve` is a process of its own."""
    check_max_wait(max_wait_ms)  # before loading, as the port below
    check_scheduling(scheduling)
    kind = engine_class(engine)  # what it can do is known before it is loaded
    if batching is not None:
        check_batching(batching, kind)
    check_lanes(lanes, torch.device(device),
                batching or ("continuous" if kind.continuous else "pass"))
    sock = listening_socket(host, port)  # before loading: a busy port is one line, at once
    if (scheduling or default_scheduling(device)) == "batch":
        batch_policy()  # before the lanes start, so that they have it too (docs/serving.md#lanes)
    service = ModelService.from_run(run_dir, weights, device, engine, decode_tokens,
                                    max_wait_ms, batching, lanes, int8)
    app = create_app(service, limits)
    info = service.info
    port = sock.getsockname()[1]
    batcher = service.batcher
    batching = (f"requests join the running search at its next step ({batcher.lanes} "
                f"lane{'s' * (batcher.lanes > 1)}, {batcher.lane_kind})"
                if batcher.continuous else "requests batched per pass")
    directions = (f", translating into {', '.join(info['targets'])} (a request's \"to\")"
                  if info["targets"] else "")
    print(f"aiayn serve: {info['weights']} ({info['parameters']:,} parameters, "
          f"{info['engine']}) on {info['device']}{directions}; {batching}, up to "
          f"{batcher.decode_tokens} tokens x beam, an idle server waiting up to "
          f"{max_wait_ms:g} ms; open http://{_url_host(host)}:{port}/", flush=True)
    try:
        # No access log: its lines are INFO, never shown at this level, yet uvicorn formats
        # each request's (client address, quoted path) before the level check drops it.
        uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        service.close()


SCHEDULING = ("batch", "inherited")


def check_scheduling(scheduling: str | None) -> None:
    """--scheduling: batch or inherited (None: ``default_scheduling``)."""
    if scheduling is not None and scheduling not in SCHEDULING:
        raise AiaynError(f"--scheduling must be one of {', '.join(SCHEDULING)}, got "
                         f"{scheduling!r}")


def default_scheduling(device: str | torch.device) -> str:
    """Batch on a CPU, where the server's threads share the cores with its lanes' decoding
    (``batch_policy``); inherited on a GPU, whose decoding they do not hold up."""
    return "batch" if torch.device(device).type == "cpu" else "inherited"


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
