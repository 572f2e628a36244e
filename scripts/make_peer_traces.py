"""Prefix-sharing traces in the shapes other projects' benchmarks generate, for the replay.

    python scripts/make_peer_traces.py OUT_DIR [--seed 0]

The prefix-cache policy was developed on `make_prefix_trace.py`'s traces and Mooncake's; these
are the workloads other serving projects benchmark prefix caching with, written from their
documented parameters (not their code), so the same checks run on shapes the policy was not
tuned on. Each is a file of `TRACES.md`'s format in OUT_DIR:

- `shared-prefix.jsonl`: SGLang's generated-shared-prefix benchmark at its defaults: 64
  groups of 16 prompts, a 2,048-token system prompt per group, a 128-token question and a
  256-token answer each, all 1,024 prompts in random order.
- `shared-prefix-multiturn.jsonl`: a shared-prefix generator with multi-turn user sessions
  (inference-perf's shape): 16 groups of 8 users, a 2,048-token system prompt per group, each
  user's 5 turns adding a 128-token question and a 256-token answer, turns of all users
  interleaved at random.
- `prefix-proportion-toolbench.jsonl` and `prefix-proportion-embodied.jsonl`: AIBrix's
  synthetic prefix-sharing datasets, with the prompt lengths and shared proportions of its
  Toolbench and embodied-agent examples: per prompt a length and a shared proportion drawn
  from normal distributions, the shared part the head of its prefix's text (so prompts leave
  a shared prefix at every depth), 10 prefixes, random order.
- `chat-regenerate-edit.jsonl`: chat sessions behind a 300-token system prompt with
  ShareGPT-like lengths (log-normal messages and answers), where a user regenerates an
  answer (the same prompt again) one time in five and edits the last message (a new branch
  from the turn before) one time in ten; 24 sessions open at once.
"""

import argparse
import dataclasses
from pathlib import Path

from make_prefix_trace import Request, TokenSource, write_trace


def shared_prefix(src: TokenSource, groups: int, prompts: int, system: int, question: int, answer: int):
    requests = []
    for g in range(groups):
        head = src.tokens(system)
        requests += [
            Request(g * prompts + p, 0, head + src.tokens(question), src.tokens(answer)) for p in range(prompts)
        ]
    src.rng.shuffle(requests)
    return requests


def shared_prefix_multiturn(
    src: TokenSource, groups: int, users: int, turns: int, system: int, question: int, answer: int
):
    heads = [src.tokens(system) for _ in range(groups)]
    history = [list(heads[user // users]) for user in range(groups * users)]
    turn = [0] * len(history)
    open_users = list(range(len(history)))
    requests = []
    while open_users:
        user = src.rng.choice(open_users)
        prompt = history[user] + src.tokens(question)
        output = src.tokens(answer)
        requests.append(Request(user, turn[user], prompt, output))
        history[user] = prompt + output
        turn[user] += 1
        if turn[user] == turns:
            open_users.remove(user)
    return requests


def prefix_proportion(
    src: TokenSource, prefixes: int, per_prefix: int, length: tuple[float, float], share: tuple[float, float]
):
    rng = src.rng
    heads = [src.tokens(int(length[0] + 4 * length[1])) for _ in range(prefixes)]
    requests = []
    for p, head in enumerate(heads):
        for k in range(per_prefix):
            n = max(64, int(rng.gauss(*length)))
            shared = min(int(n * min(max(rng.gauss(*share), 0.0), 1.0)), len(head))
            requests.append(Request(p * per_prefix + k, 0, head[:shared] + src.tokens(n - shared), src.run((32, 256))))
    rng.shuffle(requests)
    return requests


@dataclasses.dataclass
class Chat:
    history: list[int]  # everything so far: the last prompt and its answer
    turns_left: int
    turn: int = 0
    last_prompt: list[int] | None = None
    last_base: int = 0  # where the last prompt's new message began


def chat_regenerate_edit(src: TokenSource, sessions: int, max_open: int, regenerate: float, edit: float):
    rng = src.rng

    def message() -> list[int]:
        return src.tokens(4 + int(rng.lognormvariate(4.0, 1.0)))

    system = src.tokens(300)
    waiting, chats, requests = list(range(sessions)), {}, []
    while waiting or chats:
        while waiting and len(chats) < max_open:
            chats[waiting.pop(0)] = Chat(list(system), rng.randint(2, 11))
        session = rng.choice(list(chats))
        chat = chats[session]
        u = rng.random()
        if chat.last_prompt is not None and u < regenerate:
            prompt = chat.last_prompt
        elif chat.last_prompt is not None and u < regenerate + edit:
            prompt = chat.last_prompt[: chat.last_base] + message()
        else:
            chat.last_base = len(chat.history)
            prompt = chat.history + message()
        output = src.tokens(4 + min(1500, int(rng.lognormvariate(5.3, 0.8))))
        requests.append(Request(session, chat.turn, prompt, output))
        chat.history, chat.last_prompt = prompt + output, prompt
        chat.turn += 1
        chat.turns_left -= 1
        if not chat.turns_left:
            del chats[session]
    return requests


TRACES = {
    "shared-prefix": lambda src: shared_prefix(src, 64, 16, 2048, 128, 256),
    "shared-prefix-multiturn": lambda src: shared_prefix_multiturn(src, 16, 8, 5, 2048, 128, 256),
    "prefix-proportion-toolbench": lambda src: prefix_proportion(src, 10, 200, (1835, 742), (0.85, 0.13)),
    "prefix-proportion-embodied": lambda src: prefix_proportion(src, 10, 100, (2285, 471), (0.97, 0.14)),
    "chat-regenerate-edit": lambda src: chat_regenerate_edit(src, 120, 24, 0.2, 0.1),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, make in TRACES.items():
        requests = make(TokenSource(args.seed, args.vocab_size))
        write_trace(requests, args.out_dir / f"{name}.jsonl")
        print(f"{name}: {len(requests)} requests, {sum(len(r.input_tokens) for r in requests)} input tokens")


if __name__ == "__main__":
    main()
