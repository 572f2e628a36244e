"""Prompt dicts, as vLLM's `vllm.inputs` types them (plain dicts work as well)."""

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # requests with different salts never share cached prefixes


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]
