"""An int32 array that follows a Python list of ints, converting only what was appended."""

import numpy as np


class Int32Mirror:
    """Mirrors a list that is only ever appended to, or replaced by another list: each call
    converts the items appended since the last one, so following a growing sequence's tokens
    or pages costs the host work of what is new, not of the whole list (a step's host work
    must not grow with context). A replaced or shortened list is converted again whole.
    With a `width`, the array is that long: the items, then zeros (a page table's row)."""

    def __init__(self, width: int | None = None):
        self._width = width
        self._list: list[int] | None = None
        self._array = np.zeros(width or 0, np.int32)
        self._count = 0  # leading items of `_list` in `_array`

    def of(self, items: list[int]) -> np.ndarray:
        """`items` as an int32 array ([len(items)], or [width] zero-padded): a view, valid
        until the next call."""
        n = len(items)
        if items is not self._list or n < self._count:
            if self._width is not None:
                self._array[: self._count] = 0  # the padding past the new items
            self._list, self._count = items, 0
        if n > len(self._array):
            if self._width is not None:
                raise ValueError(f"{n} items do not fit a mirror of width {self._width}")
            grown = np.zeros(max(n, 2 * len(self._array)), np.int32)
            grown[: self._count] = self._array[: self._count]
            self._array = grown
        self._array[self._count : n] = items[self._count : n]
        self._count = n
        return self._array if self._width is not None else self._array[:n]
