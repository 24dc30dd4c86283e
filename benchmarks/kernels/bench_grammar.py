"""The device side of structured outputs alone: the allowed-token mask applied to logits and the automaton
advanced along a row's drafts, per call, at several row counts, for one JSON schema over a real tokenizer.

    python3 benchmarks/kernels/bench_grammar.py --tokenizer DIR --schema benchmarks/schemas/person.json [--rows 1 8 32 160]
        [--drafts 4] [--reference-module OLD_GRAMMAR.py]

Rows are sampled from the automaton's states weighted towards its widest ones (a JSON string's state allows most
of the vocabulary, and that is where long outputs spend their tokens); tokens are allowed ones. The mask is timed
as the step uses it (masked logits reduced to an argmax, so it cannot be skipped), `advance` as `states_along`
over --drafts tokens. `--reference-module` times another implementation of the same functions (e.g. an earlier
commit's jaxspec/decode/grammar.py, `git show REV:jaxspec/decode/grammar.py > OLD.py`) on the same table.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def timed(fn, *args, iters: int = 200) -> float:
    """Microseconds per call, after a warm-up (compile) call."""
    import jax
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a directory with the tokenizer's files")
    p.add_argument("--schema", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 160])
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=None, help="the model's vocabulary (default: the tokenizer's)")
    p.add_argument("--reference-module", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from transformers import AutoTokenizer

    from jaxspec.decode import grammar
    from jaxspec.models.tokenizer import Tokenizer
    from jaxspec.structured.compiler import GrammarCompiler
    from jaxspec.structured.params import StructuredOutputsParams
    from jaxspec.structured.table import GrammarTables

    tok = Tokenizer(AutoTokenizer.from_pretrained(args.tokenizer))
    V = args.vocab_size or tok.vocab_size
    t0 = time.perf_counter()
    automaton = GrammarCompiler(tok, V, timeout=3600).compile(
        StructuredOutputsParams(json=json.load(open(args.schema)), disable_any_whitespace=True))
    compile_s = time.perf_counter() - t0
    tables = GrammarTables(V)
    tables.acquire(automaton)
    table = tables.device_table()
    print(f"automaton: {automaton.num_states} states, {automaton.num_edges} edges, widest {automaton.count.max()}, "
          f"{tables.num_bitmap_rows - 1} with a bitmap row; compiled in {compile_s:.1f} s", flush=True)

    impls = {"current": (grammar, table)}
    if args.reference_module:
        spec = importlib.util.spec_from_file_location("reference_grammar", args.reference_module)
        ref = sys.modules["reference_grammar"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
        width = 1 << max(int(automaton.count.max()) - 1, 0).bit_length()
        impls["reference"] = (ref, ref.GrammarTable(table.states, table.edges, width))

    rng = np.random.default_rng(0)
    weights = automaton.count.astype(np.float64) ** 2
    results = []
    for rows in args.rows:
        states = rng.choice(automaton.num_states, rows, p=weights / weights.sum()).astype(np.int32)
        drafts = np.stack([automaton.allowed(s)[rng.integers(0, automaton.count[s], args.drafts)] for s in states])
        base = jnp.full((rows,), tables.base(automaton), jnp.int32)
        logits = jax.random.normal(jax.random.PRNGKey(rows), (rows, V), jnp.float32)
        row = {"rows": rows}
        for name, (mod, tab) in impls.items():
            mask_fn = jax.jit(lambda b, s, lg, mod=mod, tab=tab: jnp.argmax(
                mod.constrain(lg, mod.allowed_tokens(tab, b, s, V)), axis=-1))
            walk_fn = jax.jit(lambda b, s, d, mod=mod, tab=tab: mod.states_along(tab, b, s, d))
            row[f"{name}_mask_us"] = timed(mask_fn, base, jnp.asarray(states), logits)
            row[f"{name}_states_along_us"] = timed(walk_fn, base, jnp.asarray(states), jnp.asarray(drafts))
            row[f"{name}_walk"] = np.asarray(walk_fn(base, jnp.asarray(states), jnp.asarray(drafts))).tolist()
        if "reference" in impls:
            assert row["current_walk"] == row["reference_walk"], "the two implementations disagree"
        for name in impls:
            row.pop(f"{name}_walk")
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "states": automaton.num_states, "edges": automaton.num_edges,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
