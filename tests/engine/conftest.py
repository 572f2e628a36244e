"""Tiny hybrid and plain-transformer models shared by the engine tests, each served by one `LLM`."""

import pytest

from jaxengine import LLM
from tests.models.tiny_models import save_tiny_model

# Small buckets keep compiles few: token buckets 16/32/64, sequence buckets 1/4/8.
ENGINE_ARGS = dict(max_model_len=320, page_size=4, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (model_dir, torch reference model)} for a hybrid (Bamba) and a plain (Llama) model."""
    out = {}
    for arch in ("bamba", "llama"):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, save_tiny_model(arch, path))
    return out


@pytest.fixture(scope="session")
def bamba_llm(tiny_models) -> LLM:
    """A warmed-up engine over the tiny Bamba model."""
    return LLM(tiny_models["bamba"][0], **ENGINE_ARGS)
