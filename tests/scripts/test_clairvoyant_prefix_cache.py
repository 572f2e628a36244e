"""The clairvoyant reference: with room for everything it hits exactly the longest prefix an
earlier request computed; with room for one hit point it keeps the one needed soonest."""

import json
from pathlib import Path

from jaxengine.run_config import DEFAULT_MODEL
from tests.scripts.load_script import load_script

replay = load_script("replay_prefix_trace")
clairvoyant = load_script("clairvoyant_prefix_cache")


def _request(prompt: list[int], output: list[int]):
    return replay.TraceRequest(0, 0, prompt, output)


def _longest_computed_prefix(requests: list, page: int) -> list[int]:
    """Independent of the script's hashing: per request, the longest page-aligned prefix of
    its prompt (a token short of it whole) that an earlier request's tokens start with."""
    out = []
    for j, r in enumerate(requests):
        best = 0
        for earlier in requests[:j]:
            tokens = earlier.input_tokens + earlier.output_tokens
            n = 0
            while n < min(len(tokens), len(r.input_tokens) - 1) and tokens[n] == r.input_tokens[n]:
                n += 1
            best = max(best, n // page * page)
        out.append(best)
    return out


def test_with_room_for_everything_every_reusable_prefix_hits():
    shared = list(range(1, 70))
    requests = [
        _request(shared + [100] * 30, [5] * 20),
        _request(shared + [101] * 30, [6] * 3),
        _request(shared + [100] * 30 + [5] * 20 + [7] * 40, [8] * 4),  # the first one's next turn
        _request([9] * 50, [1] * 5),
        _request(shared[:40] + [3] * 60, [2] * 2),
    ]
    hits = clairvoyant.best_hits(requests, page_size=16, checkpoint_blocks=4, page_blocks=1, budget_blocks=10**6)
    assert hits == _longest_computed_prefix(requests, 16) == [0, 64, 112, 0, 32]


def test_with_room_for_one_hit_point_it_keeps_the_one_needed_next():
    # Prefixes A and B (48 tokens each) alternate A B A A B; one checkpoint (4 blocks) and its
    # 3 pages fit. Belady keeps A's after B's first request (A is needed next), so the second
    # B misses: LRU would have kept B's and missed the second A instead.
    a, b = list(range(1, 49)), list(range(101, 149))
    order = [a, b, a, a, b]
    requests = [_request(p + [200 + i] * 10, [300 + i] * 5) for i, p in enumerate(order)]
    hits = clairvoyant.clairvoyant(
        requests, page_size=16, checkpoint_blocks=4, page_blocks=1, budget_blocks=7, on_path=False
    )
    assert hits == [0, 0, 48, 48, 0]


def test_command_line_reads_both_formats(tmp_path: Path, capsys):
    trace = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 70, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 90, "output_length": 2, "hash_ids": [1, 2, 4]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = clairvoyant.main(
        [
            str(trace),
            "--format",
            "mooncake",
            "--block-tokens",
            "32",
            "--model-config",
            str(DEFAULT_MODEL),
            "--budget-bytes",
            "1e9",
        ]
    )
    # The second request shares blocks 1 and 2 (64 tokens) with the first.
    assert result["hit_tokens"] == 64 and result["input_tokens"] == 160
    assert "clairvoyant token hit rate: 0.4000" in capsys.readouterr().out


def test_lru_eviction_keeps_the_one_used_last():
    # The same A B A A B trace: with least-recently-used eviction of the same checkpoints, the
    # second request's B evicts A, so the third request (A) misses; A's then evicts B's, and the
    # fourth (A) hits; the fifth (B) misses, B having gone when A came back.
    a, b = list(range(1, 49)), list(range(101, 149))
    order = [a, b, a, a, b]
    requests = [_request(p + [200 + i] * 10, [300 + i] * 5) for i, p in enumerate(order)]
    hits = clairvoyant.clairvoyant(
        requests, page_size=16, checkpoint_blocks=4, page_blocks=1, budget_blocks=7, on_path=False, eviction="lru"
    )
    assert hits == [0, 0, 0, 48, 0]
