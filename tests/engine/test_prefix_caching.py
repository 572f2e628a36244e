"""Prefix caching end to end: greedy outputs are identical with caching on and off."""

import pytest

from jaxengine import LLM, SamplingParams
from tests.models.tiny_models import ARCHS, random_prompt, save_tiny_model

# page 4 and chunk 8 (tiny models): a 45-token prefix ends mid-page and mid-chunk
ARGS = dict(max_model_len=256, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)
SMALL_POOLS = dict(num_kv_pages=1 + 64, num_ssm_snapshot_slots=3)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _run_workload(llm: LLM) -> list[list[int]]:
    """A shared system prompt with distinct questions, two multi-turn conversations (each turn
    the previous prompt + answer + a new message), exact repeats, and salted duplicates,
    in four rounds; returns every output's tokens in order."""
    system = random_prompt(45, 1)
    conversations = [random_prompt(30, 2), random_prompt(13, 3)]
    outputs = []
    for turn in range(4):
        questions = [system + random_prompt(3 + q, 10 * turn + q) for q in range(3)]
        prompts = questions + conversations + [questions[0]]  # the last is an exact repeat
        prompts += [{"prompt_token_ids": conversations[0], "cache_salt": f"user{turn % 2}"}]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        outputs.extend(o.token_ids for o in outs)
        conversations = [c + o.token_ids + random_prompt(4, 100 + turn) for c, o in zip(conversations, outs[3:5])]
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_identical_with_caching_on_and_off(tmp_path, arch):
    save_tiny_model(arch, tmp_path)
    on = LLM(tmp_path, **ARGS, **SMALL_POOLS)
    off = LLM(tmp_path, **ARGS, **SMALL_POOLS, enable_prefix_caching=False)
    assert _run_workload(on) == _run_workload(off)
    stats = on.stats()
    assert stats["tokens_hit"] > 0.2 * stats["tokens_asked"]
    assert off.stats()["tokens_hit"] == 0
    if on.engine.scheduler.pages is not None:
        assert stats["kv_page_evictions"] > 0
    if on.engine.scheduler.states is not None:
        assert stats["ssm_snapshot_evictions"] > 0


def test_dense_scan_checkpoints_give_identical_outputs(tmp_path):
    """Checkpoints scattered from inside the scan (dense retention) are read back by later
    hits; a wrong state or conv window there would change the greedy tokens."""
    save_tiny_model("bamba", tmp_path)
    dense = LLM(tmp_path, **ARGS, ssm_retention="dense", num_ssm_snapshot_slots=64)
    off = LLM(tmp_path, **ARGS, enable_prefix_caching=False)
    long_prefix = random_prompt(70, 7)
    first = [long_prefix + random_prompt(5, 8)]
    # one long first prefill (chunks of 32) stores scan checkpoints at 8, 16, 24, ...
    dense.generate(first, GREEDY, use_tqdm=False)
    scan_only = [c.num_tokens for c in dense.engine.scheduler.states.snapshots.values() if c.num_tokens % 32]
    assert scan_only, "no checkpoint came from inside the scan"
    probes = [long_prefix[:n] + random_prompt(6, n) for n in (9, 17, 26, 41, 58, 66)]
    got = dense.generate(probes, GREEDY, use_tqdm=False)
    want = off.generate(probes, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [8, 16, 24, 40, 56, 64]


def test_num_cached_tokens_on_hand_built_cases(tmp_path):
    """A second request sharing 100 tokens with a 112-token first one hits at the largest
    full page (100) on a plain transformer. On a hybrid model it hits at the largest
    checkpoint <= 100: none yet (the first prompt checkpointed only its end, 112), so its
    prefill stops at the junction 100 to make one, and a third request hits there."""
    shared = random_prompt(100, 11)
    first = shared + random_prompt(12, 12)
    for arch, expected, expected_repeat in (("llama", 100, 108), ("bamba", 0, 100)):
        path = tmp_path / arch
        save_tiny_model(arch, path)
        llm = LLM(path, **ARGS)
        llm.generate([first], GREEDY, use_tqdm=False)
        second = llm.generate([shared + [4, 5]], GREEDY, use_tqdm=False)[0]
        assert second.num_cached_tokens == expected, arch
        third = llm.generate([shared + [6]], GREEDY, use_tqdm=False)[0]
        assert third.num_cached_tokens == 100, arch
        repeat = llm.generate([first], GREEDY, use_tqdm=False)[0]
        # an exact repeat must compute its last token: the plain transformer hits at the last
        # full page before it (108); the hybrid at the last checkpoint below it (the junction 100)
        assert repeat.num_cached_tokens == expected_repeat, arch
