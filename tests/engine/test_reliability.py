"""The engine survives its callers: faults at every point of a step, interrupts, threads,
abandoned streams and bad parameters leave it consistent, idle and giving the tokens a fresh
engine gives."""

import gc
import math
import random
import signal
import threading
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams
from jaxengine.engine.caller_lock import CallerLock
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.scheduler import Scheduler
from tests.models.tiny_models import VOCAB_SIZE, random_prompt, save_tiny_model
from tests.property_examples import examples

ARGS = dict(
    max_model_len=128, page_size=4, max_num_seqs=8, max_num_batched_tokens=32, warm_up=False, compilation_cache_dir=None
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
# A workload that prefills in chunks, decodes, shares prefixes (hits) and mixes sampling.
SHARED = random_prompt(30, 1)
WORKLOAD = [SHARED + random_prompt(9, 2), random_prompt(50, 3), SHARED + random_prompt(4, 4), random_prompt(3, 5)]
PARAMS = [GREEDY, SEEDED, GREEDY, SEEDED]
PROBE = [SHARED + random_prompt(7, 6), random_prompt(20, 7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bamba")
    save_tiny_model("bamba", path)
    return path


@pytest.fixture(scope="module")
def expected(model_dir):
    """What a fresh engine gives for the workload and the probe."""
    fresh = LLM(model_dir, **ARGS)
    return _tokens(fresh, WORKLOAD, PARAMS), _tokens(fresh, PROBE, [GREEDY, SEEDED])


@pytest.fixture(autouse=True)
def python_ctrl_c():
    """Ctrl-C as a user's Python has it (`KeyboardInterrupt`), whatever a test run in this
    process before left as the SIGINT handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def llm(model_dir):
    """One engine for the whole module: every test leaves it sound, so faults pile up on it."""
    return LLM(model_dir, **ARGS)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_sound(llm: LLM, expected_probe) -> None:
    """Nothing held, nothing leaked, bookkeeping consistent, pools alive, and a fresh engine's tokens."""
    engine = llm.engine
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and not engine.requests
    sched.check_invariants()
    assert sched.cache.pool.num_referenced == 0 and not sched.cache.pending
    assert all(c.pins == 0 for c in sched.cache.checkpoints.values())
    if sched.slots is not None:
        assert not sched.slots.in_use
    assert not engine.runner.pools_lost()
    assert _tokens(llm, PROBE, [GREEDY, SEEDED]) == expected_probe


class Boom(Exception):
    pass


def _fail_on_call(monkeypatch, owner, name: str, k: int, *, after: bool = False, exc=Boom) -> dict:
    """Makes `owner.name` raise `exc` on its k-th call (after running it, with `after`)."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == k and not after:
            raise exc("injected")
        result = real(*args, **kwargs)
        if calls["n"] == k:
            raise exc("injected")
        return result

    monkeypatch.setattr(owner, name, wrapped)
    return calls


def _runner_points(llm: LLM) -> dict:
    runner = llm.engine.runner
    return {
        "before the device step": (runner, "sample", False),
        "after the device step took the pools": (runner, "run_executable", True),
    }


POINTS = [
    "schedule",
    "build",
    "before the device step",
    "after the device step took the pools",
    "update mid-way",
    "token handling",
]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_fault_at_any_point_of_a_step_leaves_the_engine_sound(llm, expected, monkeypatch, point, k):
    owners = {
        "schedule": (llm.engine.scheduler, "schedule", False),
        "build": (llm.engine.builder, "build", False),
        "update mid-way": (llm.engine.scheduler, "_register_pages", False),
        "token handling": (llm.engine.outputs, "append", False),
        **_runner_points(llm),
    }
    owner, name, after = owners[point]
    calls = _fail_on_call(monkeypatch, owner, name, k, after=after)
    with pytest.raises(Boom):
        llm.generate(WORKLOAD, PARAMS, use_tqdm=False)
    assert calls["n"] >= k
    monkeypatch.undo()
    _assert_sound(llm, expected[1])
    assert _tokens(llm, WORKLOAD, PARAMS) == expected[0]


@pytest.mark.parametrize("point", ["device step", "schedule", "update", "taking in new requests"])
@pytest.mark.parametrize("k", [1, 2, 5])  # the workload always takes at least 6 steps (6 new tokens)
def test_ctrl_c_anywhere_in_the_loop_is_raised_once_consistent(llm, expected, monkeypatch, point, k):
    """SIGINT inside a step (it completes, then KeyboardInterrupt: the pools are the step's new
    ones, never the donated ones) or between steps, while new requests are taken in."""
    if point == "taking in new requests":
        k = 1  # each request is taken in once
    owner, name = {
        "device step": (llm.engine.runner, "sample"),
        "schedule": (llm.engine.scheduler, "schedule"),
        "update": (llm.engine.scheduler, "update"),
        "taking in new requests": (llm.engine, "enqueue"),
    }[point]
    real = getattr(owner, name)
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == k:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(WORKLOAD, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    _assert_sound(llm, expected[1])


def test_a_hundred_random_interrupts(llm, expected):
    rng = random.Random(0)
    interrupted = 0
    for i in range(100):
        timer = threading.Timer(rng.uniform(0, 0.05), signal.raise_signal, (signal.SIGINT,))
        try:
            timer.start()  # a short delay may fire while start() still waits for the thread
            llm.generate(WORKLOAD, PARAMS, use_tqdm=False)
            timer.join()  # a signal sent after the call returned lands here
            time.sleep(0.01)
        except KeyboardInterrupt:
            interrupted += 1
        assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting, i
    assert interrupted > 30
    _assert_sound(llm, expected[1])


def test_a_failed_call_aborts_only_its_own_requests(llm, expected, monkeypatch):
    """A stream is under way when another call's step fails: the stream's requests go on
    (recomputed) and give the fresh engine's tokens; the failed call's are gone."""
    stream = llm.generate_stream(WORKLOAD, PARAMS)
    first = next(stream)
    _fail_on_call(monkeypatch, llm.engine.runner, "run_executable", 1, after=True)
    with pytest.raises(Boom):
        llm.generate([random_prompt(12, 9)], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    got = [[] for _ in WORKLOAD]
    got[first.index].extend(first.new_token_ids)
    for event in stream:
        got[event.index].extend(event.new_token_ids)
    assert got == expected[0]
    _assert_sound(llm, expected[1])


def test_eight_threads_fifty_calls_each(llm, expected):
    prompts = [random_prompt(5 + t, 40 + t) for t in range(8)]
    alone = {t: _tokens(llm, [prompts[t]], [SEEDED if t % 2 else GREEDY])[0] for t in range(8)}
    failures = []

    def caller(t: int) -> None:
        for _ in range(50):
            got = _tokens(llm, [prompts[t]], [SEEDED if t % 2 else GREEDY])[0]
            if got != alone[t]:
                failures.append((t, got))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures
    _assert_sound(llm, expected[1])


def test_a_thread_waiting_for_the_lock_gets_in_between_another_callers_steps(llm, expected):
    """The lock is free between steps: a `stats()` call from another thread is answered while
    a long request is still running."""
    long = threading.Thread(
        target=_tokens,
        args=(llm, [random_prompt(4, 8)], [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)]),
    )
    long.start()
    deadline = time.monotonic() + 60
    while not llm.engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.001)
    llm.stats()
    answered_while_running = long.is_alive()
    long.join()
    assert answered_while_running
    _assert_sound(llm, expected[1])


def test_caller_lock_says_whether_a_thread_waits_for_it():
    lock = CallerLock()
    entered = []

    def waiter() -> None:
        with lock:
            entered.append(lock.contended)

    with lock:
        with lock:  # re-entrant
            assert not lock.contended
        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + 30
        while not lock.contended and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lock.contended and not entered
    thread.join()
    assert entered == [False] and not lock.contended
    assert lock.acquire(blocking=False)
    lock.release()


def test_closed_and_dropped_streams_abort_their_requests(llm, expected):
    rng = random.Random(1)
    for i in range(30):
        stream = llm.generate_stream(WORKLOAD, PARAMS)
        for _ in range(rng.randrange(0, 12)):
            if next(stream, None) is None:
                break
        if i % 2:
            stream.close()
            assert next(stream, None) is None
        else:
            del stream  # dropped unread: aborted at the next step of any caller
            gc.collect()
            llm.generate([[1, 2]], GREEDY, use_tqdm=False)
        assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting, i
    _assert_sound(llm, expected[1])


def test_a_stream_never_read_is_aborted_when_dropped(llm, expected):
    llm.generate_stream(WORKLOAD, PARAMS)  # dropped at once
    gc.collect()
    _assert_sound(llm, expected[1])


def test_generate_during_a_stream_gets_only_its_own_outputs(llm, expected):
    stream = llm.generate_stream(WORKLOAD, PARAMS)
    got = [[] for _ in WORKLOAD]
    finished = set()
    for n, event in enumerate(stream):
        got[event.index].extend(event.new_token_ids)
        if event.finished:
            finished.add(event.index)
            assert event.output.outputs[0].token_ids == got[event.index]
        if n == 2:
            assert _tokens(llm, PROBE, [GREEDY, SEEDED]) == expected[1]
    assert got == expected[0] and finished == set(range(len(WORKLOAD)))


def test_abort_by_request_id(llm, expected):
    stream = llm.generate_stream(WORKLOAD, PARAMS)
    event = next(stream)
    assert llm.abort(event.request_id) and not llm.abort(event.request_id)
    outputs = {e.index: e.output for e in stream if e.finished}
    assert outputs[event.index].outputs[0].finish_reason == "abort"
    assert sorted(outputs) == list(range(len(WORKLOAD)))
    _assert_sound(llm, expected[1])


def test_streams_validate_at_the_call(llm):
    with pytest.raises(ValueError, match="request 1: SamplingParams.temperature"):
        llm.generate_stream([[1], [2]], [GREEDY, SamplingParams(temperature=math.nan)])
    assert not llm.engine.scheduler.waiting


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(temperature=math.nan), "temperature must be a finite number"),
        (SamplingParams(temperature=math.inf), "temperature must be a finite number"),
        (SamplingParams(repetition_penalty=math.nan), "repetition_penalty must be a finite number"),
        (SamplingParams(top_p=np.float32("nan")), "top_p must be a finite number"),
        (SamplingParams(presence_penalty=-math.inf), "presence_penalty must be"),
        (SamplingParams(seed=2**64), "seed must be an integer"),
        (SamplingParams(seed=1.5), "seed must be an integer"),
        (SamplingParams(max_tokens=True), "max_tokens must be an integer"),
        (SamplingParams(ignore_eos="yes"), "ignore_eos must be true or false"),
        (SamplingParams(stop=[""]), "stop must be non-empty strings"),
        (SamplingParams(stop_token_ids=[1.0]), "stop_token_ids must be token ids"),
        (SamplingParams(temperature=10**400), "temperature must be a finite number"),
    ],
)
def test_bad_numbers_are_refused_by_name(llm, params, match):
    with pytest.raises(ValueError, match=f"request 0: SamplingParams.{match}"):
        llm.generate([[1, 2]], params, use_tqdm=False)
    assert not llm.engine.scheduler.waiting


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([1.9, 2.9], r"token ids must be integers, got 1.9 \(float\) at index 0"),
        (["5", "6"], r"token ids must be integers, got '5' \(str\)"),
        ([True, 3], r"token ids must be integers, got True \(bool\)"),
        (np.array([1.0, 2.0]), r"token ids must be integers, got .*1\.0\)? \(float64\)"),
    ],
)
def test_token_ids_must_be_integers(llm, prompt, match):
    with pytest.raises(ValueError, match=f"request 0: {match}"):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_values_the_step_arrays_cannot_hold_run_as_intended(llm):
    """Seeds of any 64-bit integer are reduced to the step's 32 bits (vLLM takes 64-bit
    seeds); a top_k beyond the vocabulary means no limit; None for the stop lists is empty."""
    base = dict(max_tokens=5, temperature=1.0, ignore_eos=True)
    for seed in (-2, 2**40, 2**63):
        out = _tokens(llm, [[3, 4, 5]] * 2, [SamplingParams(seed=seed, **base)] * 2)
        assert out[0] == out[1]
    unseeded = _tokens(llm, [[3, 4, 5]] * 4, [SamplingParams(seed=-1, **base)] * 4)  # -1: no seed, as in vLLM
    assert len({tuple(t) for t in unseeded}) > 1
    assert _tokens(llm, [[3, 4]], [SamplingParams(seed=2**32 + 5, **base)]) == _tokens(
        llm, [[3, 4]], [SamplingParams(seed=5, **base)]
    )
    assert _tokens(llm, [[3, 4]], [SamplingParams(top_k=2**31, seed=1, **base)]) == _tokens(
        llm, [[3, 4]], [SamplingParams(top_k=0, seed=1, **base)]
    )
    assert len(_tokens(llm, [[3]], [SamplingParams(stop=None, stop_token_ids=None, max_tokens=3)])[0]) >= 1
    assert _tokens(llm, [np.asarray([3, 4], np.int64)], [GREEDY]) == _tokens(llm, [[3, 4]], [GREEDY])


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([None, "x", True]),
    st.builds(np.float32, st.floats(width=32, allow_nan=True)),
    st.builds(np.int64, st.integers(-(2**40), 2**40)),
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fields=st.dictionaries(
        st.sampled_from(
            [
                "max_tokens",
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "seed",
                "min_tokens",
                "logprobs",
            ]
        ),
        NUMBERS,
        max_size=4,
    ),
    prompt=st.one_of(st.lists(st.integers(-5, VOCAB_SIZE + 5), max_size=6), st.lists(NUMBERS, max_size=3)),
)
def test_any_parameters_either_run_or_are_refused_before_any_work(llm, fields, prompt):
    params = SamplingParams(**{"max_tokens": 3, **fields})
    try:
        out = llm.generate([[1, 2], prompt], [GREEDY, params], use_tqdm=False)
    except ValueError:
        assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
        return
    assert all(0 <= t < VOCAB_SIZE for o in out for t in o.outputs[0].token_ids)
    assert not llm.engine.scheduler.running


def test_engine_arguments_the_machine_or_model_cannot_take_fail_at_construction(model_dir):
    with pytest.raises(ValueError, match="max_logprobs=1000 exceeds the vocabulary"):
        LLM(model_dir, **{**ARGS, "max_logprobs": 1000})
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=512"):
        LLM(model_dir, **{**ARGS, "max_model_len": 4096})
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="kernels='pallas' needs a TPU or GPU"):
            LLM(model_dir, **{**ARGS, "kernels": "pallas"})


def test_recovery_keeps_the_pools_when_the_device_step_never_ran(llm, monkeypatch):
    _fail_on_call(monkeypatch, llm.engine.builder, "build", 2)
    with pytest.raises(Boom):
        llm.generate(WORKLOAD, PARAMS, use_tqdm=False)
    assert not llm.engine.runner.pools_lost()
    assert llm.engine.scheduler.cache.checkpoints  # the first step's cache content survives


def test_recovery_forgets_the_cache_when_the_pools_were_lost(llm, monkeypatch):
    llm.generate(WORKLOAD[:1], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.cache.checkpoints
    recover = Scheduler.recover
    seen = []
    monkeypatch.setattr(
        Scheduler,
        "recover",
        lambda self, device_state_lost: (seen.append(device_state_lost), recover(self, device_state_lost)),
    )
    _fail_on_call(monkeypatch, llm.engine.runner, "run_executable", 1, after=True)
    with pytest.raises(Boom):
        llm.generate(WORKLOAD, PARAMS, use_tqdm=False)
    assert seen == [True] and not llm.engine.scheduler.cache.checkpoints and not llm.engine.scheduler.cache.nodes
    assert isinstance(llm.engine, LLMEngine)
