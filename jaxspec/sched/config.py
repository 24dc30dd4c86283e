"""An engine's configuration, checked once, and the sizes it implies: the context length and the KV pool."""
from __future__ import annotations

import dataclasses

# What a request's `logprobs` returns (vLLM's `logprobs_mode` names): the log-softmax of the target's logits as
# they come out of the model, or of the distribution sampled from (after penalties, the grammar, min_tokens,
# temperature and top-k/top-p/min-p; greedy rows: no temperature, no truncation). vLLM's "raw_logits" and
# "processed_logits" (unnormalised values) are not offered. Defined here, not beside the decode state that reads
# it, so that `validate` imports no JAX: the command-line tools check their flags with it before loading anything.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

# When the engine compiles its step programs (jaxspec.decode.compiler; docs/performance.md, "Start-up"):
#   "tiered"  the smallest token bucket's programs without autotuning, then the engine serves while the other buckets'
#             (without autotuning, in parallel) and every autotuned program (one at a time) compile in the background;
#             a step uses the best program compiled so far, and only buckets that are compiled (a larger one, padded,
#             or prefill in smaller chunks meanwhile)
#   "full"    every warm-up program autotuned before the engine serves (full speed from the first step)
#   "fast"    every warm-up program without autotuning before the engine serves, nothing autotuned later
#   "none"    nothing ahead: each program compiles when a step first needs it (autotuned)
#   "auto"    "tiered" on a GPU; "full" elsewhere (where both tiers are one compile)
# True means "full" and False "none".
WARMUP_MODES = ("auto", "tiered", "full", "fast", "none")

# Weight quantization on load (jaxspec.nn.quant): "fp8" stores the layers' projections as float8 e4m3 with
# per-output-channel scales, the target's and a draft model's or an EAGLE / EAGLE-3 / MTP head's.
QUANTIZATION_SCHEMES = ("fp8",)

# The KV cache's dtype (vLLM's `kv_cache_dtype` names) -> the pools' dtype: "auto" the model's; "fp8" (e4m3) or
# "fp8_e5m2" a byte per value, stored with a per-tensor scale of 1 (values past the format's largest saturate) and read
# back into the model's dtype by the attention. The names are those `import jax` needs not be run for.
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


# Pallas's Triton lowering offsets an array under 2^32 bytes with signed 32-bit element indices, which wrap for a
# one-byte array of 2^31 elements or more (jaxspec.pallas.gemv reads such weights as uint16 pairs): an fp8 KV pool on a
# GPU is kept below the first bound or at the second.
ONE_BYTE_POOL_WRAP = (2 ** 31, 2 ** 32)


