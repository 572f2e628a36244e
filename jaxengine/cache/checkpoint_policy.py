"""Which recurrent-state checkpoints a step writes, and what each is worth to the cache.

A step that computes tokens `(start, end]` of a sequence can store the state after any page
boundary in that span: the scan produces it (see `pallas_kernels/ssd/reference.py`,
`ssd_states_at`). Three kinds of checkpoint come out of it:

* *Edges*, written whenever there is room at their priority:
    - the prompt end: the last boundary of what the sequence prefills that lies on the grain
      (below);
    - junctions: where known prefixes part along the request's path beyond its hit: where it
      leaves the paths earlier requests took, and where those paths branch, even if their
      pages were evicted (`prefix_shape.py`). A junction starts with as many uses as requests
      passed there;
    - trailing: each boundary on the grain a decoding sequence reaches (the latest one is
      where the next turn of a conversation resumes).
  Prompt ends and trailing edges carry the hit count the sequence inherited from the
  checkpoint it resumed from (1 for a fresh prefix), so a conversation that keeps coming back
  keeps its latest state. With dense retention a fresh prefix's prompt end starts as a
  candidate instead (the scheduler's `_hits`): most first turns never come back, and the
  prompt's rungs stay used below it, so until a request comes back to it (which makes it a
  junction) the prompt's tail above its top rung holds only room nothing used needs (2Q's
  probation for a prompt's tail: the heads of many prompts rather than a few whole ones).
* *Candidates* (hits 0) at the other boundaries on the grain, per the retention interval
  (vLLM's `prefix_cache_retention_interval`): `None` every one (dense), `0` none (sparse), `N`
  every N tokens (the user's choice, grain or not). They fill room nothing more valuable
  needs; a later request that diverges at one of them hits there, which raises it to a used
  checkpoint.
* *Rungs* (dense only): the candidates 1, 2, 4, 8, ... grains deep, a ladder along every
  prompt. A request that leaves a cached prompt where nobody left it before finds no
  junction there, and the candidates it passes are long gone (they rank below all used
  content); a rung at least half as deep as where it leaves is kept as a used checkpoint of
  its own kind (`reuse_model.RUNG`), ranked by how often rungs get hit. Like any
  checkpoint it is worth the compute it saves over the checkpoint above it (the rung half as
  deep) per byte its eviction frees, which while deeper checkpoints on its path stay is only
  its own (`hit_value.ModelCosts.checkpoint_value`). A prompt of n grains has about log2(n)
  of them.

The *grain* is the page multiple prefixes have been seen to part at (`divergence_grain.py`):
one page for traffic that parts anywhere, a block for traffic whose prefixes are equal only in
whole blocks, where a checkpoint off the block boundaries could never be hit.
"""

import enum
from collections.abc import Collection

from jaxengine.cache import reuse_model


class Kind(enum.Enum):
    CANDIDATE = "candidate"
    PROMPT = "prompt"
    JUNCTION = "junction"
    TRAILING = "trailing"
    RUNG = "rung"

    @property
    def origin(self) -> int:
        """The origin the eviction ranking learns reuse per (`reuse_model`): a candidate
        that a request hits has turned out to be where prefixes branch, like a junction
        (unless the request goes on past it along a cached path nothing branches from:
        `PrefixCache.record_hit`)."""
        return _ORIGINS[self]


_ORIGINS = {
    Kind.CANDIDATE: reuse_model.JUNCTION,
    Kind.PROMPT: reuse_model.PROMPT,
    Kind.JUNCTION: reuse_model.JUNCTION,
    Kind.TRAILING: reuse_model.TRAILING,
    Kind.RUNG: reuse_model.RUNG,
}


DENSE = None  # prefix_cache_retention_interval: every page boundary
SPARSE = 0  # edges only


def validate_interval(interval: int | None, page_size: int) -> None:
    """Raises ValueError unless `interval` is None, 0 or a positive multiple of the page size."""
    if interval is None:
        return
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0 or interval % page_size:
        raise ValueError(
            f"prefix_cache_retention_interval must be None (dense), 0 (sparse) or a positive multiple of "
            f"page_size={page_size}, got {interval!r}"
        )


def describe_interval(interval: int | None) -> str:
    if interval is DENSE:
        return "dense (a checkpoint candidate at every page boundary, a ladder of rungs along each prompt)"
    if interval == SPARSE:
        return "sparse (prompt ends, junctions and decode boundaries only)"
    return f"a checkpoint candidate every {interval} tokens"


def plan(
    start: int,
    end: int,
    *,
    page_size: int,
    interval: int | None,
    prefill_boundary: int,
    junctions: Collection[int] = (),
    grain: int = 1,
) -> list[tuple[int, Kind]]:
    """The checkpoints a step over tokens `(start, end]` of one sequence may write, in order.

    `grain` pages: where prefixes have been seen to part (`divergence_grain`). The prompt edge
    is the last multiple of it within `prefill_boundary`, trailing edges, dense candidates and
    rungs lie on its multiples; junctions and an interval's candidates lie where they lie."""
    out = []
    step = grain * page_size
    prompt_edge = prefill_boundary // step * step
    first = (start // page_size + 1) * page_size
    for pos in range(first, end + 1, page_size):
        if pos in junctions:
            out.append((pos, Kind.JUNCTION))
        elif pos == prompt_edge:
            out.append((pos, Kind.PROMPT))
        elif pos > prefill_boundary and pos % step == 0:
            out.append((pos, Kind.TRAILING))
        elif pos < prefill_boundary and interval is DENSE and _is_rung(pos, step):
            out.append((pos, Kind.RUNG))
        elif pos < prefill_boundary and (interval is DENSE and pos % step == 0 or interval and pos % interval == 0):
            out.append((pos, Kind.CANDIDATE))
    return out


def _is_rung(pos: int, step: int) -> bool:
    """A power-of-two multiple of `step` tokens."""
    grains, rest = divmod(pos, step)
    return not rest and grains & (grains - 1) == 0


def max_per_step(num_tokens: int, num_seqs: int, page_size: int) -> int:
    """The most checkpoints one step of `num_tokens` tokens over `num_seqs` sequences plans:
    a sequence's `n` tokens cross at most `n // page_size + 1` page boundaries."""
    return num_tokens // page_size + num_seqs
