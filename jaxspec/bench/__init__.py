"""`jaxspec-bench`: throughput, latency, speculation and bubble measurements, in the shape of `vllm bench`.

- `workloads`: the datasets' prompts and output lengths, the constraint on every request
- `measure`: offline runs, steady-state decode, the speedup bound of a speculative configuration
- `online`: arrivals over time, to an engine on its own thread or a running server (--request-rate, --base-url)
- `outputs`: what the requests generated (digest, lengths, finish reasons, constraint matches)
- `report`: the printed table, the JSON file, the plot
- `startup`: `jaxspec-bench startup`, a fresh process's time to its first token, cold and warm, by phase
- `baselines.vllm`, `baselines.hf`: the same workload through vLLM or transformers
- `cli`: the command line (`main`), and `run`, which returns its results
"""
from jaxspec.bench.cli import main, run

__all__ = ["main", "run"]
