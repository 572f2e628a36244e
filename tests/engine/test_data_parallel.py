"""Data parallelism over the test run's eight CPU devices: replicas on their own devices give
transformers' greedy tokens, a conversation's next turn goes back to the replica holding its
prefix (and hits), new prompts spread by load, and bad sizes are refused by name."""

import os

import pytest

from jaxengine import LLM, SamplingParams
from tests.engine.fresh_process import last_line
from tests.models.tiny_models import hf_greedy, random_prompt, save_tiny_model

# With the step store on (the default): each replica's steps are its own devices' programs.
ARGS = dict(max_model_len=128, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    path = tmp_path_factory.mktemp("bamba")
    return path, save_tiny_model("bamba", path)


def test_two_replicas_of_two_devices_serve_a_conversation_from_one_replica(bamba):
    path, hf_model = bamba
    llm = LLM(path, data_parallel_size=2, tensor_parallel_size=2, **ARGS)
    first, second = llm.engine.replicas
    assert {d.id for d in first.runner.mesh.devices.flat} == {0, 1}
    assert {d.id for d in second.runner.mesh.devices.flat} == {2, 3}
    assert all({d.id for d in leaf.devices()} == {2, 3} for leaf in second.runner.param_leaves)
    a, b = random_prompt(30, 1), random_prompt(22, 2)
    outs = llm.generate([a, b], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 8) for p in (a, b)]
    # The two new prompts went to different replicas (the least loaded), one each.
    assert [r.stats()["tokens_asked"] for r in llm.engine.replicas] in ([30, 22], [22, 30])
    # The next turn of conversation `a` goes back to a's replica and hits its pages.
    turn = a + outs[0].outputs[0].token_ids + random_prompt(6, 3)
    asked = [r.stats()["tokens_asked"] for r in llm.engine.replicas]
    out = llm.generate([turn], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, turn, 8)
    assert out.num_cached_tokens >= 32
    grew = [r.stats()["tokens_asked"] - before for r, before in zip(llm.engine.replicas, asked)]
    assert grew.count(0) == 1 and len(turn) in grew
    stats = llm.stats()
    assert stats["data_parallel_size"] == 2 and stats["tokens_asked"] == 30 + 22 + len(turn)
    assert stats["tokens_hit"] == sum(r["tokens_hit"] for r in stats["replicas"]) >= 32


@pytest.mark.slow  # routing by prefix: run fast by the conversation test above
def test_a_prompts_samples_share_one_replica(bamba):
    path, _ = bamba
    llm = LLM(path, data_parallel_size=2, **ARGS)
    out = llm.generate(
        [random_prompt(2, 7)], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    assert sorted(r.stats()["tokens_asked"] > 0 for r in llm.engine.replicas) == [False, True]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(data_parallel_size=3, tensor_parallel_size=4),
            "data_parallel_size=3 with tensor_parallel_size=4 needs 12 devices; 8 cpu devices are present",
        ),
        (dict(data_parallel_size=0), "data_parallel_size must be a positive integer"),
    ],
)
def test_bad_data_parallel_sizes_are_refused(bamba, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(bamba[0], **ARGS, **kwargs)


# Two replicas of two devices with the defaults (the step store on), in a fresh process.
PROGRAM = """
import sys, jax
jax.config.update("jax_num_cpu_devices", 8)
from jaxengine import LLM, SamplingParams
llm = LLM(sys.argv[1], data_parallel_size=2, tensor_parallel_size=2, **eval(sys.argv[2]))
outs = llm.generate(eval(sys.argv[3]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
print([o.outputs[0].token_ids for o in outs])
"""


@pytest.mark.slow  # each replica's own steps: run fast in-process by the conversation test above
def test_replicas_run_twice_in_fresh_processes_on_one_store(bamba, tmp_path):
    """The first run fills the store (each replica its own devices' steps), the second loads it."""
    path, hf_model = bamba
    prompts = [random_prompt(30, 1), random_prompt(22, 2)]
    env = {**os.environ, "HOME": str(tmp_path)}
    want = [hf_greedy(hf_model, p, 8) for p in prompts]
    for _ in range(2):
        assert eval(last_line(PROGRAM, str(path), repr(ARGS), repr(prompts), env=env)) == want
