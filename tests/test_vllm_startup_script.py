"""benchmarks/end_to_end/vllm_startup.py on the CPU: its config.json for the presets, its reading of vLLM 0.26's log
lines (the format strings of vLLM's source), and a cold and a warm run through a stand-in for vLLM."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "end_to_end", "vllm_startup.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import vllm_startup  # noqa: E402

E = "(EngineCore pid=4242) INFO 11-26 23:02:50 [x.py:1] "
# vLLM 0.26's messages, as its format strings write them (compilation/backends.py, monitor.py, gpu_model_runner.py,
# gpu_worker.py, kv_cache_utils.py, utils/mem_utils.py, v1/engine/core.py, platforms/cuda.py)
COLD_LOG = [
    (0.5, "INFO 11-26 23:02:50 [__init__.py:246] Automatically detected platform cuda."),
    (3.0, E + "Initializing a V1 LLM engine (v0.26.0) with config: model='/m'"),
    (9.0, E + "Starting to load model /m..."),
    (9.1, E + "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER']."),
    (10.0, E + "Model loading took 2.89 GiB memory and 0.512345 seconds"),
    (14.0, E + "Dynamo bytecode transform time: 3.21 s"),
    (26.0, E + "Compiling a graph for compile range (1, 256) takes 12.34 s"),
    (26.5, E + "torch.compile took 16.50 s in total"),
    (30.0, E + "torch.compile took 4.25 s in total"),
    (31.0, E + "Memory profiling takes 1.92 seconds. Total non KV cache memory: 3.1GiB; torch peak memory increase: "
               "0.2GiB; non-torch forward increase memory: 0.1GiB; weights memory: 2.89GiB."),
    (31.1, E + "Available KV cache memory: 30.50 GiB"),
    (31.2, "INFO 11-26 23:02:50 [kv_cache_utils.py:2177] GPU KV cache size: 1,142,784 tokens"),
    (32.0, "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):   0%|          | 0/13"),
    (37.5, E + "Graph capturing finished in 6 secs, took 0.42 GiB"),
    (38.0, E + "init engine (profile, create kv cache, warmup model) took 25.50 s (compilation: 20.75 s)"),
]


def test_parse_log_cold():
    got = vllm_startup.parse_log(COLD_LOG)
    assert got["platform"] == "cuda" and got["attention_backend"] == "FLASH_ATTN"
    assert got["model_loading_s"] == pytest.approx(0.512345) and got["model_memory_gib"] == pytest.approx(2.89)
    assert got["weights_s"] is None   # dummy weights: no "Loading weights took"
    assert got["dynamo_s"] == pytest.approx(3.21) and got["inductor_compile_s"] == pytest.approx(12.34)
    assert got["torch_compile_s"] == [16.5, 4.25]   # the target's and the drafter's
    assert got["compiled_graphs_loaded_s"] is None and got["aot_loaded"] == 0
    assert got["memory_profiling_s"] == pytest.approx(1.92) and got["kv_cache_tokens"] == 1142784
    assert got["cuda_graph_s"] == 6 and got["cuda_graph_gib"] == pytest.approx(0.42)
    assert got["init_engine_s"] == pytest.approx(25.5) and got["init_engine_compilation_s"] == pytest.approx(20.75)
    assert got["log_at"]["load_start"] == 9.0 and got["log_at"]["cuda_graphs_done"] == 37.5
    assert got["cuda_graphs_wall_s"] == pytest.approx(5.5)


def test_parse_log_warm_and_missing_lines():
    got = vllm_startup.parse_log([
        E + "Directly load the compiled graph(s) for compile range (1, 256) from the cache, took 0.456 s",
        E + "Directly load AOT compilation from path /c/x",
        E + "init engine (profile, create kv cache, warmup model) took 7.10 s"])
    assert got["compiled_graphs_loaded_s"] == pytest.approx(0.456) and got["aot_loaded"] == 1
    assert got["init_engine_s"] == pytest.approx(7.1) and got["init_engine_compilation_s"] is None
    assert got["model_loading_s"] is None and got["torch_compile_s"] is None and got["cuda_graphs_wall_s"] is None


def _preset_names():
    from jaxspec.models.random import KNOWN_SHAPES
    return sorted(KNOWN_SHAPES)


@pytest.mark.parametrize("name", _preset_names())
def test_preset_config_reads_back(tmp_path, name):
    """Every preset's config.json (what vLLM is given for the same shapes) reads back to the preset, field by field:
    the MoE, sliding-window, local-rotary and sink families included."""
    import dataclasses

    from jaxspec.models.config import ModelConfig
    from jaxspec.models.random import KNOWN_SHAPES
    path = vllm_startup.model_dir(name, str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        back = ModelConfig.from_hf(json.load(f))
    want = KNOWN_SHAPES[name]
    assert dataclasses.replace(back, rope_scaling=None) == dataclasses.replace(want, rope_scaling=None)
    assert back.rope_type == want.rope_type   # (the reader keeps llama3's parameters without their type's name)
    strip = lambda d: {k: v for k, v in (d or {}).items() if k != "rope_type"}  # noqa: E731
    assert strip(back.rope_scaling_dict) == strip(want.rope_scaling_dict)
    assert not vllm_startup.has_weights(path)


FAKE_VLLM = """
import json, os, sys, types
__version__ = "0.26.0+fake"
def log(m):
    sys.stdout.write("(EngineCore pid=1) INFO 11-26 23:02:50 [x.py:1] " + m + "\\n"); sys.stdout.flush()
class LLM:
    def __init__(self, **kwargs):
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as f:
            f.write(json.dumps({"kwargs": kwargs, "env": {k: os.environ.get(k) for k in
                    ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME",
                     "HF_HUB_OFFLINE", "VLLM_USE_FLASHINFER_SAMPLER")}}) + "\\n")
        log("Model loading took 1.00 GiB memory and 0.250000 seconds")
        log("torch.compile took 2.50 s in total")
        log("init engine (profile, create kv cache, warmup model) took 3.00 s (compilation: 2.50 s)")
    def generate(self, prompts, params, use_tqdm=True):
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7] * params.max_tokens)])
                for _ in prompts]
def SamplingParams(**kwargs):
    return types.SimpleNamespace(**kwargs)
"""


def test_cold_and_warm_runs_with_a_stand_in_for_vllm(tmp_path):
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    seen, out = tmp_path / "seen.jsonl", tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), ROOT]), FAKE_VLLM_SEEN=str(seen))
    proc = subprocess.run([sys.executable, SCRIPT, "--model", "qwen2.5-coder-1.5b-instruct", "--draft-model",
                           "qwen2.5-coder-0.5b-instruct", "--runs", "cold", "warm", "--cache-root",
                           str(tmp_path / "root"), "--input-len", "16", "--quiet", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert [r["run"] for r in res["runs"]] == ["vllm-cold", "vllm-warm"] and all(r["ok"] for r in res["runs"])
    for r in res["runs"]:
        assert 0 < r["phases"]["import"] <= r["phases"]["engine"] <= r["phases"]["first_token"]
        assert r["log"]["model_loading_s"] == pytest.approx(0.25) and r["log"]["torch_compile_s"] == [2.5]
    calls = [json.loads(line) for line in seen.read_text().splitlines()]
    kw = calls[0]["kwargs"]
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    spec = kw["speculative_config"]
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 4
    assert calls[0]["env"] == calls[1]["env"]   # warm: the cold run's caches
    assert calls[0]["env"]["VLLM_CACHE_ROOT"].startswith(str(tmp_path / "root"))
    assert calls[0]["env"]["HF_HUB_OFFLINE"] == "1" and calls[0]["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
