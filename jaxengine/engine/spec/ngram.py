"""ngram's proposer: prompt lookup over a sequence's own tokens, on the host."""


class NgramIndex:
    """Prompt lookup over one sequence's tokens, which only grow: the latest start of every
    n-gram (`lookup_min` <= n <= `lookup_max`) that ends before the last token, brought up to
    date at each lookup with the tokens appended since the one before, so a lookup costs a few
    dictionary operations per new token and per n instead of a scan of the whole sequence."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start
        self._num_ends = 0  # the n-grams ending at tokens[:_num_ends] are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The up to `k` tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` (between `lookup_min` and `lookup_max` tokens long); [] if none.
        `tokens` must extend those of the previous call."""
        last = len(tokens) - 1  # n-grams end before the last token
        for end in range(self._num_ends, last):
            for n in range(self.lookup_min, min(self.lookup_max, end + 1) + 1):
                self._starts[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self._num_ends = max(self._num_ends, last)
        if k < 1:
            return []
        for n in range(min(self.lookup_max, last), self.lookup_min - 1, -1):
            start = self._starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []
