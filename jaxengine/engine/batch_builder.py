"""Turns a scheduled step into the fixed-shape integer arrays the jitted step takes.

Shapes come from a small set of buckets so the step compiles once per bucket pair:
token buckets `T` (16, 32, ... up to and including `max_num_batched_tokens`) and sequence
buckets `S`. A decode step (one token per sequence) uses `T == S`; when speculating, a verify
step (every sequence's pending token and up to k drafts, no prefill) uses `T == S * (k + 1)`.
A step that verifies drafts, decode or mixed, samples k + 1 rows per sequence and keeps the
states after its draft positions; one that verifies none runs in a plain engine's shape.
With a drafter (an MTP module or a draft model), each shape that verifies no drafts comes
twice: with the drafter, for steps in which some sequence speculates, and without it, for the
others (a drafter skipped at run time would still cost its arguments and empty loops).
The checkpoints a step can store are part of its shape: a mixed step always has room for all
it may plan; a decode or verify step stores a few per sequence at most, and most store none,
so their shapes come in save buckets (0, 1, 4, ...) and a step pays only for the saves it has.
"""

import dataclasses
import math

import numpy as np

from jaxengine.cache import checkpoint_policy
from jaxengine.engine.device_inputs import ignored
from jaxengine.engine.padded_arrays import PaddedArrays
from jaxengine.engine.sampler import SamplingBatch
from jaxengine.engine.sampling_params import MAX_BAD_WORDS, MAX_STOP_TOKEN_IDS
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence_settings import SettingsRows
from jaxengine.engine.structured_output import fill_row
from jaxengine.models.batch import StepBatch


