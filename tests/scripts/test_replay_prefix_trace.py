"""The prefix-cache trace replay: hits worked out by hand from the scheduler's rules, the
JSON report, the KV budget, and the synthetic system-prompt trace."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.run_config import DEFAULT_MODEL
from tests.scripts.load_script import load_script

HYBRID = DEFAULT_MODEL / "config.json"  # Bamba: 2 attention + 4 Mamba layers, scan chunk 64


replay = load_script("replay_prefix_trace")
make_trace = load_script("make_prefix_trace")


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    """A plain transformer of the default model's size: 6 attention layers, 2 KV heads of 48."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": 192,
        "intermediate_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    }
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _write(path: Path, requests: list[tuple[list[int], list[int]]]) -> Path:
    with path.open("w") as f:
        for i, (prompt, output) in enumerate(requests):
            f.write(
                json.dumps(
                    {
                        "session_id": i,
                        "turn_id": 0,
                        "ts": float(i),
                        "num_input_tokens": len(prompt),
                        "num_output_tokens": len(output),
                        "input_tokens": prompt,
                        "output_tokens": output,
                    }
                )
                + "\n"
            )
    return path


def _run(trace: Path, config: Path, *extra: str) -> dict:
    return replay.main([str(trace), "--model-config", str(config), *extra])


@pytest.fixture
def shared_prefix_trace(tmp_path: Path) -> Path:
    """Three requests sharing a 40-token prefix, then the first one's next turn (page size 16)."""
    prefix = list(range(1, 41))
    a, b, c, d = ([k] * 10 for k in (101, 102, 103, 104))
    answer = list(range(200, 220))  # 20 tokens
    return _write(
        tmp_path / "trace.jsonl",
        [
            (prefix + a, answer),
            (prefix + b, [7] * 4),
            (prefix + c, [7] * 4),
            (prefix + a + answer + d, [7] * 4),
        ],
    )


@pytest.mark.parametrize("retention, hits", [("dense", [0, 32, 32, 64]), ("sparse", [0, 0, 32, 64])])
def test_hybrid_hits_where_a_checkpoint_was_left(shared_prefix_trace, retention, hits):
    # Request 0 (50 tokens): a cold miss. Its prefill leaves a candidate checkpoint at each
    # page boundary (16, 32; dense only) and one at its prompt's last boundary (48); the 20
    # sampled tokens are computed but the last (69 tokens), so decoding crosses 64.
    # Request 1: pages 0-1 (tokens 0-31) match, page 2 holds other tokens. Dense: the candidate
    # at 32 is a hit. Sparse: no checkpoint at 32, so it hits 0 and leaves one at that junction.
    # Request 2: hit 32. Request 3 (80 tokens, request 0's next turn): the checkpoint at 64.
    result = _run(shared_prefix_trace, HYBRID, "--budget-bytes", "1e9", "--retention", retention)
    assert [r["hit_tokens"] for r in result["per_request"]] == hits
    assert result["token_hit_rate"] == pytest.approx(sum(hits) / 230)
    assert result["lost_tokens"] == (32 if retention == "sparse" else 0)


def test_a_request_leaving_a_long_prompt_where_nobody_left_it_hits_a_rung(tmp_path):
    # Request 0: a 640-token prompt (40 pages). The room left beside its pages holds its prompt
    # end and its rungs (pages 1, 2, 4, 8, 16, 32) but only a few candidates, the deepest,
    # which go first when the cache is trimmed to the budget. Request 1 leaves it after 27
    # pages, where nobody left it before: no junction, no candidate there. It hits the rung
    # at 16 pages (256 tokens); without rungs (sparse) nothing.
    prompt = list(range(1, 641))
    trace = _write(tmp_path / "leave.jsonl", [(prompt, [7] * 4), (prompt[:432] + [9] * 50, [7] * 4)])
    page = 2 * 2 * 16 * 2 * 48 * 4  # one block
    dense = _run(trace, HYBRID, "--budget-bytes", str(200 * page))
    assert [r["hit_tokens"] for r in dense["per_request"]] == [0, 256]
    assert dense["lost_tokens"] == 432 - 256
    sparse = _run(trace, HYBRID, "--budget-bytes", str(200 * page), "--retention", "sparse")
    assert [r["hit_tokens"] for r in sparse["per_request"]] == [0, 0]


