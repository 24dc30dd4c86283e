"""The engine's shape, checked: the packages import downward only, no room of the engine writes another's fields (each
asks the owner, or calls a method the owner offers), and what is compiled has one owner that the scheduler, the runner
and adaptive k ask alike while background compiles land. Also: step pricing stays within its budget."""
import ast
import pathlib
import sys
import threading
import time

import pytest

from jaxspec import LLM, SamplingParams
from test_spec import ENGINE, drafters, prompt_of, target  # noqa: F401 (fixtures)

PACKAGE = pathlib.Path(__file__).parent.parent / "jaxspec"

# What each package may not import: the layers above it (the model math below loading, loading below the device
# side, the device side below the host's engine, the engine below what serves, benchmarks and trains it).
ABOVE = {
    "pallas": {"nn", "models", "decode", "structured", "sched", "serve", "bench", "train", "spec", "llm", "cli",
               "distributed"},
    "nn": {"models", "decode", "structured", "sched", "serve", "bench", "train", "spec", "llm", "cli", "distributed"},
    "models": {"decode", "sched", "serve", "bench", "train", "spec", "llm", "cli", "distributed"},
    "decode": {"sched", "serve", "bench", "train", "llm", "cli", "distributed"},
    "structured": {"sched", "serve", "bench", "train", "llm", "cli", "distributed"},
    "sched": {"serve", "bench", "train", "cli", "distributed"},
}
# pallas/ kernels know arrays, not the model: JAX and the standard library only (and each other)
PALLAS_MAY_IMPORT = {"jax", "jaxlib", "numpy", "functools", "math", "dataclasses", "typing", "__future__", "jaxspec"}


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return out


def upward_imports(root: pathlib.Path) -> list[str]:
    bad = []
    for package, above in ABOVE.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imports_of(path):
                parts = module.split(".")
                if parts[0] == "jaxspec" and len(parts) > 1 and parts[1] in above:
                    bad.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
                if package == "pallas" and parts[0] not in PALLAS_MAY_IMPORT:
                    bad.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
                if package == "pallas" and parts[0] == "jaxspec" and parts[1:2] != ["pallas"]:
                    bad.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    return bad


def test_the_packages_import_downward_only(tmp_path):
    assert upward_imports(PACKAGE) == []
    # the check sees an arrow up: nn reading the presets' cache directory, as it once did
    (tmp_path / "jaxspec" / "nn").mkdir(parents=True)
    (tmp_path / "jaxspec" / "nn" / "ops.py").write_text("from jaxspec.models.presets import cache_dir\n")
    assert upward_imports(tmp_path / "jaxspec") == ["jaxspec/nn/ops.py:1 imports jaxspec.models.presets"]


def test_the_offered_quantization_schemes_are_the_implemented_ones():
    from jaxspec.nn import quant
    from jaxspec.sched.config import QUANTIZATION_SCHEMES
    assert QUANTIZATION_SCHEMES == quant.SCHEMES


# ---- no room writes another's fields ---------------------------------------------------------------------------

def room_classes():
    """The engine's rooms: the objects it composes, each the one owner of its state."""
    from jaxspec.decode.compiled import CompiledSteps
    from jaxspec.decode.compiler import ProgramStore, StepPrograms
    from jaxspec.decode.drafters.draft_model import DraftModelDrafter
    from jaxspec.decode.drafters.eagle import EagleDrafter
    from jaxspec.decode.drafters.ngram import NgramDrafter
    from jaxspec.decode.runner import ModelRunner
    from jaxspec.sched.adaptive import KChooser
    from jaxspec.sched.block_manager import BlockManager
    from jaxspec.sched.engine import Engine
    from jaxspec.sched.intake import Intake
    from jaxspec.sched.pricing import StepPricing
    from jaxspec.sched.scheduler import Scheduler
    from jaxspec.sched.stats import EngineCounts
    from jaxspec.sched.step_builder import StepBuilder
    from jaxspec.sched.warmup import Warmup
    from jaxspec.structured.table import GrammarTables
    return [LLM, Engine, ModelRunner, CompiledSteps, StepPrograms, ProgramStore, Scheduler, BlockManager, Intake,
            KChooser, StepBuilder, EngineCounts, GrammarTables, StepPricing, Warmup, DraftModelDrafter, EagleDrafter,
            NgramDrafter]


