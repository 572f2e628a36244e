"""More memory never loses hits: the replayed token hit rate at twice the budget is never
more than a point below the rate at the budget, over random small traces of every synthetic
kind (30 to 300 requests; agent sessions over a shared tool specification of 500 to 3,000
tokens, interleaved conversations, few-shot prompts), for the hybrid default model and a
7B-shaped hybrid (whose checkpoint weighs as much as ~400 tokens of KV), budgets from 4
checkpoints' bytes up."""

import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxengine.run_config import DEFAULT_MODEL
from tests.property_examples import examples
from tests.scripts.load_script import load_script

replay = load_script("replay_prefix_trace")
make_trace = load_script("make_prefix_trace")

MODELS = {
    "default": DEFAULT_MODEL,
    "7b-shape": Path(__file__).resolve().parents[2] / "configs" / "models" / "nemotron-h-7b-shape",
}


def _trace(kind: str, seed: int) -> list:
    """A small trace of `kind` with parameters drawn from `seed`."""
    src, rng = make_trace.TokenSource(seed, 4096), random.Random(seed)
    if kind == "agentic":
        requests = make_trace.agentic(
            src,
            num_sessions=rng.randint(16, 40),
            turns=(3, rng.randint(4, 10)),
            tool_spec_tokens=rng.randint(500, 3000),
            task_tokens=(20, 100),
            tool_result_tokens=(50, 400),
            action_tokens=(10, 60),
            max_active=rng.randint(6, 24),
        )
    elif kind == "conversations":
        requests = make_trace.conversations(
            src,
            num_conversations=rng.randint(6, 16),
            num_turns=rng.randint(5, 6),
            system_tokens=rng.randint(0, 300),
            first_message_tokens=(20, 200),
            message_tokens=(10, 100),
            output_tokens=(5, 60),
            order=rng.choice(["round-robin", "random"]),
            max_active=rng.randint(1, 6),
        )
    else:
        requests = make_trace.few_shot(
            src,
            instruction_tokens=rng.randint(0, 300),
            num_families=rng.randint(1, 3),
            tasks_per_family=rng.randint(1, 3),
            family_tokens=rng.randint(16, 200),
            task_tokens=rng.randint(16, 200),
            num_requests=rng.randint(30, 80),
            message_tokens=(5, 40),
            output_tokens=(5, 40),
        )
    return [replay.TraceRequest(r.session_id, r.turn_id, r.input_tokens, r.output_tokens) for r in requests]


def hit_rate(requests: list, model: str, budget_checkpoints: float) -> float:
    """The replayed token hit rate with a budget of `budget_checkpoints` checkpoints' bytes."""
    cfg = replay.read_model_config(MODELS[model])
    longest = max(len(r.input_tokens) + len(r.output_tokens) for r in requests)
    one = replay.sizes(cfg, 0, 16, 2, 2, longest)
    s = replay.sizes(cfg, int(budget_checkpoints * one.checkpoint_blocks * one.block_bytes), 16, 2, 2, longest)
    hits = replay.replay(requests, replay.build_scheduler(cfg, s, 16, None), s)
    return sum(hits) / sum(len(r.input_tokens) for r in requests)


@settings(max_examples=examples(60), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["agentic", "conversations", "few-shot"]),
    seed=st.integers(0, 10**6),
    model=st.sampled_from(sorted(MODELS)),
    budget=st.sampled_from([4, 6, 8, 12, 16, 24, 32]),
)
def test_twice_the_memory_never_loses_hits(kind, seed, model, budget):
    requests = _trace(kind, seed)
    assert hit_rate(requests, model, 2 * budget) >= hit_rate(requests, model, budget) - 0.01


def test_more_memory_keeps_agent_sessions_hitting():
    # 63 requests of interleaved agent sessions: twice the memory used to hit 26 points less
    # (a shared specification's checkpoint evicted before the sessions' own).
    requests = _trace("agentic", 2)
    assert hit_rate(requests, "default", 16) >= hit_rate(requests, "default", 8) - 0.01
