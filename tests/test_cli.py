"""The command lines' answers to bad arguments and failures (issue #34): one line naming the flag and what is valid,
exit code 2 for a bad flag and 1 for a failure at run time, no traceback, and nothing loaded or compiled first; the
server's port taken before the model loads; `jaxspec.generate` reusing its engine."""
import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import weakref

import pytest

import jaxspec
import jaxspec.llm
import jaxspec.models.loader
import jaxspec.models.random
from jaxspec.bench import main as bench_main
from jaxspec.cli import main as jaxspec_main
from jaxspec.train.cli import main as train_main

SPEC_K0 = '{"method": "ngram", "num_speculative_tokens": 0}'

# (command, arguments, exit code, what the one line must name); {file}: an existing file, {closed}: a closed port
BAD_ARGUMENTS = [
    ("serve", ["nosuchmodel"], 2, "nosuchmodel"),
    ("serve", ["--max-num-seqs", "0"], 2, "--max-num-seqs"),
    ("serve", ["--block-size", "0"], 2, "--block-size"),
    ("serve", ["--max-model-len", "1"], 2, "--max-model-len"),
    ("serve", ["--kv-memory-fraction", "1.5"], 2, "--kv-memory-fraction"),
    ("serve", ["--port", "70000"], 2, "--port"),
    ("serve", ["--speculative-config", SPEC_K0], 2, "num_speculative_tokens"),
    ("serve", ["--speculative-config", '{"method": "ngram", "k": 2}'], 2, "--speculative-config"),
    ("serve", ["--speculative-config", '{"method": "eagle3", "model": "no/such/head"}'], 2, "--speculative-config"),
    ("serve", ["--lora-modules", "sql={dir}"], 2, "--enable-lora"),
    ("serve", ["--enable-lora", "--lora-modules", "sql"], 2, "NAME=PATH"),
    ("serve", ["--enable-lora", "--max-lora-rank", "0"], 2, "--max-lora-rank"),
    ("bench", ["--input-len", "-1"], 2, "--input-len"),
    ("bench", ["--request-rate", "-1"], 2, "--request-rate"),
    ("bench", ["--output-len", "0"], 2, "--output-len"),
    ("bench", ["--max-concurrency", "0"], 2, "--max-concurrency"),
    ("bench", ["--num-prompts", "0"], 2, "--num-prompts"),
    ("bench", ["--max-model-len", "1"], 2, "--max-model-len"),
    ("bench", ["--model", "nosuchmodel"], 2, "--model"),
    ("bench", ["--speculative-config", SPEC_K0], 2, "num_speculative_tokens"),
    ("bench", ["--speculative-config", '{"method": "ngram"}', "--spec-method", "ngram"], 2, "--spec-method"),
    ("bench", ["--spec-method", "eagle3"], 2, "--draft-model"),
    ("bench", ["--lora-mix"], 2, "--lora-mix"),
    ("bench", ["--lora-modules", "sql"], 2, "NAME=PATH"),
    ("bench", ["--dataset", "sharegpt", "--dataset-path", "nope.json"], 2, "--dataset-path"),
    ("bench", ["--dataset", "random", "--dataset-path", "{file}"], 2, "--dataset-path"),
    ("bench", ["--base-url", "http://127.0.0.1:{closed}", "--num-prompts", "1"], 1, "--base-url"),
    ("train", ["--model", "smollm2-135m-instruct", "--out", "{dir}", "--steps", "0"], 2, "--steps"),
    ("train", ["--model", "nosuchmodel", "--out", "{dir}"], 2, "--model"),
    ("train", ["--model", "smollm2-135m-instruct", "--out", "{file}"], 2, "--out"),
    ("train", ["--model", "smollm2-135m-instruct", "--out", "{dir}", "--learning-rate", "0"], 2, "--learning-rate"),
    ("train", ["--model", "smollm2-135m-instruct", "--out", "{dir}", "--dataset-path", "nope.json"], 2,
     "--dataset-path"),
]
MAINS = {"serve": lambda argv: jaxspec_main(["serve", *argv]), "bench": bench_main, "train": train_main}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nothing_loads(monkeypatch):
    """A command that would load a model (and compile its engine) fails the test at once instead."""
    def refuse(*args, **kwargs):
        raise AssertionError("the command loaded a model before checking its arguments")
    monkeypatch.setattr(jaxspec.llm.LLM, "__init__", refuse)
    monkeypatch.setattr(jaxspec.models.loader, "load_model", refuse)
    monkeypatch.setattr(jaxspec.models.random, "random_model", refuse)


