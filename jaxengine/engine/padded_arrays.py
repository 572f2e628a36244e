"""Fresh padded arrays of fixed shapes, made from one template per dtype.

A step's batch is ~40 small arrays, each starting as its padding value (0, 1 or -1). Made one
by one (`np.zeros`, `np.full`) they cost a few microseconds each, every step; here each step
copies one template per dtype that already holds every array's padding, and hands out views
of that copy: one allocation per dtype instead of one per array."""

import numpy as np


class PaddedArrays:
    """Makes fresh, writable arrays of the given shapes, dtypes and padding values."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], type, int | float]]):
        """`specs`: name -> (shape, dtype, padding value)."""
        self._groups: list[tuple[np.ndarray, list[tuple[str, int, int, tuple[int, ...]]]]] = []
        for dtype in dict.fromkeys(np.dtype(d) for _, d, _ in specs.values()):
            fields, parts, offset = [], [], 0
            for name, (shape, d, fill) in specs.items():
                if np.dtype(d) != dtype:
                    continue
                size = int(np.prod(shape))
                fields.append((name, offset, offset + size, tuple(shape)))
                parts.append(np.full(size, fill, dtype))
                offset += size
            self._groups.append((np.concatenate(parts), fields))

    def fresh(self) -> dict[str, np.ndarray]:
        """name -> a new array holding its padding (views of one new buffer per dtype)."""
        arrays = {}
        for template, fields in self._groups:
            buffer = template.copy()
            for name, start, stop, shape in fields:
                arrays[name] = buffer[start:stop].reshape(shape)
        return arrays
