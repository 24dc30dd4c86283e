"""One engine across processes (several hosts), on jax.distributed.

Every process holds its devices' shards of the weights and the KV cache and runs every step program (one SPMD
program over all processes' devices: tensor parallelism across hosts). Process 0 alone runs the scheduler (and the
server); the others follow it. Each device operation process 0's runner makes (a step's packed inputs, a history
or logit-bias write, a replay) is sent to the followers before it is made, over one TCP connection each, and they
make it in the same order; a step's outputs are replicated, and process 0 reads its own copy. The followers never
plan, sample on the host or read a step's output.

On every host, with the same model and engine arguments (the weights are read or generated alike everywhere):

    import jaxspec
    jaxspec.distributed.initialize("HOST0", 29500, num_processes=2, process_id=RANK)
    llm = jaxspec.LLM(MODEL, tensor_parallel_size=jax.device_count())
    if RANK == 0:
        jaxspec.distributed.lead(llm)     # waits for the followers; then use llm as usual
        ...
        jaxspec.distributed.shutdown()    # (also at exit) the followers return
    else:
        jaxspec.distributed.follow(llm)   # returns when process 0 shuts down

Structured outputs are refused across processes (their automata tables live on process 0's devices only).
"""
from __future__ import annotations

import atexit
import time
from multiprocessing.connection import Client, Listener

# The engine's own connection listens on the coordinator's host at the coordinator's port + this.
ENGINE_PORT_OFFSET = 1
# What a follower may be asked to run: the runner's device operations, nothing else.
MIRRORED = frozenset({"run_packed", "write_history", "write_logit_bias", "replay"})
CONNECT_SECONDS = 300.0   # how long a follower retries reaching process 0 (it may still be loading weights)

_coordinator: tuple[str, int] | None = None
_leader: "Leader | None" = None


def initialize(master_addr: str, master_port: int, num_processes: int, process_id: int):
    """jax.distributed.initialize with process 0 at master_addr:master_port (and the engine's connection at the
    next port); on CPUs the collectives go over gloo."""
    import jax
    global _coordinator
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is invalid; valid: 0..{num_processes - 1}")
    if jax.config.jax_platforms in ("cpu", None) or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"{master_addr}:{master_port}", num_processes=num_processes, process_id=process_id)
    _coordinator = (master_addr, master_port + ENGINE_PORT_OFFSET)


def _authkey() -> bytes:
    import os
    return os.environ.get("JAXSPEC_DISTRIBUTED_KEY", "jaxspec").encode()


def _check(llm):
    import jax
    if _coordinator is None:
        raise RuntimeError("call jaxspec.distributed.initialize(...) on every process first")
    engine = getattr(llm, "engine", llm)
    tp = engine.runner.tp
    size = 1 if tp is None else tp.size
    if size != jax.device_count():
        raise ValueError(f"tensor_parallel_size={size}: an engine across processes spans every device; give "
                         f"tensor_parallel_size={jax.device_count()} (jax.device_count())")
    return engine


class Leader:
    """Process 0's side: the followers' connections, each device operation sent to all of them."""

    def __init__(self, engine, num_followers: int):
        host, port = _coordinator
        with Listener(("", port), authkey=_authkey()) as listener:
            self.conns = [listener.accept() for _ in range(num_followers)]
        self.engine = engine
        engine.intake.refuse_structured_outputs("not supported by an engine across processes (jaxspec.distributed): "
                                                "the automata tables would live on process 0's devices only")
        engine.runner.mirror_to(self.send)

    def send(self, op: str, *args):
        for conn in self.conns:
            conn.send((op, args))

    def close(self):
        self.engine.runner.mirror_to(None)
        self.engine.intake.refuse_structured_outputs(None)
        for conn in self.conns:
            try:
                conn.send(("stop", ()))
                conn.close()
            except OSError:   # a follower already gone
                pass
        self.conns = []


def lead(llm) -> Leader:
    """On process 0, after building the LLM (or Engine): waits for every other process to follow, then mirrors
    each device operation to them. Returns the Leader (`shutdown` ends it)."""
    import jax
    global _leader
    if jax.process_index() != 0:
        raise RuntimeError(f"lead() runs on process 0; this is process {jax.process_index()}: call follow(llm)")
    engine = _check(llm)
    _leader = Leader(engine, jax.process_count() - 1)
    atexit.register(shutdown)
    return _leader


def follow(llm):
    """On every process but 0, after building the same LLM (or Engine): makes each device operation process 0
    sends, until it shuts down."""
    import jax
    if jax.process_index() == 0:
        raise RuntimeError("follow() runs on processes other than 0; process 0 calls lead(llm)")
    runner = _check(llm).runner
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            conn = Client(_coordinator, authkey=_authkey())
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"process 0 did not listen at {_coordinator} within {CONNECT_SECONDS:.0f} s")
            time.sleep(0.2)
    with conn:
        while True:
            try:
                op, args = conn.recv()
            except EOFError:   # process 0 ended without shutting down
                return
            if op == "stop":
                return
            if op not in MIRRORED:
                raise ValueError(f"process 0 sent {op!r}; a follower runs only {sorted(MIRRORED)}")
            getattr(runner, op)(*args)


def shutdown():
    """On process 0: the followers return from follow()."""
    global _leader
    if _leader is not None:
        _leader.close()
        _leader = None
