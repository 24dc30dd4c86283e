"""Shared fixtures: CPU JAX, tiny random HF checkpoints (session-scoped), the SmolLM2 GGUF preset file."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One thread for the math libraries of the references (torch's OpenMP and MKL, numpy's OpenBLAS): their threads
# wait for each other at every operation, and the suite runs beside another busy process (CI's second xdist
# worker), whose core a second thread waits for. With a busy-looping process beside it, transformers' greedy
# generate of tests/test_engine.py took ~10x the time with two threads; alone, one thread costs ~1.2x on the
# same calls. (XLA's CPU runtime has its own thread pool, which these variables leave as it is.) Set before any
# of them is imported, and inherited by the xdist workers and subprocesses.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
# Four CPU devices for the tensor-parallel tests (everything else runs on the first).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
# The suite's time is mostly XLA compiling tiny steps on the CPU, and most of that LLVM's optimisation of the
# generated code: without it a step compiles in about half the time and the tiny models run as fast as they
# need to. (IEEE semantics hold at every level: no fast-math either way.)
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def _cpu_elemental_emitters():
    """XLA's CPU fusions compiled by its elemental IR emitters instead of the MLIR fusion emitters that are its
    default: a speculative step of the tiny models compiles in ~1/3 of the time (~9-13 s against ~27-37 s for a
    draft model's adaptive-k steps) and runs no slower (faster: ~2.4 s against ~5 s for the same requests three
    times); both emit IEEE arithmetic and the tokens were the same. Only where jaxlib knows the flag (XLA aborts on
    an unknown one). Returns the compile option that restores XLA's default, {} where it is the default."""
    from jaxspec.xla_flags import _libraries, _libraries_name   # stdlib only: JAX is not imported here
    flag = "xla_cpu_use_fusion_emitters"
    if flag not in os.environ["XLA_FLAGS"] and _libraries_name(flag, _libraries()):
        os.environ["XLA_FLAGS"] += f" --{flag}=false"
    return {flag: True} if f"--{flag}=false" in os.environ["XLA_FLAGS"] else {}   # (xdist: the parent set it)


# XLA's default CPU emitters as a compile option: for what counts the fusions of a compiled step
# (tests/test_hot_path.py), whose bounds are the default emitters' (the elemental ones fuse less)
DEFAULT_CPU_EMITTERS = _cpu_elemental_emitters() if os.environ["JAX_PLATFORMS"] == "cpu" else {}
# A per-session persistent compilation cache: engines whose steps differ only in params or in async/sync
# scheduling (many of tests/test_spec.py) compile once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxspec-test-jit-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402

from random_drafts import perturbed  # noqa: E402,F401  (the tests import it from here)


def _dequantize_with_optimisation():
    """Real models' GGUF tensors are dequantized by small jitted programs (jaxspec.models.dequant) that run once
    per tensor over hundreds of megabytes: without LLVM's optimisation (above) a 0.5B model loads in ~1.7x the
    time. They are few and compile in a moment, so they keep it."""
    import jax
    from jaxspec.models import dequant
    dequant._dequantize_blocks = jax.jit(dequant._dequantize_blocks.__wrapped__, static_argnums=(1, 2),
                                         compiler_options={"xla_backend_optimization_level": 2})


if "xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]:
    _dequantize_with_optimisation()


