"""Building an engine's parts: the model and its tokenizer, the draft model, the cache pool
sized for both, the batch builder, the speculator, the runner, the scheduler and the input
and output processors. Every engine argument the model cannot serve is an error here, before
any weights load."""

import dataclasses
from pathlib import Path

import jax

from jaxengine.cache.live_slots import LiveSlots
from jaxengine.engine import multihost
from jaxengine.engine.batch_builder import BatchBuilder
from jaxengine.engine.cache_sizing import CachePlan, log_plan, plan_cache
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.input_processor import InputProcessor
from jaxengine.engine.mesh import Parallelism
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.runner import ModelRunner
from jaxengine.engine.scheduler import Scheduler
from jaxengine.engine.spec.draft_model import load_draft
from jaxengine.engine.spec.speculator import Speculator
from jaxengine.engine.step_store import StepStore
from jaxengine.engine.structured_output import GrammarCompiler
from jaxengine.engine.tokenizer import load_tokenizer
from jaxengine.models.arch import checkpoint_dtype, load_model_config
from jaxengine.models.config import ModelConfig
from jaxengine.models.kernels import kernel_ops
from jaxengine.models.loader import load_model


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """What one `LLMEngine` is made of."""

    config: EngineConfig  # resolved: dtype, and the cache pool's size
    model_config: ModelConfig
    tokenizer: object | None
    max_model_len: int
    draft_config: ModelConfig | None
    plan: CachePlan
    builder: BatchBuilder
    spec: Speculator | None
    runner: ModelRunner
    scheduler: Scheduler
    inputs: InputProcessor
    outputs: OutputProcessor


def build_engine(model_dir: Path, config: EngineConfig, parallelism: Parallelism | None) -> EngineParts:
    """The parts of an engine serving `model_dir`; `parallelism`: where on the devices (default:
    the config's, from the first device on; data-parallel replicas start further on)."""
    config.validate()
    if config.num_nodes > 1:  # before anything touches a device
        multihost.join(config.distributed_init_addr, config.num_nodes, config.node_rank, config.distributed_timeout_s)
    if config.dtype == "auto":
        config = dataclasses.replace(config, dtype=checkpoint_dtype(model_dir))
    # Interpreted kernels run host callbacks, which a stored executable must not hold. The
    # engine stores its steps itself (`step_store`) and leaves JAX's process-wide persistent
    # cache as the program set it: executables that cache loads behind the store's back, in a
    # process that has compiled others, failed on XLA:CPU ("NOT_FOUND: Function ... not found").
    cache_dir = None if config.kernels.startswith("pallas-interpret") else config.compilation_cache_dir
    kernel_ops(config.kernels)  # kernels this machine cannot run: an error now, not at the first step
    declared = load_model_config(model_dir)
    parallelism = parallelism or config.parallelism
    parallelism.validate(declared)
    config.check_model(declared, model_dir)
    spec = config.speculative()
    uses_mtp = spec is not None and spec.uses_mtp
    cfg, graphdef, params = load_model(
        model_dir, config.dtype, config.kernels, mtp=uses_mtp, place=parallelism.placement(declared)
    )
    tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else model_dir)
    max_model_len = config.resolved_max_model_len(cfg)
    draft = None  # a draft model's (config, graph definition, parameters)
    if spec is not None and spec.model is not None:
        draft = load_draft(
            spec.model,
            cfg,
            dtype=config.dtype,
            kernels=config.kernels,
            max_model_len=max_model_len,
            parallelism=parallelism,
        )
    draft_config = draft[0] if draft else None
    plan = plan_cache(config, cfg, draft_config, [params, draft[2] if draft else None])
    config = plan.config
    caching = config.enable_prefix_caching
    k = spec.num_speculative_tokens if spec else 0
    slots = LiveSlots(config.resolved_num_ssm_slots()) if cfg.num_recurrent_layers else None
    if slots is not None and slots.num_live < 2 + k:
        raise ValueError(
            f"engine argument num_ssm_slots={slots.num_live} is below the {2 + k} slots one sequence "
            f"needs (its read and write slots and one per speculative token)"
        )
    builder = BatchBuilder(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        page_size=config.page_size,
        eos_token_ids=cfg.eos_token_ids,
        vocab_size=cfg.vocab_size,
        blocks_per_checkpoint=plan.blocks_per_checkpoint if caching else 0,  # no hits to read without caching
        saves_checkpoints=caching and plan.blocks_per_checkpoint > 0,
        num_speculative_tokens=k,
        recurrent=bool(cfg.num_recurrent_layers),
        drafter=spec is not None and spec.drafts_in_step,
    )
    speculator = Speculator(spec, seq_bucket=builder.seq_bucket, max_model_len=max_model_len) if spec else None
    runner = ModelRunner(
        cfg,
        graphdef,
        params,
        num_blocks=plan.num_blocks,
        page_size=config.page_size,
        num_slots=slots.num_slots if slots else 2,
        feed_size=builder.seq_buckets[-1],
        num_logprobs=config.max_logprobs,
        num_step_drafts=k if builder.drafter else 0,
        draft=draft,
        # Several processes: steps compiled each (a stored one holds its process's devices).
        store=StepStore(cache_dir if jax.process_count() == 1 else None),
        kernels=config.kernels,
        parallelism=parallelism,
    )
    scheduler = Scheduler(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        page_size=config.page_size,
        cache=plan.cache,
        slots=slots,
        retention_interval=plan.retention_interval,
        num_speculative_tokens=k,
        speculates=speculator.admits if speculator else None,
    )
    inputs = InputProcessor(
        model_dir,
        tokenizer,
        cfg.vocab_size,
        max_model_len,
        config.max_logprobs,
        config.page_size,
        pool_pages=plan.cache.pool.num_usable if plan.cache.has_kv else None,
        engine_seed=config.seed,
        grammars=GrammarCompiler(tokenizer, cfg.vocab_size, cfg.eos_token_ids),
    )
    outputs = OutputProcessor(tokenizer, cfg.eos_token_ids)
    log_plan(plan, cfg)  # once built: the line says the engine is ready
    return EngineParts(
        config,
        cfg,
        tokenizer,
        max_model_len,
        draft_config,
        plan,
        builder,
        speculator,
        runner,
        scheduler,
        inputs,
        outputs,
    )
