"""The text of an unfinished output, decoded a few tokens at a time.

A streamed output is looked at after every step, and decoding its whole output each time is
host work that grows with the output (200 µs at 1,000 tokens with the default model's
tokenizer, per stream and step). `TextSoFar` keeps the text of the tokens it last saw and
decodes only a window: the last `WINDOW` tokens it had, with those added since (an output of
up to `WHOLE_UP_TO` tokens is decoded whole, which costs no more). Decoding is local — a token's characters depend on it and its near neighbours only (a character cut into
byte tokens, a leading space stripped, spaces cleaned up around punctuation) — so past its
first few characters the window's text before and after the new tokens is the whole text's
tail before and after them. Where the two windows agree on too little, or the kept text does
not end as the old window does, or the last tokens seen are not where they were (a list cut
or replaced), it decodes the whole output instead.
"""

from collections.abc import Callable

WINDOW = 32  # tokens decoded again with those appended
WHOLE_UP_TO = 4 * WINDOW  # tokens decoded whole: as cheap as two windows
MIN_AGREED = 16  # characters the two windows must share first: clear of the window's start


class TextSoFar:
    """The decoded text of a list of tokens that grows by appends (see the module)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode  # the whole-text decoder: token ids -> text
        self._tokens: list[int] = []  # a copy of the last `WINDOW` tokens seen
        self._count = 0  # tokens seen
        self._text = ""  # their text

    def of(self, tokens: list[int]) -> str:
        """The text `tokens` decode to: `decode(tokens)`, from the window where it can be."""
        n = len(tokens)
        seen = self._tokens
        start = self._count - len(seen)
        if n <= WHOLE_UP_TO or n < self._count or n - self._count > WINDOW or tokens[start : self._count] != seen:
            return self._remember(tokens, self._decode(tokens))
        if n == self._count:
            return self._text
        old = self._decode(seen)
        new = self._decode(seen + tokens[self._count :])
        agreed = _common_prefix(old, new)
        if agreed < MIN_AGREED or not self._text.endswith(old[agreed:]):
            return self._remember(tokens, self._decode(tokens))
        text = self._text[: len(self._text) - (len(old) - agreed)] + new[agreed:]
        return self._remember(tokens, text)

    def _remember(self, tokens: list[int], text: str) -> str:
        self._tokens = tokens[-WINDOW:]
        self._count = len(tokens)
        self._text = text
        return text


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (a binary search over slices,
    compared at C speed)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
