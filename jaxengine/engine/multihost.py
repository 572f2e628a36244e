"""Many hosts: one engine over the devices of several processes, joined by jax.distributed.

Every process loads the model, holds its shards of the parameters and pools and compiles the
same steps; only process 0 schedules, keeps the prefix cache and takes requests. XLA's
collectives need every process in every step, so before each step process 0 sends the step's
host-built batch to the others (`Lockstep`), which run it on their shards. The batch travels
through the key-value store of jax.distributed's coordination service, host to host: a
broadcast over the devices would queue behind the step in flight, so process 0 could not
build and send step N + 1 while step N runs (async scheduling). Values process 0 decides
while setting up (`from_process_0`) go over the devices, where nothing is in flight yet.
The bytes are pickles: the processes of one engine trust each other.
"""

import itertools
import logging
import pickle
import socket
import time

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils

logger = logging.getLogger("jaxengine")

_joined: tuple[str, int, int] | None = None  # (address, processes, rank) this process joined with
WAIT_MS = 1000  # a follower's wait for process 0's next call, renewed until it comes
_engines = itertools.count()  # the engines (Locksteps) this process created


def join(address: str, num_nodes: int, node_rank: int, timeout_s: int) -> None:
    """Joins this process to the others (the engine arguments distributed_init_addr,
    num_nodes, node_rank). Must run before anything in the process touches a device.
    A process other than 0 that reaches nothing at `address` within `timeout_s` raises
    TimeoutError; a process the others do not join within it is stopped by JAX's
    coordination service, with its message."""
    global _joined
    if _joined == (address, num_nodes, node_rank):
        return
    if _joined is not None:
        raise ValueError(
            f"engine arguments distributed_init_addr={address!r}, num_nodes={num_nodes}, "
            f"node_rank={node_rank}: this process joined as {_joined} already"
        )
    if node_rank > 0:
        _wait_for(address, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # XLA:CPU's collectives across processes
    logger.info(
        "node %d of %d: joining %s (waiting up to %d s for the others)", node_rank, num_nodes, address, timeout_s
    )
    try:
        jax.distributed.initialize(
            address,
            num_nodes,
            node_rank,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=timeout_s,
            shutdown_timeout_seconds=timeout_s,
        )
    except RuntimeError as err:  # JAX was in use already, or joined by other means
        raise ValueError(f"engine argument num_nodes={num_nodes}: {err}") from None
    _joined = (address, num_nodes, node_rank)


def _wait_for(address: str, timeout_s: int) -> None:
    """Returns once something listens at `address` ("host:port"), or raises TimeoutError."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine argument distributed_init_addr={address!r}: nothing answered there within "
                    f"distributed_timeout_s={timeout_s} s; is process 0 (node_rank=0) running?"
                ) from None
            time.sleep(0.2)


class Lockstep:
    """Process 0's calls on its model runner, made on every other process's runner too.

    Call n of the process's e-th engine travels under the key `jaxengine/lockstep/<e>/<process>/<n>`
    once for each other process, which reads and deletes it: the store holds only calls not run
    yet. Every process creates its engines in the same order (the same script), so their
    numbers agree."""

    def __init__(self):
        self.leading = jax.process_count() > 1 and jax.process_index() == 0
        self.stopped = False  # process 0 said there are no more steps
        self.calls = 0  # sent (process 0) or received (the others)
        self.engine = next(_engines)
        if jax.process_count() > 1 and distributed.global_state.client is None:
            raise RuntimeError(
                "several processes but no jax.distributed client: join them with the engine arguments "
                "distributed_init_addr / num_nodes / node_rank, or jax.distributed.initialize()"
            )

    def send(self, method: str, *args) -> None:
        """On process 0 of several: tells the others to call `runner.<method>(*args)` (before
        process 0 calls it itself), without waiting for the device. Elsewhere nothing."""
        if not self.leading or self.stopped:
            return
        data = pickle.dumps((method, args))
        try:
            for process in range(1, jax.process_count()):
                distributed.global_state.client.key_value_set_bytes(_key(self.engine, process, self.calls), data)
        except jax.errors.JaxRuntimeError as err:  # the coordination service lost a process
            self.stopped = True
            raise ConnectionError(f"process 0 lost the other processes of the engine (one stopped?): {err}") from err
        self.calls += 1

    def stop(self) -> None:
        """On process 0 of several: releases the others from `follow` (no more steps)."""
        try:
            self.send("")
        except ConnectionError as err:
            logger.warning("%s", err)
        self.stopped = True

    def follow(self, runner) -> int:
        """On a process other than 0: makes process 0's runner calls on `runner` until process
        0 stops; returns how many it made."""
        made = 0
        while not self.stopped:
            method, args = pickle.loads(self._receive())
            if method:
                getattr(runner, method)(*args)
                made += 1
            else:
                self.stopped = True
        return made

    def _receive(self) -> bytes:
        """Process 0's next call, waiting for as long as process 0 lives."""
        key = _key(self.engine, jax.process_index(), self.calls)
        client = distributed.global_state.client
        while True:
            try:
                data = client.blocking_key_value_get_bytes(key, WAIT_MS)
                client.key_value_delete(key)
                break
            except jax.errors.JaxRuntimeError as err:
                if "DEADLINE_EXCEEDED" in str(err):  # no call yet: process 0 is idle
                    continue
                self.stopped = True
                raise ConnectionError(f"process {jax.process_index()} lost process 0 of the engine: {err}") from err
        self.calls += 1
        return data


def _key(engine: int, process: int, call: int) -> str:
    return f"jaxengine/lockstep/{engine}/{process}/{call}"


def from_process_0(value):
    """Process 0's `value` (anything picklable) on every process; `value` itself with one."""
    if jax.process_count() == 1:
        return value
    return pickle.loads(_broadcast(pickle.dumps(value) if jax.process_index() == 0 else b""))


def _broadcast(data: bytes) -> bytes:
    """Process 0's `data` on every process: its length, then its bytes padded to a power of
    two (a few compiled broadcast shapes, not one per length)."""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buffer = np.zeros(1 << max(size - 1, 0).bit_length(), np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size].tobytes()
