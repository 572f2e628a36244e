"""Step inputs that a step ignores, filled once and kept on the devices.

Some inputs are read only when a sequence's settings ask for them: the penalties' token
histories ([S, max_model_len]) and the grammars' token masks ([S, vocab / 32]). A step in
which no sequence has a penalty (or a grammar) skips them on the device, so the batch builder
hands it the same read-only host array every time (`ignored`), and the runner swaps that
array for its copy on the devices, made at its first use in each sharding a step asks for
(`DeviceCopies`). Such a step neither fills the input on the host nor sends it again:
histories are 34 MB at 256 sequences of 32 k tokens, which the host takes ~19 ms to fill and
XLA:CPU ~6 ms per 8 MB to take in, every step. The host arrays live as long as the process
(one per shape and fill, shared by its engines); the device copies as long as their runner.
Sent to another process of the engine (`multihost.Lockstep` pickles the step's batch), such
an array travels as its shape and fill and is that process's own array again.
"""

import dataclasses
from collections.abc import Callable

import jax
import numpy as np


class IgnoredArray(np.ndarray):
    """A read-only int32 array of one value that a step ignores (see the module)."""

    def __reduce__(self):
        if _arrays.get((self.shape, getattr(self, "value", None))) is self:
            return ignored, (self.shape, self.value)
        return self.view(np.ndarray).__reduce__()  # a view or result of one: a plain array


_arrays: dict[tuple[tuple[int, ...], int], IgnoredArray] = {}
_ids: set[int] = set()  # of the arrays in `_arrays` (kept alive there, so never reused)


def ignored(shape: tuple[int, ...], fill: int) -> IgnoredArray:
    """The ignored array of `shape` filled with `fill`: the same object every time, in every
    engine of the process (it never changes)."""
    key = (tuple(shape), int(fill))
    array = _arrays.get(key)
    if array is None:
        array = np.full(key[0], key[1], np.int32).view(IgnoredArray)
        array.value = key[1]
        array.setflags(write=False)
        _arrays[key] = array
        _ids.add(id(array))
    return array


class DeviceCopies:
    """A runner's device copies of the ignored arrays its steps get, one per sharding."""

    def __init__(self):
        self._copies: dict[tuple[int, jax.sharding.Sharding], jax.Array] = {}

    def swap(self, inputs, shardings: Callable[[], object]):
        """`inputs` (a dataclass of arrays) with each ignored array replaced by its device
        copy in that field's sharding in `shardings()` (a dataclass of the same fields: the
        step's expected input shardings, which XLA chooses per executable; None for an input
        the executable dropped, which stays as it is), made the first time that array is
        asked for in that sharding."""
        names = [name for name, value in vars(inputs).items() if id(value) in _ids]
        if not names:
            return inputs
        expected = shardings()
        return dataclasses.replace(
            inputs, **{name: self._copy(getattr(inputs, name), getattr(expected, name)) for name in names}
        )

    def _copy(self, value: IgnoredArray, sharding: jax.sharding.Sharding | None) -> jax.Array | IgnoredArray:
        if sharding is None:  # an input the executable does not take at all (XLA dropped it)
            return value
        copy = self._copies.get((id(value), sharding))
        if copy is None:
            plain = value.view(np.ndarray)
            copy = jax.make_array_from_callback(plain.shape, sharding, lambda index: plain[index])
            self._copies[(id(value), sharding)] = copy
        return copy

    def delete(self) -> None:
        """Frees the copies (their runner is closing)."""
        for copy in self._copies.values():
            copy.delete()
        self._copies.clear()
