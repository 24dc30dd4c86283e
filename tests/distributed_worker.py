"""One process of tests/test_distributed.py's engine across two processes (2 CPU devices each, gloo):
`python distributed_worker.py RANK PORT OUT`. Process 0 leads and writes the generated tokens to OUT (JSON)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: E402,F401  (the suite's XLA and JAX settings)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec  # noqa: E402
from distributed_case import ENGINE, model, run  # noqa: E402


def main():
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jaxspec.distributed.initialize("localhost", port, num_processes=2, process_id=rank)
    assert jax.device_count() == 4 and len(jax.local_devices()) == 2
    llm = jaxspec.LLM(model(), **ENGINE, tensor_parallel_size=jax.device_count())
    if rank == 0:
        jaxspec.distributed.lead(llm)
        tokens = run(llm)
        try:   # refused by name at the request, not inside the loop
            llm.generate([[1, 2, 3]], jaxspec.SamplingParams(
                max_tokens=4, structured_outputs=jaxspec.StructuredOutputsParams(regex="[ab]+")), use_tqdm=False)
            refused = None
        except ValueError as e:
            refused = str(e)
        jaxspec.distributed.shutdown()
    else:
        jaxspec.distributed.follow(llm)
    # the replicated state each process holds: the same in both, the device operations mirrored in order
    runner = llm.engine.runner
    held = {name: np.asarray(array.addressable_data(0)).tolist() for name, array in
            (("history", runner.state.history), ("num_tokens", runner.state.num_tokens),
             ("logit_bias", runner.logit_bias_table))}
    result = {"held": held}
    if rank == 0:
        result.update(tokens=tokens, refused=refused, stats=llm.stats()["spec"], hit_tokens=llm.stats()["prefix_cache"]["hit_tokens"])
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
