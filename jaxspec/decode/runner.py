"""The device side of an engine: the target's and the drafter's params and the decode state on the device, the
compiled steps (one per token bucket and variant), warm-up, and per step three dispatches (the inputs' load, the
step, the outputs' copy) and the output's copy to the host started. The engine loop (jaxspec.sched.engine) plans
steps and reads their outputs; it never touches device arrays other than the output it is waiting for.

Hooks for benchmarks and profiles: `bucket_for`, `last_inputs` and `replay` (run a live step's inputs again),
`issue_seconds` (host time to issue each step), `argument_buffers` (buffers each step call passes). Which programs are
compiled while some still compile in the background is `compiled`'s to say (jaxspec.decode.compiled).

Every buffer a step takes or returns keeps one address from step to step: the inputs are copied into a per-bucket inbox
and the outputs written into a per-variant outbox, both donated like the state. XLA captures the step as a CUDA graph
and re-records it whenever an address it captured changes, and on the GPU the re-recording, issued behind the running
step, holds the host 1-2 ms (docs/lab/2026-11-24-step-call-blocking.md). `_load_inputs` (host buffer -> inbox) and
`_copy_outputs` (outbox -> fresh arrays the host reads while the next step overwrites the outbox) move the data instead.
XLA's own temporary buffer can still move between steps; jaxspec.xla_flags's update mode covers it.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import pathlib
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decode.compiled import CompiledSteps
from jaxspec.decode.compiler import FAST, TUNED, ProgramStore, StepPrograms, store_wanted
from jaxspec.decode.inputs import StepInputs
from jaxspec.decode.state import DecodeState, StepConfig, init_state, state_schema
from jaxspec.decode.step import StepVariant, make_step, output_shapes
from jaxspec.nn import schema
from jaxspec.nn.decoder import Decoder
from jaxspec.nn.ops import LORA_A, LORA_B, Ops
from jaxspec.nn.sharding import PARAM_RULES, STATE_RULES
from jaxspec.sampling_params import MAX_LOGIT_BIAS

MIN_TOKEN_BUCKET = 8
# JAX settings a traced program depends on (the engine's fingerprint holds them)
_PROGRAM_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                     "jax_numpy_rank_promotion", "jax_threefry_partitionable")


def _load_inputs(inbox, buf):
    return jax.lax.dynamic_update_slice(inbox, buf, (0,))   # in place: inbox is donated


def _copy_outputs(outbox):
    return jax.tree_util.tree_map(jnp.copy, outbox)


def _write_logit_bias(table, slot, row):
    return table.at[slot].set(row)   # in place: table is donated


def logit_bias_row(bias: dict[int, float]) -> np.ndarray:
    """A request's row of the logit-bias table: i32[2, MAX_LOGIT_BIAS], its token ids (-1 padding), then its
    values' float32 bits."""
    row = np.zeros((2, MAX_LOGIT_BIAS), np.int32)
    row[0] = -1
    row[0, :len(bias)] = list(bias)
    row[1, :len(bias)] = np.asarray(list(bias.values()), np.float32).view(np.int32)
    return row


def _bytes_per_device(arrays) -> collections.Counter:
    """device -> bytes of these arrays it holds (its shard of each, or the whole of a replicated one)."""
    held = collections.Counter()
    for a in arrays:
        shard = int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for device in a.sharding.device_set:
            held[device] += shard
    return held


