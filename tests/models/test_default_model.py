"""The embedded default model: jaxengine's per-token loss equals transformers' on held-out text."""

import numpy as np
import torch
from transformers import AutoTokenizer, BambaForCausalLM

from jaxengine import LLM
from jaxengine.run_config import DEFAULT_MODEL


def _token_losses(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """Cross-entropy of each next token, in float64."""
    logits = logits[:-1].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(-1))
    return log_z - shifted[np.arange(len(ids) - 1), ids[1:]]


def test_heldout_per_token_loss_matches_transformers():
    text = (DEFAULT_MODEL / "heldout_sample.txt").read_text()
    ids = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL)).encode(text)
    llm = LLM(DEFAULT_MODEL, warm_up=False, max_num_batched_tokens=256)
    ours = _token_losses(llm.prompt_logits(ids), ids)
    with torch.no_grad():
        hf = BambaForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
        theirs = _token_losses(hf(torch.tensor([ids])).logits[0].numpy(), ids)
    assert len(ids) > 900
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert abs(ours.mean() - theirs.mean()) < 1e-4
    assert ours.mean() < 5.0  # a trained model, not noise (uniform over 4096 tokens is 8.3)
