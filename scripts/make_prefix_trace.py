"""Synthetic request traces for the prefix-cache replay, in the format of `TRACES.md`.

    python scripts/make_prefix_trace.py conversations OUT.jsonl [--conversations 8] [--turns 6] \
        [--system-tokens 500] [--first-message-tokens MIN MAX] [--message-tokens 100 300] \
        [--output-tokens 50 150] [--order round-robin|random] [--max-active K] [--seed 0] \
        [--vocab-size 4096]
    python scripts/make_prefix_trace.py system-prompt OUT.jsonl [--system-tokens 200] \
        [--questions 16] [--message-tokens 10 40] [--output-tokens 20 60] [--seed 0]
    python scripts/make_prefix_trace.py few-shot OUT.jsonl [--instruction-tokens 256] [--families 4] \
        [--tasks-per-family 4] [--family-tokens 256] [--task-tokens 256] [--requests 200] \
        [--message-tokens 20 60] [--output-tokens 20 60] [--seed 0]
    python scripts/make_prefix_trace.py agentic OUT.jsonl [--sessions 24] [--turns 2 20] \
        [--tool-spec-tokens 2000] [--task-tokens 50 200] [--tool-result-tokens 100 600] \
        [--action-tokens 20 80] [--max-active 8] [--seed 0]

`conversations`: C multi-turn conversations sharing one system prompt (none with
`--system-tokens 0`), interleaved; each turn's input is the previous turn's input and output
followed by a new user message (the first turn's from `--first-message-tokens`, by default
`--message-tokens`).
`system-prompt`: one shared system prompt followed by N distinct questions.
`few-shot`: a branching tree of few-shot prompts: one instruction shared by all, a block of
examples shared by the tasks of a family, a block of examples of each task, then a new
question; each request picks a task at random. Prefixes diverge inside earlier prompts
(at the family and task boundaries), not at their ends.
`agentic`: interleaved agent sessions over one shared tool specification: a session opens
with the specification and a task, and each turn's input is the previous turn's input, the
model's action (its output) and the tool's result; up to `--max-active` sessions are open at
once, the next request coming from one of them at random, and a session runs a random number
of turns from `--turns`.
Token ids are drawn uniformly from [1, vocab size); message and output lengths uniformly
from the inclusive ranges given.

`--mooncake-blocks N` writes the trace in Mooncake's format instead (as kvcache-ai/Mooncake's
FAST'25 traces: `timestamp`, `input_length`, `output_length`, and one `hash_ids` entry per
N-token block of the prompt, equal ids for blocks whose whole prefix is equal): the same
traffic as a system that hashes its prompts per block sees it, for
`replay_prefix_trace.py --format mooncake --block-tokens N`.
"""

import argparse
import dataclasses
import json
import random
from pathlib import Path


@dataclasses.dataclass
class Request:
    """One line of a trace."""

    session_id: int
    turn_id: int
    input_tokens: list[int]
    output_tokens: list[int]

    def to_json(self, ts: float) -> dict:
        return {
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "ts": ts,
            "num_input_tokens": len(self.input_tokens),
            "num_output_tokens": len(self.output_tokens),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
        }


class TokenSource:
    """Random token runs of random lengths, reproducible from a seed."""

    def __init__(self, seed: int, vocab_size: int):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab_size) for _ in range(n)]

    def run(self, lengths: tuple[int, int]) -> list[int]:
        return self.tokens(self.rng.randint(*lengths))


def conversations(
    src: TokenSource,
    *,
    num_conversations: int,
    num_turns: int,
    system_tokens: int,
    first_message_tokens: tuple[int, int],
    message_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    order: str,
    max_active: int | None = None,
) -> list[Request]:
    """Interleaved conversations over one shared system prompt, turns in order within each."""
    system = src.tokens(system_tokens)
    history = [list(system) for _ in range(num_conversations)]
    next_turn = [0] * num_conversations
    requests = []
    for session in _turn_order(src.rng, num_conversations, num_turns, order, max_active):
        message = src.run(first_message_tokens if next_turn[session] == 0 else message_tokens)
        prompt = history[session] + message
        output = src.run(output_tokens)
        requests.append(Request(session, next_turn[session], prompt, output))
        history[session] = prompt + output
        next_turn[session] += 1
    return requests


def _turn_order(
    rng: random.Random, num_conversations: int, num_turns: int, order: str, max_active: int | None
) -> list[int]:
    """The session of each request in arrival order. At most `max_active` conversations are
    open at once (all by default); when one ends, the next one opens in its place."""
    waiting = list(range(num_conversations))
    active: list[int] = []
    remaining = [num_turns] * num_conversations
    sessions = []
    while waiting or active:
        while waiting and len(active) < (max_active or num_conversations):
            active.append(waiting.pop(0))
        if order == "round-robin":
            turn = [active.pop(0) for _ in range(len(active))]
        else:
            turn = [active.pop(rng.randrange(len(active)))]
        for session in turn:
            sessions.append(session)
            remaining[session] -= 1
            if remaining[session]:
                active.append(session)
            elif waiting and len(active) < (max_active or num_conversations):
                active.append(waiting.pop(0))
    return sessions