def optimized_env(**extra) -> dict:
    """os.environ for a subprocess that runs a real model (the SmolLM2 server, the quickstart notebook's kernel):
    XLA_FLAGS without the suite's --xla_backend_optimization_level=0, so that its steps get LLVM's optimisation, as
    optimize_steps gives an in-process engine (SmolLM2's steps run far more often than they compile: the
    notebook took ~1/3 less CPU time so). Everything else is the suite's (the compilation cache, the emitters)."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "")
    return {**os.environ, "XLA_FLAGS": " ".join(flags.split()), **extra}


@pytest.fixture
def optimized_steps(monkeypatch):
    """Every engine the test builds compiles its steps with LLVM's optimisation (what optimize_steps gives one
    engine), engines built out of the test's reach included (jaxspec-bench's): for a real model, whose steps cost
    more to run than to compile (jaxspec-bench's SmolLM2 matrix, tests/test_bench.py: half the CPU time)."""
    from jaxspec.nn.ops import Ops
    options = Ops.compiler_options
    monkeypatch.setattr(Ops, "compiler_options", lambda self, num_tokens, tier="tuned": {
        **options(self, num_tokens, tier), "xla_backend_optimization_level": 2})


def optimize_steps(llm):
    """Compiles `llm`'s steps with LLVM's optimisation, which the suite otherwise leaves out (above): for a real
    model, whose steps run many times and cost more to run than to compile. Returns llm."""
    import dataclasses
    from jaxspec.nn.ops import Ops

    class OptimizedOps(Ops):
        def compiler_options(self, num_tokens: int, tier: str = "tuned") -> dict:
            return {**super().compiler_options(num_tokens, tier), "xla_backend_optimization_level": 2}
    runner = llm.engine.runner
    runner.ops = OptimizedOps(**{f.name: getattr(runner.ops, f.name) for f in dataclasses.fields(Ops)})
    return llm

TINY_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

# name -> (transformers config class name, extra config kwargs, max_shard_size or None)
TINY_MODELS = {
    "llama": ("LlamaConfig", dict(rms_norm_eps=1e-5, rope_theta=10000.0), None),
    "llama3_tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)), None),
    "llama_sharded": ("LlamaConfig", dict(), "60KB"),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=False), None),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False), None),
    # GGUF-only (jaxspec's HF-dir loader accepts llama3 rope scaling only): linear rope scaling, factor 2.
    "llama_linear": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=2.0)), None),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads a real 0.5B+ model (kept in CI, seconds to a minute)")
    config.addinivalue_line("markers", "gpu: needs a GPU (tests/gpu); skipped on any other backend")


# The files that take longest on two cores (seconds of one worker, --durations=0 at aa1a3c6), longest first. The
# suite runs them first (pytest_collection_modifyitems; xdist's --dist loadfile hands whole files out in collection
# order, pyproject's --no-loadscope-reorder), so the two workers end together on short files: xdist's default order
# (files with the most tests first) left the notebook and the real-model files for the end, one worker running them
# alone for minutes. A file not named here runs after these, in its own order.
LONGEST_FIRST = ["test_adaptive_k.py", "test_spec_sampling.py", "test_train.py", "test_spec_layouts.py",
                 "test_engine.py", "test_long_context.py", "test_spec.py", "test_tp.py", "test_serve.py",
                 "test_hybrid.py", "test_eagle3_families.py", "test_notebook.py", "test_fp8.py",
                 "test_structured.py", "test_bench.py", "test_serve_ray.py", "test_serve_fields.py",
                 "test_model_parity.py", "test_hot_path.py", "test_gguf_tokenizer.py", "test_pard_train.py",
                 "test_paged_attention.py", "test_prefill_attention.py", "test_structure.py",
                 "test_sliding_window.py", "test_startup.py", "test_lora.py", "test_parallel_drafter.py",
                 "test_prefix_cache.py", "test_qwen3_moe.py", "test_gemma3.py", "test_distributed.py",
                 "test_spec_reference.py", "test_loaders.py", "test_core.py", "test_gpt_oss.py",
                 "test_train_packing.py"]


def pytest_collection_modifyitems(config, items):
    """Longest files first (LONGEST_FIRST; the order within a file is kept).

    tests/gpu: what only a GPU shows (Pallas kernels lowered through Triton, XLA's CUDA graphs, bf16 engines on the
    device), each test marked `gpu` and skipped on any other backend. The CPU is the default above, so the GPU
    machine names its platform and runs them in one process: JAX_PLATFORMS=cuda python -m pytest -q -n 0 tests/gpu"""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)) if item.path.parent.name == "tests" else len(rank))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (JAX backend: {jax.default_backend()}); on the GPU machine: "
                                   "JAX_PLATFORMS=cuda python -m pytest -q -n 0 tests/gpu")
    for item in gpu_items:
        item.add_marker(skip)