def test_plain_transformer_hits_at_every_full_cached_page(shared_prefix_trace, llama_dir):
    # Without Mamba layers any run of cached full pages is a hit: request 1 already takes
    # pages 0-1 (32 tokens); request 3 takes pages 0-3 (64 tokens).
    result = _run(shared_prefix_trace, llama_dir, "--budget-bytes", "1e9")
    assert [r["hit_tokens"] for r in result["per_request"]] == [0, 32, 32, 64]
    assert result["ssm"]["checkpoints_held"] == 0


def test_json_report_has_the_fields(shared_prefix_trace, tmp_path, capsys):
    out = tmp_path / "out.json"
    _run(shared_prefix_trace, HYBRID, "--budget-bytes", "1e9", "--retention", "every=64", "--json", str(out))
    report = json.loads(out.read_text())
    assert {
        "requests",
        "input_tokens",
        "hit_tokens",
        "token_hit_rate",
        "lost_tokens",
        "budget",
        "kv",
        "ssm",
        "per_request",
        "settings",
    } <= set(report)
    assert {"budget_bytes", "block_bytes", "budget_blocks", "live_blocks", "live_slots"} <= set(report["budget"])
    assert {"page_bytes", "pages_held", "bytes_held", "evictions"} <= set(report["kv"])
    assert {
        "checkpoint_bytes",
        "checkpoint_blocks",
        "checkpoints_held",
        "bytes_held",
        "written",
        "skipped",
        "evictions",
    } <= set(report["ssm"])
    # 2 layers * K and V * 16 tokens * 2 KV heads * 48 dims * 4 bytes; 4 layers * (6 heads * 64 * 64 * 4 + 512 * 4 * 4)
    page = 2 * 2 * 16 * 2 * 48 * 4
    assert report["kv"]["page_bytes"] == report["budget"]["block_bytes"] == page
    assert report["ssm"]["checkpoint_bytes"] == 4 * (6 * 64 * 64 * 4 + 512 * 4 * 4)
    assert report["ssm"]["checkpoint_blocks"] == -(-report["ssm"]["checkpoint_bytes"] // page)
    assert report["kv"]["bytes_held"] == report["kv"]["pages_held"] * page
    assert report["ssm"]["bytes_held"] == report["ssm"]["checkpoints_held"] * report["ssm"]["checkpoint_blocks"] * page
    assert report["requests"] == 4 and report["input_tokens"] == 230
    assert report["settings"]["retention_interval"] == 64
    assert "token hit rate: " in capsys.readouterr().out


def test_one_budget_holds_pages_and_checkpoints(shared_prefix_trace):
    page = 2 * 2 * 16 * 2 * 48 * 4
    result = _run(shared_prefix_trace, HYBRID, "--budget-bytes", str(40 * page))
    held = result["kv"]["bytes_held"] + result["ssm"]["bytes_held"]
    assert result["budget"]["budget_blocks"] == 40 and held <= 40 * page
    assert result["ssm"]["evictions"] > 0 and result["ssm"]["checkpoints_held"] >= 1


def test_a_trace_without_token_ids_is_refused(tmp_path):
    trace = tmp_path / "counts.jsonl"
    trace.write_text(json.dumps({"session_id": 0, "turn_id": 0, "num_input_tokens": 5, "num_output_tokens": 2}) + "\n")
    with pytest.raises(ValueError, match="input_tokens"):
        replay.load_trace(trace)
    with pytest.raises(SystemExit):
        _run(trace, HYBRID, "--budget-bytes", "1e9")


def test_shared_system_prompt_hits_like_a_transformer(tmp_path, llama_dir):
    # 200-token system prompt: 12 full pages (192). Dense: the first request left a candidate
    # checkpoint at 192, so the hybrid hits from the second request on, like the plain
    # transformer. Sparse: the second request leaves a junction checkpoint there, the third hits.
    trace = tmp_path / "system.jsonl"
    make_trace.main(["system-prompt", str(trace), "--system-tokens", "200", "--questions", "5"])
    hybrid = _run(trace, HYBRID, "--budget-bytes", "1e9")
    assert [r["hit_tokens"] for r in hybrid["per_request"]] == [0, 192, 192, 192, 192]
    sparse = _run(trace, HYBRID, "--budget-bytes", "1e9", "--retention", "sparse")
    assert [r["hit_tokens"] for r in sparse["per_request"]] == [0, 0, 192, 192, 192]
    llama = _run(trace, llama_dir, "--budget-bytes", "1e9")
    assert [r["hit_tokens"] for r in llama["per_request"]] == [0, 192, 192, 192, 192]


def test_few_shot_prompts_branch_inside_earlier_prompts(tmp_path):
    trace = tmp_path / "shots.jsonl"
    make_trace.main(
        [
            "few-shot",
            str(trace),
            "--instruction-tokens",
            "32",
            "--families",
            "2",
            "--tasks-per-family",
            "2",
            "--family-tokens",
            "16",
            "--task-tokens",
            "16",
            "--requests",
            "30",
        ]
    )
    requests = replay.load_trace(trace)
    assert len(requests) == 30
    instruction = requests[0].input_tokens[:32]
    tasks = {}
    for r in requests:
        assert r.input_tokens[:32] == instruction
        tasks.setdefault(r.session_id, r.input_tokens[:64])
        assert r.input_tokens[:64] == tasks[r.session_id]
    heads = {t[:48] for t in map(tuple, tasks.values())}
    assert len(tasks) == 4 and len(heads) == 2  # two families of two tasks


def test_conversations_can_keep_a_few_open_at_once(tmp_path):
    trace = tmp_path / "conv.jsonl"
    make_trace.main(
        [
            "conversations",
            str(trace),
            "--conversations",
            "6",
            "--turns",
            "3",
            "--system-tokens",
            "0",
            "--first-message-tokens",
            "20",
            "20",
            "--max-active",
            "3",
        ]
    )
    sessions = [r.session_id for r in replay.load_trace(trace)]
    assert sessions[:3] == [0, 1, 2] and len(sessions) == 18
    for k in range(1, 19):  # conversations started and not yet through their 3 turns
        seen = sessions[:k]
        assert sum(1 for c in set(seen) if seen.count(c) < 3) <= 3


def test_conversation_turns_extend_the_previous_turn(tmp_path):
    trace = tmp_path / "conv.jsonl"
    make_trace.main(
        [
            "conversations",
            str(trace),
            "--conversations",
            "3",
            "--turns",
            "4",
            "--system-tokens",
            "50",
            "--order",
            "random",
            "--seed",
            "7",
        ]
    )
    requests = replay.load_trace(trace)
    assert len(requests) == 12
    system = requests[0].input_tokens[:50]
    last = {}
    for r in requests:
        assert r.input_tokens[:50] == system
        if r.session_id in last:
            previous = last[r.session_id]
            assert r.turn_id == previous.turn_id + 1
            history = previous.input_tokens + previous.output_tokens
            assert r.input_tokens[: len(history)] == history and len(r.input_tokens) >= len(history) + 100
        else:
            assert r.turn_id == 0
        last[r.session_id] = r


def test_gated_delta_checkpoints_are_sized_from_their_declared_state(shared_prefix_trace, tmp_path):
    """A Qwen3.5 config: 3 Gated DeltaNet layers (conv window over q | k | v and a float32
    delta-rule state) and 1 gated attention layer; bfloat16 KV and conv, float32 states."""
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
    }
    path = tmp_path / "qwen3_5"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    report = replay.main(
        [str(shared_prefix_trace), "--model-config", str(path), "--budget-bytes", "1e9", "--kv-dtype", "bfloat16"]
    )
    conv = (2 * 2 * 16 + 4 * 8) * 4  # channels x kernel
    assert report["ssm"]["checkpoint_bytes"] == 3 * (conv * 2 + 4 * 16 * 8 * 4)
    assert report["kv"]["page_bytes"] == 2 * 16 * 2 * 16 * 2
    assert [r["hit_tokens"] for r in report["per_request"]] == [0, 32, 32, 64]  # dense, as for Bamba


