"""`jaxspec-bench`: throughput, latency, speculation and bubble measurements, in the shape of `vllm bench`.

- `workloads`: the datasets' prompts and output lengths, the constraint on every request
- `measure`: offline runs, steady-state decode, the speedup bound of a speculative configuration
- `online`: arrivals over time, to an engine on its own thread or a running server (--request-rate, --base-url)
- `outputs`: what the requests generated (digest, lengths, finish reasons, constraint matches)
- `report`: the printed table, the JSON file, the plot
- `startup`: `jaxspec-bench startup`, a fresh process's time to its first token, cold and warm, by phase
- `child_process`: a timed child process of `startup` (jaxspec's runs and vLLM's) and its one-line JSON result
- `baselines.vllm`, `baselines.hf`: the same workload through vLLM or transformers
- `args`: the flags (the engine's are jaxspec/cli_args.py's) and their checks, the command's and `startup`'s
- `engine`: what the flags build: the model, the draft, the context length, LLM's keywords
- `cli`: the command line (`main`), and `run`, which returns its results, one function per kind of run
"""
from jaxspec.bench.cli import main, run

__all__ = ["main", "run"]
