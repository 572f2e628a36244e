"""The peer-shaped traces: each has the prefix structure its docstring promises."""

import json
import os

from tests.scripts.load_script import load_script

peers = load_script("make_peer_traces")
make_trace = load_script("make_prefix_trace")


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    requests = peers.shared_prefix(make_trace.TokenSource(0, 32000), 3, 4, 64, 8, 5)
    assert len(requests) == 12 and all(len(r.input_tokens) == 72 and len(r.output_tokens) == 5 for r in requests)
    by_group = {}
    for r in requests:
        by_group.setdefault(r.session_id // 4, []).append(r.input_tokens)
    for prompts in by_group.values():
        assert all(_common(prompts[0], p) == 64 for p in prompts[1:])  # random ids: no longer by chance
    heads = [prompts[0][:64] for prompts in by_group.values()]
    assert len({tuple(h) for h in heads}) == 3
    assert [r.session_id for r in requests] != sorted(r.session_id for r in requests)  # shuffled


def test_shared_prefix_multiturn_turns_extend_their_users_history():
    requests = peers.shared_prefix_multiturn(make_trace.TokenSource(1, 32000), 2, 3, 4, 32, 8, 6)
    assert len(requests) == 2 * 3 * 4
    last = {}
    for r in requests:
        if r.session_id in last:
            prompt, output = last[r.session_id]
            assert r.input_tokens[: len(prompt) + 6] == prompt + output and len(r.input_tokens) == len(prompt) + 6 + 8
        else:
            assert r.turn_id == 0 and len(r.input_tokens) == 32 + 8
        last[r.session_id] = (r.input_tokens, r.output_tokens)
    first = {r.session_id: r.input_tokens[:32] for r in requests if r.turn_id == 0}
    assert first[0] == first[2] and first[0] != first[3]  # users 0-2 in group 0, 3-5 in group 1


def test_prefix_proportion_prompts_leave_their_prefix_at_many_depths():
    requests = peers.prefix_proportion(make_trace.TokenSource(2, 32000), 2, 50, (400, 100), (0.8, 0.1))
    groups = {}
    for r in requests:
        groups.setdefault(r.session_id // 50, []).append(r.input_tokens)
    for prompts in groups.values():
        longest = max(prompts, key=len)
        depths = {_common(longest, p) for p in prompts if p is not longest}
        assert len(depths) > 20 and min(depths) < 0.7 * 400 and max(depths) > 0.9 * 400 * 0.8
    assert _common(groups[0][0], groups[1][0]) < 5


def test_chat_regenerations_repeat_a_prompt_and_edits_branch_from_the_turn_before():
    requests = peers.chat_regenerate_edit(make_trace.TokenSource(3, 32000), 30, 6, 0.2, 0.1)
    last, regenerated, edited, continued = {}, 0, 0, 0
    for r in requests:
        if r.session_id in last:
            prompt, output, base = last[r.session_id]
            if r.input_tokens == prompt:
                regenerated += 1
            elif r.input_tokens[: len(prompt) + len(output)] == prompt + output:
                continued += 1
                base = len(prompt) + len(output)
            else:
                assert r.input_tokens[:base] == prompt[:base]  # the last message replaced
                edited += 1
            last[r.session_id] = (r.input_tokens, r.output_tokens, base)
        else:
            assert r.turn_id == 0
            last[r.session_id] = (r.input_tokens, r.output_tokens, 300)
    assert regenerated > 10 and edited > 5 and continued > 3 * edited


def test_main_writes_each_trace_in_the_replay_format(tmp_path, monkeypatch):
    small = {
        "shared-prefix": lambda src: peers.shared_prefix(src, 2, 3, 64, 8, 4),
        "chat-regenerate-edit": lambda src: peers.chat_regenerate_edit(src, 4, 2, 0.2, 0.1),
    }
    monkeypatch.setattr(peers, "TRACES", small)
    peers.main([str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["chat-regenerate-edit.jsonl", "shared-prefix.jsonl"]
    lines = [json.loads(line) for line in (tmp_path / "shared-prefix.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(line["num_input_tokens"] == len(line["input_tokens"]) == 72 for line in lines)
