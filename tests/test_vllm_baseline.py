"""jaxspec/bench/baselines/vllm.py on a hybrid target with MTP (issue #15's side-by-side): the request the child gets and
the vLLM engine arguments it builds, against a fake `vllm` module (no GPU, no vLLM needed)."""
import json
import sys
import types
from argparse import Namespace

from jaxspec.bench.baselines import vllm as vllm_baseline


def _args(**kw):
    base = dict(spec_method=None, num_spec_tokens=2, max_concurrency=2, max_model_len=64, max_num_batched_tokens=32,
                temperature=0.0, seed=0, ignore_eos=True, random_weights=True, dtype="auto",
                vllm_memory_fraction=0.4)
    return Namespace(**{**base, **kw})


def _fake_vllm(monkeypatch, seen: dict):
    class Out:
        def __init__(self, n):
            self.outputs = [types.SimpleNamespace(token_ids=[1] * n, finish_reason="length")]
            self.metrics = None

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def generate(self, prompts, params, use_tqdm=False):
            return [Out(p.max_tokens) for p in params]

        def get_metrics(self):
            return []

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = LLM, lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", mod)


def test_mtp_side_by_side_on_a_qwen35_config_directory(tmp_path, monkeypatch):
    """--spec-method mtp maps to vLLM's method "mtp" with no draft model (vLLM reads mtp.* from the target), and a
    Qwen3.5 config (vision_config beside text_config) is served language-model-only: without it vLLM builds the
    vision tower and profiles images through processor files a config-only directory does not have."""
    config = {"model_type": "qwen3_5", "vision_config": {},
              "text_config": {"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]}}
    find_spec = vllm_baseline.importlib.util.find_spec   # FlashInfer absent, as in the GPU machine's wheel set
    monkeypatch.setattr(vllm_baseline.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else find_spec(name, *a))
    (tmp_path / "config.json").write_text(json.dumps(config))
    request = vllm_baseline.build_request(_args(spec_method="mtp"), [[1, 2, 3]], [4], str(tmp_path), None)
    assert request["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    seen: dict = {}
    _fake_vllm(monkeypatch, seen)
    req, res = tmp_path / "request.json", tmp_path / "result.json"
    req.write_text(json.dumps(request))
    vllm_baseline._child(str(req), str(res))
    assert seen["language_model_only"] is True and seen["load_format"] == "dummy"
    # its Gated DeltaNet layers prefill with vLLM's Triton kernel (the FlashInfer default fails without FlashInfer)
    assert seen["gdn_prefill_backend"] == "triton"
    assert seen["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert json.loads(res.read_text())["label"] == "vllm+mtp"
    # a text-only config directory keeps vLLM's defaults
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    seen.clear()
    vllm_baseline._child(str(req), str(res))
    assert "language_model_only" not in seen and "gdn_prefill_backend" not in seen
