"""The HTTP routes: OpenAI's completions, chat completions and models, vLLM's tokenize,
detokenize, health, version and metrics, over one `EngineLoop`.

A request is checked whole (its body by pydantic, its values by `sampling.py` and the
engine's own validation) before anything is queued; errors are OpenAI's JSON error bodies.
A client that disconnects, from a stream or while waiting for a whole response, has its
request aborted at once, which frees its pages and slots."""

import asyncio
import dataclasses
import json
import re
from importlib.metadata import version

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxengine.engine.engine_loop import EngineLoop
from jaxengine.engine.outputs import RequestOutput, StreamOutput
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Status
from jaxengine.serve import responses
from jaxengine.serve.metrics import ServerMetrics
from jaxengine.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxengine.serve.sampling import (
    Prompt,
    RequestError,
    chat_prompt,
    check_chat,
    check_completion,
    completion_prompts,
    sampling_params,
)

DISCONNECT_POLL_S = 0.1  # how often a request waiting for its whole response checks its client


@dataclasses.dataclass
class ServerState:
    loop: EngineLoop
    model_name: str
    chat_template: str | None
    api_key: str | None
    metrics: ServerMetrics


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    """OpenAI's error body."""
    kind = kind or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(
        status, "InternalServerError"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


def _param_of(message: str) -> str | None:
    """The field an engine validation message names ("SamplingParams.top_p must ...")."""
    found = re.search(r"SamplingParams\.(\w+)", message)
    return found.group(1) if found else None


class Submission:
    """One HTTP request's prompts in the engine loop, their increments handed to this
    request's event loop as they come."""

    def __init__(self, state: ServerState, prompts: list[Prompt], params: SamplingParams, salt: str | None):
        self.state = state
        self.queue: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()

        def listener(news) -> None:  # on the engine loop's thread
            try:
                aio.call_soon_threadsafe(self.queue.put_nowait, news)
            except RuntimeError:  # the event loop closed: the server is stopping
                pass

        values = [{"prompt_token_ids": p.value} if isinstance(p.value, list) else {"prompt": p.value} for p in prompts]
        if salt is not None:
            values = [v | {"cache_salt": salt} for v in values]
        try:
            self.groups = state.loop.submit(values, params, listener, texts=[p.text for p in prompts])
        except ValueError as err:
            raise RequestError(str(err), _param_of(str(err))) from None
        self.remaining = sum(len(g) for g in self.groups)
        self.aborted = False
        self.last_token_time: dict[tuple[int, int], float] = {}

    async def events(self):
        """Each increment as it comes, until every sample has finished."""
        while self.remaining:
            news = await self.queue.get()
            if isinstance(news, BaseException):
                raise news
            now = asyncio.get_running_loop().time()
            for event in news:
                self._observe_itl(event, now)
                self.remaining -= event.finished
                yield event

    def _observe_itl(self, event: StreamOutput, now: float) -> None:
        key = (event.index, event.sample)
        before = self.last_token_time.get(key)
        if before is not None and event.new_token_ids:
            gap = (now - before) / len(event.new_token_ids)
            for _ in event.new_token_ids:
                self.state.metrics.itl.observe(gap)
        self.last_token_time[key] = now

    def outputs(self) -> list[RequestOutput]:
        """Each prompt's output (its samples together), once all have finished."""
        return [self.state.loop.llm.engine.output(group) for group in self.groups]

    def abort(self) -> None:
        """Stops every sample not finished yet and frees what they hold (once)."""
        if self.aborted:
            return
        self.aborted = True
        for group in self.groups:
            unfinished = sum(s.status is not Status.FINISHED for s in group)
            self.state.loop.abort(group)
            self.state.metrics.aborted(unfinished)

    async def wait(self, request: Request) -> list[RequestOutput]:
        """Every sample to its end, aborting them if the client goes away meanwhile."""

        async def drain():
            async for _ in self.events():
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    raise asyncio.CancelledError  # aborted below
            task.result()
        except BaseException:
            task.cancel()
            self.abort()
            raise
        outputs = self.outputs()
        self.state.metrics.finished(outputs)
        return outputs


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="jaxengine", version=version("jaxengine"))
    llm = state.loop.llm

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        return error_response(err.status, str(err), err.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON ({message})", None
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail))

    # A dependency of the /v1 routes rather than a middleware: Starlette's HTTP middleware
    # hides a client's disconnect from the route (`Request.is_disconnected`).
    async def authorize(request: Request) -> None:
        if state.api_key is not None and request.headers.get("authorization") != f"Bearer {state.api_key}":
            raise RequestError("invalid or missing API key (Authorization: Bearer ...)", status=401)

    key = [Depends(authorize)]

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise RequestError(
                f"the model {name!r} does not exist; this server serves {state.model_name!r}", "model", 404
            )

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def get_version():
        return {"version": version("jaxengine")}

    @app.get("/v1/models", dependencies=key)
    async def models():
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxengine",
            "root": str(llm.engine.model_dir),
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        text = await asyncio.to_thread(generate_latest, state.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        tokenizer = _tokenizer(llm)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            ids = chat_prompt(tokenizer, chat, state.chat_template).value
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = llm.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": _tokenizer(llm).decode(body.tokens)}

    @app.post("/v1/completions", dependencies=key)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_completion(body)
        params = sampling_params(
            body,
            llm.get_default_sampling_params(),
            max_tokens=16 if body.max_tokens is None else body.max_tokens,
            logprobs=body.logprobs,
        )
        prompts = completion_prompts(body)
        if body.echo and llm.tokenizer is not None:  # token-id prompts echo their text
            prompts = [p if p.text is not None else Prompt(p.value, _decoded(llm, p.value)) for p in prompts]
        submission = Submission(state, prompts, params, body.cache_salt)
        request_id = responses.new_id("cmpl")
        if body.stream:
            return EventSourceResponse(_stream_completion(state, submission, request_id, body), sep="\n")
        outputs = await submission.wait(request)
        return responses.completion_body(
            request_id,
            state.model_name,
            outputs,
            body.n,
            echo=body.echo,
            logprobs=body.logprobs,
            ids=body.return_token_ids,
        )

    @app.post("/v1/chat/completions", dependencies=key)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_chat(body)
        prompt = chat_prompt(_tokenizer(llm, chat=True), body, state.chat_template)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = llm._sampling_defaults.get("max_tokens")  # else up to max_model_len
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, llm.get_default_sampling_params(), max_tokens=max_tokens, logprobs=logprobs)
        submission = Submission(state, [prompt], params, body.cache_salt)
        request_id = responses.new_id("chatcmpl")
        if body.stream:
            return EventSourceResponse(_stream_chat(state, submission, request_id, body, logprobs), sep="\n")
        (output,) = await submission.wait(request)
        return responses.chat_body(request_id, state.model_name, output, logprobs=logprobs, ids=body.return_token_ids)

    return app


