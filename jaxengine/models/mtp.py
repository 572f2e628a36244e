"""The multi-token-prediction (MTP) module: a draft head the target model carries, run inside
the target's own step (speculative decoding's `mtp` method).

Qwen3-Next / Qwen3.5's format (`mtp.*` tensors), and Nemotron-H's (the same computation under
other names). At position t it reads the target's final hidden state h_t and the embedding of
token t + 1,

    x_t = fc([pre_fc_norm_embedding(embed(token t+1)), pre_fc_norm_hidden(h_t)])   # [2D] -> [D]

runs one full-attention decoder layer of the model's own kind over x (Nemotron-H: an attention
layer, then its feed-forward layers), with KV pages of its own that lie in the cache blocks
beside the target's (so prefix caching keeps them), and

    g_t = norm(layers(x)_t),   logits = head(g_t)   (the target's output projection)

predicts token t + 2. Drafting k tokens after a step: the first from g at each sequence's last
accepted position; each next one by running the layer at the following position on its own
output g and the draft it just made (one token per sequence), as vLLM does.

Every step with a sequence that speculates runs the module over all its tokens, whether it
drafts or not, so every position a speculating sequence computes has its MTP KV entry: the
token after each is known to the host (`following_ids`) or is the step's own sample there
(at a verify step's rows the sample equals the draft wherever the draft was accepted, and
is the target's correction at the first rejection). A step where no sequence speculates (the
engine admits requests without speculation where it does not pay) runs in a shape compiled
without the module (`BatchBuilder`), or, in one with it while that compiles, skips it.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.batch import Pools, StepBatch, token_layout
from jaxengine.models.conditional import if_in_place, when
from jaxengine.models.config import ModelConfig
from jaxengine.models.decoder_layer import DecoderLayer, add_residual
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import RMSNorm, linear, norm_settings


class Mtp(nnx.Module):
    """`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`, `mtp.layers.*`, `mtp.norm`
    (Nemotron-H's `mtp.layers.0.enorm`, `.hnorm`, `.eh_proj` and the last layer's
    `final_layernorm` are loaded into the same parameters)."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        norm = norm_settings(cfg, dtype)
        self.pre_fc_norm_embedding = RMSNorm(d, **norm)
        self.pre_fc_norm_hidden = RMSNorm(d, **norm)
        self.fc = linear(2 * d, d, bias=False, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, spec, dtype=dtype, rngs=rngs) for spec in cfg.mtp_layers])
        self.norm = RMSNorm(d, **norm)

    def inputs(self, embedded: jax.Array, hidden: jax.Array) -> jax.Array:  # [T, D], [T, D] -> x [T, D]
        return self.fc(jnp.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1))

    def outputs(self, cfg: ModelConfig, x: jax.Array, attention_out: jax.Array) -> jax.Array:  # -> g [T, D]
        h = add_residual(cfg, x, attention_out)  # the first layer's attention
        for layer in self.layers:  # its feed-forward (Qwen), or the feed-forward layers after it (Nemotron-H)
            h = layer.feed_forward(cfg, h)
        return self.norm(h)


DraftChooser = Callable[[jax.Array, int], jax.Array]  # (logits [S, V], drafts before it) -> draft [S] int32