def _mooncake(path: Path, rows: list[tuple[int, int, list[int]]]) -> Path:
    with path.open("w") as f:
        for i, (inputs, outputs, ids) in enumerate(rows):
            f.write(
                json.dumps({"timestamp": i, "input_length": inputs, "output_length": outputs, "hash_ids": ids}) + "\n"
            )
    return path


def test_mooncake_blocks_become_token_ids(tmp_path):
    trace = _mooncake(tmp_path / "m.jsonl", [(70, 3, [7, 8, 9]), (40, 2, [7, 5]), (96, 1, [7, 8, 6])])
    requests = replay.load_mooncake(trace, 32)
    a, b, c = requests
    assert len(a.input_tokens) == 70 and len(set(a.input_tokens)) == 70  # three blocks, none alike
    assert b.input_tokens[:32] == a.input_tokens[:32] and b.input_tokens[32] != a.input_tokens[32]
    assert not set(b.input_tokens[32:]) & set(a.input_tokens)  # block 5 is none of 7, 8, 9
    assert c.input_tokens[:64] == a.input_tokens[:64] and len(c.input_tokens) == 96
    outputs = a.output_tokens + b.output_tokens + c.output_tokens
    assert len(outputs) == 6 and len(set(outputs)) == 6  # fresh: never equal to any prompt token
    assert not set(outputs) & {t for r in requests for t in r.input_tokens}


