"""Step inputs kept on the devices instead of sent with every step.

A step takes ~40 small host-built arrays (`StepBatch`, `SamplingBatch`), and each host array
handed to a step is a separate transfer when the step is called. Most of them do not change
from one decode step to the next (sampling settings, the slots, sample rows, a page table
between page boundaries), so the runner keeps its last device copy of each and hands that
copy to the step while the builder's array holds the same bytes (`DeviceInputs`), as vLLM's
persistent batch and SGLang's do with their input buffers: a steady decode step sends only
what moved (positions, the index of the token drawn).

Some inputs are read only when a sequence's settings ask for them: the penalties' token
histories ([S, max_model_len]) and the grammars' token masks ([S, vocab / 32]). A step in
which no sequence has a penalty (or a grammar) skips them on the device, so the batch builder
hands it the same read-only host array every time (`ignored`), and the runner swaps that
array for its copy on the devices, made at its first use in each sharding a step asks for.
Such a step neither fills the input on the host nor compares or sends it: histories are 34 MB
at 256 sequences of 32 k tokens, which the host takes ~19 ms to fill and XLA:CPU ~6 ms per
8 MB to take in, every step. The host arrays live as long as the process (one per shape and
fill, shared by its engines); the device copies as long as their runner. Sent to another
process of the engine (`multihost.Lockstep` pickles the step's batch), such an array travels
as its shape and fill and is that process's own array again.
"""

import dataclasses
from collections.abc import Callable
from copy import copy as shallow_copy

import jax
import numpy as np

# Inputs larger than this are sent with their step whenever they are not ignored arrays:
# comparing them costs about what sending them does, and keeping them costs device memory.
MAX_KEPT_BYTES = 1 << 20


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


@dataclasses.dataclass
class _Kept:
    """The last bytes a step got for one input (field, shape, dtype, sharding), and their
    device copy once a second step got the same (None until then)."""

    data: bytes
    copy: jax.Array | None = None


class DeviceInputs:
    """A runner's device copies of step inputs: each ignored array's, one per sharding, and
    each other input's last value, per field, shape and sharding (see the module)."""

    def __init__(self):
        self._ignored: dict[tuple[int, jax.sharding.Sharding], jax.Array] = {}
        self._kept: dict[tuple, _Kept] = {}

    def swap(self, inputs, shardings: Callable[[], object]):
        """`inputs` (a dataclass of arrays) with each ignored array replaced by its device
        copy, and each other host array by the copy of its previous value where it holds the
        same bytes, in that field's sharding in `shardings()` (a dataclass of the same fields:
        the step's expected input shardings, which XLA chooses per executable; None for an
        input the executable dropped, which stays as it is). A changed input goes with its
        step and is kept on the host; its copy is made the second time it comes unchanged,
        so that inputs that change every step are never copied twice."""
        expected = None
        swapped = {}
        for name, value in vars(inputs).items():
            if not isinstance(value, np.ndarray):
                continue  # already on the devices
            if expected is None:
                expected = shardings()
            sharding = getattr(expected, name)
            if sharding is None:  # an input the executable does not take at all (XLA dropped it)
                continue
            if id(value) in _ids:
                swapped[name] = self._ignored_copy(value, sharding)
            elif value.nbytes <= MAX_KEPT_BYTES:
                copy = self._kept_copy(name, value, sharding)
                if copy is not None:
                    swapped[name] = copy
        if not swapped:
            return inputs
        # A shallow copy with the copies in place: `dataclasses.replace` would run the
        # dataclass's __init__ again, which costs a step more than the rest of this together.
        inputs = shallow_copy(inputs)
        vars(inputs).update(swapped)
        return inputs

    def _ignored_copy(self, value: IgnoredArray, sharding: jax.sharding.Sharding) -> jax.Array:
        copy = self._ignored.get((id(value), sharding))
        if copy is None:
            copy = self._ignored[(id(value), sharding)] = _device_copy(value.view(np.ndarray), sharding)
        return copy

    def _kept_copy(self, name: str, value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array | None:
        """The device copy of `value` if the last step given this input had the same bytes."""
        key = (name, value.shape, value.dtype, sharding)
        data = value.tobytes()
        kept = self._kept.get(key)
        if kept is None or kept.data != data:
            self._kept[key] = _Kept(data)  # changed: it goes with the step
            return None
        if kept.copy is None:
            # Its own bytes: on CPU the device array may share the host array's memory, and
            # `value` is a view of the buffer that holds all its step's arrays.
            kept.copy = _device_copy(value.copy(), sharding)
        return kept.copy

    def delete(self) -> None:
        """Frees the copies (their runner is closing)."""
        for copy in [*self._ignored.values(), *(kept.copy for kept in self._kept.values())]:
            if copy is not None:
                copy.delete()
        self._ignored.clear()
        self._kept.clear()


def _device_copy(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """`value` on the devices in `sharding` (each process places its own shards)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