def mtp_drafts(
    model,
    pools: Pools,
    batch: StepBatch,
    sample_rows: jax.Array,
    num_drafts: jax.Array,
    following_ids: jax.Array,
    wants_drafts: jax.Array,
    speculates: jax.Array,
    hidden: jax.Array,
    sampled: jax.Array,
    last: jax.Array,
    choose: DraftChooser,
    num_speculative_tokens: int,
    ops: KernelOps,
) -> tuple[jax.Array, Pools]:
    """Runs the MTP module over the step's tokens when some sequence `speculates` [S] and,
    when some sequence `wants_drafts` [S] (only speculating ones do), drafts
    `num_speculative_tokens` tokens per sequence after its last accepted one, each picked by
    `choose` from the module's logits.

    hidden [T, D]: the target's final hidden states; sampled [S, W]: the step's samples;
    last [S]: each sequence's last accepted sample row (`engine/spec/acceptance.py`);
    following_ids [T]: the token after each token where the host knows it, else -1.
    Returns drafts [S, k] int32 (zeros when none is wanted) and the pools with the MTP
    layer's KV entries written.

    The pass over the step's tokens runs whenever a sequence speculates, so every position it
    computes has its entry for whenever drafting resumes: a loop of one iteration or none,
    with nothing of the module outside it. The drafting inside it runs only when wanted, under
    `lax.cond`s; its KV writes stay outside them (to the null slot when not drafting): XLA
    copies pages a branch returns."""
    cfg = model.cfg
    store = pools.store_arrays()
    kv = 2 * cfg.num_attention_layers  # the MTP layer's K and V pages: store[kv], store[kv + 1]
    page_size = store[kv].shape[1]
    num_tokens = batch.input_ids.shape[0]
    num_seqs, width = sampled.shape
    wanted = jnp.any(wants_drafts)
    when_wanted = functools.partial(when, wanted)

    def run(carry):  # the module's pass over the step's tokens, then the drafting
        _, k_pages, v_pages, hidden, sampled = carry
        pages = [k_pages, v_pages]
        used = jnp.arange(width)[None, :] >= (width - 1 - num_drafts)[:, None]  # [S, W]: rows of real tokens
        own = jnp.zeros(num_tokens, jnp.int32).at[jnp.where(used, sample_rows, num_tokens)].set(sampled, mode="drop")
        following = jnp.where(following_ids >= 0, following_ids, own)  # [T]
        layout = token_layout(batch, page_size)
        g = _layer_pass(model, following, hidden, layout.positions, layout.slot_mapping, batch, pages, ops)  # [T, D]

        row = jnp.take_along_axis(sample_rows, last[:, None], axis=1)[:, 0]  # [S] flat token index
        g = g[row]  # [S, D]
        draft = when_wanted(lambda g: choose(model.head(g), 0), g)
        drafts = [draft]
        start = layout.positions[row]  # [S]
        pages_per_seq = batch.page_table.shape[1]
        capacity = pages_per_seq * page_size
        seqs = jnp.arange(num_seqs, dtype=jnp.int32)
        step = dataclasses.replace(batch, cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32))
        for i in range(1, num_speculative_tokens):
            # One token per sequence at the next position; past the page table (drafts never
            # used: the host drafts none past max_model_len), or when not drafting, into the null slot.
            pos = start + i
            page = batch.page_table[seqs, jnp.minimum(pos // page_size, pages_per_seq - 1)]
            slot = jnp.where(wanted & (pos < capacity), page * page_size + pos % page_size, 0)
            step = dataclasses.replace(step, kv_lens=jnp.minimum(pos + 1, capacity))
            g = _layer_pass(model, draft, g, pos, slot, step, pages, ops, when_wanted)
            draft = when_wanted(lambda g, i=i: choose(model.head(g), i), g)
            drafts.append(draft)
        return jnp.stack(drafts, axis=1), *pages, jnp.zeros_like(hidden), jnp.zeros_like(sampled)

    drafts = jnp.zeros((num_seqs, num_speculative_tokens), jnp.int32)
    drafts, store[kv], store[kv + 1], _, _ = if_in_place(
        jnp.any(speculates), run, (drafts, store[kv], store[kv + 1], hidden, sampled)
    )
    return drafts, pools.with_store(store, pools.states)


def _layer_pass(
    model,
    ids: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    batch: StepBatch,
    pages: list[jax.Array],
    ops: KernelOps,
    guard=None,
) -> jax.Array:
    """The module over tokens `ids` [N] after hidden states `hidden` [N, D] at `positions`,
    writing their K/V to `slots` of the pages [K, V] (in place in `pages`) -> g [N, D].
    `guard(fn, *args)`, if given, runs the compute under a condition."""
    mtp, layer = model.mtp, model.mtp.layers[0]
    guard = guard or (lambda fn, *args: fn(*args))

    def project(ids, hidden, positions):
        x = mtp.inputs(model.embedding(ids), hidden)
        return x, *layer.attention.project(layer.mixer_norm(x), positions)

    def finish(x, q, gate, k_pages, v_pages, batch):
        return mtp.outputs(model.cfg, x, layer.attention.attend(q, gate, k_pages, v_pages, batch, ops))

    x, q, gate, k, v = guard(project, ids, hidden, positions)
    pages[0], pages[1] = ops.write_kv_pages(pages[0], pages[1], k, v, slots)
    return guard(finish, x, q, gate, pages[0], pages[1], batch)
