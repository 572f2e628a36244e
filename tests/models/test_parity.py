"""jaxengine against the Hugging Face implementation, for every supported architecture.

Each architecture's tiny model (see `tiny_models`: its SSM state, attention and context
matter, so a bug in carrying state does change logits and greedy tokens) is saved once and
loaded into one `LLM`, which all tests of that architecture share, as a server would.

The engine computes in float32 like the torch reference but sums in another order (chunked
SSD scan, paged attention), so logits differ by rounding only: ~1e-5 on logits of magnitude
~10. `FLOAT32_ATOL = 1e-4` leaves room for that, while a real mistake (a wrong decay, a
token attending to the wrong page, a state not carried across chunks or steps) moves logits
by O(1). Greedy generation must agree token for token: along these paths the top-1 logit
leads by at least 0.002, two orders of magnitude above the rounding error.

Step shapes are few on purpose (each new one compiles): a 29-token prefill, the 16-token
bucket that every piece of the split prefill falls in, one 3-prompt prefill and the decode
step of 3 sequences.
"""

import dataclasses
import functools

import numpy as np
import pytest
from transformers import PreTrainedModel

from jaxengine import LLM, SamplingParams
from tests.models.tiny_models import (
    ARCHS,
    ENGINE_ARGS,
    FLOAT32_ATOL,
    hf_greedy,
    hf_logits,
    max_abs_diff,
    random_prompt,
    save_tiny_model,
)

PROMPT_LEN = 29  # not a multiple of the Mamba chunk size (8); spans four chunks
SPLIT = [7, 5, 1, 1, 3, 12]  # pieces that straddle chunk boundaries, incl. single tokens
GENERATE_LENS = (5, 13, 30)
MAX_NEW_TOKENS = 32


@dataclasses.dataclass
class Case:
    """One architecture: the torch reference, the engine on the same checkpoint, a prompt."""

    arch: str
    hf: PreTrainedModel
    llm: LLM
    prompt: list[int]

    @functools.cached_property
    def hf_prompt_logits(self) -> np.ndarray:
        return hf_logits(self.hf, self.prompt)


# Variants whose layers the fast run covers in another architecture (Granite's in Bamba and
# Llama, Qwen3-Next's and Qwen3.5-MoE's in Qwen3.5, Falcon-H1's defaults in Falcon-H1) run
# with `-m slow`.
VARIANTS = ("granite_moe", "granite_dense", "qwen3_next", "qwen3_5_moe", "falcon_h1_plain")


@pytest.fixture(scope="module", params=[pytest.param(a, marks=pytest.mark.slow) if a in VARIANTS else a for a in ARCHS])
def case(request, tmp_path_factory) -> Case:
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf = save_tiny_model(arch, path)
    return Case(arch, hf, LLM(path, dtype="float32", **ENGINE_ARGS), random_prompt(PROMPT_LEN, seed=1))


def first_difference(got: list[int], want: list[int]) -> int:
    """Index of the first differing token (or the shorter length)."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def test_prompt_logits_match_hf(case: Case):
    got = case.llm.prompt_logits(case.prompt)
    assert got.dtype == np.float32
    assert max_abs_diff(got, case.hf_prompt_logits) <= FLOAT32_ATOL


def test_split_prefill_matches_one_shot_and_hf(case: Case):
    assert sum(SPLIT) == PROMPT_LEN
    split = case.llm.prompt_logits(case.prompt, chunk_sizes=SPLIT)
    assert max_abs_diff(split, case.llm.prompt_logits(case.prompt)) <= FLOAT32_ATOL
    assert max_abs_diff(split, case.hf_prompt_logits) <= FLOAT32_ATOL


def test_greedy_generate_matches_hf(case: Case):
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(GENERATE_LENS)]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = case.llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        want = hf_greedy(case.hf, prompt, MAX_NEW_TOKENS)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == want, (
            f"prompt of {len(prompt)} tokens: first divergence at {first_difference(out.outputs[0].token_ids, want)}"
        )


def test_new_request_does_not_inherit_previous_state(case: Case):
    """A finished request leaves its conv/SSM states (and KV) behind in slots and pages that
    the next request is handed again; the new request must start from zero state."""
    case.llm.prompt_logits(random_prompt(PROMPT_LEN, seed=2), chunk_sizes=[16, 13])  # both slots now dirty
    assert max_abs_diff(case.llm.prompt_logits(case.prompt), case.hf_prompt_logits) <= FLOAT32_ATOL
