"""Marconi's simulator is given a model that holds the bytes the replay holds: the 7B shape it
was written for keeps its own dimensions, other shapes get fitted ones."""

from pathlib import Path

import pytest

from jaxengine.models.arch import load_model_config
from tests.scripts.load_script import load_script

bench = load_script("bench_prefix_replay")
replay = load_script("replay_prefix_trace")
MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def _sizes(name: str):
    cfg = load_model_config(MODELS / name)
    return cfg, replay.sizes(cfg, 10**10, 16, 2, 2, 1000)


def _marconi_bytes(model: dict) -> tuple[int, int]:
    """KV bytes a token and bytes of one checkpoint, by the formulas of Marconi's `utils.py`
    (get_kvs_size: 2 * l * d * 2; get_mamba_state_size: d * n * 2 + (2d + 2n) * 4 * 2)."""
    d, n = model["d"], model["n"]
    return model["num_attn_layers"] * 2 * d * 2, model["num_ssm_layers"] * (d * n * 2 + (2 * d + 2 * n) * 8)


def test_the_7b_shape_keeps_its_own_dimensions():
    cfg, s = _sizes("nemotron-h-7b-shape")
    model = bench.marconi_model(cfg, s, 16)
    # The model: 24 Mamba2 layers, 4 attention layers, width 4096, state 128.
    assert (model["num_ssm_layers"], model["num_attn_layers"], model["d"], model["n"]) == (24, 4, 4096, 128)


@pytest.mark.parametrize("name", ["nemotron-h-56b-shape", "jamba-mini-1.5-shape", "qwen3-next-80b-a3b-thinking-shape"])
def test_other_shapes_get_the_replays_bytes(name):
    cfg, s = _sizes(name)
    model = bench.marconi_model(cfg, s, 16)
    kv, checkpoint = _marconi_bytes(model)
    assert kv == s.kv_page_bytes / 16
    assert checkpoint == pytest.approx(s.checkpoint_bytes, rel=0.005)
    assert (model["num_ssm_layers"], model["num_attn_layers"]) == (cfg.num_recurrent_layers, cfg.num_attention_layers)


def test_a_mooncake_format_trace_is_replayed_in_its_own_block_size(tmp_path):
    path, fmt, _ = bench.load("mooncake:/traces/qwen.jsonl@1/4", None, tmp_path, block_tokens=16)
    assert path == Path("/traces/qwen.jsonl")
    assert fmt == ["--format", "mooncake", "--block-tokens", "16", "--replica", "1/4"]
    assert bench.load("mooncake:/traces/m.jsonl", None, tmp_path)[1] == [
        "--format",
        "mooncake",
        "--block-tokens",
        "512",
    ]


def test_marconis_hits_are_cut_to_whole_pages_short_of_the_prompts_last_token():
    # 40-token prompt, 37 tokens hit: 2 pages. 48-token prompt hit whole: the last token is
    # computed, so 47 -> 2 pages. 16-token prompt hit whole: 15 -> none. No hit: none.
    assert bench.page_hits([37, 48, 16, 0], [40, 48, 16, 100], 16) == [32, 32, 0, 0]


def test_marconis_rates_as_it_counts_and_in_pages():
    class FakeRadixCache:
        """Hits each prompt as long as the prompt before it (Marconi's request_history rows)."""

        def __init__(self, **kwargs):
            self.request_history, self._last = [], 0

        def match_prefix(self, prompt):
            hit = min(self._last, len(prompt))
            self.request_history.append((hit > 0, len(prompt), hit))

        def insert(self, token_ids, state_at_leaf, state_at_branchoff):
            self._last = len(token_ids)

    class Request:
        def __init__(self, n_in, n_out):
            self.input_tokens, self.output_tokens = list(range(n_in)), list(range(n_out))

    # Hits 0, then 30 (the first request's 20 + 10 tokens), then 50 of 50 (the second's 40 + 20).
    requests = [Request(20, 10), Request(40, 20), Request(50, 0)]
    as_counted, in_pages = bench.marconi(FakeRadixCache, requests, 1e9, 1, {}, 16)
    assert as_counted == pytest.approx((0 + 30 + 50) / 110)
    assert in_pages == pytest.approx((0 + 16 + 48) / 110)
