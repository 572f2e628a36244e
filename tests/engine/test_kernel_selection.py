"""The engine with the Pallas kernels (in their interpreters) gives the references' tokens."""

import pytest
from transformers import BambaConfig, BambaForCausalLM

from jaxengine import LLM, SamplingParams
from jaxengine.models.kernels import kernel_ops
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ssd import ragged_ssd_scan
from tests.models.tiny_models import perturb_, random_prompt

ARGS = dict(max_model_len=64, page_size=4, max_num_seqs=2, max_num_batched_tokens=32, warm_up=False)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kernel_friendly_bamba(tmp_path_factory):
    """A tiny Bamba whose shapes suit both kernel families (SSM head dim 64, state 16)."""
    cfg = BambaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=2, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=64,
    )
    model = BambaForCausalLM(cfg).eval()
    perturb_(model, seed=0)
    path = tmp_path_factory.mktemp("bamba_kernels")
    model.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["pallas-interpret-tpu", "pallas-interpret-gpu"])
def test_interpreted_kernels_match_references_end_to_end(kernel_friendly_bamba, kernels):
    prompts = [random_prompt(11, 1), random_prompt(3, 2)]
    want = LLM(kernel_friendly_bamba, kernels="reference", **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(kernel_friendly_bamba, kernels=kernels, **ARGS).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_cpu_uses_references_and_unknown_names_fail():
    ops = kernel_ops("auto")
    assert ops.ragged_paged_attention is ragged_paged_attention and ops.ragged_ssd_scan is ragged_ssd_scan
    with pytest.raises(ValueError, match="needs a TPU or GPU backend"):
        kernel_ops("pallas")
    with pytest.raises(ValueError, match="unknown kernels='cuda'"):
        kernel_ops("cuda")