@dataclasses.dataclass
class EngineConfig:
    max_num_seqs: int = 16
    max_model_len: int | None = None          # default: min(model's max positions, 4096)
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None          # default: from kv_memory_fraction on a GPU, else enough for all
    kv_memory_fraction: float | None = None   # share of free device memory for the KV pool (GPU default 0.5)
    # vLLM's name: the share of the device memory XLA's allocator may hold (its bytes_limit) that the engine fills,
    # weights, activations and the KV pool together; the pool is what the loaded weights and ACTIVATION_RESERVE leave
    gpu_memory_utilization: float | None = None
    async_scheduling: bool = True
    enable_prefix_caching: bool = True        # off by itself for models with per-slot (recurrent) layer state
    warmup: bool | str = "auto"               # WARMUP_MODES, or True ("full") / False ("none")
    seed: int = 0
    # Device-specific choices, measured on an H100 (docs/lab/2026-11-22-first-round-step.md); "auto" picks the GPU ones there.
    attention: str = "auto"           # "pallas" (reads KV pages in place) or "reference" (jnp gather)
    unroll_layers: bool | None = None  # layers unrolled (stacked weights indexed statically) or scanned
    delta_rule: str = "auto"     # Gated DeltaNet recurrence: "reference" (JAX scan), "pallas" (kernel), "auto" (GPU: kernel)
    tensor_parallel_size: int = 1     # devices the model is split over (nn/sharding.py)
    structured_compile_timeout: float = 30.0   # seconds one request's structured-outputs constraint may compile
    structured_compile_memory: float = 2.0     # GiB of memory one constraint's compile (its process) may use
    logprobs_mode: str = "raw_logprobs"   # what `logprobs` returns: "raw_logprobs" or "processed_logprobs" (vLLM's)
    quantization: str | None = None   # None (the checkpoint's dtype) or one of QUANTIZATION_SCHEMES
    kv_cache_dtype: str = "auto"      # one of KV_CACHE_DTYPES: the KV pools' dtype
    enable_lora: bool = False         # LoRA adapters per request (jaxspec.lora): max_loras device slots of rank
    max_loras: int = 1                # up to max_lora_rank, vLLM's names and defaults
    max_lora_rank: int = 16

    def validate(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size", "max_loras",
                     "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; it must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid; it must be >= 2")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid; it must be >= 1")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction < 1:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} is invalid; it must be in (0, 1)")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} is invalid; it must be in (0, 1]")
        sizings = [n for n in ("num_kv_blocks", "kv_memory_fraction", "gpu_memory_utilization")
                   if getattr(self, n) is not None]
        if len(sizings) > 1:
            raise ValueError(f"{' and '.join(sizings)} both size the KV pool; give one of them")
        if not (isinstance(self.structured_compile_timeout, (int, float)) and self.structured_compile_timeout > 0):
            raise ValueError(f"structured_compile_timeout={self.structured_compile_timeout!r} is invalid; it must be "
                             "a number of seconds > 0")
        if not (isinstance(self.structured_compile_memory, (int, float)) and self.structured_compile_memory > 0):
            raise ValueError(f"structured_compile_memory={self.structured_compile_memory!r} is invalid; it must be "
                             "a number of GiB > 0")
        if not isinstance(self.warmup, bool) and self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup={self.warmup!r} is invalid; choose True, False or one of "
                             f"{', '.join(map(repr, WARMUP_MODES))}")
        if self.attention not in ("auto", "pallas", "reference"):
            raise ValueError(f"attention={self.attention!r} is invalid; choose 'auto', 'pallas' or 'reference'")
        if self.delta_rule not in ("auto", "pallas", "reference"):
            raise ValueError(f"delta_rule={self.delta_rule!r} is invalid; choose 'auto', 'pallas' or 'reference'")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"quantization={self.quantization!r} is not supported; choose None or "
                             f"{', '.join(map(repr, QUANTIZATION_SCHEMES))}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora with tensor_parallel_size={self.tensor_parallel_size} is not implemented; "
                             "serve adapters with tensor_parallel_size=1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose "
                             f"{', '.join(map(repr, KV_CACHE_DTYPES))}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            logits_mode = self.logprobs_mode in ("raw_logits", "processed_logits")
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r} is invalid"
                             f"{' (vLLM logits modes are not supported)' if logits_mode else ''}; choose "
                             f"{' or '.join(map(repr, LOGPROBS_MODES))}")

    def warmup_mode(self, gpu: bool) -> str:
        """The warm-up mode this engine runs ("tiered", "full", "fast" or "none")."""
        if isinstance(self.warmup, bool):
            return "full" if self.warmup else "none"
        if self.warmup == "auto":
            return "tiered" if gpu else "full"
        return self.warmup

    def resolve_max_model_len(self, model_config) -> int:
        """The context length: the configured one, checked against the model's, or min(model's, 4096)."""
        most = model_config.max_position_embeddings
        max_model_len = self.max_model_len or min(most, 4096)
        if max_model_len > most:
            raise ValueError(f"max_model_len={max_model_len} is invalid for this model: it has "
                             f"max_position_embeddings={most}; give max_model_len in [2, {most}]")
        return max_model_len

    def prefix_caching_off_because(self, recurrent_layer_kinds: list[str]) -> str | None:
        """Why prefix caching is off (None: it is on). A cached block holds KV only: a layer kind with per-slot
        state (a recurrent state) would need that state at the prefix's end too, which is not kept, so such
        models run without the cache."""
        if not self.enable_prefix_caching:
            return "enable_prefix_caching=False"
        if recurrent_layer_kinds:
            return (f"the model's {', '.join(recurrent_layer_kinds)} layers keep a per-slot recurrent state that a "
                    "cached block of KV does not hold (the state at the prefix's end is not saved), so reusing cached "
                    "blocks would not be exact")
        return None

    def kv_dtype(self, model_dtype):
        """The KV pools' dtype: the model's (`kv_cache_dtype` "auto") or the fp8 format it names."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def num_blocks(self, model_config, max_blocks_per_seq: int, dtype, tp=None, logit_rows: int | None = None) -> int:
        """KV blocks in the pool of `dtype`: `num_kv_blocks` when given; on a GPU the blocks `kv_memory_fraction`
        (0.5) of its free memory holds, or with `gpu_memory_utilization` what that share of the allocator's limit
        leaves after the memory in use (weights) and activation_reserve, at most enough for every slot at
        max_model_len; elsewhere exactly that many. `logit_rows`: the most positions a step samples (its rows times
        the drafts plus one; default max_num_seqs). On a GPU a one-byte (fp8) pool stays out of ONE_BYTE_POOL_WRAP."""
        import jax
        import jax.numpy as jnp

        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform == "gpu" else None
        mc = model_config
        # one pool's (k's or v's) elements per block, on the device that holds the most of it
        per_block = mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
        if tp is not None and tp.shard_attention:
            per_block //= tp.size   # each device holds its KV heads' share of a block
        one_byte = stats is not None and jnp.dtype(dtype).itemsize == 1
        low, high = ONE_BYTE_POOL_WRAP
        if self.num_kv_blocks:
            if one_byte and low <= self.num_kv_blocks * per_block < high:
                raise ValueError(f"num_kv_blocks={self.num_kv_blocks} makes each fp8 KV pool "
                                 f"{self.num_kv_blocks * per_block:,} elements, which the GPU kernels cannot index "
                                 f"(2^31 to 2^32 one-byte elements); give at most {(low - 1) // per_block} or at "
                                 f"least {-(-high // per_block)}")
            return self.num_kv_blocks
        enough = self.max_num_seqs * max_blocks_per_seq
        if not stats:
            return enough
        limit, in_use = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
        per_block_bytes = 2 * per_block * jnp.dtype(dtype).itemsize     # k and v
        if self.gpu_memory_utilization is not None:
            reserve = self.activation_reserve(mc, logit_rows or self.max_num_seqs)
            room = self.gpu_memory_utilization * limit - in_use - reserve
            if room < per_block_bytes:
                raise ValueError(
                    f"gpu_memory_utilization={self.gpu_memory_utilization} gives the engine "
                    f"{self.gpu_memory_utilization * limit / 2**30:.2f} GiB of the device's {limit / 2**30:.2f} GiB; "
                    f"the weights hold {in_use / 2**30:.2f} GiB and steps of {self.max_num_batched_tokens} tokens "
                    f"need {reserve / 2**30:.2f} GiB, which leaves no room for a KV block of {per_block_bytes:,} "
                    f"bytes: raise gpu_memory_utilization (at most 1) or lower max_num_batched_tokens")
            blocks = min(enough, int(room // per_block_bytes))
        else:
            blocks = max(1, min(enough, int((limit - in_use) * (self.kv_memory_fraction or 0.5) // per_block_bytes)))
        if one_byte and low <= blocks * per_block < high:
            blocks = (low - 1) // per_block
        return blocks

    def activation_reserve(self, model_config, logit_rows: int) -> int:
        """Bytes kept out of a gpu_memory_utilization pool for what a step holds beside the weights and the pool:
        per token of max_num_batched_tokens its residual, attention and MLP intermediates (gate and up together) in
        4-byte words at most, and float32 logits with their log-softmax and sampling copies for `logit_rows`
        positions; twice over for XLA's temporaries and its GEMM autotuner's scratch, plus 1 GiB for the runtime."""
        mc = model_config
        per_token = 4 * (4 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
                         + 3 * max(mc.intermediate_size, mc.moe_intermediate_size))
        return 2 * (self.max_num_batched_tokens * per_token + 4 * logit_rows * mc.vocab_size * 4) + 2**30
