"""What a request's samples gained since they were last looked at: the unit of streaming."""

from jaxengine.engine.outputs import StreamOutput
from jaxengine.engine.sequence import Sequence, Status


class Increments:
    """Per sample of some requests, the tokens, text and log-probabilities added since the
    last look, and with a sample's last increment its whole output. Read where the engine
    is not stepping (under its lock): `generate_stream` and the serving loop both use it."""

    def __init__(self, engine, seqs: list[Sequence]):
        self.engine = engine
        self.seqs = seqs
        self._sent_tokens = [0] * len(seqs)
        self._sent_text = [""] * len(seqs)
        self._reported = [False] * len(seqs)

    @property
    def done(self) -> bool:
        """Whether every sample's last increment was taken."""
        return all(self._reported)

    def take(self, limit: int | None = None) -> list[StreamOutput]:
        """The increments of the samples with news (at most `limit`), in sample order."""
        events = []
        for i, seq in enumerate(self.seqs):
            if limit is not None and len(events) == limit:
                break
            if self._reported[i]:
                continue
            finished = seq.status is Status.FINISHED
            start = self._sent_tokens[i]
            new_tokens = seq.output_token_ids[start:]
            if not new_tokens and not finished:
                continue
            text = self.engine.decode(seq) if finished else _settled(self.engine.decode(seq), seq.params.stop)
            sent = self._sent_text[i]
            grows = text.startswith(sent)  # else decoding changed what was sent: wait for more
            self._sent_tokens[i] += len(new_tokens)
            self._sent_text[i] = text if grows else sent
            self._reported[i] = finished
            wants_logprobs = seq.params.logprobs is not None
            events.append(
                StreamOutput(
                    seq.index,
                    seq.request_id,
                    new_tokens,
                    text[len(sent) :] if grows else "",
                    finished,
                    self.engine.output([seq]) if finished else None,
                    seq.sample,
                    seq.logprobs[start : start + len(new_tokens)] if wants_logprobs else None,
                )
            )
        return events


def _settled(text: str, stops: tuple[str, ...]) -> str:
    """The part of an unfinished sample's text that later tokens cannot change: without a
    trailing character still being decoded (U+FFFD) or the start of a stop string it may
    yet complete (held back, as vLLM does, until the match is decided)."""
    text = text.rstrip("\ufffd")
    hold = max((len(s) for s in stops), default=1) - 1
    return text[: len(text) - hold] if hold else text
