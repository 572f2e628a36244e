"""The model runner: owns the parameters and the donated pools and runs compiled steps."""

import dataclasses
import functools
import weakref
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef

from jaxengine.engine.device_inputs import DeviceInputs
from jaxengine.engine.mesh import Parallelism, Rules, axis_rules, param_shardings
from jaxengine.engine.multihost import Lockstep
from jaxengine.engine.pools import allocate_pools, pool_shardings
from jaxengine.engine.sampler import (
    SampleOutput,
    SamplingBatch,
    draft_tokens,
    fed,
    feed_of,
    prompt_logprobs,
    sample_tokens,
)
from jaxengine.engine.spec.acceptance import last_accepted_rows
from jaxengine.engine.step_executables import StepExecutables
from jaxengine.engine.step_store import StepStore
from jaxengine.models.batch import Pools, StepBatch
from jaxengine.models.config import ModelConfig
from jaxengine.models.draft_chain import draft_model_drafts
from jaxengine.models.kernels import kernel_ops
from jaxengine.models.mtp import mtp_drafts


def _model_step(
    graphdef: nnx.GraphDef,
    treedef: PyTreeDef,
    placement: Pools,
    param_leaves: list,
    pools: Pools,
    batch: StepBatch,
    *,
    decode: bool,
    all_logits: bool,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, Pools]:
    """One pure forward step: merges the model inside, returns logits and the new pools (in
    the shardings `placement`, those they came in: donation hands their buffers back)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))
    logits, pools = model(pools, batch, decode=decode, all_logits=all_logits, rows=rows)
    return _everywhere(logits), jax.lax.with_sharding_constraint(pools, placement)


def _everywhere(outputs):
    """`outputs` whole on every device: each process can read them (`multihost.py`)."""
    return jax.lax.with_sharding_constraint(outputs, PartitionSpec())


def _sample_step(
    graphdef: nnx.GraphDef,
    treedef: PyTreeDef,
    draft_graphdef: nnx.GraphDef | None,
    draft_treedef: PyTreeDef | None,
    placement: tuple[Pools | None, Pools],
    param_leaves: list,
    draft_leaves: list,
    pools: Pools,
    draft_pools: Pools | None,
    batch: StepBatch,
    sampling: SamplingBatch,
    feed: jax.Array,
    *,
    decode: bool,
    num_logprobs: int,
    num_step_drafts: int,
) -> tuple[SampleOutput, Pools | None, Pools]:
    """One engine step: forward, then sample each sequence's sample rows on device (and the
    prompt log-probabilities of the tokens `sampling.next_ids` asks for); with an MTP module
    or a draft model (in a step that runs it: `sampling.runs_drafter`; else `draft_leaves` are
    [] and `draft_pools` None), `num_step_drafts` drafts per sequence for the next step. The
    pools come back in the shardings `placement` (the draft's, the target's): those they came in.
    `feed`: the previous step's `SampleOutput.feed`, the tokens the host has not read yet."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))
    batch, sampling = fed(batch, sampling, feed)
    h, pools = model(pools, batch, decode=decode, hidden=True)  # [T, D]
    out = sample_tokens(model.head(h[sampling.sample_rows.reshape(-1)]), sampling, num_logprobs)  # [S, W, ...]
    out = dataclasses.replace(out, prompt=prompt_logprobs(model.head, h, sampling.next_ids, num_logprobs))
    out = dataclasses.replace(out, feed=feed_of(out.tokens, feed.shape[0]))
    last = last_accepted_rows(batch, sampling.sample_rows, sampling.num_drafts, out.tokens)  # [S]

    def choose(logits: jax.Array, i: int | jax.Array) -> jax.Array:
        return draft_tokens(logits, sampling, last, i)

    if model.mtp is not None and sampling.runs_drafter:
        drafts, pools = mtp_drafts(
            model,
            pools,
            batch,
            sampling.sample_rows,
            sampling.num_drafts,
            sampling.following_ids,
            sampling.wants_drafts,
            sampling.speculates,
            h,
            out.tokens,
            last,
            choose,
            num_step_drafts,
            kernel_ops(model.kernels),
        )
        out = dataclasses.replace(out, drafts=drafts)
    if draft_pools is None:  # no draft model, or a step without it
        return _everywhere(out), None, jax.lax.with_sharding_constraint(pools, placement[1])
    draft = nnx.merge(draft_graphdef, jax.tree.unflatten(draft_treedef, draft_leaves))
    drafts, draft_pools = draft_model_drafts(
        draft,
        draft_pools,
        batch,
        sampling.sample_rows,
        sampling.num_drafts,
        sampling.wants_drafts,
        sampling.speculates,
        out.tokens,
        last,
        choose,
        num_step_drafts,
        decode,
    )
    out = dataclasses.replace(out, drafts=drafts)
    # The pools in the order jit flattens the (keyword) arguments: it gives each donated
    # input buffer to the first output of its shape, and a draft may have the target's shapes.
    draft_pools, pools = jax.lax.with_sharding_constraint((draft_pools, pools), placement)
    return _everywhere(out), draft_pools, pools


