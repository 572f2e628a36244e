"""The per-sequence inputs of a step that never change while a sequence runs: its sampling
parameters, seed and prompt length.

A steady decode step runs the same sequences in the same order as the step before, so these
arrays are the same too. `SettingsRows` keeps the last ones it built per sequence bucket, with
the sequences they were built for, and hands them out again while those are a step's
sequences (as vLLM's persistent batch keeps its rows between steps), instead of storing
fourteen values per sequence every step. The arrays are read-only once built (a step with
other sequences gets new ones), so several steps can hold them at once, and the runner's
`DeviceInputs` finds them unchanged and sends none of them. A bucket's last sequences are
held until a step of that bucket runs others (or the builder goes with its engine).
"""

import numpy as np

from jaxengine.engine.padded_arrays import PaddedArrays
from jaxengine.engine.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS, SamplingParams
from jaxengine.engine.sequence import Sequence

# name -> (row shape after the sequence axis, dtype, padding): the `SamplingBatch` fields held.
ROWS = dict(
    temperature=((), np.float32, 0),
    top_k=((), np.int32, 0),
    top_p=((), np.float32, 1),
    min_p=((), np.float32, 0),
    presence_penalty=((), np.float32, 0),
    frequency_penalty=((), np.float32, 0),
    repetition_penalty=((), np.float32, 1),
    seeds=((), np.uint32, 0),
    prompt_lens=((), np.int32, 0),
    min_tokens=((), np.int32, 0),
    wants_logprobs=((), bool, False),
    bias_ids=((MAX_LOGIT_BIAS,), np.int32, -1),
    bias_values=((MAX_LOGIT_BIAS,), np.float32, 0),
    allowed_ids=((MAX_ALLOWED_TOKEN_IDS,), np.int32, -1),
)


class SettingsRows:
    """A batch builder's settings arrays, kept per sequence bucket (see the module)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._padded: dict[int, PaddedArrays] = {}
        # sequence bucket -> (the sequences, their arrays, whether any counts its history)
        self._last: dict[int, tuple[list[Sequence], dict[str, np.ndarray], bool]] = {}

    def of(self, seqs: list[Sequence], num_seqs: int) -> tuple[dict[str, np.ndarray], bool]:
        """The arrays ([num_seqs, ...] each, padding past `seqs`) of `ROWS` for `seqs`, and
        whether any of them has a penalty (reads its token history)."""
        last = self._last.get(num_seqs)
        if last is not None and len(last[0]) == len(seqs) and all(a is b for a, b in zip(last[0], seqs)):
            return last[1], last[2]
        arrays = self._build(seqs, num_seqs)
        penalised = any(is_penalised(seq.params) for seq in seqs)
        self._last[num_seqs] = (list(seqs), arrays, penalised)
        return arrays, penalised

    def _build(self, seqs: list[Sequence], num_seqs: int) -> dict[str, np.ndarray]:
        padded = self._padded.get(num_seqs)
        if padded is None:
            padded = self._padded[num_seqs] = PaddedArrays(
                {name: ((num_seqs, *row), dtype, fill) for name, (row, dtype, fill) in ROWS.items()}
            )
        a = padded.fresh()
        for i, seq in enumerate(seqs):
            p = seq.params
            a["temperature"][i] = p.temperature
            a["top_k"][i] = min(max(p.top_k, 0), self.vocab_size)  # 0: no limit; above the vocabulary: none either
            a["top_p"][i] = p.top_p
            a["min_p"][i] = p.min_p
            a["presence_penalty"][i] = p.presence_penalty
            a["frequency_penalty"][i] = p.frequency_penalty
            a["repetition_penalty"][i] = p.repetition_penalty
            a["seeds"][i] = seq.seed
            a["prompt_lens"][i] = seq.num_prompt_tokens
            a["min_tokens"][i] = p.min_tokens
            a["wants_logprobs"][i] = p.logprobs is not None
            if p.logit_bias:
                a["bias_ids"][i, : len(p.logit_bias)] = list(p.logit_bias)
                a["bias_values"][i, : len(p.logit_bias)] = np.clip(list(p.logit_bias.values()), -100, 100)
            if p.allowed_token_ids:
                a["allowed_ids"][i, : len(p.allowed_token_ids)] = p.allowed_token_ids
        for array in a.values():
            array.setflags(write=False)
        return a


def is_penalised(params: SamplingParams) -> bool:
    """Whether a sequence's sampling counts its history: the host's side of the condition
    under which `sampler._choose` applies penalties (the two must agree, or a history the
    device reads is left empty)."""
    return params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0
