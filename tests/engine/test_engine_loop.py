"""The engine loop thread: requests submitted from other threads get exactly their own
increments, equal to `generate`'s outputs, while `generate` runs beside it; a failed step
reaches every listener as an error and the loop goes on serving."""

import queue
import threading

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine.engine_loop import EngineLoop
from jaxengine.run_config import DEFAULT_MODEL

PROMPTS = [f"def function_{i}(x):" for i in range(4)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(DEFAULT_MODEL, warm_up=False, max_model_len=256, compilation_cache_dir=None) as llm:
        yield llm


@pytest.fixture
def loop(llm):
    loop = EngineLoop(llm).start()
    yield loop
    loop.stop(timeout=60)


def collect(loop: EngineLoop, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    """Submits one prompt and gathers its increments until its last."""
    news: queue.Queue = queue.Queue()
    loop.submit([prompt], params, news.put)
    tokens, text = [], ""
    while True:
        item = news.get(timeout=120)
        if isinstance(item, BaseException):
            raise item
        for event in item:
            tokens += event.new_token_ids
            text += event.new_text
            if event.finished:
                assert event.output.outputs[0].token_ids == tokens
                return tokens, text


def test_submitted_requests_equal_generate_while_generate_runs_beside(llm, loop):
    want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = [None] * len(PROMPTS)

    def run(i: int) -> None:
        got[i] = collect(loop, PROMPTS[i], GREEDY)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    beside = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # this thread steps too, meanwhile
    for t in threads:
        t.join(120)
    assert [g[0] for g in got] == [o.outputs[0].token_ids for o in want]
    assert [g[1] for g in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].token_ids for o in beside] == [o.outputs[0].token_ids for o in want]
    assert loop.num_requests == 0 and not llm.engine.has_unfinished


def test_a_bad_request_is_refused_before_queueing(loop):
    with pytest.raises(ValueError, match="temperature"):
        loop.submit(["x", "y"], SamplingParams(temperature=-1), lambda news: None)
    assert loop.num_requests == 0 and loop.load() == (0, 0)


def test_a_failed_step_reaches_the_listener_and_the_loop_goes_on(llm, loop, monkeypatch):
    real_step = llm.engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected step failure"):
        collect(loop, PROMPTS[0], GREEDY)
    assert not llm.engine.has_unfinished  # the failed request was aborted
    want = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert collect(loop, PROMPTS[1], GREEDY)[0] == want
