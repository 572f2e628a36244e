"""Response bodies and stream chunks of the completions and chat APIs, from the engine's
outputs. Choices are numbered prompt by prompt: prompt i's sample j is choice i * n + j."""

import time
import uuid

from jaxengine.engine.outputs import Logprob, RequestOutput, SampleLogprobs, StreamOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    """Token counts of finished prompts; `cached_tokens`: prompt tokens the prefix cache served."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(entries: SampleLogprobs, token_ids: list[int], offset: int, n: int) -> dict:
    """OpenAI's completions log-probabilities: per token its text, its logprob, the top `n`
    as {text: logprob} and its character offset in the text (from `offset`)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        tops.append({_text(lp): lp.logprob for t, lp in entry.items() if lp.rank is not None and lp.rank <= n})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: SampleLogprobs, token_ids: list[int], n: int) -> dict:
    """OpenAI's chat log-probabilities: per token its text, bytes, logprob and the top `n`."""
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= n), key=lambda lp: lp.rank)
        content.append(
            {
                **_chat_entry(chosen),
                "top_logprobs": [_chat_entry(lp) for lp in top],
            }
        )
    return {"content": content}


def _chat_entry(lp: Logprob) -> dict:
    text = _text(lp)
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def prompt_logprobs(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), token id -> its
    logprob, rank and text."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


def completion_body(
    request_id: str, model: str, outputs: list[RequestOutput], n: int, *, echo: bool, logprobs: int | None, ids: bool
) -> dict:
    """The whole response of a completions request that is not streamed."""
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            prefix = (out.prompt or "") if echo else ""
            choice = {
                "index": i * n + c.index,
                "text": prefix + (c.text or ""),
                "logprobs": completion_logprobs(c.logprobs, c.token_ids, len(prefix), logprobs) if c.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs(out),
            }
            if ids:
                choice |= {"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids}
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(outputs),
    }


def chat_body(request_id: str, model: str, out: RequestOutput, *, logprobs: int | None, ids: bool) -> dict:
    """The whole response of a chat request that is not streamed."""
    choices = []
    for c in out.outputs:
        choice = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text or ""},
            "logprobs": chat_logprobs(c.logprobs, c.token_ids, logprobs) if c.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if ids:
            choice |= {"token_ids": c.token_ids}
        choices.append(choice)
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([out]),
        "prompt_logprobs": prompt_logprobs(out),
    }
    if ids:
        body["prompt_token_ids"] = out.prompt_token_ids
    return body


def completion_chunk(request_id: str, model: str, event: StreamOutput, n: int, *, logprobs: int | None) -> dict:
    """One stream chunk of a completions request: a choice's new text (and its finish reason
    on its last chunk)."""
    last = event.output.outputs[0] if event.finished else None
    choice = {
        "index": event.index * n + event.sample,
        "text": event.new_text,
        "logprobs": completion_logprobs(event.new_logprobs, event.new_token_ids, 0, logprobs)
        if event.new_logprobs
        else None,
        "finish_reason": last.finish_reason if last else None,
        "stop_reason": last.stop_reason if last else None,
    }
    return _chunk(request_id, "text_completion", model, [choice])


def chat_chunk(request_id: str, model: str, event: StreamOutput, *, logprobs: int | None, first: bool) -> dict:
    """One stream chunk of a chat request: the assistant's new content (its role first)."""
    last = event.output.outputs[0] if event.finished else None
    delta = {"role": "assistant", "content": event.new_text} if first else {"content": event.new_text}
    choice = {
        "index": event.sample,
        "delta": delta,
        "logprobs": chat_logprobs(event.new_logprobs, event.new_token_ids, logprobs) if event.new_logprobs else None,
        "finish_reason": last.finish_reason if last else None,
        "stop_reason": last.stop_reason if last else None,
    }
    return _chunk(request_id, "chat.completion.chunk", model, [choice])


def usage_chunk(request_id: str, obj: str, model: str, outputs: list[RequestOutput]) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return _chunk(request_id, obj, model, []) | {"usage": usage(outputs)}


def _chunk(request_id: str, obj: str, model: str, choices: list[dict]) -> dict:
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
