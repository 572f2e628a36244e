"""The hybrid decoder stack, built from the layer table of a `ModelConfig`.

One class serves every supported architecture: each layer is an optional mixer (any type of
`mixers.py`, or two side by side) and an optional feed-forward (MLP or MoE), each a pre-norm
residual branch scaled by `residual_multiplier`, and may first run one of the model's shared
blocks (Zamba2, `shared_block.py`). The model knows nothing of scheduling: it takes a
`StepBatch` and the pools and returns logits and the updated pools.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import VOCAB, param
from jaxengine.models.batch import Pools, StepBatch, TokenLayout, token_layout
from jaxengine.models.checkpoint_store import checkpoint_layout
from jaxengine.models.config import ModelConfig
from jaxengine.models.decoder_layer import DecoderLayer, add_residual
from jaxengine.models.kernels import KernelOps, kernel_ops
from jaxengine.models.layers import RMSNorm, linear, norm_settings
from jaxengine.models.mixer_state import initial_states, written_pools
from jaxengine.models.mixers import recurrent_states
from jaxengine.models.mtp import Mtp
from jaxengine.models.shared_block import SharedBlock


class HybridLM(nnx.Module):
    """A causal language model over the paged KV pool and the recurrent-state pools."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, kernels: str = "auto"):
        self.cfg = cfg
        self.kernels = kernels
        self.embed = param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype), (VOCAB, None))  # [V, D]
        self.layers = nnx.List([DecoderLayer(cfg, spec, dtype=dtype, rngs=rngs) for spec in cfg.layers])
        if cfg.shared_block:
            self.shared_blocks = nnx.List(
                [SharedBlock(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.shared_block.num_blocks)]
            )
        self.final_norm = RMSNorm(cfg.hidden_size, **norm_settings(cfg, dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs, axes=(None, VOCAB)
            )
        self.mtp = Mtp(cfg, dtype=dtype, rngs=rngs) if cfg.mtp_layers else None

    def __call__(
        self,
        pools: Pools,
        batch: StepBatch,
        *,
        decode: bool = False,
        all_logits: bool = False,
        rows: jax.Array | None = None,
        hidden: bool = False,
    ) -> tuple[jax.Array, Pools]:
        """Runs one ragged step.

        Returns float32 logits `[T, V]` for every token when `all_logits`, `[R, V]` for the
        flat token indices `rows` [R] when given, else `[S, V]` for each sequence's last token
        this step — or with `hidden`, every token's final hidden state `[T, D]` (`head` turns
        it into logits); and the updated pools."""
        cfg = self.cfg
        ops: KernelOps = kernel_ops(self.kernels)
        page_size = pools.k_pages[0].shape[1] if pools.k_pages else 1  # without attention: unused
        layout: TokenLayout = token_layout(batch, page_size)
        # The cache blocks: KV pages of attention layer l are store[2l] and store[2l + 1] (the
        # MTP layers' follow, `mtp.py`); checkpoints lie across all of them (`checkpoint_store.py`).
        store = pools.store_arrays()
        ckpts = None
        if store:
            ckpts = checkpoint_layout(recurrent_states(cfg), store[0].shape[1:], store[0].dtype, len(store))
        states = list(pools.states)
        # A sequence whose first token this step is position 0 starts from zero states; one
        # that resumes from a prefix hit reads the checkpoint instead of its read slot.
        fresh = layout.start_pos == 0  # [S]
        reads = not decode and batch.restore_blocks.shape[1] > 0  # decode steps never start from a hit
        hit = batch.restore_blocks[:, 0] > 0 if reads else None  # [S]
        # A mixer returns states at the checkpoints' positions (for the cache blocks) and at
        # the draft positions of the sequences that verify (for their live slots).

        h = embeddings = self.embedding(batch.input_ids)
        attn_i = rec_i = 0
        for layer in self.layers:
            mixed, x = [], h
            if layer.spec.shared_block is not None:
                k, v = 2 * attn_i, 2 * attn_i + 1
                block = self.shared_blocks[layer.spec.shared_block]
                added, store[k], store[v] = block(
                    h, embeddings, store[k], store[v], layer.shared_use, batch, layout, ops
                )
                x = h + added
                attn_i += 1
            x = layer.mixer_norm(x) if layer.spec.mixers else None
            for name in layer.spec.mixers:
                if name == "attention":
                    k, v = 2 * attn_i, 2 * attn_i + 1
                    out, store[k], store[v] = layer.attention(x, store[k], store[v], batch, layout, ops)
                    attn_i += 1
                else:
                    restored = ckpts.read(store, batch.restore_blocks, rec_i) if reads else None
                    initial = initial_states(states[rec_i], batch.read_slots, fresh, hit, restored)
                    out, final, saved, at_drafts = getattr(layer, name)(x, initial, batch, layout, ops, decode)
                    states[rec_i] = written_pools(states[rec_i], batch.write_slots, final)
                    if batch.state_seq.shape[0]:
                        states[rec_i] = written_pools(states[rec_i], batch.state_slots, at_drafts)
                    if batch.save_seq.shape[0]:
                        ckpts.write(store, batch.save_blocks, rec_i, saved)
                    rec_i += 1
                mixed.append(out)
            if mixed:
                h = add_residual(cfg, h, sum(mixed[1:], mixed[0]))
            h = layer.feed_forward(cfg, h)

        pools = pools.with_store(store, tuple(states))
        if rows is not None:
            h = h[rows]
        elif not all_logits and not hidden:
            last = jnp.clip(batch.cu_q_lens[1:] - 1, 0, h.shape[0] - 1)  # [S]
            h = h[last]
        h = self.final_norm(h)
        return (h if hidden else self.head(h)), pools

    def embedding(self, ids: jax.Array) -> jax.Array:
        """Token ids `[T]` -> input embeddings `[T, D]`."""
        h = self.embed[...][ids]
        return h * self.cfg.embedding_multiplier if self.cfg.embedding_multiplier != 1.0 else h

    def head(self, h: jax.Array) -> jax.Array:
        """Final hidden states `[R, D]` -> float32 logits `[R, V]`."""
        cfg = self.cfg
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("td,vd->tv", h, self.embed[...], preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(h).astype(jnp.float32)
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        return logits
