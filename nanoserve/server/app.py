"""The OpenAI-compatible HTTP API: `create_app(async_engine)` returns a FastAPI app.

    POST /v1/completions, /v1/chat/completions   (stream false: one JSON; true: SSE chunks)
    GET  /v1/models, /health, /metrics

A request's life: validate the body (pydantic, strict) -> check the model name -> tokenize and
check the context length -> fan out one engine request per choice (n per prompt) -> merge their
outputs, as one JSON body or as a stream of `data: {...}` events ending in `data: [DONE]`.
Everything that can be refused is refused *before* anything reaches the engine, so a bad request
costs no KV memory and never disturbs the batch others are in.

No leaks: each choice is consumed by its own task; whenever a response ends early (the client
disconnects, a sibling choice fails, the server shuts down) the tasks are cancelled, which
closes `AsyncEngine.generate` and aborts the request, freeing its KV blocks at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from pydantic import ValidationError

from nanoserve import __version__
from nanoserve.async_engine import AsyncEngine
from nanoserve.outputs import RequestOutput
from nanoserve.server import protocol as P
from nanoserve.server import responses as R
from nanoserve.server.admission import Admission
from nanoserve.server.auth import APIKeyMiddleware
from nanoserve.server.batches import BatchService
from nanoserve.server.body_limit import MAX_BODY_BYTES, BodyLimitMiddleware
from nanoserve.server.chat_output import ChatOutputFormat
from nanoserve.server.cluster_collector import ClusterCollector
from nanoserve.server.engine_collector import EngineCollector
from nanoserve.server.errors import APIError, install_error_handlers, model_not_found, validation_error
from nanoserve.server.metrics import CONTENT_TYPE, ServerMetrics
from nanoserve.server.reasoning import THINK_START
from nanoserve.server.request_ids import RequestIdMiddleware
from nanoserve.server.running import Choice, Launch
from nanoserve.server.stats_log import StatsLogger
from nanoserve.server.streaming import KEEPALIVE_SECONDS, EventStream, unless_disconnected
from nanoserve.slo import RequestClass
from nanoserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class CORSOptions:
    """Which browser origins may call the API (Starlette's CORSMiddleware; vLLM's flags and
    defaults: any origin, method and header, no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class OpenAIServer:
    """The routes' logic, kept off the FastAPI objects so it reads top to bottom."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str], *, max_queued: int | None = None,
                 request_timeout: float | None = None, sse_keepalive: float | None = KEEPALIVE_SECONDS) -> None:
        self.engine = engine
        self.sse_keepalive = sse_keepalive
        self.model_name = served_model_names[0]  # the one responses name
        self.model_names = frozenset(served_model_names)  # any of them may be asked for
        self.metrics = ServerMetrics(self.model_name)
        engine.step_observers.append(self.metrics.observe_step)
        self.admission = Admission(max_queued)
        self.metrics.registry.register(EngineCollector(
            self.model_name, engine.stats, lambda: engine.is_running, lambda: self.admission.queued,
            lambda: self.admission.rejected))
        self.metrics.registry.register(ClusterCollector(self.model_name, engine.cluster_stats))
        self.request_timeout = request_timeout  # seconds; a body's `timeout` may only shorten it
        self.created = R.now()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer or R.IdTokenizer()

    # -- admission ---------------------------------------------------------------------------
    def admit(self, req: P._SamplingRequest) -> None:
        self.check_model(req.model)
        req.check_supported()
        if not self.engine.is_running:
            raise APIError(f"The engine is not running ({self.engine.last_error or 'stopped'}).", 503)
        if self.admission.draining:
            self.admission.check(req.priority, 1)  # raises: the server is shutting down

    def plan(self, req: P._SamplingRequest, prompts: list[str | list[int]], max_tokens: int | None,
             logprobs: int | None, prefix: str, prompt_field: str, max_tokens_field: str = "max_tokens",
             raw: Request | None = None) -> list[Choice]:
        """Validate each prompt against the context window and make n choices per prompt.
        Without max_tokens a choice may use the rest of the context, as in vLLM."""
        choices: list[Choice] = []
        n = req.n or 1
        http_request_id = raw.state.request_id if raw is not None else None
        limits = [t for t in (self.request_timeout, req.timeout) if t is not None]
        deadline = time.monotonic() + min(limits) if limits else None
        slo = None
        if req.slo is not None:  # targets left out keep the class's defaults
            slo = replace(self.engine.default_slo(req.priority), **req.slo.model_dump(exclude_unset=True))
        for prompt in prompts:
            budget = max_tokens if max_tokens is not None else max(1, self.engine.max_model_len - len(prompt))
            if max_tokens is None and "max_tokens" in self.engine.sampling_defaults:  # generation_config's
                budget = min(budget, int(self.engine.sampling_defaults["max_tokens"]))
            ids: list[int] = []  # the prompt's token ids, set by its first choice's validation
            for j in range(n):
                params = req.sampling_params(budget, logprobs, j, self.engine.sampling_defaults)
                if j == 0:
                    try:
                        ids = self.engine.prepare(prompt, params)
                    except ValueError as exc:
                        long = "context length" in str(exc)
                        raise APIError(str(exc), param=max_tokens_field if long and max_tokens is not None
                                       else prompt_field) from exc
                choices.append(Choice(len(choices), ids, params, f"{prefix}-{len(choices)}", req.priority, slo,
                                      deadline, http_request_id))
        # Last, once the request is known to be valid: a malformed one is a 400, never a 429.
        self.admission.check(req.priority, len(choices))
        return choices

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model)

    # -- running -----------------------------------------------------------------------------
    def launch(self, choices: list[Choice]) -> Launch:
        """Start the choices now, counted as queued before any other handler runs."""
        return Launch(self.engine, self.admission, self.metrics, choices)

    async def finals(self, launch: Launch, raw: Request | None) -> list[RequestOutput]:
        try:
            return await unless_disconnected(raw, launch.finals())
        finally:
            launch.cancel()  # also when the wait was cancelled before it began

    def stream(self, launch: Launch, events: Callable[[R.Outputs], AsyncGenerator[str, None]]) -> EventStream:
        """An SSE response: `events(outputs)`, a mid-stream failure as an error event, then [DONE].
        The stream cancels the launch when it closes, even if its body never started."""
        return EventStream(self._events(launch, events), on_close=launch.cancel, keepalive=self.sse_keepalive)

    async def _events(self, launch: Launch,
                      events: Callable[[R.Outputs], AsyncGenerator[str, None]]) -> AsyncIterator[str]:
        # Both generators are closed explicitly: when the client leaves, the response closes only
        # the outermost one, and an unclosed inner one would keep its requests running.
        try:
            async with contextlib.aclosing(launch.outputs()) as outputs, \
                    contextlib.aclosing(events(outputs)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except APIError as exc:
            self.metrics.observe_error(exc.type)
            yield R.sse(exc.body())
        yield "data: [DONE]\n\n"

    # -- /v1/completions ---------------------------------------------------------------------
    async def completions(self, req: P.CompletionRequest, raw: Request | None) -> Any:
        self.admit(req)
        tok = self.engine.tokenizer
        prompts = [tok.encode(p, add_special_tokens=req.add_special_tokens is not False)
                   if isinstance(p, str) and tok is not None else p for p in req.prompt]
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = self.plan(req, prompts, req.max_tokens, req.logprobs, rid, "prompt", raw=raw)
        prompt_tokens = sum(len(choices[i].token_ids) for i in range(0, len(choices), req.n or 1))
        head = {"id": rid, "object": "text_completion", "created": R.now(), "model": self.model_name}
        echoed = None
        if req.echo:  # each prompt's text, as given or as its token ids decode
            echoed = [p if isinstance(p, str) else tok.decode(p) if tok is not None else "" for p in req.prompt]
        if req.stream:
            return self.stream(self.launch(choices), partial(
                R.completion_events, head=head, n=len(choices), tokenizer=self.tokenizer, logprobs=req.logprobs,
                include_usage=req.include_usage, prompt_tokens=prompt_tokens, per_prompt=req.n or 1, echoed=echoed))
        finals = await self.finals(self.launch(choices), raw)
        return R.completion_response(head, finals, self.tokenizer, req.logprobs, prompt_tokens, req.n or 1, echoed)

    # -- /v1/chat/completions ----------------------------------------------------------------
    async def chat(self, req: P.ChatCompletionRequest, raw: Request | None) -> Any:
        self.admit(req)
        tok = self.require_tokenizer("chat")
        text = self.render_chat(tok, req.chat_messages(), req.add_generation_prompt is not False,
                                req.template_variables())
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reasoning = self.engine.reasoning_parser is not None
        fmt = ChatOutputFormat(req.parsed_tools, reasoning, reasoning and text.rstrip().endswith(THINK_START))
        choices = self.plan(req, [ids], req.requested_max_tokens, top_n, rid, "messages",
                            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                            raw=raw)
        head = {"id": rid, "object": "chat.completion", "created": R.now(), "model": self.model_name}
        if req.stream:
            return self.stream(self.launch(choices), partial(
                R.chat_events, head={**head, "object": "chat.completion.chunk"}, n=len(choices),
                tokenizer=self.tokenizer, top_n=top_n, include_usage=req.include_usage, prompt_tokens=len(ids),
                fmt=fmt))
        finals = await self.finals(self.launch(choices), raw)
        return R.chat_response(head, finals, self.tokenizer, top_n, len(ids), fmt)

    def require_tokenizer(self, what: str) -> Tokenizer:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(f"This model has no tokenizer, so {what} is unavailable; use /v1/completions "
                           "with token ids.")
        return tok

    @staticmethod
    def render_chat(tok: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    variables: dict[str, Any]) -> str:
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from exc

    # -- /tokenize, /detokenize (vLLM's) -----------------------------------------------------
    def tokenize(self, req: P.TokenizeRequest) -> dict:
        self.check_model(req.model)
        req.check()
        tok = self.require_tokenizer("/tokenize")
        if req.messages is not None:
            text = self.render_chat(tok, P.chat_messages(req.messages), req.add_generation_prompt is not False,
                                    req.template_variables())
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            assert req.prompt is not None  # check(): exactly one of them
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": [tok.token_to_str(t) for t in ids] if req.return_token_strs else None}

    def detokenize(self, req: P.DetokenizeRequest) -> dict:
        self.check_model(req.model)
        tok = self.require_tokenizer("/detokenize")
        if any(t >= tok.vocab_size for t in req.tokens):
            raise APIError(f"tokens must be ids below the vocabulary size {tok.vocab_size}.", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    # -- one line of a batch -----------------------------------------------------------------
    async def run_batch_request(self, url: str, body: Any) -> dict:
        """A batch line's request, run as the offline class whatever its body says: the response
        body, or APIError for a line the endpoint itself would have refused."""
        endpoints: dict[str, tuple[type[P._SamplingRequest], Callable[[Any, Request | None], Awaitable[Any]]]] = {
            "/v1/completions": (P.CompletionRequest, self.completions),
            "/v1/chat/completions": (P.ChatCompletionRequest, self.chat)}
        endpoint = endpoints.get(url)
        if endpoint is None:
            raise APIError(f"Unsupported url {url!r}: a batch line may call /v1/completions or "
                           "/v1/chat/completions.", param="url")
        model, handler = endpoint
        if not isinstance(body, dict):
            raise APIError("A batch line's body must be a JSON object.", param="body")
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(list(exc.errors())) from exc
        if req.stream:
            raise APIError("stream is not allowed in a batch request.", param="stream")
        req.priority = RequestClass.OFFLINE
        return await handler(req, None)

    # -- the rest ----------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "nanoserve",
                "root": self.engine.model_name, "max_model_len": self.engine.max_model_len}


def create_app(engine: AsyncEngine, served_model_name: str | Sequence[str] | None = None, *,
               state_dir: str | Path | None = None, max_queued: int | None = None,
               request_timeout: float | None = None, api_keys: Sequence[str] = (),
               cors: CORSOptions = CORSOptions(), log_stats_interval: float | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, sse_keepalive: float | None = KEEPALIVE_SECONDS) -> FastAPI:
    """Build the app around an AsyncEngine. The app starts the engine thread if it is not
    running yet, and then also stops it when the app shuts down. `served_model_name`: the name
    (or names: the first is the one responses carry) clients ask for; `state_dir` keeps uploaded
    files and batches across restarts (None: a temporary directory, gone with the process);
    `max_queued` bounds the online requests waiting to start (429 past it, see admission.py);
    `request_timeout` cuts off any request after that many seconds (408); `api_keys`: any of
    them as a Bearer token opens the /v1 routes (none: open to all, auth.py); `cors`: which
    browser origins may call the API; `log_stats_interval`: seconds between stats lines in the
    log (stats_log.py; None: none); `max_body_bytes`: a larger request body is a 413
    (body_limit.py); `sse_keepalive`: seconds without an event before a stream sends a comment."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
    server = OpenAIServer(engine, names or [engine.model_name], max_queued=max_queued,
                          request_timeout=request_timeout, sse_keepalive=sse_keepalive)
    batches = BatchService(server, state_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = not engine.is_running
        engine.start()
        await batches.start()  # resumes the batches a previous run left unfinished
        stats_task = (asyncio.create_task(StatsLogger(log_stats_interval).run(engine.stats))
                      if log_stats_interval else None)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await batches.stop()  # persists where every batch stands
            if owned:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="nanoserve", summary="OpenAI-compatible LLM serving", lifespan=lifespan)
    app.state.server = server
    app.state.batches = batches
    install_error_handlers(app, on_error=server.metrics.observe_error)
    app.include_router(batches.router)
    # Outermost last: every response gets its request id (a 401 too); CORS answers preflights
    # and marks responses (a 401 too, so a browser can read it); the key check is innermost.
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=list(api_keys))
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials, expose_headers=["X-Request-Id"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, raw: Request) -> Any:
        return await server.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, raw: Request) -> Any:
        return await server.chat(body, raw)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        if model != server.model_name:
            raise model_not_found(model)
        return server.model_card()

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Forget every cached prefix (vLLM's endpoint of the same name): after the model's
        weights changed behind the server, or to measure cold. Requests running keep their blocks."""
        return {"blocks_forgotten": await engine.reset_prefix_cache()}

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest) -> dict:
        return server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest) -> dict:
        return server.detokenize(body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Any:
        if server.admission.draining:
            return APIError("The server is shutting down.", 503).response()
        if engine.is_running:
            return {"status": "ok"}
        return APIError(f"The engine is not running ({engine.last_error or 'stopped'}).", 503).response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app