def guard_writes(monkeypatch, classes, code_under: pathlib.Path = PACKAGE) -> list[str]:
    """From now on, an attribute set on an instance of these classes by code under `code_under` other than that
    instance's own methods (the caller's `self` is another object, or none) is recorded: 'Class.field <- caller
    (file:line)'. (A test's own spies, installed with monkeypatch, are not the package's code.)"""
    writes = []

    def set_own_attribute(self, name, value):
        caller = sys._getframe(1)
        if caller.f_locals.get("self") is not self and pathlib.Path(caller.f_code.co_filename).is_relative_to(
                code_under):
            writes.append(f"{type(self).__name__}.{name} <- {caller.f_code.co_qualname} "
                          f"({pathlib.Path(caller.f_code.co_filename).name}:{caller.f_lineno})")
        object.__setattr__(self, name, value)
    for cls in classes:
        monkeypatch.setattr(cls, "__setattr__", set_own_attribute)
    return writes


def test_the_guard_sees_a_write_into_another_object(monkeypatch):
    class Room:
        def __init__(self):
            self.budget = 8

        def widen(self):
            self.budget = 16

    writes = guard_writes(monkeypatch, [Room], code_under=pathlib.Path(__file__).parent)
    room = Room()
    room.widen()
    assert writes == []

    def follow_compiles(scheduler):
        scheduler.budget = 32
    follow_compiles(room)
    assert writes == [f"Room.budget <- {follow_compiles.__qualname__} (test_structure.py:"
                      f"{follow_compiles.__code__.co_firstlineno + 1})"]


K = 2
BUCKETS = [8, 16]