def token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest`, capped by and always including the budget."""
    buckets = []
    size = smallest
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_num_batched_tokens)
    return tuple(buckets)


def seq_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of four up to, and always including, `max_num_seqs`: few shapes to compile."""
    buckets = []
    size = 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 4
    buckets.append(max_num_seqs)
    return tuple(buckets)


def _fit(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One compiled step shape."""

    num_tokens: int
    num_seqs: int
    decode: bool  # every sequence advances from its live state by at most T // S tokens
    num_saves: int = 0  # checkpoints the step can store
    sample_width: int = 1  # tokens sampled per sequence: its last `sample_width` (verify steps)
    num_position_states: int = 0  # states after draft positions the step can write to live slots
    runs_drafter: bool = False  # the MTP module or draft model runs in it (some sequence speculates)

    @property
    def key(self) -> tuple[int, int, int, bool, int, bool]:
        """The runner's key of the shape's executable (`step_executables.ShapeKey`)."""
        return self.num_tokens, self.num_seqs, self.num_saves, self.decode, self.sample_width, self.runs_drafter

    @property
    def size(self) -> tuple[int, int, bool, int, int, int, bool]:
        """Orders shapes from the cheapest step to the dearest."""
        return (
            self.num_tokens,
            self.num_seqs,
            not self.decode,
            self.num_saves,
            self.sample_width,
            self.num_position_states,
            self.runs_drafter,
        )

    def covers(self, small: "Shape") -> bool:
        """Whether a step of shape `small` fits this one: no dimension smaller, and a decode
        step fits a mixed shape (a mixed step handles any tokens per sequence) but not the
        reverse (a verify shape is a decode shape with more tokens per sequence: a plain decode
        step fits it); a shape with the drafter fits a step without it (the drafter skips it at
        run time)."""
        return (
            self.num_tokens >= small.num_tokens
            and self.num_seqs >= small.num_seqs
            and self.num_saves >= small.num_saves
            and (self.decode == small.decode or not self.decode)
            and (not self.decode or self.num_tokens // self.num_seqs >= small.num_tokens // small.num_seqs)
            and self.sample_width >= small.sample_width
            and self.num_position_states >= small.num_position_states
            and self.runs_drafter >= small.runs_drafter
        )


def save_buckets(num_seqs: int) -> tuple[int, ...]:
    """0, then powers of four below `num_seqs`, then `num_seqs`: a decode step's save room."""
    return (0, *seq_buckets(num_seqs))


def bad_word_bans(output: list[int], words: list[list[int]]) -> list[int]:
    """The tokens the next draw may not be: the last token of each bad word whose other
    tokens end the output so far (a one-token word: always), as vLLM matches them."""
    return sorted({w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1 :] == w[:-1]})


class BatchBuilder:
    """Builds `StepBatch` and `SamplingBatch` arrays for scheduled steps."""

    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        page_size: int,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        blocks_per_checkpoint: int = 0,
        saves_checkpoints: bool = False,
        num_speculative_tokens: int = 0,
        recurrent: bool = False,
        drafter: bool = False,
    ):
        self.token_buckets = token_buckets(max_num_batched_tokens)
        self.seq_buckets = seq_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.blocks_per_checkpoint = blocks_per_checkpoint  # 0: no recurrent layers
        self.saves_checkpoints = saves_checkpoints  # prefix caching on a model with recurrent layers
        # Speculation: mixed steps verify drafts, sampling after each of a sequence's last
        # k + 1 tokens and, with recurrent layers, keeping the state after each draft position.
        self.num_speculative_tokens = num_speculative_tokens
        self.recurrent = recurrent
        self.drafter = drafter  # an MTP module or a draft model drafts inside the step
        self._padded_arrays: dict[Shape, PaddedArrays] = {}
        self._settings = SettingsRows(vocab_size)  # sampling parameters, seeds, prompt lengths

    def _verifying(self, s: int, verify: bool) -> dict:
        """A shape's room for drafts: a verify shape samples each sequence's last k + 1 rows
        and, with recurrent layers, keeps the states after its k draft positions."""
        if not verify:
            return {}
        k = self.num_speculative_tokens
        return dict(sample_width=k + 1, num_position_states=s * k if self.recurrent else 0)

    def _mixed(self, t: int, s: int, verify: bool, drafter: bool) -> Shape:
        return Shape(
            t, s, decode=False, num_saves=self._mixed_saves(t, s), runs_drafter=drafter, **self._verifying(s, verify)
        )

    def seq_bucket(self, num_seqs: int) -> int:
        """The sequence bucket a step of `num_seqs` sequences runs in."""
        return _fit(num_seqs, self.seq_buckets)

    def _decode(self, s: int, num_saves: int, verify: bool, drafter: bool) -> Shape:
        t = s * (self.num_speculative_tokens + 1) if verify else s
        return Shape(t, s, decode=True, num_saves=num_saves, runs_drafter=drafter, **self._verifying(s, verify))

    def _decode_saves(self, s: int, verify: bool) -> tuple[int, ...]:
        """The save buckets of decode (verify) shapes: a sequence's 1 (k + 1) tokens reach at
        most 1 (ceil((k + 1) / page_size)) page boundaries."""
        if not self.saves_checkpoints:
            return (0,)
        per_seq = math.ceil((self.num_speculative_tokens + 1) / self.page_size) if verify else 1
        return save_buckets(s * per_seq)

    def _mixed_saves(self, num_tokens: int, num_seqs: int) -> int:
        if not self.saves_checkpoints:
            return 0
        return checkpoint_policy.max_per_step(num_tokens, num_seqs, self.page_size)

    def shapes(self) -> list[Shape]:
        """Every shape a run can hit: mixed steps for each (T, S) pair that some batch can fill
        (at least one token per sequence), and decode steps for each S and save bucket; when
        speculating, each of them also as a verify shape; with a drafter, the verify shapes with
        it and the others both with and without it."""
        token_b, seq_b = self.token_buckets, self.seq_buckets
        variants = [(False, False)]  # (verify, runs_drafter)
        if self.num_speculative_tokens:
            variants += [(False, True), (True, True)] if self.drafter else [(True, False)]
        shapes = []
        for verify, drafter in variants:
            for t in token_b:
                for i, s in enumerate(seq_b):
                    fewest_seqs = seq_b[i - 1] + 1 if i else 1
                    if fewest_seqs <= t:
                        shapes.append(self._mixed(t, s, verify, drafter))
            for s in seq_b:
                for c in self._decode_saves(s, verify):
                    shapes.append(self._decode(s, c, verify, drafter))
        return shapes

    def shape_of(self, step: ScheduledStep) -> Shape:
        s = _fit(len(step.seqs), self.seq_buckets)
        verify = any(step.drafts)
        drafter = self.drafter and any(seq.speculates for seq in step.seqs)
        if step.is_decode:
            return self._decode(s, _fit(len(step.saves), self._decode_saves(s, verify)), verify, drafter)
        return self._mixed(_fit(step.total_tokens, self.token_buckets), s, verify, drafter)

    def _padded(self, shape: Shape) -> PaddedArrays:
        """The maker of `shape`'s arrays, each holding its padding (made at the shape's first
        step): name -> (shape, dtype, padding). The histories and grammar masks are not among
        them (a step that reads none gets an ignored array), nor the sequences' settings
        (`SettingsRows`)."""
        padded = self._padded_arrays.get(shape)
        if padded is not None:
            return padded
        t, s, p, c = shape.num_tokens, shape.num_seqs, shape.num_position_states, shape.num_saves
        drafting = t if shape.runs_drafter else 0
        i32 = np.int32
        nb = self.blocks_per_checkpoint
        specs = dict(
            ids=((t,), i32, 0),
            next_ids=((t,), i32, -1),
            following_ids=((drafting,), i32, -1),
            feed_rows=((t,), i32, -1),
            history_feed=((s,), i32, -1),
            cu=((s + 1,), i32, 0),
            kv_lens=((s,), i32, 0),
            page_table=((s, self.pages_per_seq), i32, 0),
            read=((s,), i32, 0),
            write=((s,), i32, 0),
            steps=((s,), i32, 0),
            history_lens=((s,), i32, 0),
            banned=((s, MAX_STOP_TOKEN_IDS), i32, -1),
            wants_drafts=((s if shape.runs_drafter else 0,), bool, False),
            speculates=((s if shape.runs_drafter else 0,), bool, False),
            bad_ids=((s, MAX_BAD_WORDS), i32, -1),
            constrained=((s,), bool, False),
            sample_rows=((s, shape.sample_width), i32, 0),
            num_drafts=((s,), i32, 0),
            state_seq=((p,), i32, 0),
            state_pos=((p,), i32, -1),
            state_slots=((p,), i32, 0),
            restore=((s, nb), i32, 0),
            save_seq=((c,), i32, 0),
            save_pos=((c,), i32, -1),
            save_blocks=((c, nb), i32, 0),
        )
        padded = self._padded_arrays[shape] = PaddedArrays(specs)
        return padded

    def empty(self, shape: Shape) -> tuple[StepBatch, SamplingBatch]:
        """An all-padding batch of `shape` (used for warm-up): touches only the null sinks."""
        return self.build(ScheduledStep([], []), shape)

    def build(
        self, step: ScheduledStep, shape: Shape | None = None, *, drafting: bool = False
    ) -> tuple[StepBatch, SamplingBatch]:
        """The step's arrays; `drafting`: its sequences may verify drafts in the next step.
        The drafter's inputs (`following_ids`, `wants_drafts`, `speculates`) are empty in a
        shape without it."""
        shape = shape or self.shape_of(step)
        s_size = shape.num_seqs
        drafter = shape.runs_drafter
        a = self._padded(shape).fresh()
        ids, next_ids, following_ids, feed_rows = a["ids"], a["next_ids"], a["following_ids"], a["feed_rows"]
        history_feed, cu, kv_lens, page_table = a["history_feed"], a["cu"], a["kv_lens"], a["page_table"]
        read, write = a["read"], a["write"]
        cu[len(step.seqs) :] = step.total_tokens  # padding sequences start (and end) past the step's tokens
        steps, history_lens = a["steps"], a["history_lens"]
        settings, penalised = self._settings.of(step.seqs, s_size)
        # Only penalties read the histories, and only grammars the masks: without one in the
        # step the device gets the same ignored array, so a step's host work grows neither
        # with its sequences' lengths nor with max_model_len.
        constrained_step = any(seq.matcher is not None for seq in step.seqs)
        if penalised:
            history = np.full((s_size, self.max_model_len), -1, np.int32)
        else:
            history = ignored((s_size, self.max_model_len), -1)
        banned, wants_drafts, speculates, bad_ids = a["banned"], a["wants_drafts"], a["speculates"], a["bad_ids"]
        mask_shape = (s_size, -(-self.vocab_size // 32))
        grammar_mask = np.zeros(mask_shape, np.int32) if constrained_step else ignored(mask_shape, 0)
        constrained, sample_rows, num_drafts = a["constrained"], a["sample_rows"], a["num_drafts"]
        width = shape.sample_width
        state_seq, state_pos, state_slots = a["state_seq"], a["state_pos"], a["state_slots"]

        offset = 0
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            start = seq.num_computed
            drafts = step.drafts_of(i)
            # Its tokens from the first this step computes (a verify step's: its pending token
            # and its drafts), never the whole sequence.
            ahead = seq.tokens[start:] + drafts
            known = ahead[:n]
            ids[offset : offset + len(known)] = known
            if len(known) < n:  # its last token: sampled by the step before, not read yet
                if seq.num_unfilled != 1 or drafts or len(known) != n - 1:
                    raise RuntimeError(f"sequence {seq.request_id}: tokens not read would be needed")
                feed_rows[offset + n - 1] = history_feed[i] = seq.feed_row
            if seq.params.prompt_logprobs is not None:  # each prompt token's log-probability, from the one before
                asked = range(start, min(start + n, seq.num_prompt_tokens - 1))
                next_ids[offset : offset + len(asked)] = ahead[1 : 1 + len(asked)]
            if drafter:
                known = seq.tokens[start + 1 : start + n + 1]  # not the drafts: their sample rows say what follows
                following_ids[offset : offset + len(known)] = known
            cu[i] = offset
            if width == 1:  # not a verify step: its last token's row
                sample_rows[i, 0] = offset + n - 1
            else:
                sample_rows[i] = offset + np.maximum(np.arange(n - width, n), 0)
            offset += n
            kv_lens[i] = start + n
            if seq.owned_slots:
                read[i], write[i] = seq.read_slot, seq.write_slot
            num_drafts[i] = len(drafts)
            for j, slot in enumerate(seq.position_slots[: len(drafts)] if self.recurrent and drafts else []):
                p = i * self.num_speculative_tokens + j  # sequence i's after its pending token and j drafts
                state_seq[p], state_pos[p], state_slots[p] = i, start + 1 + j, slot

            p = seq.params
            steps[i] = seq.num_sampled
            if penalised:
                history[i, : len(seq.tokens)] = seq.token_array()
                history[i, len(seq.tokens) : len(seq.tokens) + len(drafts)] = drafts
            history_lens[i] = seq.num_tokens
            if drafter:
                wants_drafts[i] = drafting and seq.speculates and not seq.bad_word_ids
                speculates[i] = seq.speculates
            if p.min_tokens and seq.num_sampled < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                banned[i, : len(stops)] = stops[:MAX_STOP_TOKEN_IDS]
            if seq.bad_word_ids:
                bans = bad_word_bans(seq.output_token_ids, seq.bad_word_ids)
                bad_ids[i, : len(bans)] = bans
            if seq.matcher is not None and seq.num_computed + n >= len(seq.tokens):  # it samples this step
                fill_row(seq.matcher, grammar_mask, i)
                constrained[i] = True

        if step.seqs:
            np.stack([seq.page_row(self.pages_per_seq) for seq in step.seqs], out=page_table[: len(step.seqs)])
        restore = a["restore"]
        for i, blocks in step.restores:
            restore[i] = blocks
        if len(step.saves) > shape.num_saves:
            raise RuntimeError(f"{len(step.saves)} checkpoint saves exceed the step's {shape.num_saves}")
        save_seq, save_pos, save_blocks = a["save_seq"], a["save_pos"], a["save_blocks"]
        for c, save in enumerate(step.saves):
            save_seq[c], save_pos[c], save_blocks[c] = save.seq_index, save.position, save.blocks
        batch = StepBatch(
            ids,
            cu,
            kv_lens,
            page_table,
            read,
            write,
            restore,
            save_seq,
            save_pos,
            save_blocks,
            state_seq,
            state_pos,
            state_slots,
        )
        sampling = SamplingBatch(
            **settings,
            steps=steps,
            history=history,
            history_lens=history_lens,
            banned=banned,
            bad_ids=bad_ids,
            grammar_mask=grammar_mask,
            constrained=constrained,
            sample_rows=sample_rows,
            num_drafts=num_drafts,
            next_ids=next_ids,
            following_ids=following_ids,
            wants_drafts=wants_drafts,
            speculates=speculates,
            feed_rows=feed_rows,
            history_feed=history_feed,
            history_ends=ignored((s_size,), -1),  # the device's (`sampler.fed`)
        )
        return batch, sampling
