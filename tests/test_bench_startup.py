"""`jaxspec-bench startup` on the CPU: a cold and a warm run, each a fresh process, their phases and compiles."""
import json
import os

import pytest

from jaxspec.bench import main, run

# A tiny llama (--random-weights reads config.json alone): the children start, build and compile in seconds.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128, "torch_dtype": "float32"}


# A stand-in for vLLM (--baseline vllm's child imports it; no GPU, no vLLM needed): it notes what it was given.
FAKE_VLLM = """
import json, os, types
__version__ = "0.0+fake"
class LLM:
    def __init__(self, **kwargs):
        caches = {k: os.environ[k] for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as f:
            f.write(json.dumps({"kwargs": kwargs, "caches": caches}) + "\\n")
    def generate(self, prompts, params, use_tqdm=True):
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7] * params.max_tokens)])
                for _ in prompts]
def SamplingParams(**kwargs):
    return types.SimpleNamespace(**kwargs)
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """`vllm` importable here (the bench checks) and in the child processes (PYTHONPATH); the file it writes."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "fake"),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(tmp_path / "seen.jsonl"))
    return tmp_path / "seen.jsonl"


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("startup_model")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def test_cold_then_warm_start_reports_phases_and_compiles(tmp_path, tiny_config_dir, fake_vllm, capsys):
    """The jaxspec runs (cold, then warm on the cache the cold one left) and --baseline vllm's, in that order."""
    out = tmp_path / "startup.json"
    results = run(["startup", "--model", str(tiny_config_dir), "--random-weights", "--dtype", "float32",
                   "--runs", "cold", "warm", "--max-num-batched-tokens", "8", "--max-model-len", "64",
                   "--max-concurrency", "2", "--input-len", "12", "--cache-root", str(tmp_path / "caches"),
                   "--baseline", "vllm", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["startup"] == results and written["args"]["runs"] == ["cold", "warm"]
    assert [r["run"] for r in results] == ["cold", "warm", "vllm-cold", "vllm-warm"]
    for r in results[2:]:   # vLLM: `import vllm`, LLM(...), the first token
        ph = r["phases"]
        assert 0 < ph["import"] <= ph["engine"] <= ph["first_token"] and r["vllm"] == "0.0+fake"
    seen = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert len(seen) == 2 and seen[0]["caches"] == seen[1]["caches"]   # warm: the caches the cold run left
    assert all(d.startswith(str(tmp_path / "caches")) for d in seen[0]["caches"].values())
    kw = seen[0]["kwargs"]
    assert kw["model"] == str(tiny_config_dir) and kw["load_format"] == "dummy" and kw["max_model_len"] == 64
    results = results[:2]
    for r in results:
        ph = r["phases"]
        assert 0 < ph["import"] <= ph["backend"] <= ph["weights"] <= ph["engine"] <= ph["first_token"]
        # all compiled: when the last program landed (here before the engine returned: a CPU's warm-up compiles all)
        assert ph["engine"] <= ph["all_compiled"] <= r["wait_compiled_returned"]
        assert r["device"] and r["jax"] and r["config"]["max_num_batched_tokens"] == 8
        assert r["variants_compiled"] == len(r["compile_log"]) > 0
        for e in r["compile_log"]:
            assert e["bucket"] == 8 and e["variant"] and 0 < e["done_at"] <= ph["all_compiled"]
    cold, warm = results
    assert warm["cache_dir"] == cold["cache_dir"] and str(tmp_path / "caches") in cold["cache_dir"]
    # the warm run loads every step program the cold one compiled from the disk cache
    assert {e["source"] for e in cold["compile_log"]} == {"compiled"}
    assert {e["source"] for e in warm["compile_log"]} == {"disk"}
    assert warm["variants_from_disk"] == warm["variants_compiled"]
    assert len(cold["check_tokens"]) == 16 and warm["check_tokens"] == cold["check_tokens"]
    printed = capsys.readouterr().out
    assert "first token" in printed and "all compiled" in printed and "\nwarm " in printed and "vllm-warm" in printed


@pytest.mark.parametrize("argv,message", [
    (["--runs", "cold", "hot"], "invalid choice: 'hot'"),
    (["--runs", "warm", "cold"], "argument --runs: 'warm' comes before any 'cold'"),
    (["--compare"], "argument --compare: not used by `jaxspec-bench startup`"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["startup", "--random-weights", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("jaxspec-bench startup: error:")


def test_runs_that_decode_differently_are_an_error(monkeypatch, capsys):
    """A warm run whose programs came from the disk must decode the cold run's tokens: a difference stops the bench."""
    import jaxspec.bench.startup as startup
    ran = iter([[5, 6, 7], [5, 6, 8]])
    monkeypatch.setattr(startup, "run_child", lambda argv, kind, cache: {
        "run": kind, "phases": {"import": 1.0}, "device": "cpu", "check_tokens": next(ran)})
    with pytest.raises(SystemExit, match=r"different tokens from one prompt: \[\(5, 6, 7\), \(5, 6, 8\)\]"):
        startup.run(["--random-weights", "--runs", "cold", "warm"])


# ---- no import circles in jaxspec/bench (issue #61) ----
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxspec", "bench")


def bench_import_graph(root: str = BENCH, package: str = "jaxspec.bench") -> dict[str, set[str]]:
    """Module -> the modules of the package under `root` it imports, anywhere in its text (a function's import,
    run later, is one too). A package is named by its __init__.py; importing a module is not counted as importing
    its parent package (Python has that one already in hand)."""
    import ast
    modules = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(directory, name), root)[:-3].split(os.sep)
                parts = [package, *(rel[:-1] if rel[-1] == "__init__" else rel)]
                modules[".".join(parts)] = (os.path.join(directory, name), rel[-1] == "__init__")
    graph = {}
    for module, (path, is_package) in modules.items():
        here = module if is_package else module.rpartition(".")[0]
        targets = set()
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:   # relative: from the package `level` steps up
                    anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:   # `from pkg import module` imports the module; else pkg itself
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of the graph once, as the modules along it (its first module repeated at its end)."""
    circles, seen = [], set()

    def walk(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                circle = path[path.index(nxt):] + [nxt]
                key = frozenset(circle)
                if key not in seen:
                    seen.add(key)
                    circles.append(circle)
            else:
                walk(nxt, path + [nxt])
    for start in sorted(graph):
        walk(start, [start])
    return circles


def test_no_module_of_the_bench_imports_one_that_imports_it_back():
    graph = bench_import_graph()
    assert {"jaxspec.bench.cli", "jaxspec.bench.startup", "jaxspec.bench.baselines.vllm"} <= set(graph)
    assert "jaxspec.bench.args" in graph["jaxspec.bench.startup"]   # the graph sees imports inside functions too
    assert import_circles(graph) == [], "\n".join(" -> ".join(c) for c in import_circles(graph))


def test_the_circle_check_finds_a_circle(tmp_path):
    """The check above, on a copy of jaxspec/bench where startup.py's child imports the command back."""
    import shutil
    copy = tmp_path / "bench"
    shutil.copytree(BENCH, copy)
    with open(copy / "startup.py", "a") as f:
        f.write("\n\ndef _later():\n    from jaxspec.bench.cli import run\n    return run\n")
    circles = import_circles(bench_import_graph(str(copy)))
    assert ["jaxspec.bench.cli", "jaxspec.bench.startup", "jaxspec.bench.cli"] in circles, circles