def test_mooncake_block_ids_may_be_64_bit_hashes(tmp_path):
    # Bailian's traces give SipHash ids; equal ids are equal blocks whatever their size.
    big, other = 2**64 - 5, 2**63 + 11
    trace = _mooncake(tmp_path / "m.jsonl", [(20, 1, [big, other]), (30, 1, [big, 3]), (16, 1, [other])])
    a, b, c = replay.load_mooncake(trace, 16)
    assert a.input_tokens[:16] == b.input_tokens[:16] and a.input_tokens[16:] == c.input_tokens[:4]
    assert not set(b.input_tokens[16:]) & set(a.input_tokens)
    assert all(0 <= t < 2**31 for r in (a, b, c) for t in r.input_tokens + r.output_tokens)


def _lines(path: Path, records: list[dict]) -> Path:
    """Mooncake lines of one block each (id: the line's index) and one output token."""
    path.write_text(
        "".join(json.dumps({"output_length": 1, "hash_ids": [i], **r}) + "\n" for i, r in enumerate(records))
    )
    return path


def test_mooncake_requests_run_in_order_of_arrival(tmp_path):
    # Each request told apart by its input length.
    by_time = _lines(
        tmp_path / "t.jsonl",
        [{"timestamp": 30, "input_length": 1}, {"timestamp": 10, "input_length": 2},
         {"timestamp": 30, "input_length": 3}, {"timestamp": 20, "input_length": 4}],
    )  # fmt: skip
    assert [len(r.input_tokens) for r in replay.load_mooncake(by_time, 16)] == [2, 4, 1, 3]  # ties in line order
    # A session's later turn given as a delay after the turn before it (aiperf's multi-turn form):
    # a1 at 0, b1 at 20, b2 at 30, a2 at 50.
    sessions = _lines(
        tmp_path / "s.jsonl",
        [{"session_id": "a", "timestamp": 0, "input_length": 1},
         {"session_id": "a", "delay": 50, "input_length": 2},
         {"session_id": "b", "timestamp": 20, "input_length": 3},
         {"session_id": "b", "delay": 10, "input_length": 4}],
    )  # fmt: skip
    assert [len(r.input_tokens) for r in replay.load_mooncake(sessions, 16)] == [1, 3, 4, 2]
    # Nothing says when the first turn came: line order.
    untimed = _lines(tmp_path / "u.jsonl", [{"input_length": 5}, {"delay": 5, "input_length": 6}, {"input_length": 7}])
    assert [len(r.input_tokens) for r in replay.load_mooncake(untimed, 16)] == [5, 6, 7]
    with pytest.raises(ValueError, match=r"n.jsonl:1: 'timestamp' must be a number"):
        replay.load_mooncake(_lines(tmp_path / "n.jsonl", [{"timestamp": "noon", "input_length": 1}]), 16)