def _decoded(llm, ids: list[int]) -> str | None:
    """Token ids' text (None for ids the tokenizer cannot decode: validation names them)."""
    try:
        return llm.tokenizer.decode(ids, skip_special_tokens=True)
    except Exception:
        return None


def _tokenizer(llm, chat: bool = False):
    if llm.tokenizer is None:
        raise RequestError("this model has no tokenizer (tokenizer.json)", "messages" if chat else None)
    return llm.tokenizer


async def _stream(submission: Submission, chunk, usage_object: str | None, request_id: str, model: str):
    """Server-sent events: one chunk per increment, a usage chunk if asked, then [DONE].
    Leaving early (the client went away) aborts what has not finished."""
    finished = False
    try:
        async for event in submission.events():
            yield {"data": json.dumps(chunk(event))}
        outputs = submission.outputs()
        submission.state.metrics.finished(outputs)
        finished = True
        if usage_object is not None:
            yield {"data": json.dumps(responses.usage_chunk(request_id, usage_object, model, outputs))}
        yield {"data": "[DONE]"}
    finally:
        if not finished:
            submission.abort()


def _stream_completion(state: ServerState, submission: Submission, request_id: str, body: CompletionRequest):
    echoed: set[int] = set()

    def chunk(event: StreamOutput) -> dict:
        out = responses.completion_chunk(request_id, state.model_name, event, body.n, logprobs=body.logprobs)
        if body.echo and (event.index, event.sample) not in echoed:  # the prompt before the first text
            echoed.add((event.index, event.sample))
            prompt = submission.groups[event.index][event.sample].prompt or ""
            out["choices"][0]["text"] = prompt + out["choices"][0]["text"]
        return out

    usage = "text_completion" if body.stream_options and body.stream_options.include_usage else None
    return _stream(submission, chunk, usage, request_id, state.model_name)


def _stream_chat(state: ServerState, submission: Submission, request_id: str, body, logprobs):
    started: set[int] = set()

    def chunk(event: StreamOutput) -> dict:
        first = event.sample not in started
        started.add(event.sample)
        return responses.chat_chunk(request_id, state.model_name, event, logprobs=logprobs, first=first)

    usage = "chat.completion.chunk" if body.stream_options and body.stream_options.include_usage else None
    return _stream(submission, chunk, usage, request_id, state.model_name)