def hf_greedy(hf, prompt, n) -> list[int]:
    """transformers' greedy continuation of `prompt` (token ids), `n` tokens, EOS ignored."""
    import torch
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, num_beams=1,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def randomize_(model, seed: int):
    """Give every weight O(1)-scale random values (norm weights around 1) so parity tests see real signal."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed" in name:
                p.copy_(noise)
            elif p.ndim == 2:
                p.copy_(noise / p.shape[-1] ** 0.5)  # unit gain for a unit-variance input
            else:
                p.copy_(0.5 * noise)  # biases


def make_tiny_hf_model(kind: str, path, seed: int = 0):
    """Save a tiny random transformers model of `kind` (a TINY_MODELS key) in float32 safetensors at `path`."""
    import torch
    import transformers
    config_cls, extra, shard = TINY_MODELS[kind]
    config = getattr(transformers, config_cls)(**{**TINY_DIMS, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return path


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    """{kind: directory} of tiny random HF checkpoints: llama, llama3_tied, llama_sharded, qwen2, qwen3,
    llama_linear."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {kind: make_tiny_hf_model(kind, root / kind, seed=i) for i, kind in enumerate(TINY_MODELS)}


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """The SmolLM2-135M-Instruct Q4_1 GGUF, assembled (and sha256-verified) into the jaxspec cache."""
    from jaxspec.models.presets import preset_path
    return preset_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_0_5b_gguf_path():
    """The Qwen2.5-Coder-0.5B-Instruct GGUF, assembled from its 6 pip packages into the jaxspec cache."""
    from jaxspec.models.presets import preset_path
    return preset_path("qwen2.5-coder-0.5b-instruct")


# ---- engine fixtures (tests/test_engine.py) ----------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_llama_model(tiny_hf_dirs):
    """The tiny random llama checkpoint as a jaxspec `Model` (float32, no tokenizer: pass token ids)."""
    from jaxspec.models.loader import load_model
    return load_model(str(tiny_hf_dirs["llama"]), dtype="float32")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf_path):
    """SmolLM2-135M-Instruct (real weights and tokenizer) as a float32 jaxspec `Model`."""
    from jaxspec.models.loader import load_model
    return load_model(str(smollm2_gguf_path), dtype="float32")


def random_model(seed: int = 0, *, arch: str = "llama", vocab_size: int = 128, hidden_size: int = 32,
                 num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 64,
                 max_position_embeddings: int = 256, base=None, noise: float = 1.0, attn_gain: float = 1.0):
    """A tiny random jaxspec `Model` (float32, no tokenizer), built in-process from HF-named tensors, which
    it keeps as `model.hf_tensors` (what tests/reference.py reads).

    `attn_gain` scales every o_proj: below 1, attention moves the residual stream less, so the next token
    depends more on the current one and drafters can learn to predict the model.

    With `base` (a Model of the same shapes), the weights are base's plus `noise` times fresh random ones:
    a draft model that agrees with its target often but not always.
    """
    import numpy as np
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.model import Model
    from jaxspec.models.weights import params_from_hf_tensors

    hd = hidden_size // num_heads
    config = ModelConfig(arch=arch, vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=hd, rms_norm_eps=1e-5,
                         max_position_embeddings=max_position_embeddings)
    rng = np.random.default_rng(seed)
    D, F, q, kv = hidden_size, intermediate_size, num_heads * hd, num_kv_heads * hd

    def mat(*shape):  # unit gain for a unit-variance input
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    t = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, D)),
         "model.norm.weight": 1 + 0.2 * rng.standard_normal(D), "lm_head.weight": 2 * mat(vocab_size, D)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + 0.2 * rng.standard_normal(D),
                  p + "post_attention_layernorm.weight": 1 + 0.2 * rng.standard_normal(D),
                  p + "self_attn.q_proj.weight": mat(q, D), p + "self_attn.k_proj.weight": mat(kv, D),
                  p + "self_attn.v_proj.weight": mat(kv, D), p + "self_attn.o_proj.weight": attn_gain * mat(D, q),
                  p + "mlp.gate_proj.weight": mat(F, D), p + "mlp.up_proj.weight": mat(F, D),
                  p + "mlp.down_proj.weight": mat(D, F)})
        if config.qkv_bias:
            t.update({p + f"self_attn.{n}_proj.bias": 0.1 * rng.standard_normal(w)
                      for n, w in (("q", q), ("k", kv), ("v", kv))})
        if config.qk_norm:
            t.update({p + f"self_attn.{n}_norm.weight": 1 + 0.2 * rng.standard_normal(hd) for n in ("q", "k")})
    if base is not None:  # base + noise * (random of the same scale as each base tensor)
        t = {name: b + noise * b.std() * rng.standard_normal(b.shape) for name, b in base.hf_tensors.items()}
    t = {name: np.asarray(a, np.float32) for name, a in t.items()}
    model = Model(config, params_from_hf_tensors(config, t.__getitem__, "float32"), tokenizer=None,
                  name=f"random-{arch}-{seed}")
    model.hf_tensors = t
    return model


