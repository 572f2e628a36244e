"""A request body -> the prompts to queue and their `SamplingParams`. Everything here raises
`RequestError` naming the field, before anything is queued; the engine's own validation
(`LLMEngine.validate_request`) follows when the prompts are submitted."""

import dataclasses
from pathlib import Path

from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields


class RequestError(ValueError):
    """A request that cannot be served: a 400 (or `status`), naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclasses.dataclass
class Prompt:
    """One prompt to queue: text or token ids, and its text where it came as ids."""

    value: str | list[int]
    text: str | None


# Request field -> SamplingParams field, where given (None: the model's default stays).
DIRECT = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


def sampling_params(
    body: SamplingFields, defaults: SamplingParams, *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """The request's sampling parameters over the model's defaults (generation_config.json)."""
    values = {name: getattr(body, name) for name in DIRECT if getattr(body, name) is not None}
    if body.logit_bias is not None:
        bias = {}
        for key, value in body.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        values["logit_bias"] = bias
    so = structured_outputs(body)
    if so is not None:
        values["structured_outputs"] = so
    try:
        return dataclasses.replace(
            defaults,
            **values,
            n=body.n,
            max_tokens=max_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids or (),
            logprobs=logprobs,
        )
    except ValueError as err:  # a structured_outputs mapping with an unknown key
        raise RequestError(str(err), "structured_outputs") from None


def structured_outputs(body: SamplingFields) -> dict | None:
    """The request's grammar, from vLLM's `structured_outputs` or OpenAI's `response_format`."""
    fmt = body.response_format
    kind = None if fmt is None else fmt.get("type")
    if kind not in (None, "text", "json_object", "json_schema"):
        raise RequestError(
            f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
        )
    if body.structured_outputs is not None and kind not in (None, "text"):
        raise RequestError("give structured_outputs or a response_format, not both", "response_format")
    if body.structured_outputs is not None:
        return body.structured_outputs
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return {"json": schema}
    return None


def completion_prompts(body: CompletionRequest) -> list[Prompt]:
    """The prompts of a completions request: text, token ids, or a list of either."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [Prompt(prompt, prompt)]
    if not prompt:
        raise RequestError("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [Prompt(list(prompt), None)]
    return [Prompt(p, p) if isinstance(p, str) else Prompt(list(p), None) for p in prompt]


def check_completion(body: CompletionRequest) -> None:
    """Refuses what this server does not do (rather than ignoring it)."""
    if body.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise RequestError("best_of other than n is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise RequestError("echo together with logprobs is not supported", "echo")


def check_chat(body: ChatCompletionRequest) -> None:
    """Refuses what this server does not do: tool-call parsing."""
    if isinstance(body.tool_choice, dict) or body.tool_choice == "required":
        raise RequestError("tool_choice other than 'none' or 'auto' is not supported", "tool_choice")
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")


def chat_prompt(tokenizer, body: ChatCompletionRequest, server_template: str | None) -> Prompt:
    """The conversation rendered with the chat template (the request's, else the server's,
    else the tokenizer's) and tokenized without adding special tokens (the template has them)."""
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so chat is not available; use /v1/completions")
    template = body.chat_template or server_template
    if template is None and tokenizer.chat_template is None:
        raise RequestError("this model has no chat template; start the server with --chat-template", "messages")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tools=body.tools,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as err:  # a template error is the request's (its messages or its template)
        raise RequestError(f"the chat template could not render the messages: {err}", "messages") from None
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)


def _message(message: ChatMessage, i: int) -> dict:
    content = message.content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts are supported", f"messages[{i}].content[{j}]")
            parts.append(part["text"])
        content = "\n".join(parts)
    return {**message.model_dump(exclude_none=True), "content": content or ""}


def read_template(value: str | None) -> str | None:
    """--chat-template: a Jinja file or the template itself."""
    if value is not None and Path(value).is_file():
        return Path(value).read_text()
    return value