@pytest.mark.parametrize("command,argv,code,names", BAD_ARGUMENTS,
                         ids=[f"{c}:{' '.join(a)}" for c, a, _, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_naming_the_flag(command, argv, code, names, tmp_path, capsys, nothing_loads):
    file = tmp_path / "a_file"
    file.write_text("{}")
    places = {"{file}": str(file), "{dir}": str(tmp_path / "out"), "{closed}": str(closed_port())}
    argv = [places.get(a, a).replace("{closed}", places["{closed}"]) for a in argv]
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        MAINS[command](argv)
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert names in err, err
    assert elapsed < 5, f"{elapsed:.1f} s to refuse {argv}"


# Each command in a process of its own: the line is printed before anything imports JAX.
REPORT_JAX = ("import atexit, sys; atexit.register(lambda: 'jax' in sys.modules and print('JAX was imported', "
              "file=sys.stderr)); sys.argv[0] = 'jaxspec'; from {module} import main; main(sys.argv[1:])")


def run_command(module: str, argv: list[str], timeout: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", REPORT_JAX.format(module=module), *argv], capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("module,argv,names", [
    ("jaxspec.cli", ["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    ("jaxspec.bench", ["--input-len", "-1"], "--input-len"),
    ("jaxspec.train.cli", ["--model", "smollm2-135m-instruct", "--out", "x", "--steps", "0"], "--steps"),
])
def test_a_bad_argument_is_answered_before_jax_is_imported(module, argv, names):
    proc, _ = run_command(module, argv)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and names in proc.stderr, proc.stderr


def test_a_port_in_use_is_reported_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, elapsed = run_command("jaxspec.cli", ["serve", "--port", str(port)], timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr, proc.stderr
    assert elapsed < 10


def test_the_port_answers_503_while_the_model_loads():
    from jaxspec.listen import LoadingResponder, listen
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with sock:
        with LoadingResponder(sock):
            for method, path in (("GET", "/health"), ("POST", "/v1/completions"), ("HEAD", "/health")):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request(method, path, body=b'{"prompt": "Hi"}' if method == "POST" else None)
                r = conn.getresponse()
                body = r.read()
                conn.close()
                assert r.status == 503 and r.getheader("Retry-After")
                assert body == b"" if method == "HEAD" else json.loads(body)["error"]["code"] == 503
        # The server takes the socket over: a client connecting now waits in the backlog, it is not refused.
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_bench_reads_sharegpt_from_dataset_path(tmp_path):
    from jaxspec.bench.workloads import load_workload

    class WordTokenizer:
        def encode(self, text, **kwargs):
            return [len(w) for w in text.split()]
    conversations = [{"conversations": [{"from": "human", "value": f"question {i} with five words"},
                                        {"from": "gpt", "value": "an answer of six words here"}]} for i in range(3)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    args = argparse.Namespace(dataset="sharegpt", dataset_path=str(path), num_prompts=2, max_input_len=64,
                              output_len=5, seed=0)
    workload = load_workload(args, WordTokenizer(), 100)
    assert workload.prompts == [[8, 1, 4, 4, 5]] * 2 and workload.output_lens == [5, 5]


# ---- jaxspec.generate keeps its engine ----
class FakeLLM:
    """Counts the engines `generate` builds (without holding them); answers with itself."""
    built: list = []

    def __init__(self, model, **options):
        time.sleep(0.05)   # building takes a while: concurrent first calls overlap
        self.model, self.options = model, options
        FakeLLM.built.append(weakref.ref(self))

    def generate(self, prompts, sampling_params, use_tqdm=True):
        return [(self, prompts, sampling_params.max_tokens)]


@pytest.fixture
def fake_llm(monkeypatch):
    getattr(jaxspec.llm.generate, "cache_clear", lambda: None)()
    FakeLLM.built = []
    monkeypatch.setattr(jaxspec.llm, "LLM", FakeLLM)
    yield FakeLLM
    getattr(jaxspec.llm.generate, "cache_clear", lambda: None)()


def test_generate_reuses_its_engine_per_model_and_options(fake_llm):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    (first, _, _), = jaxspec.generate("a", model="m", max_tokens=4, max_num_seqs=2, speculative_config=spec)
    (again, _, n), = jaxspec.generate("b", model="m", max_tokens=8, max_num_seqs=2, speculative_config=dict(spec))
    assert again is first and n == 8 and len(fake_llm.built) == 1
    first_ref = weakref.ref(first)
    del first, again
    (other, _, _), = jaxspec.generate("c", model="m", max_num_seqs=4, speculative_config=spec)
    assert len(fake_llm.built) == 2 and other.options["max_num_seqs"] == 4
    assert first_ref() is None, "the engine built for other options is still held"
    threads = [threading.Thread(target=jaxspec.generate, args=("d",), kwargs=dict(model="n")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_llm.built) == 3, "concurrent first calls built more than one engine"


# ---- the engine's flags: declared once (jaxspec/cli_args.py), with the engine's defaults (issue #61) ----
def test_every_command_defaults_its_engine_flags_as_the_engine_does():
    """A flag left out means what the keyword left out of LLM(...) means, in `jaxspec serve` (and the Ray replicas,
    which declare the same flags), `jaxspec-bench` and `jaxspec-bench startup`."""
    import inspect

    from jaxspec.bench.args import BENCH_ENGINE_FIELDS
    from jaxspec.bench.cli import build_parser as bench_parser
    from jaxspec.bench.startup import build_parser as startup_parser
    from jaxspec.cli_args import ENGINE_FLAGS, SERVER_ENGINE_FIELDS, add_engine_args
    llm_defaults = {name: p.default for name, p in inspect.signature(jaxspec.llm.LLM.__init__).parameters.items()}
    assert {field: options["default"] for field, (_, options) in ENGINE_FLAGS.items()} == \
        {field: llm_defaults[field] for field in ENGINE_FLAGS}
    serve = argparse.ArgumentParser()
    add_engine_args(serve)
    for parser, fields in ((serve, SERVER_ENGINE_FIELDS), (bench_parser(), BENCH_ENGINE_FIELDS),
                           (startup_parser(), BENCH_ENGINE_FIELDS)):
        args = vars(parser.parse_args([]))
        assert {field: args[field] for field in fields} == {field: llm_defaults[field] for field in fields}
