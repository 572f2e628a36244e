"""A clairvoyant prefix cache: the hit rate a policy that knows every future request reaches
on a trace, as the ceiling to set the engine's online policy against.

    python scripts/clairvoyant_prefix_cache.py TRACE.jsonl --model-config path/to/config.json \
        --budget-bytes 4e9 [--format tokens|mooncake] [--block-tokens 512] [--replica K/M] \
        [--kv-dtype float32] [--state-dtype float32] [--page-size 16] [--json OUT.json]

It replays the trace with the replay tool's rules and byte accounting (`replay_prefix_trace.py`:
one request at a time, full pages, a checkpoint spanning as many blocks as its bytes need,
the running request's own pages outside the budget), with two things an online cache cannot
know:

  * where checkpoints pay: a request stores a checkpoint exactly at the page boundaries of
    what it computed where some later request's hit would end with an unlimited cache (the
    later request's longest page-aligned prefix that an earlier request left), and nowhere
    else;
  * what to evict (Belady's rule): the checkpoint whose next use is farthest away goes first,
    and with it the pages that only it made reachable; pages that no checkpoint makes
    reachable are not kept at all.

A checkpoint's *uses* are counted two ways, and the run that hits more is reported: the
requests whose unlimited-cache hit ends there, or all requests that pass it on the way to
their own (a shared prefix's checkpoint is then kept as the fallback of everything below it).
For a model without recurrent layers a "checkpoint" weighs nothing: every page where a later
hit ends is a hit point, held by its pages. A request whose own hit point was evicted hits the
deepest one still held on its path. Belady's rule is optimal for items of one size used at
known times; hit points here differ in size and share pages, so this is a strong reference
rather than a proven bound: an online policy can beat it on some traces.

`--eviction lru` keeps the first kind of foresight and drops the second: checkpoints only
where a later hit ends, evicted least recently used first (a hit point is used when a request
hits it or, counted on the path, passes it). It says how much of the ceiling comes from
knowing *which* content returns rather than *when*.
"""

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import replay_prefix_trace  # noqa: E402

from jaxengine.cache.block_hash import extend_hashes, root_hash  # noqa: E402

NEVER = 1 << 62


@dataclasses.dataclass(eq=False)
class _Node:
    parent: "_Node | None"
    uses: list[int]  # the requests that use it as a hit point, in order
    next_use: int = 0  # index into `uses`
    cached: bool = False  # its page is held
    below: int = 0  # checkpoints at or under it
    checkpoint: bool = False
    last_use: int = 0  # the request that last stored, hit or passed it

    def next_use_time(self, now: int) -> int:
        while self.next_use < len(self.uses) and self.uses[self.next_use] <= now:
            self.next_use += 1
        return self.uses[self.next_use] if self.next_use < len(self.uses) else NEVER


def hit_pages(inputs: Sequence[list[bytes]], stored: Sequence[list[bytes]]) -> list[int]:
    """Each request's hit in pages with an unlimited cache: the longest prefix of its hit-able
    pages (`inputs[j]`) that an earlier request stored."""
    seen: set[bytes] = set()
    hits = []
    for hashes, kept in zip(inputs, stored):
        d = 0
        while d < len(hashes) and hashes[d] in seen:
            d += 1
        hits.append(d)
        seen.update(kept)
    return hits


