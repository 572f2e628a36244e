"""The engine with the Pallas kernels (in their interpreters) gives the references' tokens."""

import numpy as np
import pytest
from transformers import BambaConfig, BambaForCausalLM

from jaxengine import LLM, SamplingParams
from jaxengine.models.kernels import REFERENCE_SCAN_ROW, kernel_ops, reference_scan
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ssd import ragged_ssd_scan
from tests.models.tiny_models import perturb_, random_prompt, save_tiny_model

ARGS = dict(max_model_len=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=32, warm_up=False)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kernel_friendly_bamba(tmp_path_factory):
    """A tiny Bamba whose shapes suit both kernel families (SSM head dim 64, state 16)."""
    cfg = BambaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=2,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        max_position_embeddings=64,
    )
    model = BambaForCausalLM(cfg).eval()
    perturb_(model, seed=0)
    path = tmp_path_factory.mktemp("bamba_kernels")
    model.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["pallas-interpret-tpu", "pallas-interpret-gpu"])
@pytest.mark.parametrize("tp", [1, 2], ids=["one-device", "tp2"])
def test_interpreted_kernels_match_references_end_to_end(kernel_friendly_bamba, kernels, tp):
    """At TP 2 each kernel runs on its device's heads (2 KV heads, 2 Mamba heads, one group)."""
    prompts = [random_prompt(11, 1), random_prompt(3, 2)]
    want = LLM(kernel_friendly_bamba, kernels="reference", **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(kernel_friendly_bamba, kernels=kernels, tensor_parallel_size=tp, **ARGS).generate(
        prompts, GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.slow
def test_interpreted_tpu_gated_delta_kernel_matches_the_reference_end_to_end(tmp_path):
    save_tiny_model("qwen3_5", tmp_path)
    prompts = [random_prompt(11, 1), random_prompt(3, 2)]
    want = LLM(tmp_path, kernels="reference", **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(tmp_path, kernels="pallas-interpret-tpu", **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["pallas-interpret-tpu", "pallas-interpret-gpu"])
def test_interpreted_selective_scan_kernels_match_the_reference_end_to_end(tmp_path, kernels):
    """The tiny Jamba's 128 channels and state 8 suit both kernels."""
    save_tiny_model("jamba", tmp_path)
    prompts = [random_prompt(11, 1), random_prompt(3, 2)]
    want = LLM(tmp_path, kernels="reference", **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(tmp_path, kernels=kernels, **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_cpu_uses_references_and_unknown_names_fail():
    ops = kernel_ops("auto")
    assert ops.ragged_paged_attention is ragged_paged_attention and ops.ragged_ssd_scan is reference_scan
    with pytest.raises(ValueError, match="needs a TPU or GPU backend"):
        kernel_ops("pallas")
    with pytest.raises(ValueError, match="unknown kernels='cuda'"):
        kernel_ops("cuda")


def test_reference_scan_on_short_rows_equals_the_chunk_grid():
    """The engine's reference scan runs on rows shorter than the chunk: same outputs, and the
    states it returns at chunk boundaries are the chunk grid's."""
    chunk, heads, head_dim, state = 4 * REFERENCE_SCAN_ROW, 2, 8, 4
    rng = np.random.default_rng(0)
    lens, starts = [150, 1, 0, 37], [0, 70, 0, 100]  # long, decode, empty, mid-chunk start
    num_tokens = sum(lens) + 5
    x = rng.standard_normal((num_tokens, heads, head_dim)).astype(np.float32)
    dt = rng.uniform(0.01, 0.1, (num_tokens, heads)).astype(np.float32)
    A = -rng.uniform(0.5, 1.5, heads).astype(np.float32)
    B, C = (rng.standard_normal((num_tokens, 1, state)).astype(np.float32) for _ in range(2))
    init = rng.standard_normal((len(lens), heads, head_dim, state)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    args = (x, dt, A, B, C, init, cu, np.asarray(starts, np.int32))
    want = ragged_ssd_scan(*args, chunk_size=chunk)
    got = reference_scan(*args, chunk_size=chunk)
    np.testing.assert_allclose(got.y, want.y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got.final_states, want.final_states, rtol=1e-4, atol=1e-4)
    assert got.chunk_states.shape[0] > want.chunk_states.shape[0]  # it did use shorter rows
    checked = 0
    for r in range(want.chunk_states.shape[0]):
        seq, end = int(want.chunk_seq[r]), int(want.chunk_end[r])
        if seq < len(lens) and end % chunk == 0:
            match = np.flatnonzero((np.asarray(got.chunk_seq) == seq) & (np.asarray(got.chunk_end) == end))
            assert len(match) == 1, (seq, end)
            np.testing.assert_allclose(got.chunk_states[match[0]], want.chunk_states[r], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 3  # the long sequence crosses chunk boundaries 64 and 128, the mid-chunk one 128
