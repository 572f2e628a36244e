"""Pallas TPU (Mosaic) kernel for the ragged Mamba2 SSD scan; drop-in for `reference.ragged_ssd_scan`.

Semantics are the reference's (see its docstring): chunks aligned to absolute positions,
never crossing sequences, each sequence restarting from its initial state, and outputs
y [T, H, P], final_states [S, H, P, N] and the state after every chunk row with the same
row layout (`chunk_seq`, `chunk_end`), so callers may use either implementation.

Layout. The row bookkeeping is the reference's, recomputed in `ragged.scan_rows`: every
row is a contiguous range of at most `chunk_size` flat tokens, rows are in token order and
cover exactly the real tokens. Nothing is scattered into a [R, chunk_size] grid: the kernel
reads the flat token arrays directly, so a batch of short segments costs about its size.
The cumulative log-decay within each row, cum[t] = sum_{u <= t in t's row} dt[u] * A, is an
O(T * H) segmented scan done in XLA (`_layout.row_decays`).

Kernel. Grid (head blocks: "parallel", token blocks of chunk_size tokens: "arbitrary").
Step (h, k) sees token blocks k and k + 1 of every input (two auto-pipelined BlockSpecs of
the same array, together a window of 2 * chunk_size tokens) and runs, in order, every row
that starts in block k; such a row lies inside the window. Rows are processed in tiles of
`tq` tokens (window-aligned, so all slices are aligned) and only tiles the row touches are
visited. For a row with start state S (per head, [P, N]), tokens l (queries) and s (keys):
    y_l  = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s + exp(cum_l) C_l S^T
    S'   = exp(cum_last) S + sum_s (dt_s exp(cum_last - cum_s) x_s)^T B_s
The first line is a masked tile-pair loop (C B^T on the MXU, shared by all heads of a
group; the decay-masked scores times x on the MXU), the second one MXU product per key
tile. The state lives in VMEM scratch across rows and grid steps and is reset from
init_states (a DMA) at each sequence's first row; after every row it is DMA'd to
chunk_states[row] (double-buffered staging). y accumulates in a 2 * chunk_size VMEM window:
at the end of step k its first half (block k, now complete since later rows start at or
after block k + 1) is the y output block and its second half (the spill of the last row
into block k + 1) moves down. final_states are gathered from chunk_states in XLA.

Numerics: everything is float32 as in the reference. Products of input values (C B^T) use
bfloat16 MXU passes when the inputs are bfloat16 (exact products, float32 accumulation);
every other product has a float32 operand and runs at Precision.HIGHEST. Tokens outside the
row (neighbouring rows, padding, out-of-bounds rows of a partial last block) are removed
with selects before any arithmetic, so garbage or NaN there cannot leak.

Block choices (realistic H = 64-128, P = 64, N = 128, chunk 256, G = 1-8): a head block is
the largest divisor `hb` of H with hb * P <= 512 lanes (a multiple of 128), within one group
or a whole number of groups, so C B^T is computed once per group for the block: hb = 8 for
P = 64, giving H / 8 "parallel" blocks for the cores. Tiles are tile_size tokens, by default
min(chunk_size, 128): a tile pair is one MXU-sized product, and a short row touches one or
two tiles instead of a whole chunk. A real TPU compile needs chunk_size a multiple of 128 (the decay
blocks put tokens on lanes). Per-step VMEM for float32 inputs: x blocks 2 x 2 x 256 x 512
(2 MiB), B and C blocks 1 MiB, decay blocks 0.6 MiB, the y block and window 2 MiB, state
and staging 0.75 MiB, plus tile temporaries: under 10 MiB, well inside the 48 MiB limit set
below (v7x has 64 MiB per core). Each token block is fetched twice (as block "k + 1", then
as block "k"); at up to about chunk_size * (N + P) MACs per token and head the kernel is
MXU-bound, so that costs little. Precision.HIGHEST float32 products take several MXU passes;
the price of matching the float32 reference to 1e-4.

Verification: the tests run the kernel in the Mosaic TPU interpreter and lower it with
jax.export for platforms=["tpu"]. Export checks the Pallas-to-Mosaic lowering only; Mosaic's
own layout passes run when a TPU compiles the kernel, which no test here can do.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import ragged
from pallas_kernels.ssd import _layout
from pallas_kernels.ssd.reference import RaggedScanOutput

DEFAULT_TILE = 128  # tq: tokens per query / key tile (one MXU tile)
MAX_BLOCK_LANES = 512  # upper bound on hb * P
VMEM_LIMIT_BYTES = 48 * 1024 * 1024

_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims of both operands: a @ b^T


def heads_per_block(num_heads: int, num_groups: int, head_dim: int) -> int:
    """hb: heads per grid block (see the module docstring)."""
    per_group = num_heads // num_groups
    fits = [
        d
        for d in range(1, num_heads + 1)
        if num_heads % d == 0
        and (per_group % d == 0 or d % per_group == 0)
        and (d * head_dim % 128 == 0 or d == num_heads)
    ]
    small = [d for d in fits if d * head_dim <= MAX_BLOCK_LANES]
    return max(small) if small else min(fits)


def _dot(a: jax.Array, b: jax.Array, dims=(((1,), (0,)), ((), ()))) -> jax.Array:
    """MXU product accumulated in float32; float32 operands at full precision."""
    precision = lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _scan_kernel(
    # Scalar prefetch (SMEM).
    block_rows_ref,  # [NB + 1] int32: rows starting in token block k are [block_rows[k], block_rows[k + 1])
    row_start_ref,  # [R] int32: flat index of each row's first token
    row_len_ref,  # [R] int32
    row_first_ref,  # [R] int32: 1 where the row restarts from its sequence's initial state
    row_seq_ref,  # [R] int32
    # Inputs: "lo" is token block k, "hi" token block k + 1 (clamped to the last block).
    x_lo,  # [cs, hb * P]
    x_hi,
    b_lo,  # [cs, gb * N]: the gb groups of this head block
    b_hi,
    c_lo,  # [cs, gb * N]
    c_hi,
    cum_row_lo,  # [hb, cs] float32: within-row cumulative log-decay, tokens on lanes
    cum_row_hi,
    dt_row_lo,  # [hb, cs] float32: step sizes, tokens on lanes
    dt_row_hi,
    cum_col_lo,  # [cs, hb] float32: cum again, tokens on sublanes
    cum_col_hi,
    init_hbm,  # [S, H, P, N] in HBM
    # Outputs.
    y_ref,  # [cs, hb * P] float32: y of token block k
    chunk_states_hbm,  # [R, H, P, N] float32 in HBM
    # Scratch.
    y_win,  # [2 * cs, hb * P] float32: y of token blocks k and k + 1 being accumulated
    state_ref,  # [hb, P, N] float32: the running state
    staging,  # [2, hb, P, N] float32: states on their way to chunk_states
    sems,  # DMA semaphores [3]: two staging slots, init-state loads
    *,
    chunk_size: int,
    tile: int,
    head_dim: int,
    state_size: int,
    heads_per_block: int,
    heads_per_group: int,
    num_blocks: int,
):
    cs, tq, P, N, hb = chunk_size, tile, head_dim, state_size, heads_per_block
    f32 = jnp.float32
    h, k = pl.program_id(0), pl.program_id(1)
    tiles_per_block = cs // tq
    heads = pl.ds(h * hb, hb)

    @pl.when(k == 0)
    def _():
        y_win[...] = jnp.zeros_like(y_win)

    def load_tile(lo, hi, i, axis):
        """Window tile i (tokens [i * tq, (i + 1) * tq) of blocks k, k + 1) along `axis`."""

        def load(ref, j):
            window = pl.ds(pl.multiple_of(j * tq, tq), tq)
            return ref[window, :] if axis == 0 else ref[:, window]

        return lax.cond(i < tiles_per_block, lambda: load(lo, i), lambda: load(hi, i - tiles_per_block))

    def staging_copy(slot, row):
        return pltpu.make_async_copy(staging.at[slot], chunk_states_hbm.at[row, heads], sems.at[slot])

    def run_row(r, carry):
        start = row_start_ref[r] - k * cs  # window index of the row's first token, in [0, cs)
        end = start + row_len_ref[r]  # <= 2 * cs
        first_tile, last_tile = lax.div(start, tq), lax.div(end - 1, tq)  # tiles the row touches

        @pl.when(row_first_ref[r] == 1)
        def _():
            copy = pltpu.make_async_copy(init_hbm.at[row_seq_ref[r], heads], state_ref, sems.at[2])
            copy.start()
            copy.wait()

        def in_row(i, axis):
            """[tq, 1] (axis 0) or [1, tq] (axis 1) mask of tile i's tokens inside the row."""
            idx = i * tq + lax.broadcasted_iota(jnp.int32, (tq, 1) if axis == 0 else (1, tq), axis)
            return (idx >= start) & (idx < end)

        def row_tile(lo, hi, i, axis):
            """Window tile i as float32, zero outside the row (selects: garbage and NaN never leak)."""
            return jnp.where(in_row(i, axis), load_tile(lo, hi, i, axis).astype(f32), 0.0)

        def group_cols(v, j):
            """Columns of head j's group in a [tq, gb * N] tile."""
            g = j // heads_per_group
            return v[:, g * N : (g + 1) * N]

        # 1. Outputs of each query tile the row touches.
        def query_tile(qi, carry):
            c_q = row_tile(c_lo, c_hi, qi, 0)  # [tq, gb * N]
            cum_q = row_tile(cum_col_lo, cum_col_hi, qi, 0)  # [tq, hb]
            q_idx = qi * tq + lax.broadcasted_iota(jnp.int32, (tq, tq), 0)
            acc = tuple(  # start-state term exp(cum_l) C_l S^T, head by head: [tq, P]
                _dot(group_cols(c_q, j) * jnp.exp(cum_q[:, j : j + 1]), state_ref[j], _TRANS_B) for j in range(hb)
            )

            def key_tile(ki, acc):
                b_k = row_tile(b_lo, b_hi, ki, 0)  # [tq, gb * N]
                x_k = row_tile(x_lo, x_hi, ki, 0)  # [tq, hb * P]
                cum_k = row_tile(cum_row_lo, cum_row_hi, ki, 1)  # [hb, tq]
                dt_k = row_tile(dt_row_lo, dt_row_hi, ki, 1)  # [hb, tq]
                k_idx = ki * tq + lax.broadcasted_iota(jnp.int32, (tq, tq), 1)
                # Causal pairs with the query in the row. Keys outside the row need no mask (their B
                # and cum are zero), but queries past its end would see exp(0 - cum_k) overflow.
                pairs = (q_idx >= k_idx) & (q_idx < end)
                cb = [  # C B^T per group, in the input dtype: exact bfloat16 products for bfloat16 inputs
                    _dot(group_cols(c_q, j).astype(c_lo.dtype), group_cols(b_k, j).astype(b_lo.dtype), _TRANS_B)
                    for j in range(0, hb, heads_per_group)
                ]
                out = []
                for j in range(hb):
                    decay = jnp.exp(jnp.where(pairs, cum_q[:, j : j + 1] - cum_k[j : j + 1, :], -jnp.inf))
                    scores = cb[j // heads_per_group] * decay * dt_k[j : j + 1, :]  # [tq(l), tq(s)]
                    out.append(acc[j] + _dot(scores, x_k[:, j * P : (j + 1) * P]))
                return tuple(out)

            acc = lax.fori_loop(first_tile, qi + 1, key_tile, acc)
            rows = pl.ds(pl.multiple_of(qi * tq, tq), tq)
            y_win[rows, :] += jnp.concatenate(acc, axis=1)
            return carry

        lax.fori_loop(first_tile, last_tile + 1, query_tile, None)

        # 2. The state after the row: decay the start state, add every key tile's contribution.
        cum_tile = load_tile(cum_row_lo, cum_row_hi, last_tile, 1)  # [hb, tq]
        lane = last_tile * tq + lax.broadcasted_iota(jnp.int32, (1, tq), 1)
        cum_last = jnp.sum(jnp.where(lane == end - 1, cum_tile, 0.0), axis=1, keepdims=True)  # [hb, 1]
        for j in range(hb):
            state_ref[j] = state_ref[j] * jnp.exp(cum_last[j : j + 1, :])

        def state_tile(ki, carry):
            b_k = row_tile(b_lo, b_hi, ki, 0)  # [tq, gb * N]
            x_t = row_tile(x_lo, x_hi, ki, 0).T  # [hb * P, tq]
            cum_k = row_tile(cum_row_lo, cum_row_hi, ki, 1)
            weight = row_tile(dt_row_lo, dt_row_hi, ki, 1) * jnp.exp(cum_last - cum_k)  # [hb, tq]
            for j in range(hb):
                state_ref[j] += _dot(x_t[j * P : (j + 1) * P, :] * weight[j : j + 1, :], group_cols(b_k, j))
            return carry

        lax.fori_loop(first_tile, last_tile + 1, state_tile, None)

        # 3. Publish the state after this row.
        slot = lax.rem(r, 2)

        @pl.when(r >= 2)
        def _():
            staging_copy(slot, r).wait()  # the copy issued from this slot two rows ago

        staging[slot] = state_ref[...]
        staging_copy(slot, r).start()
        return carry

    lax.fori_loop(block_rows_ref[k], block_rows_ref[k + 1], run_row, None)

    # Block k is complete: later rows start in block k + 1 or after.
    y_ref[...] = y_win[:cs, :]
    y_win[:cs, :] = y_win[cs:, :]
    y_win[cs:, :] = jnp.zeros((cs, y_win.shape[1]), f32)

    @pl.when(k == num_blocks - 1)
    def _():
        def drain(row, carry):
            staging_copy(lax.rem(row, 2), row).wait()
            return carry

        num_used = block_rows_ref[num_blocks]  # the copies of the last two rows are in flight
        lax.fori_loop(jnp.maximum(num_used - 2, 0), num_used, drain, None)


def ragged_ssd_scan(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H] positive step sizes
    A: jax.Array,  # [H] negative
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    init_states: jax.Array,  # [S, H, P, N]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32: absolute position of each sequence's first token
    *,
    chunk_size: int,
    tile_size: int | None = None,  # tokens per MXU tile; default min(chunk_size, 128)
    interpret: bool = False,  # run on CPU with the Mosaic TPU interpreter
) -> RaggedScanOutput:
    """Runs the SSD recurrence over every sequence of a ragged batch (Pallas TPU kernel).

    `tile_size` must divide chunk_size; 128 suits every TPU generation, 256 may suit the
    256-wide MXUs of v6e / v7x when rows are long and chunk-aligned."""
    _layout.validate_inputs(x, dt, A, B, C, init_states, cu_seqlens, start_pos, chunk_size)
    cs = chunk_size
    tq = min(cs, DEFAULT_TILE) if tile_size is None else tile_size
    if not isinstance(tq, int) or tq < 1 or cs % tq:
        raise ValueError(f"tile_size must be a positive divisor of chunk_size {cs}, got {tq!r}")
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    hb = heads_per_block(num_heads, num_groups, head_dim)
    per_group = num_heads // num_groups
    gb = max(1, hb // per_group)  # groups per head block
    num_head_blocks, num_blocks = num_heads // hb, pl.cdiv(num_tokens, cs)

    rows = ragged.scan_rows(cu_seqlens, start_pos, num_tokens, cs)
    num_rows = rows.chunk_seq.shape[0]
    dt_masked, cum = _layout.row_decays(dt, A, cu_seqlens, start_pos, cs)  # [T, H] each
    # Rows starting in token block k: used rows are sorted by start; unused ones sort last.
    start_key = jnp.where(jnp.arange(num_rows) < rows.num_used, rows.row_start, num_blocks * cs + 1)
    block_rows = jnp.searchsorted(start_key, jnp.arange(num_blocks + 1, dtype=jnp.int32) * cs).astype(jnp.int32)

    def tokens_on_lanes(v):  # [T, H] -> [H / hb, hb, T]
        return v.T.reshape(num_head_blocks, hb, num_tokens)

    def tokens_on_sublanes(v):  # [T, H] -> [H / hb, T, hb]
        return v.reshape(num_tokens, num_head_blocks, hb).transpose(1, 0, 2)

    def token_blocks(shape, index):
        """Two BlockSpecs of one array: token block k ("lo") and k + 1 ("hi", clamped).

        index(h, kk) gives the block index for head block h and token block kk."""
        return [
            pl.BlockSpec(shape, lambda h, k, *_: index(h, k)),
            pl.BlockSpec(shape, lambda h, k, *_: index(h, jnp.minimum(k + 1, num_blocks - 1))),
        ]

    # Head block h reads the gb groups of its heads (or the one group it lies in).
    group_block = (lambda h: h) if hb >= per_group else (lambda h: lax.div(h * hb, per_group))
    x_specs = token_blocks((cs, hb * head_dim), lambda h, k: (k, h))
    bc_specs = token_blocks((cs, gb * state_size), lambda h, k: (k, group_block(h)))
    row_specs = token_blocks((pl.squeezed, hb, cs), lambda h, k: (h, 0, k))
    col_specs = token_blocks((pl.squeezed, cs, hb), lambda h, k: (h, k, 0))
    in_specs = [*x_specs, *bc_specs, *bc_specs, *row_specs, *row_specs, *col_specs, pl.BlockSpec(memory_space=pl.ANY)]
    out_specs = [
        pl.BlockSpec((cs, hb * head_dim), lambda h, k, *_: (k, h)),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    f32 = jnp.float32
    kernel = functools.partial(
        _scan_kernel,
        chunk_size=cs,
        tile=tq,
        head_dim=head_dim,
        state_size=state_size,
        heads_per_block=hb,
        heads_per_group=per_group,
        num_blocks=num_blocks,
    )
    y, chunk_states = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, num_heads * head_dim), f32),
            jax.ShapeDtypeStruct((num_rows, num_heads, head_dim, state_size), f32),
        ],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_head_blocks, num_blocks),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((2 * cs, hb * head_dim), f32),
                pltpu.VMEM((hb, head_dim, state_size), f32),
                pltpu.VMEM((2, hb, head_dim, state_size), f32),
                pltpu.SemaphoreType.DMA((3,)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT_BYTES
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        block_rows, rows.row_start, rows.row_len, rows.row_first, rows.row_seq,
        *(x.reshape(num_tokens, num_heads * head_dim),) * 2,
        *(B.reshape(num_tokens, num_groups * state_size),) * 2,
        *(C.reshape(num_tokens, num_groups * state_size),) * 2,
        *(tokens_on_lanes(cum),) * 2,
        *(tokens_on_lanes(dt_masked),) * 2,
        *(tokens_on_sublanes(cum),) * 2,
        init_states.astype(f32),
    )  # fmt: skip
    return RaggedScanOutput(
        y=y.reshape(num_tokens, num_heads, head_dim),
        final_states=ragged.final_states(rows, chunk_states, init_states),
        chunk_states=chunk_states,
        chunk_seq=rows.chunk_seq,
        chunk_end=rows.chunk_end,
    )