def system_prompt(
    src: TokenSource,
    *,
    system_tokens: int,
    num_questions: int,
    message_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
) -> list[Request]:
    """One shared system prompt, each question a session of its own."""
    system = src.tokens(system_tokens)
    return [Request(q, 0, system + src.run(message_tokens), src.run(output_tokens)) for q in range(num_questions)]


def few_shot(
    src: TokenSource,
    *,
    instruction_tokens: int,
    num_families: int,
    tasks_per_family: int,
    family_tokens: int,
    task_tokens: int,
    num_requests: int,
    message_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
) -> list[Request]:
    """Requests over a tree of few-shot prompts: instruction, family examples, task examples."""
    instruction = src.tokens(instruction_tokens)
    families = [instruction + src.tokens(family_tokens) for _ in range(num_families)]
    tasks = [family + src.tokens(task_tokens) for family in families for _ in range(tasks_per_family)]
    requests = []
    for i in range(num_requests):
        task = src.rng.randrange(len(tasks))
        requests.append(Request(task, i, tasks[task] + src.run(message_tokens), src.run(output_tokens)))
    return requests


def agentic(
    src: TokenSource,
    *,
    num_sessions: int,
    turns: tuple[int, int],
    tool_spec_tokens: int,
    task_tokens: tuple[int, int],
    tool_result_tokens: tuple[int, int],
    action_tokens: tuple[int, int],
    max_active: int,
) -> list[Request]:
    """Interleaved agent sessions: tool specification and task, then action and tool result
    per turn; the next request comes from an open session picked at random."""
    spec = src.tokens(tool_spec_tokens)
    lengths = [src.rng.randint(*turns) for _ in range(num_sessions)]
    waiting, active = list(range(num_sessions)), []
    history: dict[int, list[int]] = {}
    done = [0] * num_sessions
    requests = []
    while waiting or active:
        while waiting and len(active) < max_active:
            active.append(waiting.pop(0))
        session = active[src.rng.randrange(len(active))]
        if done[session] == 0:
            prompt = spec + src.run(task_tokens)
        else:
            prompt = history[session] + src.run(tool_result_tokens)
        action = src.run(action_tokens)
        requests.append(Request(session, done[session], prompt, action))
        history[session] = prompt + action
        done[session] += 1
        if done[session] == lengths[session]:
            active.remove(session)
            del history[session]
    return requests


def mean_turn_gap(requests: list[Request]) -> float | None:
    """Mean number of other requests between two consecutive turns of one session."""
    last, gaps = {}, []
    for i, r in enumerate(requests):
        if r.session_id in last and r.turn_id > 0:
            gaps.append(i - last[r.session_id] - 1)
        last[r.session_id] = i
    return sum(gaps) / len(gaps) if gaps else None


def write_trace(requests: list[Request], path: Path) -> None:
    """Writes one JSON line per request; `ts` is the line index in seconds."""
    with path.open("w") as f:
        for i, request in enumerate(requests):
            f.write(json.dumps(request.to_json(float(i))) + "\n")