def clairvoyant(
    requests: list,
    *,
    page_size: int,
    checkpoint_blocks: int,
    page_blocks: int,
    budget_blocks: int,
    on_path: bool,
    eviction: str = "belady",
) -> list[int]:
    """Hit tokens of each request under the clairvoyant policy (see the module's docstring).
    `page_blocks` is 1 when pages take cache blocks (the model has attention layers), else 0.
    `on_path`: a hit point's uses are the requests that pass it on the way to their own
    (True), or only those whose hit ends there (False). `eviction`: "belady" (farthest next
    use first) or "lru" (least recently used first)."""
    root = root_hash(None)
    inputs, stored = [], []
    for r in requests:
        full = extend_hashes([], r.input_tokens + r.output_tokens, page_size, root)  # what a finished sequence leaves
        inputs.append(full[: (len(r.input_tokens) - 1) // page_size])
        stored.append(full)
    unlimited = hit_pages(inputs, stored)
    nodes: dict[bytes, _Node] = {}
    for hashes, d in zip(inputs, unlimited):
        if d:
            nodes.setdefault(hashes[d - 1], _Node(None, []))
    for j, (hashes, d) in enumerate(zip(inputs, unlimited)):
        for h in hashes[:d] if on_path else hashes[d - 1 : d]:
            if h in nodes:
                nodes[h].uses.append(j)
    checkpoints: set[_Node] = set()
    held = 0  # blocks
    hits = []
    for i, (hashes, kept) in enumerate(zip(inputs, stored)):
        # Look up: the deepest checkpoint held on the request's path.
        hit = next((d for d in range(len(hashes), 0, -1) if nodes.get(hashes[d - 1]) in checkpoints), 0)
        hits.append(hit * page_size)
        for h in hashes[:hit] if on_path else hashes[hit - 1 : hit]:  # its uses, counted as above
            nodes[h].last_use = i
        # Store: a checkpoint where later hits end, at each page boundary this request computed.
        parent = None
        for d, h in enumerate(kept, 1):
            node = nodes.get(h)
            if node is None:
                node = nodes[h] = _Node(parent, [])
            node.parent = parent
            parent = node
            if d > hit and node not in checkpoints and node.next_use_time(i) != NEVER:
                checkpoints.add(node)
                node.last_use = i
                held += checkpoint_blocks
                n = node
                while n is not None:
                    if not n.cached:
                        n.cached = True
                        held += page_blocks
                    n.below += 1
                    n = n.parent
        # Evict: farthest next use first, with the pages only it made reachable.
        if held > budget_blocks:
            if eviction == "belady":
                order = sorted(checkpoints, key=lambda n: n.next_use_time(i), reverse=True)
            else:
                order = sorted(checkpoints, key=lambda n: n.last_use)
            for node in order:
                if held <= budget_blocks:
                    break
                checkpoints.remove(node)
                held -= checkpoint_blocks
                n = node
                while n is not None:
                    n.below -= 1
                    if n.below == 0:
                        n.cached = False
                        held -= page_blocks
                    n = n.parent
    return hits


def best_hits(requests: list, eviction: str = "belady", **sizes: int) -> list[int]:
    """The clairvoyant's hits under whichever counting of uses hits more on this trace."""
    runs = [clairvoyant(requests, **sizes, on_path=on_path, eviction=eviction) for on_path in (False, True)]
    return max(runs, key=sum)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    replay_prefix_trace.add_trace_arguments(parser)
    parser.add_argument(
        "--eviction",
        choices=["belady", "lru"],
        default="belady",
        help="farthest next use first (the ceiling), or least recently used first",
    )
    args = parser.parse_args(argv)
    requests, cfg, s = replay_prefix_trace.trace_and_sizes(parser, args)
    start = time.perf_counter()
    hits = best_hits(
        requests,
        args.eviction,
        page_size=args.page_size,
        checkpoint_blocks=s.checkpoint_blocks,
        page_blocks=1 if s.kv_page_bytes else 0,
        budget_blocks=s.budget_blocks,
    )
    num_input = sum(len(r.input_tokens) for r in requests)
    result = {
        "requests": len(requests),
        "input_tokens": num_input,
        "hit_tokens": sum(hits),
        "token_hit_rate": sum(hits) / num_input,
        "seconds": time.perf_counter() - start,
    }
    print(
        f"clairvoyant token hit rate: {result['token_hit_rate']:.4f} ({sum(hits)} / {num_input}), "
        f"{len(requests)} requests, budget {s.budget_blocks} blocks of {s.block_bytes} B"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