def widened(model, factor: int = 2):
    """A model of `factor` times the hidden size, heads, KV heads and MLP width that computes what `model` computes:
    its weights in the first block of each wider matrix, zeros elsewhere (the extra heads attend to zero values, the
    extra channels of the residual stream stay zero), norm weights scaled by sqrt(factor) and its eps divided by
    factor (an RMS over `factor` times the channels, the extra ones zero). A draft model of other widths than its
    target that agrees with it up to rounding."""
    import dataclasses

    import numpy as np
    from jaxspec.models.model import Model
    from jaxspec.models.weights import params_from_hf_tensors
    c = model.config
    config = dataclasses.replace(c, hidden_size=factor * c.hidden_size, num_heads=factor * c.num_heads,
                                 num_kv_heads=factor * c.num_kv_heads, intermediate_size=factor * c.intermediate_size,
                                 rms_norm_eps=c.rms_norm_eps / factor)

    def padded(a, shape):
        out = np.zeros(shape, np.float32)
        out[tuple(slice(0, n) for n in a.shape)] = a
        return out
    tensors = {}
    for name, a in model.hf_tensors.items():
        if a.ndim == 1:   # a norm weight over the hidden channels
            tensors[name] = padded(a / np.sqrt(factor), (factor * a.shape[0],))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensors[name] = padded(a, (a.shape[0], factor * a.shape[1]))
        else:
            tensors[name] = padded(a, (factor * a.shape[0], factor * a.shape[1]))
    wide = Model(config, params_from_hf_tensors(config, tensors.__getitem__, "float32"), tokenizer=None,
                 name=model.name + "-widened")
    wide.hf_tensors = tensors
    return wide


def transformers_from_gguf(path):
    """transformers' own float32 load of a GGUF file (the reference implementation), with two of its repeated
    pure computations done once: it reads the file's metadata twice (config, then tensors; every tokenizer string
    becomes a numpy view, tens of seconds for a large vocabulary) and builds the same tensor-name map once per
    module. The reader reads the file's bytes through a plain ndarray over its np.memmap (the same mapping): each
    of those views of a memmap runs its Python-level __getitem__ and __array_finalize__, ~2/3 of the reader's time
    (Qwen2.5's 151k-token vocabulary: ~7 s against ~2.4 s). The same reader and map are used; what it loads is
    unchanged."""
    import functools
    from pathlib import Path
    import gguf
    import numpy as np
    import torch
    import transformers
    path = Path(path)
    readers = {}
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    class OnceReader(real_reader):
        # GGUFReader.__init__ sets self.data = np.memmap(file): kept as a plain ndarray view of it
        data = property(lambda self: self.__dict__["data"],
                        lambda self, value: self.__dict__.__setitem__("data", value.view(np.ndarray)))

        def __new__(cls, file, *args, **kwargs):
            if str(file) not in readers:
                readers[str(file)] = reader = super().__new__(cls)
                real_reader.__init__(reader, file, *args, **kwargs)
            return readers[str(file)]

        def __init__(self, *args, **kwargs):   # initialised once, in __new__
            pass

    gguf.GGUFReader, gguf.get_tensor_name_map = OnceReader, functools.lru_cache(None)(real_map)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf_path):
    """transformers' own float32 load of the same SmolLM2 GGUF: the reference implementation."""
    return transformers_from_gguf(smollm2_gguf_path)


# ---- the speculation tests' tiny target and drafters (tests/test_spec.py; shared with test_adaptive_k.py,
# test_prefix_cache.py and test_tp.py): session-scoped, so a worker builds and fits them once --------------
SPEC_VOCAB = 128
# "draft_model_parallel": the draft_model cases' draft model drafting in parallel (PARD's recipe, docs/
# parallel_drafting.md: drafts 2..k from one forward over k-1 mask tokens). Any id could be the mask token of a
# model never trained with one, and after most ids its drafts 2..k are never the target's: with 125 (one of three of
# the 128, found by replaying the greedy runs of the spec tests on the dense references) a second draft is accepted
# in the greedy runs of test_spec_counts_recomputed_on_host, test_async_matches_sync and
# test_cached_prefixes_draft_and_accept_what_the_host_recomputes, so the mask tokens' KV at an accepted second
# draft's position is rewritten there too.
SPEC_MASK_TOKEN = 125


