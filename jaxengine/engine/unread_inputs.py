"""Step inputs that no sequence of a step uses, filled once and kept on the devices.

Some inputs are read only when a sequence's settings ask for them: the penalties' token
histories ([S, max_model_len]) and the grammars' token masks ([S, vocab / 32]). A step in
which no sequence has a penalty (or a grammar) skips them on the device, so the batch builder
hands it the same read-only host array every time (`unread`), and the runner swaps that
array for its copy on the devices, made at its first use (`DeviceCopies`). Such a step
neither fills the input on the host nor sends it again: histories are 34 MB at 256 sequences
of 32 k tokens, which the host takes ~19 ms to fill and XLA:CPU ~6 ms per 8 MB to take in,
every step. Sent to another process of the engine (`multihost.Lockstep` pickles the step's
batch), such an array travels as its shape and fill and is that process's own array again.
"""

import dataclasses
from collections.abc import Callable

import jax
import numpy as np


class UnreadArray(np.ndarray):
    """A read-only int32 array of one value that a step does not read (see the module)."""

    def __reduce__(self):
        return unread, (self.shape, self.value)


_arrays: dict[tuple[tuple[int, ...], int], UnreadArray] = {}


def unread(shape: tuple[int, ...], fill: int) -> UnreadArray:
    """The unread array of `shape` filled with `fill`: the same object every time, in every
    engine of the process (it never changes)."""
    key = (tuple(shape), int(fill))
    array = _arrays.get(key)
    if array is None:
        array = np.full(key[0], key[1], np.int32).view(UnreadArray)
        array.value = key[1]
        array.setflags(write=False)
        _arrays[key] = array
    return array


class DeviceCopies:
    """A runner's device copies of the unread arrays its steps get."""

    def __init__(self):
        self._copies: dict[int, jax.Array] = {}  # id of an unread array -> its copy on the devices

    def swap(self, inputs, shardings: Callable[[], object]):
        """`inputs` (a dataclass of arrays) with each unread array replaced by its device
        copy, made the first time in its field's sharding in `shardings()` (a dataclass of
        the same fields: the step's expected input shardings)."""
        swapped = {
            name: self._copy(name, value, shardings)
            for name, value in vars(inputs).items()
            if isinstance(value, UnreadArray)
        }
        return dataclasses.replace(inputs, **swapped) if swapped else inputs

    def _copy(self, name: str, value: UnreadArray, shardings: Callable[[], object]) -> jax.Array:
        copy = self._copies.get(id(value))
        if copy is None:
            plain = value.view(np.ndarray)
            copy = jax.make_array_from_callback(plain.shape, getattr(shardings(), name), lambda index: plain[index])
            self._copies[id(value)] = copy
        return copy

    def delete(self) -> None:
        """Frees the copies (their runner is closing)."""
        for copy in self._copies.values():
            copy.delete()
        self._copies.clear()
