"""Prefix caching end to end: greedy outputs identical with caching on and off, and hits
where a plain transformer would hit."""

import pytest

from jaxengine import LLM, SamplingParams
from tests.models.tiny_models import random_prompt, save_tiny_model

# page 4 and chunk 8 (tiny models): a 45-token prefix ends mid-page and mid-chunk
ARGS = dict(
    max_model_len=256, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False, compilation_cache_dir=None
)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# Pools small enough that pages and checkpoints evict: room for the running sequences and a
# few checkpoints (a tiny model's checkpoint takes 2 blocks without attention layers, ~20 with).
SMALL_POOL = {"mamba2": 1 + 6, "llama": 1 + 80}
SMALL_POOL_WITH_ATTENTION = 1 + 120
# One architecture per kind of layer stack the cache serves: attention only, Mamba2 only,
# Mamba2 with attention (Bamba; Granite's models differ only in their feed-forwards and
# multipliers), Nemotron-H's mixer-only layers, Gated DeltaNet with gated attention (Qwen3.5;
# Qwen3-Next and Qwen3.5-MoE differ only in their feed-forwards and projection layout), and
# short convolutions, whose state is only a conv window, with attention (LFM2).
CACHING_ARCHS = ("llama", "mamba2", "bamba", "nemotron_h", "qwen3_5", "lfm2", "falcon_h1", "zamba2", "jamba")
FAST_ARCHS = ("bamba",)  # attention and Mamba2 layers; the others run with `-m slow`


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
        outputs.extend(o.outputs[0].token_ids for o in outs)
        conversations = [
            c + o.outputs[0].token_ids + random_prompt(4, 100 + turn) for c, o in zip(conversations, outs[3:5])
        ]
    return outputs


@pytest.mark.parametrize(
    "arch", [a if a in FAST_ARCHS else pytest.param(a, marks=pytest.mark.slow) for a in CACHING_ARCHS]
)
def test_outputs_identical_with_caching_on_and_off(tmp_path, arch):
    """For every retention interval (dense, sparse, every 8 tokens), under a pool where
    everything evicts."""
    save_tiny_model(arch, tmp_path)
    # The retentions share step shapes, and so the executables of the first one.
    pool = dict(
        num_cache_blocks=SMALL_POOL.get(arch, SMALL_POOL_WITH_ATTENTION),
        compilation_cache_dir=str(tmp_path / "compiled"),
    )
    want = _run_workload(LLM(tmp_path, **{**ARGS, **pool}, enable_prefix_caching=False))
    retentions = (None, 0, 8) if arch != "llama" else (None,)  # no checkpoints without recurrent layers
    engines = []  # kept alive: the later ones run the executables the first one compiled
    for retention in retentions:
        on = LLM(tmp_path, **{**ARGS, **pool}, prefix_cache_retention_interval=retention)
        engines.append(on)
        assert _run_workload(on) == want, f"retention {retention}"
        stats = on.stats()
        assert stats["tokens_hit"] > 0.2 * stats["tokens_asked"], retention
        if on.engine.scheduler.cache.recurrent:
            assert stats["checkpoint_evictions"] > 0, retention
        if on.engine.scheduler.cache.has_kv:
            assert stats["kv_page_evictions"] > 0, retention


@pytest.mark.parametrize("arch", [pytest.param("qwen3_5", marks=pytest.mark.slow), "llama"])  # Bamba's: below
def test_default_settings_hit_like_a_transformer(tmp_path, arch):
    """Default engine settings (page 16): a 200-token shared prefix hits from the second
    request on; after P(300) + x, a request P[:150] + y hits at the last page boundary of
    the shared part; no hit crosses a cache salt."""
    save_tiny_model(arch, tmp_path)
    llm = LLM(tmp_path, warm_up=False, compilation_cache_dir=None)
    if arch != "llama":
        assert llm.stats()["prefix_cache_retention_interval"] is None  # dense: the default for hybrids
    prefix = random_prompt(200, 20)
    hits = [
        llm.generate([prefix + random_prompt(9, 21 + r)], GREEDY, use_tqdm=False)[0].num_cached_tokens for r in range(3)
    ]
    assert hits == [0, 192, 192]
    p = random_prompt(300, 30)
    llm.generate([p + random_prompt(5, 31)], GREEDY, use_tqdm=False)
    assert llm.generate([p[:150] + random_prompt(5, 32)], GREEDY, use_tqdm=False)[0].num_cached_tokens == 144
    salted = llm.generate([{"prompt_token_ids": prefix + [1, 2], "cache_salt": "other"}], GREEDY, use_tqdm=False)
    assert salted[0].num_cached_tokens == 0