def spec_config(method: str, drafters: dict, k: int, **options) -> dict:
    """The speculative_config of one of the speculation tests' methods (a spec_drafters key) with k drafts:
    "draft_model_parallel" is method "draft_model" with parallel_drafting and SPEC_MASK_TOKEN."""
    spec = dict(method=method, num_speculative_tokens=k, **options)
    if method == "draft_model_parallel":
        spec.update(method="draft_model", parallel_drafting=True, mask_token_id=SPEC_MASK_TOKEN)
    if method != "ngram" and method in drafters:   # (a caller with a drafter of its own sets it after)
        spec["model"] = drafters[method]
    return spec


@pytest.fixture(scope="session")
def spec_target():
    """The target of tests/test_spec.py (its docstring says why its attention is damped)."""
    return random_model(0, vocab_size=SPEC_VOCAB, num_layers=4, attn_gain=0.3)


@pytest.fixture(scope="session")
def spec_drafters(spec_target, tmp_path_factory):
    """method -> `SpeculativeConfig.model` for that method: a perturbed copy of the target (it agrees with
    the target often but not always) for draft_model and draft_model_parallel (the same model), EAGLE heads
    fitted to the target, nothing for n-gram.

    Under xdist the heads are fitted once per run, by the first worker that needs them, into the directory
    the run's workers share (the parent of their base temp directories, made for this run); the others wait
    on its lock and read the same files."""
    import fcntl
    from eagle_heads import fit_eagle_head
    target = spec_target
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "spec_heads"
    root.mkdir(parents=True, exist_ok=True)
    heads = {"eagle": root / "eagle1", "eagle3": root / "eagle3"}
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "fitted").exists():
            fit_eagle_head("eagle", heads["eagle"], target, seed=2, num_layers=2, reg_weight=5.0)
            fit_eagle_head("eagle3", heads["eagle3"], target, seed=3, reg_weight=5.0)
            (root / "fitted").touch()
    draft = random_model(1, vocab_size=SPEC_VOCAB, num_layers=4, base=target, noise=0.15)
    return {"draft_model": draft, "draft_model_parallel": draft, **heads, "ngram": None}


@pytest.fixture(scope="session")
def spec_references(spec_target, spec_drafters):
    """The independent dense references: "target" (Greedy: the target's greedy continuations), "heads"
    ({method: EagleReference}) and "propose" ({method: propose(sequence, k) -> the k greedy drafts the
    method must hold after `sequence`}; draft_model_parallel's: the draft model's argmax after the sequence then
    j mask tokens, j = 0..k-1, from one dense forward over the sequence and k-1 mask tokens, causal)."""
    import json
    import numpy as np
    from safetensors.numpy import load_file
    from reference import EagleReference, Greedy, ngram_drafts
    from jaxspec.models.config import ModelConfig
    target, drafters = spec_target, spec_drafters
    heads = {}
    for method in ("eagle", "eagle3"):
        path = drafters[method]
        hcfg = ModelConfig.from_hf({"model_type": "llama", **json.loads((path / "config.json").read_text())})
        heads[method] = EagleReference(method, load_file(str(path / "model.safetensors")), hcfg, target.hf_tensors,
                                       target.config)
    draft = Greedy(drafters["draft_model"].hf_tensors, drafters["draft_model"].config)

    def parallel_drafts(seq, k):
        logits = draft.logits(list(seq) + [SPEC_MASK_TOKEN] * (k - 1))[len(seq) - 1:]
        return [int(t) for t in np.argmax(logits, axis=-1)]
    propose = {"draft_model": draft.next_tokens, "draft_model_parallel": parallel_drafts,
               "ngram": lambda seq, k: ngram_drafts(list(seq), k, 2, 4),
               **{m: h.greedy_drafts for m, h in heads.items()}}
    return {"target": Greedy(target.hf_tensors, target.config), "heads": heads, "propose": propose}