def test_mooncake_replica_keeps_the_requests_of_one_prefix_class(tmp_path):
    # The second block id routes a request (the first one, for a prompt of one block).
    trace = _mooncake(tmp_path / "m.jsonl", [(70, 1, [0, 4, 9]), (70, 1, [0, 5, 9]), (20, 1, [6]), (40, 1, [0, 2])])
    kept = replay.load_mooncake(trace, 32, replica=(0, 2))
    assert [len(r.input_tokens) for r in kept] == [70, 20, 40]
    assert replay.parse_replica("1/20") == (1, 20)
    for bad in ("20/20", "x", "1/0", "-1/3"):
        with pytest.raises(ValueError, match="--replica"):
            replay.parse_replica(bad)


def test_a_mooncake_line_whose_blocks_do_not_cover_its_input_is_refused(tmp_path):
    trace = _mooncake(tmp_path / "m.jsonl", [(70, 1, [0, 4, 9]), (100, 1, [0, 4])])
    with pytest.raises(ValueError, match=r"m.jsonl:2: 2 hash_ids for input_length=100.*--block-tokens"):
        replay.load_mooncake(trace, 32)
    bad = _mooncake(tmp_path / "bad.jsonl", [(70, -1, [0, 4, 9])])
    with pytest.raises(ValueError, match="output_length"):
        replay.load_mooncake(bad, 32)


def test_mooncake_hits_end_on_block_boundaries(tmp_path):
    # A conversation: each turn's prompt is the last one's full blocks, two more, and a partial
    # block of its own (Mooncake hashes a changed last block anew), so a turn parts from the
    # previous one where that one's full blocks end. The cache learns after 8 such partings
    # that prefixes part only at multiples of a block (4 pages) and from then on writes its
    # prompt-end checkpoint at the last one: a turn then hits all it shares with the previous
    # turn, where before it hit only the junction the previous turn left, a turn behind.
    rows, full = [], [1000]
    for turn in range(14):
        full = full + [turn * 10 + 1, turn * 10 + 2]
        rows.append((64 * len(full) + 44, 5, full + [turn * 10 + 3]))
    trace = _mooncake(tmp_path / "m.jsonl", rows)
    result = _run(
        trace, HYBRID, "--format", "mooncake", "--block-tokens", "64", "--budget-bytes", "1e9", "--retention", "sparse"
    )
    hits = [r["hit_tokens"] for r in result["per_request"]]
    shared = [0] + [64 * (len(r[2]) - 1) for r in rows[:-1]]  # the previous turn's full blocks
    assert hits[:3] == [0, 0, shared[1]]  # a turn behind: the junction at the first parting
    assert hits[-4:] == shared[-4:]


def test_a_bailian_shaped_trace_replays_in_time_order(tmp_path):
    # Alibaba's Bailian traces: 16-token blocks named by 64-bit hashes, fields of their own,
    # timestamps in seconds. One conversation of four turns, each the last one's prompt and two
    # blocks more, written newest first: replayed by arrival, each turn hits the whole turn before.
    ids = [2**63 + 7 * k for k in range(8)]
    turns = [ids[: 2 + 2 * t] for t in range(4)]
    rows = [
        {"chat_id": t, "parent_chat_id": t - 1 if t else -1, "turn": t + 1, "type": "text", "timestamp": 60.0 + t,
         "input_length": 16 * len(blocks), "output_length": 3, "hash_ids": blocks}
        for t, blocks in enumerate(turns)
    ]  # fmt: skip
    trace = tmp_path / "qwen_trace_blksz_16.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    result = _run(
        trace, HYBRID, "--format", "mooncake", "--block-tokens", "16", "--budget-bytes", "1e9", "--retention", "sparse"
    )
    assert [r["hit_tokens"] for r in result["per_request"]] == [0, 32, 64, 96]