def place_params(params: nnx.State, mesh: Mesh, rules: Rules) -> tuple[list[jax.Array], PyTreeDef]:
    """The parameters' leaves put on the mesh, each in the sharding its logical axes give
    (host arrays go straight to their shards), and their tree structure."""
    leaves, treedef = jax.tree.flatten(params)
    return [jax.device_put(x, s) for x, s in zip(leaves, param_shardings(params, mesh, rules))], treedef


class ModelRunner:
    """Holds a model's parameters and pools on a device mesh and runs steps on host-built batches."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        *,
        num_blocks: int,
        page_size: int,
        num_slots: int,
        feed_size: int = 1,
        num_logprobs: int = 20,
        num_step_drafts: int = 0,
        draft: tuple[ModelConfig, nnx.GraphDef, nnx.State] | None = None,
        parallelism: Parallelism | None = None,
        store: StepStore | None = None,
        kernels: str = "auto",
    ):
        self.cfg = cfg
        # What the compiled step bakes in besides its argument shapes: the model's settings
        # (norm epsilons, multipliers, routing, ...) and the kernels its graph calls.
        self._baked = repr((cfg, draft[0] if draft else None, kernels))
        self.page_size = page_size
        self.num_logprobs = num_logprobs
        # Drafts per sequence the MTP module or the draft model makes each step (with one).
        self.num_step_drafts = num_step_drafts
        parallelism = parallelism or Parallelism()
        self.mesh = parallelism.mesh()
        rules = axis_rules(cfg, self.mesh, parallelism.enable_expert_parallel)
        draft_rules = axis_rules(draft[0], self.mesh, parallelism.enable_expert_parallel) if draft else None
        dtype = jax.tree.leaves(params)[0].dtype
        sizes = dict(num_blocks=num_blocks, page_size=page_size, num_slots=num_slots, dtype=dtype, mesh=self.mesh)
        self._allocate = functools.partial(allocate_pools, cfg, **sizes, rules=rules)
        self._allocate_draft = (
            functools.partial(allocate_pools, draft[0], **sizes, rules=draft_rules) if draft else (lambda: None)
        )
        self.pools = self._allocate()
        self.draft_pools = self._allocate_draft()
        # The last step's sampled tokens, one per sequence row ([feed_size]: the largest
        # sequence bucket), on the device for the next step to take those the host has not read.
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._fresh_feed = functools.partial(jax.device_put, np.zeros(feed_size, np.int32), replicated)
        self.feed = self._fresh_feed()
        placement = pool_shardings(self.pools)
        # The steps are jitted here with the model's structure bound, and take the parameters
        # as a flat list: hashing the graph definition and flattening the parameter tree on
        # every call cost milliseconds of host time per step.
        self.param_leaves, self.param_treedef = place_params(params, self.mesh, rules)
        bound = dict(graphdef=graphdef, treedef=self.param_treedef)
        self.model_step = jax.jit(
            functools.partial(_model_step, **bound, placement=placement),
            static_argnames=("decode", "all_logits"),
            donate_argnames=("pools",),
        )
        # The draft model's parameters and pools (its pools: blocks and slots of the target's indices).
        self.draft_leaves, draft_treedef = place_params(draft[2], self.mesh, draft_rules) if draft else ([], None)
        self.sample_step = jax.jit(
            functools.partial(
                _sample_step,
                **bound,
                draft_graphdef=draft[1] if draft else None,
                draft_treedef=draft_treedef,
                placement=(pool_shardings(self.draft_pools), placement),
            ),
            static_argnames=("decode", "num_logprobs", "num_step_drafts"),
            donate_argnames=("pools", "draft_pools"),
        )
        # The pools' shapes and shardings, to compile against while the pools themselves are
        # donated to running steps.
        self.pool_specs, self.draft_pool_specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (self.pools, self.draft_pools)
        )
        # One executable per step shape, compiled (or loaded from `store`) ahead of its first
        # step, and called directly: no tracing, no dispatch through the jit's cache.
        self.steps = StepExecutables(self._lower, self._file_key, store or StepStore(None))
        # With several processes, process 0's steps run on the others too (`multihost.py`).
        self.lockstep = Lockstep()
        # The batch builder's inputs that steps ignore or that did not change since the last
        # step, kept on the devices in the shardings each executable takes them in.
        self.inputs = DeviceInputs()
        self._input_shardings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def pools_lost(self) -> bool:
        """Whether the pools were donated to a step that did not hand new ones back."""
        return any(leaf.is_deleted() for leaf in jax.tree.leaves((self.pools, self.draft_pools)))

    def reset_pools(self) -> None:
        """Fresh zero pools (after `pools_lost`): everything they held is gone."""
        self.lockstep.send("reset_pools")
        self.pools = self._allocate()
        self.draft_pools = self._allocate_draft()
        self.feed = self._fresh_feed()

    def logits(self, batch: StepBatch, decode: bool = False, all_logits: bool = False) -> jax.Array:
        """Runs one step and returns float32 logits (every token's when `all_logits`)."""
        self.lockstep.send("logits", batch, decode, all_logits)
        with jax.set_mesh(self.mesh):  # kernels run on each device's heads (`kernels.py`)
            logits, self.pools = self.model_step(
                param_leaves=self.param_leaves, pools=self.pools, batch=batch, decode=decode, all_logits=all_logits
            )
        return logits

    def sample(self, batch: StepBatch, sampling: SamplingBatch, decode: bool) -> SampleOutput:
        """Runs one step and samples each sequence's next token on device."""
        self.lockstep.send("sample", batch, sampling, decode)
        out, self.draft_pools, self.pools = self.steps.run(
            batch,
            sampling,
            decode,
            lambda executable: self.run_executable(executable, batch, sampling),
            can_retry=lambda: not self.pools_lost(),
        )
        self.feed = out.feed
        return out

    def run_executable(
        self, executable: jax.stages.Compiled, batch: StepBatch, sampling: SamplingBatch
    ) -> tuple[SampleOutput, Pools | None, Pools]:
        """Runs a step executable on the current pools (donating them) and returns the new
        ones (the draft model's, then the target's)."""
        shardings = functools.partial(self._shardings_of, executable)
        batch = self.inputs.swap(batch, lambda: shardings()[0])
        sampling = self.inputs.swap(sampling, lambda: shardings()[1])
        out, draft_pools, pools = executable(
            **self._step_args(batch, sampling, self.pools, self.draft_pools, self.feed)
        )
        return out, draft_pools if sampling.runs_drafter else self.draft_pools, pools

    def _shardings_of(self, executable: jax.stages.Compiled) -> tuple[StepBatch, SamplingBatch]:
        """The shardings `executable` takes its batch and sampling inputs in (a StepBatch and
        a SamplingBatch of them)."""
        shardings = self._input_shardings.get(executable)
        if shardings is None:
            kwargs = executable.input_shardings[1]
            shardings = self._input_shardings[executable] = (kwargs["batch"], kwargs["sampling"])
        return shardings

    def executable(self, batch: StepBatch, sampling: SamplingBatch, *, decode: bool) -> jax.stages.Compiled:
        """The step executable for this batch's shape: ready, loaded from the store, or compiled."""
        return self.steps.get(batch, sampling, decode)

    def _lower(self, batch: StepBatch, sampling: SamplingBatch, decode: bool) -> jax.stages.Lowered:
        with jax.set_mesh(self.mesh):  # kernels run on each device's heads (`kernels.py`)
            args = self._step_args(batch, sampling, self.pool_specs, self.draft_pool_specs, self._feed_spec)
            return self.sample_step.lower(
                **args, decode=decode, num_logprobs=self.num_logprobs, num_step_drafts=self.num_step_drafts
            )

    def _file_key(self, batch: StepBatch, sampling: SamplingBatch, decode: bool) -> str:
        static = dict(
            decode=decode, num_logprobs=self.num_logprobs, num_step_drafts=self.num_step_drafts, model=self._baked
        )
        return self.steps.store.key(
            static,
            *self._step_args(batch, sampling, self.pool_specs, self.draft_pool_specs, self._feed_spec).values(),
        )

    @property
    def _feed_spec(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.feed.shape, self.feed.dtype, sharding=self.feed.sharding)

    def _step_args(
        self,
        batch: StepBatch,
        sampling: SamplingBatch,
        pools: Pools,
        draft_pools: Pools | None,
        feed: jax.Array | jax.ShapeDtypeStruct,
    ) -> dict:
        """A step's arguments: the draft model's parameters and pools only to a step that runs it."""
        drafter = sampling.runs_drafter
        return dict(
            param_leaves=self.param_leaves,
            draft_leaves=self.draft_leaves if drafter else [],
            pools=pools,
            draft_pools=draft_pools if drafter else None,
            batch=batch,
            sampling=sampling,
            feed=feed,
        )

    def num_compiled_steps(self) -> int:
        """How many step executables this runner has compiled or loaded (for recompile checks)."""
        return len(self.steps.ready) + self.model_step._cache_size()

    def close(self) -> None:
        """Gives back what the runner holds: its step executables, its background compile
        (stopped after the compile in flight) and its device arrays. The runner cannot run
        steps after."""
        self.steps.close()
        self.inputs.delete()
        for leaf in jax.tree.leaves((self.pools, self.draft_pools, self.param_leaves, self.draft_leaves, self.feed)):
            if not leaf.is_deleted():
                leaf.delete()

    def warm_up(
        self,
        batches: list[tuple[StepBatch, SamplingBatch, bool]],
        progress: Callable | None = None,
        later: set = frozenset(),
    ) -> None:
        """Loads or compiles the step of every given (all-padding) batch before real work
        starts; the shapes in `later` that are not stored compile on a background thread."""
        self.steps.prepare(batches, later=later, progress=progress)