def write_mooncake_trace(requests: list[Request], path: Path, block_tokens: int) -> None:
    """Writes one Mooncake line per request: a block's id names it and every token before it
    (ids in order of first appearance), `timestamp` the line index in milliseconds."""
    ids: dict[tuple, int] = {}
    with path.open("w") as f:
        for i, request in enumerate(requests):
            tokens, hash_ids, parent = request.input_tokens, [], -1
            for start in range(0, len(tokens), block_tokens):
                parent = ids.setdefault((parent, tuple(tokens[start : start + block_tokens])), len(ids))
                hash_ids.append(parent)
            f.write(
                json.dumps(
                    {
                        "timestamp": 1000 * i,
                        "input_length": len(tokens),
                        "output_length": len(request.output_tokens),
                        "hash_ids": hash_ids,
                    }
                )
                + "\n"
            )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = parser.add_subparsers(dest="kind", required=True)
    conv = kinds.add_parser("conversations", help="interleaved multi-turn conversations")
    conv.add_argument("--conversations", type=int, default=8)
    conv.add_argument("--turns", type=int, default=6)
    conv.add_argument("--system-tokens", type=int, default=500)
    conv.add_argument(
        "--first-message-tokens",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="the first turn's message (default: --message-tokens)",
    )
    conv.add_argument("--message-tokens", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"))
    conv.add_argument("--output-tokens", type=int, nargs=2, default=[50, 150], metavar=("MIN", "MAX"))
    conv.add_argument("--order", choices=["round-robin", "random"], default="round-robin")
    conv.add_argument("--max-active", type=int, help="conversations open at once (default: all)")
    sysp = kinds.add_parser("system-prompt", help="one shared system prompt, distinct questions")
    sysp.add_argument("--system-tokens", type=int, default=200)
    sysp.add_argument("--questions", type=int, default=16)
    sysp.add_argument("--message-tokens", type=int, nargs=2, default=[10, 40], metavar=("MIN", "MAX"))
    sysp.add_argument("--output-tokens", type=int, nargs=2, default=[20, 60], metavar=("MIN", "MAX"))
    shot = kinds.add_parser("few-shot", help="a branching tree of few-shot prompts")
    shot.add_argument("--instruction-tokens", type=int, default=256)
    shot.add_argument("--families", type=int, default=4)
    shot.add_argument("--tasks-per-family", type=int, default=4)
    shot.add_argument("--family-tokens", type=int, default=256)
    shot.add_argument("--task-tokens", type=int, default=256)
    shot.add_argument("--requests", type=int, default=200)
    shot.add_argument("--message-tokens", type=int, nargs=2, default=[20, 60], metavar=("MIN", "MAX"))
    shot.add_argument("--output-tokens", type=int, nargs=2, default=[20, 60], metavar=("MIN", "MAX"))
    agent = kinds.add_parser("agentic", help="interleaved agent sessions over one shared tool specification")
    agent.add_argument("--sessions", type=int, default=24)
    agent.add_argument("--turns", type=int, nargs=2, default=[2, 20], metavar=("MIN", "MAX"))
    agent.add_argument("--tool-spec-tokens", type=int, default=2000)
    agent.add_argument("--task-tokens", type=int, nargs=2, default=[50, 200], metavar=("MIN", "MAX"))
    agent.add_argument("--tool-result-tokens", type=int, nargs=2, default=[100, 600], metavar=("MIN", "MAX"))
    agent.add_argument("--action-tokens", type=int, nargs=2, default=[20, 80], metavar=("MIN", "MAX"))
    agent.add_argument("--max-active", type=int, default=8)
    for sub in (conv, sysp, shot, agent):
        sub.add_argument("out", type=Path, help="the JSON Lines file to write")
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--vocab-size", type=int, default=4096)
        sub.add_argument(
            "--mooncake-blocks", type=int, metavar="N", help="write Mooncake's format with N-token blocks (see above)"
        )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    ranges = {
        f"--{name.replace('_', '-')}": tuple(value) for name, value in vars(args).items() if isinstance(value, list)
    }
    for name, (low, high) in ranges.items():
        if not 0 <= low <= high:
            parser.error(f"{name} needs 0 <= MIN <= MAX, got {low} {high}")
    src = TokenSource(args.seed, args.vocab_size)
    if args.kind == "agentic":
        if args.turns[0] < 1 or args.sessions < 1 or args.max_active < 1:
            parser.error("--turns MIN, --sessions and --max-active must be >= 1")
        requests = agentic(
            src,
            num_sessions=args.sessions,
            turns=tuple(args.turns),
            tool_spec_tokens=args.tool_spec_tokens,
            task_tokens=tuple(args.task_tokens),
            tool_result_tokens=tuple(args.tool_result_tokens),
            action_tokens=tuple(args.action_tokens),
            max_active=args.max_active,
        )
    elif args.kind == "conversations":
        messages, outputs = tuple(args.message_tokens), tuple(args.output_tokens)
        first = tuple(args.first_message_tokens or messages)
        requests = conversations(
            src,
            num_conversations=args.conversations,
            num_turns=args.turns,
            system_tokens=args.system_tokens,
            first_message_tokens=first,
            message_tokens=messages,
            output_tokens=outputs,
            order=args.order,
            max_active=args.max_active,
        )
    elif args.kind == "few-shot":
        requests = few_shot(
            src,
            instruction_tokens=args.instruction_tokens,
            num_families=args.families,
            tasks_per_family=args.tasks_per_family,
            family_tokens=args.family_tokens,
            task_tokens=args.task_tokens,
            num_requests=args.requests,
            message_tokens=tuple(args.message_tokens),
            output_tokens=tuple(args.output_tokens),
        )
    else:
        requests = system_prompt(
            src,
            system_tokens=args.system_tokens,
            num_questions=args.questions,
            message_tokens=tuple(args.message_tokens),
            output_tokens=tuple(args.output_tokens),
        )
    if args.mooncake_blocks is not None:
        if args.mooncake_blocks < 1:
            parser.error(f"--mooncake-blocks must be >= 1, got {args.mooncake_blocks}")
        write_mooncake_trace(requests, args.out, args.mooncake_blocks)
    else:
        write_trace(requests, args.out)
    total = sum(len(r.input_tokens) for r in requests)
    gap = mean_turn_gap(requests)
    between = f"; {gap:.1f} other requests between two turns of a session on average" if gap is not None else ""
    print(f"wrote {len(requests)} requests, {total} input tokens, to {args.out}{between}")


if __name__ == "__main__":
    main()