@pytest.mark.slow
def test_dense_checkpoints_inside_scan_chunks_give_identical_outputs(tmp_path):
    """Checkpoints at page boundaries inside a scan chunk (page 4, chunk 8) and across chunk
    ends are stored by the step that computes them and read back by later hits; a wrong
    state or conv window there would change the greedy tokens."""
    save_tiny_model("bamba", tmp_path)
    dense = LLM(tmp_path, **ARGS, num_cache_blocks=2000)  # room for every checkpoint: none is evicted
    off = LLM(tmp_path, **ARGS, enable_prefix_caching=False)
    long_prefix = random_prompt(70, 7)
    dense.generate([long_prefix + random_prompt(5, 8)], GREEDY, use_tqdm=False)  # chunks of 32 tokens
    probes = [long_prefix[:n] + random_prompt(6, n) for n in (9, 13, 17, 26, 30, 41, 58, 66)]
    got = dense.generate(probes, GREEDY, use_tqdm=False)
    want = off.generate(probes, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [8, 12, 16, 24, 28, 40, 56, 64]


def test_num_cached_tokens_on_hand_built_cases(tmp_path):
    """A request sharing 100 tokens with a 112-token first one hits at 100 on the hybrid as on
    the plain transformer (dense checkpoints); with sparse retention the hybrid has no
    checkpoint there yet, leaves one at that junction, and the next request hits there."""
    shared = random_prompt(100, 11)
    first = shared + random_prompt(12, 12)
    cases = (("llama", None, 100, 108), ("bamba", None, 100, 108), ("bamba", 0, 0, 100))
    for arch, retention, second_hit, repeat_hit in cases:
        path = tmp_path / f"{arch}{retention}"
        save_tiny_model(arch, path)
        llm = LLM(path, **ARGS, prefix_cache_retention_interval=retention)
        llm.generate([first], GREEDY, use_tqdm=False)
        second = llm.generate([shared + [4, 5]], GREEDY, use_tqdm=False)[0]
        assert second.num_cached_tokens == second_hit, (arch, retention)
        third = llm.generate([shared + [6]], GREEDY, use_tqdm=False)[0]
        assert third.num_cached_tokens == 100, (arch, retention)
        if retention == 0:
            assert llm.stats()["tokens_lost_for_want_of_checkpoint"] == 100  # the second request's
        # An exact repeat must compute its last token: it hits at the last page boundary before
        # it (108); sparse has no checkpoint there, only at the junction (100).
        repeat = llm.generate([first], GREEDY, use_tqdm=False)[0]
        assert repeat.num_cached_tokens == repeat_hit, (arch, retention)


def test_pool_use_is_reported_in_bytes(tmp_path):
    save_tiny_model("bamba", tmp_path)
    llm = LLM(tmp_path, **ARGS)
    llm.generate([random_prompt(60, 3)], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["checkpoints_held"] > 0 and stats["kv_pages_cached"] > 0
    assert stats["checkpoint_bytes_held"] == stats["checkpoints_held"] * 22 * stats["cache_block_bytes"]
    assert stats["kv_page_bytes_held"] == stats["kv_pages_cached"] * stats["cache_block_bytes"]
    assert stats["blocks_in_use"] == 0


@pytest.mark.parametrize("key", ["ssm_retention", "num_ssm_snapshot_slots", "num_kv_pages"])
def test_replaced_arguments_name_their_replacement(tmp_path, key):
    with pytest.raises(ValueError, match=f"'{key}' was replaced by"):
        LLM(tmp_path, **{key: 1})


@pytest.mark.parametrize("bad", [-16, 6, "dense"])
def test_bad_retention_interval_is_refused(tmp_path, bad):
    save_tiny_model("bamba", tmp_path)
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        LLM(tmp_path, **ARGS, prefix_cache_retention_interval=bad)


def test_the_resolved_retention_is_logged_at_start(tmp_path, caplog):
    save_tiny_model("bamba", tmp_path)
    with caplog.at_level("INFO", logger="jaxengine"):
        LLM(tmp_path, **ARGS)
        LLM(tmp_path, **ARGS, prefix_cache_retention_interval=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxengine"]
    assert "prefix_cache_retention_interval=None, the default for models with recurrent layers" in lines[0]
    assert "sparse" in lines[1] and "as given" in lines[1]