def test_the_engines_pool_arrangement(shared_prefix_trace):
    # One pool of 40 blocks, the running request's pages from it too, nothing trimmed.
    result = _run(shared_prefix_trace, HYBRID, "--budget-bytes", "0", "--pool-blocks", "40")
    assert result["budget"]["budget_blocks"] == 39 and result["budget"]["live_blocks"] == 0
    held = result["kv"]["pages_held"] + result["ssm"]["checkpoints_held"] * result["ssm"]["checkpoint_blocks"]
    assert 0 < held <= 39
    with pytest.raises(SystemExit):
        _run(shared_prefix_trace, HYBRID, "--budget-bytes", "0", "--pool-blocks", "1")


def test_agent_sessions_in_mooncakes_format_name_equal_blocks_alike(tmp_path):
    # The same trace in both formats: two requests' hash ids agree for exactly as many
    # leading blocks as their token ids agree in whole blocks (counted here from the tokens).
    args = [
        "agentic",
        "--sessions",
        "4",
        "--max-active",
        "2",
        "--turns",
        "2",
        "3",
        "--tool-spec-tokens",
        "40",
        "--tool-result-tokens",
        "10",
        "30",
        "--action-tokens",
        "5",
        "10",
        "--task-tokens",
        "5",
        "10",
    ]
    make_trace.main([*args, str(tmp_path / "t.jsonl")])
    make_trace.main([*args, str(tmp_path / "m.jsonl"), "--mooncake-blocks", "16"])
    tokens = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    blocks = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [b["input_length"] for b in blocks] == [len(t["input_tokens"]) for t in tokens]
    assert [b["output_length"] for b in blocks] == [len(t["output_tokens"]) for t in tokens]

    def equal_blocks(a: list, b: list) -> int:
        """Leading blocks (the last one possibly partial) whose tokens, and all before, agree."""
        n = 0
        while n < min(len(a), len(b)) / 16 and a[: 16 * (n + 1)] == b[: 16 * (n + 1)]:
            n += 1
        return n

    shared = 0
    for i, (ti, bi) in enumerate(zip(tokens, blocks)):
        assert len(bi["hash_ids"]) == -(-len(ti["input_tokens"]) // 16)
        for tj, bj in zip(tokens[:i], blocks[:i]):
            n = equal_blocks(ti["input_tokens"], tj["input_tokens"])
            ids = next(
                (k for k, (x, y) in enumerate(zip(bi["hash_ids"], bj["hash_ids"])) if x != y),
                min(len(bi["hash_ids"]), len(bj["hash_ids"])),
            )
            assert ids == n
            shared += n > 0
    assert shared > 0  # the tool specification's blocks are shared


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(1, 8), st.data())
def test_block_tokens_read_as_the_list_of_ids_they_stand_for(ids, block, data):
    # Mooncake's prompts are held as their blocks' first ids and expanded when read.
    length = data.draw(st.integers(1, len(ids) * block))
    want = [h * block + j for h in ids for j in range(block)][:length]
    tokens = replay.BlockTokens([h * block for h in ids], block, length)
    assert len(tokens) == length and list(tokens) == want and tokens == want and tokens.tolist() == want
    i = data.draw(st.integers(-length, length - 1))
    assert tokens[i] == want[i]
    start, stop = data.draw(st.integers(-length - 2, length + 2)), data.draw(st.integers(-length - 2, length + 2))
    assert tokens[start:stop] == want[start:stop]
    assert tokens + [-1] == want + [-1] and [-1] + tokens == [-1] + want
    with pytest.raises(IndexError):
        tokens[length]