@pytest.fixture(scope="module")
def tiered_run(target, drafters):  # noqa: F811
    """A tiered, adaptive draft-model engine built and run with every room guarded (guard_writes): requests served
    while the 16-token bucket's programs are held back in the background, then released; the compiles land, the prices
    are taken, more requests, the loop on its own thread, stats. What each part answered at every step is recorded."""
    from jaxspec.decode.compiler import StepPrograms
    from jaxspec.sched import pricing
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(pricing, "PRICING_BUDGET_S", 600.0)   # every pair priced, however busy the machine
    release, held = threading.Event(), []

    def hold(key, tier):
        if key[0] == 16:
            held.append(key)
            assert release.wait(300), "the test never released the held compiles"
    init = StepPrograms.__init__

    def init_holding(self, *a, **kw):
        init(self, *a, **kw)
        self.before_compile = hold
    monkeypatch.setattr(StepPrograms, "__init__", init_holding)
    writes = guard_writes(monkeypatch, room_classes())
    try:
        spec = dict(method="draft_model", model=drafters["draft_model"], num_speculative_tokens=K, adaptive=True)
        llm = LLM(target, **{**ENGINE, "max_num_batched_tokens": 16, "num_kv_blocks": 40}, warmup="tiered",
                  speculative_config=spec)
        engine = llm.engine
        runner, scheduler, chooser, compiled = engine.runner, engine.scheduler, engine.k_chooser, engine.runner.compiled
        steps = []   # per dispatched step: (bucket, draft width, program ready, budget, tokens, compiling)
        run_packed, schedule = runner.run_packed, scheduler.schedule

        def spy_schedule():
            rows = schedule()
            spy_schedule.tokens, spy_schedule.budget = sum(r.num_new for r in rows), compiled.token_budget()
            return rows

        def spy_run(T, variant, buf, grammar_table=None, record=True):
            if record:   # a live step (pricing's timed steps are not)
                width = K if variant.drafts is None else variant.drafts
                steps.append((T, width, runner.programs.ready(runner.program_key(T, variant, grammar_table)),
                              spy_schedule.budget, spy_schedule.tokens, compiled.compiling(),
                              compiled.ready(width, T)))
            return run_packed(T, variant, buf, grammar_table, record)
        monkeypatch.setattr(scheduler, "schedule", spy_schedule)
        monkeypatch.setattr(runner, "run_packed", spy_run)
        prompts = [prompt_of(13, 0), prompt_of(11, 1), prompt_of(5, 2)]
        params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.8, seed=5, max_tokens=8),
                  SamplingParams(temperature=0, max_tokens=8)]
        during = llm.generate(prompts, params, use_tqdm=False)
        for _ in range(3000):   # the background compiles every width of bucket 8 and reaches the held ones
            if held and all(compiled.ready(k, 8) for k in range(K + 1)):
                break
            time.sleep(0.1)
        while_compiling = dict(compiling=compiled.compiling(), budget=compiled.token_budget(),
                               scheduler_budget=scheduler.token_budget(), ready_buckets=compiled.ready_buckets(),
                               bucket_for_12=runner.bucket_for(12),
                               ready=[compiled.ready(k, T) for T in BUCKETS for k in range(K + 1)],
                               priced=dict(chooser.calibrated), steps=len(steps))
        release.set()
        assert engine.wait_compiled(300)
        after_compiles = dict(compiling=compiled.compiling(), budget=compiled.token_budget(),
                              scheduler_budget=scheduler.token_budget(), bucket_for_12=runner.bucket_for(12),
                              ready=[compiled.ready(k, T) for T in BUCKETS for k in range(K + 1)],
                              priced=dict(chooser.calibrated))
        later = llm.generate([prompt_of(14, 10), prompt_of(12, 11)], SamplingParams(temperature=0, max_tokens=8),
                             use_tqdm=False)
        engine.start()
        threaded = llm.generate([prompt_of(9, 20)], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        engine.stop()
        stats = llm.stats()
    finally:
        release.set()
        monkeypatch.undo()
    return dict(writes=writes, steps=steps, while_compiling=while_compiling, after_compiles=after_compiles,
                held=held, stats=stats, outputs=[during, later, threaded])


def test_no_room_writes_another_rooms_fields(tiered_run):
    """Every change of a room's state is made by its own methods: the engine, the warm-up, the pricing and the
    builders ask (what is compiled: runner.compiled) or call a method the owner offers (a drafter configured, prices
    handed to the chooser), through construction, background compiles, pricing, the loop driven and on its thread."""
    assert all(len(o.outputs[0].token_ids) > 0 for outs in tiered_run["outputs"] for o in outs)
    assert tiered_run["writes"] == []


def test_what_is_compiled_is_answered_alike_while_compiles_land(tiered_run):
    """While the 16-token bucket compiles in the background, the scheduler's budget is the compiled bucket's, every
    step runs a program that is there, at the bucket the runner picked and a width adaptive k was told is ready, and
    nothing waits for a compile; once they land every bucket and width is ready, the budget is the configured one, and
    every (k, bucket) is priced."""
    held, stats = tiered_run["held"], tiered_run["stats"]
    assert held and {T for T, _, _ in held} == {16}
    during = tiered_run["while_compiling"]
    assert during["compiling"] and during["budget"] == during["scheduler_budget"] == 8
    assert during["ready_buckets"] == [8] and during["ready"] == [True] * (K + 1) + [False] * (K + 1)
    assert during["bucket_for_12"] == 16   # no compiled bucket holds 12: that step would compile on demand
    assert during["priced"] == {}          # prices wait for the compiles
    early = tiered_run["steps"][:during["steps"]]
    assert early and all(T == 8 and ready and compiling and width_ready and tokens <= budget == 8
                         for T, width, ready, budget, tokens, compiling, width_ready in early)
    after = tiered_run["after_compiles"]
    assert not after["compiling"] and after["budget"] == after["scheduler_budget"] == 16
    assert after["bucket_for_12"] == 16 and all(after["ready"])
    assert set(after["priced"]) == {(k, T) for T in BUCKETS for k in range(K + 1)}
    late = tiered_run["steps"][during["steps"]:]
    assert all(ready and tokens <= budget == 16 for _, _, ready, budget, tokens, *_ in late)
    assert stats["recompiles"] == 0 and stats["compile"]["programs"] == len(BUCKETS) * 2 * (K + 1)


# ---- pricing within its budget ------------------------------------------------------------------------------------

def test_pricing_stops_at_its_budget_smallest_bucket_first(target, monkeypatch):  # noqa: F811
    """Step pricing never holds a start for longer than its budget: with each timed step taking (on a fake clock)
    0.5 s and a 3-second budget, the pass stops at the first step that no longer fits (bucket 8's widths first), and
    the pairs left keep the loop's measured periods."""
    from jaxspec.sched import pricing
    clock = [0.0]

    def fake_time_step(runner, T, variant, runs=pricing.TIMED_RUNS, inputs=None, seconds_left=float("inf")):
        if seconds_left < 0.5:   # as time_step: not one run fits
            return None
        clock[0] += 0.5
        return 1e-3 * T
    monkeypatch.setattr(pricing, "time_step", fake_time_step)
    llm = LLM(target, **{**ENGINE, "max_num_batched_tokens": 16, "num_kv_blocks": 40}, warmup="full",
              speculative_config=dict(method="ngram", num_speculative_tokens=K, adaptive=True))
    assert llm.engine.wait_compiled(300)   # adaptive k's narrower widths compile in the background
    pricing_pass = llm.engine.pricing
    assert pricing_pass.budget_s == pricing.PRICING_BUDGET_S
    chooser = llm.engine.k_chooser
    chooser.calibrated.clear()
    chooser.context_cost.clear()
    clock[0] = 0.0
    monkeypatch.setattr(pricing_pass, "clock", lambda: clock[0])
    monkeypatch.setattr(pricing_pass, "budget_s", 3.0)
    pricing_pass.time_steps()
    # each pair: a blank step and a context step (1 s); the fourth pair's blank step no longer fits
    assert set(chooser.calibrated) == {(0, 8), (1, 8), (2, 8)}
    assert set(chooser.context_cost) == {(0, 8), (1, 8), (2, 8)}
    assert clock[0] == 3.0
    monkeypatch.setattr(pricing_pass, "budget_s", 100.0)
    pricing_pass.time_steps()
    assert set(chooser.calibrated) == {(k, T) for T in BUCKETS for k in range(K + 1)}


def test_a_slow_step_is_timed_with_the_runs_that_fit(target):  # noqa: F811
    """time_step times no more runs than fit the seconds left at the pace of its untimed runs, and none where not one
    does."""
    from jaxspec.decode.step import StepVariant
    from jaxspec.sched import pricing
    llm = LLM(target, **{**ENGINE, "num_kv_blocks": 40}, warmup="full")
    runner, runs = llm.engine.runner, []
    run_packed = runner.run_packed

    def slow_run(T, variant, buf, grammar_table=None, record=True):
        time.sleep(0.05)
        runs.append(record)
        return run_packed(T, variant, buf, grammar_table, record)
    runner.run_packed = slow_run
    assert pricing.time_step(runner, 8, StepVariant(), seconds_left=0.06) is None
    assert runs == [False] * pricing.UNTIMED_RUNS
    runs.clear()
    assert pricing.time_step(runner, 8, StepVariant(), seconds_left=0.3) > 0.04
    assert 1 + pricing.UNTIMED_RUNS <= len(runs) < pricing.UNTIMED_RUNS + pricing.TIMED_RUNS and not any(runs)


def test_an_engine_of_random_weights_imports_no_file_format():
    """The drafters and the random-weight models import no file-format package (gguf) until a file is read: the GPU
    machine's benchmarks build random-weight engines where gguf is not installed."""
    import subprocess
    code = """
import importlib.abc, sys
class NoGguf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("gguf is not installed here (blocked by the test)")
sys.meta_path.insert(0, NoGguf())
import jaxspec.llm, jaxspec.spec, jaxspec.models.random, jaxspec.decode.drafters.draft_model
import jaxspec.decode.drafters.eagle, jaxspec.decode.drafters.mtp, jaxspec.bench.cli
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
