"""Building an engine's parts from a model and its configuration, once: the weights quantized where asked, the
drafter built and placed, the KV pool sized, the device runner, and the host's rooms around it (the KV blocks, the
scheduler, the intake, the grammar tables, adaptive k's chooser, the step builder, the counters). The engine
(jaxspec.sched.engine) composes what this returns and runs the loop between them; no part is changed after it is
built: each asks the others what it needs (what is compiled: the runner's `compiled`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decode.compiler import FAST, TUNED
from jaxspec.decode.runner import ModelRunner
from jaxspec.decode.state import StepConfig
from jaxspec.lora.slots import AdapterSlots, with_adapter_slots
from jaxspec.nn.ops import Ops
from jaxspec.nn.sharding import TensorParallel
from jaxspec.sched.adaptive import KChooser
from jaxspec.sched.block_manager import BlockManager
from jaxspec.sched.config import EngineConfig
from jaxspec.sched.intake import Intake
from jaxspec.sched.scheduler import Scheduler
from jaxspec.sched.stats import EngineCounts
from jaxspec.sched.step_builder import StepBuilder
from jaxspec.structured.table import GrammarTables


@dataclasses.dataclass
class EngineParts:
    model: object                  # the target, quantized where the config asks
    config: EngineConfig           # as given, with the checkpoint's quantization where it had one
    speculative_config: object     # SpeculativeConfig or None
    step_config: StepConfig
    warmup_mode: str               # "tiered", "full", "fast" or "none" (EngineConfig.warmup_mode)
    runner: ModelRunner
    blocks: BlockManager
    scheduler: Scheduler
    intake: Intake
    grammar_tables: GrammarTables
    k_chooser: KChooser | None     # adaptive speculation, else None
    adapters: AdapterSlots | None  # LoRA adapters resident on the device (EngineConfig.enable_lora), else None
    builder: StepBuilder
    counts: EngineCounts
    prefix_cache_disabled_reason: str | None


def quantized_target(model, scheme: str | None):
    """The target with its projections quantized as `scheme` says (a model passed in already quantized is taken as it
    is; a ValueError names a mismatch)."""
    if scheme is None:
        return model
    if model.quantization is None:
        from jaxspec.nn import quant
        return dataclasses.replace(model, params=quant.quantize_params(model.params), quantization=scheme)
    if model.quantization != scheme:
        raise ValueError(f"quantization={scheme!r}, but the model passed in is quantized as {model.quantization!r}")
    return model


def refuse_lora_unless_attention_layers(model_config):
    """LoRA reaches the projections of the `attention` layer kind (Llama, Mistral, Qwen2, Qwen3); another kind's layers
    would run without their adapters: refused by name."""
    kinds = sorted(set(model_config.layer_types or ("attention",)) - {"attention"})
    if kinds:
        raise ValueError(f"enable_lora: this model has {', '.join(map(repr, kinds))} layers, whose projections take "
                         "no LoRA adapters yet; adapters are served over Llama, Mistral, Qwen2 and Qwen3 models")


def window_tokens(config: EngineConfig, scheduler: Scheduler, step_config: StepConfig) -> int | None:
    """With blocks released behind a sliding window: the most positions a request holds blocks for at once. The
    window's keys before a step, that step's tokens and the next one's, planned before the first is read (a chunk
    each, at most), the drafts in flight, and a block at each end."""
    window = scheduler.kv_window
    if window is None:
        return None
    k = step_config.num_speculative_tokens
    return window + 2 * config.max_num_batched_tokens + 2 * k + scheduler.draft_lookahead + 2 * config.block_size


def build_parts(model, config: EngineConfig, speculative_config=None) -> EngineParts:
    from jaxspec.spec import SpeculativeConfig, build_drafter
    config.validate()
    if config.quantization is None and getattr(model, "quantization", None):
        # a checkpoint stored quantized (FP8) runs as such, as vLLM takes the checkpoint's scheme
        config = dataclasses.replace(config, quantization=model.quantization)
    mc = model.config
    max_model_len = config.resolve_max_model_len(mc)
    spec = SpeculativeConfig.coerce(speculative_config)
    drafter, drafter_params = (build_drafter(spec, model, config.quantization, config.tensor_parallel_size)
                               if spec is not None else (None, None))
    model = quantized_target(model, config.quantization)
    if config.enable_lora:   # zeroed adapter slots beside each LoRA-able weight, in the params every step takes
        refuse_lora_unless_attention_layers(mc)
        model = dataclasses.replace(model, params=with_adapter_slots(model.params, mc, config.max_loras,
                                                                     config.max_lora_rank))
    draft_configs = [drafter.config] if drafter is not None and drafter.config is not None else []
    # a draft model kept whole on each device is not split: its widths need not divide by the devices
    whole_draft = drafter is not None and drafter.whole_on_each_device
    tp = TensorParallel.create(config.tensor_parallel_size, [mc] if whole_draft else [mc, *draft_configs])
    kv_dtype = jnp.dtype(config.kv_dtype(model.params["embed"].dtype))
    K = spec.num_speculative_tokens if spec else 0
    num_blocks = config.num_blocks(mc, -(-max_model_len // config.block_size), kv_dtype, tp,
                                   logit_rows=config.max_num_seqs * (K + 1))
    step_config = StepConfig(block_size=config.block_size, num_blocks=num_blocks, num_slots=config.max_num_seqs,
                             max_model_len=max_model_len, num_speculative_tokens=K,
                             logprobs_mode=config.logprobs_mode, kv_dtype=kv_dtype.name)
    ops = Ops.for_backend(config.block_size, config.attention, config.unroll_layers, tp, config.delta_rule,
                          config.quantization)
    warmup_mode = config.warmup_mode(gpu=jax.default_backend() == "gpu")
    runner = ModelRunner(model, step_config, ops, drafter, drafter_params, max_rows=config.max_num_seqs,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         # a tiered start serves from fast programs: a step that needs a missing one does not wait
                         # for autotuning either
                         on_demand_tier=FAST if warmup_mode in ("tiered", "fast") else TUNED)
    recurrent = sorted(k for k, f in runner.target.per_slot_fields(step_config.cache_shape).items() if f)
    prefix_cache_disabled_reason = config.prefix_caching_off_because(recurrent)
    caching = prefix_cache_disabled_reason is None
    blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs, enable_prefix_caching=caching,
                          key_overlap=int(drafter is not None and drafter.kv_reads_next_token))
    windows = [mc.kv_window] + [c.kv_window for c in draft_configs]   # each reader of the KV
    adapters = (AdapterSlots(mc, config.max_loras, config.max_lora_rank, runner.write_adapter)
                if config.enable_lora else None)
    scheduler = Scheduler(blocks, step_config, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens,
                          draft_lookahead=drafter is not None and drafter.needs_kv_lookahead,
                          kv_window=None if None in windows else max(windows),
                          token_budget=runner.compiled.token_budget, adapters=adapters)
    tokenizer = model.tokenizer
    intake = Intake(vocab_size=mc.vocab_size, eos_token_ids=tokenizer.eos_token_ids if tokenizer else mc.eos_token_ids,
                    tokenizer=tokenizer, step_config=step_config, num_kv_blocks=num_blocks,
                    draft_lookahead=scheduler.draft_lookahead, share_prompt_blocks=caching,
                    compile_timeout=config.structured_compile_timeout,
                    compile_memory=config.structured_compile_memory, seed=config.seed,
                    window_tokens=window_tokens(config, scheduler, step_config), adapters=adapters)
    # the device table of the automata running requests use (structured outputs)
    grammar_tables = GrammarTables(mc.vocab_size, runner.input_sharding)
    # adaptive speculation: the host picks each step's k (jaxspec.sched.adaptive); None: always K
    k_chooser = (KChooser(K, config.max_num_batched_tokens, runner.bucket_for, runner.compiled)
                 if spec is not None and spec.adaptive else None)
    return EngineParts(model=model, config=config, speculative_config=spec, step_config=step_config,
                       warmup_mode=warmup_mode, runner=runner, blocks=blocks, scheduler=scheduler, intake=intake,
                       grammar_tables=grammar_tables, k_chooser=k_chooser, adapters=adapters,
                       builder=StepBuilder(runner, step_config, grammar_tables, k_chooser),
                       counts=EngineCounts(K, adaptive=k_chooser is not None),
                       prefix_cache_disabled_reason=prefix_cache_disabled_reason)