def _spec(a) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype and placement: what a program is compiled for."""
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


# Token ids a history write carries per dispatch: one program for every prefix length (a length-dependent shape
# would compile anew the first time a cached prefix of each size arrives: ~0.4 s of TTFT on an H100)
HISTORY_CHUNK = 256
# A program's first runs are no measure of its step's time: on a GPU XLA records the step's command buffer (a CUDA
# graph) on its first run and, in the SKIP_PROFILED update mode (jaxspec.xla_flags), learns over its first runs which
# allocations move. So neither adaptive k's step prices (jaxspec.sched.pricing) nor its measured periods (a pair
# without a device time) count them.
UNTIMED_RUNS = 2


def _write_history(state, slot, ids, start, n):
    pos = jnp.arange(ids.shape[0])
    return state.replace(history=state.history.at[slot, jnp.where(pos < n, start + pos, state.history.shape[1])].set(
        ids, mode="drop"))


class ModelRunner:
    def __init__(self, model, step_config: StepConfig, ops: Ops, drafter=None, drafter_params=None, *,
                 max_rows: int, max_num_batched_tokens: int, on_demand_tier: str = TUNED):
        self.target = Decoder(model.config, ops)
        self.step_config, self.ops = step_config, ops
        self.params, self.drafter, self.drafter_params = model.params, drafter, drafter_params
        self.dtype = model.params["embed"].dtype
        drafter_schema = drafter.state_schema(step_config) if drafter is not None else None
        self.state = init_state(self.target, step_config, self.dtype, drafter_schema)
        # Tensor parallelism: params and state placed on the mesh by their declared axes; the step keeps the
        # state's placement (it is donated) and returns its outputs whole.
        self.tp, self.state_shardings, self.input_sharding = ops.tp, None, None
        if self.tp is not None:
            tp = self.tp
            self.params = jax.device_put(self.params, tp.shardings(self.target.param_schema(), PARAM_RULES))
            # a drafter kept whole on each device (SpeculativeConfig.draft_tensor_parallel_size=1): no axis split
            whole = getattr(drafter, "whole_on_each_device", False)
            if drafter_params is not None:
                self.drafter_params = jax.device_put(
                    drafter_params, tp.shardings(drafter.param_schema(), () if whole else PARAM_RULES))
            self.state_shardings = DecodeState(**tp.shardings(state_schema(self.target, step_config), STATE_RULES),
                                               drafter=tp.shardings(drafter_schema, () if whole else STATE_RULES)
                                               if drafter_schema is not None else None)
            self.state = jax.device_put(self.state, self.state_shardings)
            self.input_sharding = tp.replicated
        self._write_history = jax.jit(_write_history, donate_argnums=(0,), out_shardings=self.state_shardings)
        # Each slot's logit bias (decode.step.row_logit_bias), written when a request with one takes the slot and
        # read only by the steps of logit-bias variants: it costs other steps nothing.
        self.logit_bias_table = jnp.zeros((step_config.num_slots + 1, 2, MAX_LOGIT_BIAS), jnp.int32,
                                          device=self.input_sharding)
        self._write_logit_bias = jax.jit(_write_logit_bias, donate_argnums=(0,), out_shardings=self.input_sharding)
        self._load_inputs = jax.jit(_load_inputs, donate_argnums=(0,), out_shardings=self.input_sharding)
        self._copy_outputs = jax.jit(_copy_outputs, out_shardings=self.input_sharding)
        # An engine across processes (jaxspec.distributed): on process 0, called with each device operation
        # (method name, arguments) before it is made, so the other processes make it too, in the same order.
        self.mirror: Callable[..., None] | None = None
        self._inboxes: dict[int, jax.Array] = {}                  # per bucket
        self._outboxes: dict[tuple[int, StepVariant], dict] = {}  # per bucket and variant
        cap = max(max_num_batched_tokens, MIN_TOKEN_BUCKET)
        self.token_buckets = [b for b in (MIN_TOKEN_BUCKET << i for i in range(32)) if b < cap] + [cap]
        # A step has at most one row per token, and at least MIN_TOKEN_BUCKET rows even when max_num_seqs is
        # smaller: with a single row the logits matmul has one row, which XLA runs as a slow matrix-vector
        # product on a GPU (measured: +0.9 ms per step at Qwen2.5-1.5B's vocabulary).
        self.max_rows = max(max_rows, MIN_TOKEN_BUCKET)
        self.on_demand_tier = on_demand_tier   # the tier a step compiles at when it first needs a missing program
        self.compiled_on_demand = 0   # programs a step waited for (not compiled ahead)
        self._blank_inputs: dict[int, StepInputs] = {}
        self.last_inputs: dict[int, tuple[StepVariant, np.ndarray]] = {}
        self._last_grammar: dict[int, object] = {}   # the grammar table each bucket's last live step read
        self.issue_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        self.last_run_compiled = False   # the last `run` compiled its step (its time is no measure of the step)
        self._runs: collections.Counter = collections.Counter()   # runs per program key
        # the last `run` compiled its step or ran its program for one of the first UNTIMED_RUNS times: either way
        # its time is no measure of the step (adaptive k times its steps)
        self.last_run_untimed = False
        # What the programs take, as shapes, dtypes and placements: compiles on another thread never touch the
        # live (donated) state.
        self._arg_specs = jax.tree_util.tree_map(_spec, (self.params, self.drafter_params, self.state))
        self._logit_bias_spec = _spec(self.logit_bias_table)
        self._box_sharding = self.input_sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        # The devices every step program runs on, in the order it is compiled for: the mesh's, or the one device.
        self.device_ids = [d.id for d in (self.tp.mesh.devices.flat if self.tp is not None else jax.devices()[:1])]
        # The compiled step programs (jaxspec.decode.compiler), keyed by (bucket, variant, grammar table shapes),
        # kept on disk beside JAX's persistent cache (and only while that is on), and what of them a step may use.
        store = None
        if jax.config.jax_compilation_cache_dir and store_wanted(jax.devices()[0].platform):
            from jaxspec.cache import cache_dir
            store = ProgramStore(cache_dir() / "programs", self.fingerprint(), self.device_ids)
        self.programs = StepPrograms(self._lower_program, self._tiers, store)
        self.compiled = CompiledSteps(self.programs, self.program_key, self.token_buckets,
                                      step_config.num_speculative_tokens, max_num_batched_tokens)

    # ---- shapes ------------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        """The bucket a step of `num_tokens` runs at (the smallest compiled one that holds it: `compiled`)."""
        return self.compiled.bucket_for(num_tokens)

    def rows_for(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_rows)

    def new_inputs(self, num_tokens: int) -> StepInputs:
        """Fresh host inputs for bucket `num_tokens`, every token and row padding (a copy of the bucket's
        blank: copying is several times cheaper than filling the padding again)."""
        blank = self._blank_inputs.get(num_tokens)
        if blank is None:
            sc = self.step_config
            blank = self._blank_inputs[num_tokens] = StepInputs(num_tokens, self.rows_for(num_tokens), sc.num_slots,
                                                                sc.max_blocks_per_seq)
        return blank.copy()

    # ---- running -----------------------------------------------------------------------------------
    def mirror_to(self, send: Callable[..., None] | None):
        """An engine across processes (jaxspec.distributed), on process 0: `send` is called with each device operation
        (method name, arguments) before it is made, so that the other processes make it too, in the same order.
        None: no more."""
        self.mirror = send

    def _tiers(self, T: int) -> tuple[str, ...]:
        """The tiers bucket T's programs have, cheapest first (one where both compile alike)."""
        fast, tuned = self.ops.compiler_options(T, FAST), self.ops.compiler_options(T, TUNED)
        return (TUNED,) if fast == tuned else (FAST, TUNED)

    def jitted_step(self, T: int, variant: StepVariant, tier: str = TUNED):
        """Bucket T's step for this variant as a jitted function (for tracing and lowering; steps run compiled
        programs)."""
        out_shardings = None if self.tp is None else (self.state_shardings, self.tp.replicated)
        return make_step(self.target, self.drafter, self.step_config, T, self.rows_for(T), variant, out_shardings,
                         self.ops.compiler_options(T, tier))

    def _lower_program(self, key, tier: str, grammar_spec=None):
        """(lowered program of `key` at `tier`, trace seconds, lower seconds), from the arguments' specs alone."""
        T, variant, _ = key
        params, drafter_params, state = self._arg_specs
        box = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self._box_sharding)   # noqa: E731
        inbox = box(self.new_inputs(T).pack())
        outbox = jax.tree_util.tree_map(box, output_shapes(variant, self.step_config, self.rows_for(T),
                                                           self.target.config.vocab_size, T))
        tables = ([grammar_spec] if variant.grammar else []) + ([self._logit_bias_spec] if variant.logit_bias else [])
        t0 = time.perf_counter()
        traced = self.jitted_step(T, variant, tier).trace(params, drafter_params, state, inbox, outbox, *tables)
        t1 = time.perf_counter()
        lowered = traced.lower()
        return lowered, t1 - t0, time.perf_counter() - t1

    def fingerprint(self) -> str:
        """What the step programs are compiled from, hashed: the arguments' shapes, dtypes and placements, the model's
        and drafter's configurations, the step's, the engine's ops, the versions of JAX and jaxlib, XLA_FLAGS and the
        JAX settings that change a program, jaxspec's own source, and the devices. Two engines with one fingerprint
        compile the same programs."""
        import os

        import jaxlib

        import jaxspec
        root = pathlib.Path(jaxspec.__file__).parent
        source = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            source.update(path.read_bytes())
        drafter = None if self.drafter is None else (type(self.drafter).__name__, repr(getattr(self.drafter, "config", None)))
        facts = (repr(jax.tree_util.tree_map(lambda s: (s.shape, str(s.dtype), repr(s.sharding)), self._arg_specs)),
                 repr(self.target.config), repr(drafter), repr(self.step_config), self.max_rows,
                 repr(dataclasses.replace(self.ops, autotune_cache_dir=None)), jax.__version__, jaxlib.__version__,
                 os.environ.get("XLA_FLAGS", ""), [getattr(jax.config, f) for f in _PROGRAM_SETTINGS],
                 jax.devices()[0].device_kind, jax.device_count(), source.hexdigest())
        return hashlib.sha256(repr(facts).encode()).hexdigest()[:24]

    @staticmethod
    def program_key(T: int, variant: StepVariant, grammar_table=None) -> tuple:
        """A program's key: a grammar variant is compiled for its table's shapes (a grown table: a new program)."""
        if not variant.grammar:
            return (T, variant, None)
        leaves, tree = jax.tree_util.tree_flatten(grammar_table)
        return (T, variant, (tree, tuple(a.shape for a in leaves)))

    def step_fn(self, T: int, variant: StepVariant, grammar_table=None):
        """The compiled program of bucket T and this variant, about to run (the best tier compiled so far; compiled
        now at `on_demand_tier` when there is none, and `last_run_compiled` set; `last_run_untimed` set)."""
        key = self.program_key(T, variant, grammar_table)
        program = self.programs.get(key)
        if program is None:
            grammar_spec = jax.tree_util.tree_map(_spec, grammar_table) if variant.grammar else None
            self.programs.compile([key], self.on_demand_tier, grammar_spec, parallel=False)
            self.compiled_on_demand += 1
            self.last_run_compiled = True
            program = self.programs.get(key)
        self.last_run_untimed = self.last_run_compiled or self._runs[key] < UNTIMED_RUNS
        self._runs[key] += 1
        return program

    def run(self, inputs: StepInputs, variant: StepVariant, grammar_table=None) -> dict:
        """Copies the inputs over, issues the step, starts copying its outputs back (device arrays). A grammar
        variant also reads `grammar_table` (jaxspec.decode.grammar.GrammarTable, already on the device)."""
        t0 = time.perf_counter()
        # The packed host buffer goes straight into the load's call, which transfers it (a separate
        # jax.device_put cost ~40 us more host time per step on the CPU backend). It is built for this step
        # alone and never written again: on the CPU backend the call may read it after returning.
        out = self.run_packed(inputs.token_matrix.shape[1], variant, inputs.pack(), grammar_table)
        self.issue_seconds.append(time.perf_counter() - t0)
        return out

    def run_packed(self, T: int, variant: StepVariant, buf: np.ndarray, grammar_table=None, record: bool = True
                   ) -> dict:
        """`run` from the packed inputs of bucket T: what a follower process runs (jaxspec.distributed). `record`:
        kept as bucket T's last live inputs (what `replay` runs again; a timed blank step is not)."""
        self.last_run_compiled = False   # step_fn sets it when it compiles
        if self.mirror is not None:
            if grammar_table is not None:   # its tables live on the leader's devices alone
                raise ValueError("structured outputs are not supported by an engine across processes")
            self.mirror("run_packed", T, variant, buf, None, record)
        out = self._issue(T, variant, buf, grammar_table)
        for array in out.values():
            array.copy_to_host_async()
        if record:
            self.last_inputs[T] = (variant, buf)
            self._last_grammar[T] = grammar_table
        return out

    def write_history(self, slot: int, token_ids: list[int]):
        """The slot's device history gets the ids of a prefix that came from the prefix cache (no step
        computes them; penalties and prompt lookup read them). Small dispatches of HISTORY_CHUNK ids each."""
        if self.mirror is not None:
            self.mirror("write_history", slot, list(token_ids))
        for start in range(0, len(token_ids), HISTORY_CHUNK):
            self._write_history_chunk(slot, token_ids[start:start + HISTORY_CHUNK], start)

    def _write_history_chunk(self, slot: int, chunk, start: int):
        ids = np.zeros(HISTORY_CHUNK, np.int32)
        ids[:len(chunk)] = chunk
        self.state = self._write_history(self.state, np.int32(slot), ids, np.int32(start), np.int32(len(chunk)))

    def write_logit_bias(self, slot: int, row: np.ndarray):
        """The slot's row of the logit-bias table (`logit_bias_row`): one small dispatch, ordered before the steps
        that read it (a step already dispatched keeps the table it was given)."""
        if self.mirror is not None:
            self.mirror("write_logit_bias", slot, row)
        self.logit_bias_table = self._write_logit_bias(self.logit_bias_table, np.int32(slot), row)

    def replay(self, T: int) -> dict:
        """Runs bucket T's last live inputs again (benchmarks: the device time of a real step). Each replay
        advances the same rows by one more token; abort those requests afterwards."""
        if self.mirror is not None:
            self.mirror("replay", T)
        variant, buf = self.last_inputs[T]
        return self._issue(T, variant, buf, self._last_grammar.get(T))

    def _issue(self, T: int, variant: StepVariant, buf, grammar_table) -> dict:
        """inbox <- buf (the packed host inputs), the step (state and boxes donated), a fresh copy of its
        outputs."""
        inbox = self._load(T, buf)
        outbox = self._outboxes.pop((T, variant), None)
        if outbox is None:
            outbox = self.new_outbox(T, variant)
        program = self.step_fn(T, variant, grammar_table)
        self.state, outbox = program(self.params, self.drafter_params, self.state, inbox, outbox,
                                     *self._table_args(variant, grammar_table))
        self._outboxes[(T, variant)] = outbox
        return self._copy_outputs(outbox)

    def write_adapter(self, slot: int, adapter: dict | None):
        """LoRA adapter slot `slot` of the target's params (jaxspec.lora.slots) <- `adapter`'s arrays ({kind: {name:
        (A [L, R, K], B [L, ..., R])}}), or zeros for None. New arrays: a step in flight keeps the ones it was given."""
        layers = dict(self.params["layers"])
        for kind, stacks in layers.items():
            stacks = dict(stacks)
            for key in [k for k in stacks if k.endswith(LORA_A) or k.endswith(LORA_B)]:
                name, part = (key[:-len(LORA_A)], 0) if key.endswith(LORA_A) else (key[:-len(LORA_B)], 1)
                value = (adapter or {}).get(kind, {}).get(name)
                stack = stacks[key]
                new = jnp.zeros(stack.shape[:1] + stack.shape[2:], stack.dtype) if value is None else value[part]
                stacks[key] = stack.at[:, slot].set(jnp.asarray(new, stack.dtype))
            layers[kind] = stacks
        self.params = {**self.params, "layers": layers}

    def _load(self, T: int, buf) -> jax.Array:
        """Bucket T's inbox (made on first use) <- buf."""
        inbox = self._inboxes.pop(T, None)
        if inbox is None:
            inbox = jnp.zeros(buf.shape, buf.dtype, device=self.input_sharding)
        inbox = self._inboxes[T] = self._load_inputs(inbox, buf)
        return inbox

    def new_outbox(self, T: int, variant: StepVariant) -> dict:
        """Device buffers shaped as bucket T's outputs under this variant (the step writes into them)."""
        shapes = output_shapes(variant, self.step_config, self.rows_for(T), self.target.config.vocab_size, T)
        # made on the device: a CPU device_put of host zeros may alias host memory, which cannot be donated
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype, device=self.input_sharding), shapes)

    def _table_args(self, variant: StepVariant, grammar_table) -> tuple:
        """The tables the variant reads, in make_step's order: the grammar table (only grammar variants take it: a
        new table shape recompiles those steps alone), then the logit-bias table."""
        tables = []
        if variant.grammar:
            if grammar_table is None:
                raise ValueError("a grammar step variant needs the grammar table")
            tables.append(grammar_table)
        if variant.logit_bias:
            tables.append(self.logit_bias_table)
        return tuple(tables)

    def warmup(self, variants, grammar_table=None, tier: str | None = None, buckets=None, desc="compiling steps"):
        """Compiles the programs of these variants for every token bucket (or `buckets`) at `tier` (None: each
        bucket's best). Grammar variants are compiled for `grammar_table`'s shapes."""
        buckets = self.token_buckets if buckets is None else buckets
        keys = [self.program_key(T, v, grammar_table) for T in buckets for v in variants]
        grammar_spec = jax.tree_util.tree_map(_spec, grammar_table) if grammar_table is not None else None
        self.programs.compile(keys, tier, grammar_spec, desc=desc)

    def warm_transfers(self, variants, buckets=None):
        """Compiles the small programs around the steps for every bucket (or `buckets`) and variant: the inbox
        load, the outputs' copy, their buffers' creation, a history write and a logit-bias write, each run once
        on blank data (no row reads it). Left to the first live step, each compiled there: on an H100 the first
        request after warm-up waited ~0.4 s for them."""
        for T in self.token_buckets if buckets is None else buckets:
            self._load(T, self.new_inputs(T).pack())
            for variant in variants:   # placed as a step returns them (committed): a program per placement
                self._copy_outputs(jax.device_put(self.new_outbox(T, variant), self._box_sharding))
        # the state as the steps leave it (committed to its devices), so the write below compiles for it
        self.state = jax.device_put(self.state, self.state_shardings or self._box_sharding)
        spare = self.step_config.num_slots   # the state's and the table's row no request holds
        self._write_history_chunk(spare, [], 0)   # no ids: writes nothing
        self.logit_bias_table = self._write_logit_bias(self.logit_bias_table, np.int32(spare), logit_bias_row({}))

    # ---- facts -------------------------------------------------------------------------------------
    def num_compiled(self) -> int:
        """Step programs compiled (each (bucket, variant, grammar shapes) once, whatever its tier)."""
        return self.programs.num_programs()

    def last_variant(self, T: int) -> tuple:
        """(variant, grammar table or None) of bucket T's last live step."""
        return self.last_inputs[T][0], self._last_grammar.get(T)

    def kernels_per_step(self, T: int, variant: StepVariant = StepVariant(), grammar_table=None) -> int:
        """Instructions of the compiled step's entry computation that launch work (fusions, custom calls,
        copies, ...; not parameters, constants, bitcasts or tuple plumbing): the kernels one step of bucket T
        runs, from the compiled HLO of this backend."""
        text = self.lower(T, variant, grammar_table).compile().as_text()
        entry = text[text.index("ENTRY"):]
        entry = entry[:entry.index("\n}")]
        plumbing = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}
        ops = re.findall(r"= (?:\([^=]*?\)|[^\s(]+) ([\w-]+)\(", entry)   # the opcode after each result's shape
        return sum(op not in plumbing for op in ops)

    def lower(self, T: int, variant: StepVariant = StepVariant(), grammar_table=None):
        """Bucket T's step lowered for this variant (jax.stages.Lowered: its HLO, its arguments)."""
        buf = jax.device_put(self.new_inputs(T).pack(), self.input_sharding)
        return self.jitted_step(T, variant).lower(self.params, self.drafter_params, self.state, buf,
                                                  self.new_outbox(T, variant), *self._table_args(variant, grammar_table))

    def argument_buffers(self) -> int:
        """Buffers one step call passes: params, drafter params, decode state, the inbox, the outbox."""
        return schema.num_buffers(self.params, self.drafter_params, self.state) + 1 + len(
            jax.tree_util.tree_leaves(output_shapes(StepVariant(), self.step_config, self.max_rows, 1)))

    def weight_bytes(self, per_device: bool = False) -> int:
        """Bytes of the target's weights: in all, or (per_device) on the device that holds the most (under tensor
        parallelism a device holds its shards and every replicated weight whole: what it reads in a step)."""
        leaves = jax.tree_util.tree_leaves(self.params)
        if not per_device:
            return sum(x.size * x.dtype.itemsize for x in leaves)
        return max(_bytes_per_device(leaves).values())

    def kv_bytes_per_token(self, per_device: bool = False) -> int:
        """Bytes of target KV one token of context occupies (every attention layer's k and v): in all, or
        (per_device) on the device that holds the most (KV heads split under tensor parallelism, or replicated)."""
        kv = list(self.state.layers.get("attention", {}).values())
        whole = sum(int(np.prod(a.shape[:1] + a.shape[2:])) * a.dtype.itemsize for a in kv)
        if not per_device or not kv:
            return whole
        held = _bytes_per_device(kv)   # the pools' bytes on each device; their tokens' share is the same
        return int(whole * max(held.values()) / sum(a.size * a.dtype.itemsize for a in kv))
