"""From sampled tokens to a request's output: stops, log-probabilities, text."""

import functools

import numpy as np

from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.engine.sampler import PromptLogprobs
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence import Sequence, Status
from jaxengine.engine.text_so_far import TextSoFar


class OutputProcessor:
    """Appends what a step sampled to its sequences' outputs, as vLLM's output processing does:
    whether a token ends a sequence (stop token ids, EOS, stop strings, lengths), each token's
    `Logprob` entries, and the detokenized text cut at a matched stop string."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer  # None: token ids only
        self.eos_token_ids = eos_token_ids

    def append(self, seq: Sequence, token: int, row_logprobs: tuple | None) -> None:
        """Appends a sampled token and, if asked, its log-probability entries; sets the
        finish reason if it ends the sequence. `row_logprobs`: (chosen logprob, rank,
        top ids [N], top logprobs [N]) of its sample row. A sequence that follows a grammar
        advances its matcher; where the grammar allowed no token at all the drawn one is
        dropped and the sequence ends (finish reason "abort", the grammar's error as stop
        reason); where the grammar is complete it ends ("stop")."""
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            seq.finish_reason = "abort"
            seq.stop_reason = f"structured output: {seq.matcher.get_error() or 'no token allowed'}"
            return
        seq.tokens.append(token)
        if seq.params.logprobs is not None:
            chosen, rank, top_ids, top_lp = row_logprobs
            top = zip(top_ids[: seq.params.logprobs], top_lp)
            seq.logprobs.append(self._entries(seq, token, float(chosen), int(rank), top))
            seq.cumulative_logprob += float(chosen)
        self._check_finished(seq, token)
        if seq.finish_reason is None and seq.matcher is not None and seq.matcher.is_stopped():
            seq.finish_reason = "stop"

    def record_prompt_logprobs(self, scheduled: ScheduledStep, prompt: PromptLogprobs, starts: list[int]) -> None:
        """Appends the Logprob entries of the prompt tokens this step's chunks predict (the
        tokens after the ones they compute, from `starts[i]` on), for the sequences that asked."""
        lp, rank, top_lp, top_ids = (
            np.asarray(a) for a in (prompt.logprob, prompt.rank, prompt.top_logprobs, prompt.top_ids)
        )
        offset = 0
        for seq, n, start in zip(scheduled.seqs, scheduled.num_tokens, starts):
            k = seq.params.prompt_logprobs
            for q in range(start, min(start + n, seq.num_prompt_tokens - 1)) if k is not None else ():
                if len(seq.prompt_logprobs) == q + 1:  # else recorded before a preemption
                    t = offset + q - start
                    top = zip(top_ids[t, :k], top_lp[t, :k])
                    seq.prompt_logprobs.append(self._entries(seq, seq.tokens[q + 1], float(lp[t]), int(rank[t]), top))
            offset += n

    def _entries(self, seq: Sequence, token: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        """One position's Logprob entries: the chosen (or prompt) token first, then the top N."""
        entry = {token: Logprob(logprob, rank, self._token_text(seq, token))}
        for r, (t, lp) in enumerate(top, start=1):
            entry.setdefault(int(t), Logprob(float(lp), r, self._token_text(seq, int(t))))
        return entry

    def _token_text(self, seq: Sequence, token: int) -> str | None:
        if self.tokenizer is None or not seq.params.detokenize:
            return None
        return self.tokenizer.decode([token])

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if p.stop and self.tokenizer is not None and self._may_end_a_stop(seq):
                text = self._full_text(seq)
                found = [(at, s) for s in p.stop if (at := text.find(s)) >= 0]
                if found:
                    at, stop = min(found)
                    seq.stop_text_cut = at + len(stop) if p.include_stop_str_in_output else at
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = "length"

    def _may_end_a_stop(self, seq: Sequence) -> bool:
        """Whether the token just appended may complete one of the sequence's stop strings,
        found from the text of its last few tokens rather than its whole output (which grows
        with every token; the whole text is decoded only when this says yes).

        The text before this token held no stop string (it was checked after every token since
        `min_tokens`), so a new one ends in what this token changed: its own characters and, at
        most, a character its bytes completed. A character spans at most 4 tokens (one a UTF-8
        byte), so a stop string of L characters lies within the last 4 L + 8 tokens, clear of
        the window's first characters, where decoding alone can differ from the whole text
        (a stripped leading space, a character cut in two). The first check after
        `min_tokens` looks at the whole output, as a stop string may lie anywhere in it."""
        p = seq.params
        first_check = seq.num_output_tokens - 1 < p.min_tokens
        start = seq.num_prompt_tokens
        if not first_check:
            start = max(start, len(seq.tokens) - 4 * max(map(len, p.stop)) - 8)
        text = self.tokenizer.decode(seq.tokens[start:], skip_special_tokens=p.skip_special_tokens)
        return any(stop in text for stop in p.stop)

    def _full_text(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def decode(self, seq: Sequence) -> str:
        """The output text so far, cut at a matched stop string ("" without detokenizing). An
        unfinished output's is decoded a window at a time (`TextSoFar`): streams ask for it
        after every step."""
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        if seq.finish_reason is None:
            if seq.text_so_far is None:
                decode = functools.partial(self.tokenizer.decode, skip_special_tokens=seq.params.skip_special_tokens)
                seq.text_so_far = TextSoFar(decode)
            return seq.text_so_far.of(seq.output_token_ids)
        text = self._full_text(seq)
        return text if seq.stop_text_cut is None else text[: seq.stop_text_cut]

    def completion(self, seq: Sequence) -> CompletionOutput:
        """One sample's output so far."""
        metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions)
        wants_logprobs = seq.params.logprobs is not None
        return CompletionOutput(
            index=seq.sample,
            text=self.decode(seq) if self.tokenizer is not None else None,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=seq.logprobs if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            metrics=metrics,
        )

    def output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of one prompt from its samples (sample 0 first)."""
        first = samples[0]
        outputs = [self.completion(s) for s in samples]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.tokens[: first.num_prompt_tokens],
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            outputs=outputs,
            finished=all(s.status is Status.FINISHED for s in samples),
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=outputs[0].metrics,
        )
