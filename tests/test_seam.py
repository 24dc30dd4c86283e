"""The model's seams: every projection of every layer kind, head and the EAGLE-3 trainer goes through `Ops.linear`
(where a quantized kernel or LoRA plugs in), and the kernels in jaxspec/pallas import JAX only, with no import
cycle through the model's math. Traced, never compiled: tiny shapes, a few seconds."""
import ast
import collections
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.config import ModelConfig
from jaxspec.nn import schema
from jaxspec.nn.decoder import Decoder
from jaxspec.nn.eagle import EagleHead
from jaxspec.nn.layers import CacheShape
from jaxspec.nn.mtp import MtpHead
from jaxspec.nn.ops import ForwardBatch, Ops

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxspec"


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: pathlib.Path, module: str, known: dict) -> set[str]:
    """The modules a source file imports anywhere in it (function-level imports too), as absolute names:
    `from pkg import name` imports pkg.name where that is a module, else pkg. (The parent packages Python runs
    first are not counted: every module of a package would otherwise import its package's __init__.)"""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the package, up level - 1
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return names


def test_kernels_import_jax_only():
    """A module of jaxspec/pallas imports JAX, numpy and the standard library, and other kernels, never the
    model's vocabulary (jaxspec.nn, ForwardBatch, configs): its adapters live in jaxspec.nn.kernels."""
    allowed = {"jax", "jaxlib", "numpy", "__future__", *sys.stdlib_module_names}
    for name, path in modules().items():
        if name.startswith("jaxspec.pallas"):
            bad = sorted(m for m in imports(path, name, {}) if m.split(".")[0] not in allowed
                         and not m.startswith("jaxspec.pallas"))
            assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}"


def test_no_import_cycle_through_the_model_or_the_kernels():
    """No chain of imports (function-level ones included) leads from a module of jaxspec.nn or jaxspec.pallas
    back to itself."""
    found = modules()
    graph = {name: {m for m in imports(path, name, found) if m in found and m != name}
             for name, path in found.items()}

    def reachable(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
        return seen

    cycles = sorted(m for m in found if m.startswith(("jaxspec.nn", "jaxspec.pallas")) and m in reachable(m))
    assert not cycles, f"import cycles through {cycles}"


# ---- every projection through Ops.linear -------------------------------------------------------------------

CALLS: list[str] = []


class CountingOps(Ops):
    """Ops whose `linear` records the weight of each call in CALLS (at trace time): a projection written around
    the seam is missing from the record."""

    def linear(self, x, lp, name, **kwargs):
        CALLS.append(name)
        return super().linear(x, lp, name, **kwargs)


BS, SLOTS = 4, 2
CACHE = CacheShape(num_kv_slots=SLOTS * 4 * BS, num_slots=SLOTS + 1)
NOT_PROJECTIONS = {"embed", "conv_weight"}   # a lookup and the Gated DeltaNet's depthwise conv


def projections(param_schema: dict) -> collections.Counter:
    """The weights one forward reads by matmul, per layer: every declared weight of two or more axes (a stacked
    layer weight: beyond the layer axis), but the embedding and the conv."""
    count = collections.Counter()
    for kind in param_schema.get("layers", {}).values():
        for name, spec in kind.items():
            if len(spec.shape) > 2 and name not in NOT_PROJECTIONS:
                count[name] += spec.shape[0]
    count.update(name for name, spec in param_schema.items()
                 if name != "layers" and len(spec.shape) >= 2 and name not in NOT_PROJECTIONS)
    return count


def config(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=8), **kw})


HYBRID = config(arch="qwen3_5", num_layers=3, layer_types=("gated_deltanet", "gated_attention", "gated_deltanet"),
                head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, partial_rotary_factor=0.25, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, shared_expert_intermediate_size=24)


def batch(T: int = 6) -> ForwardBatch:
    """Two rows of three tokens, at positions 0..2 of slots 0 and 1."""
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)   # noqa: E731
    pos, row = [0, 1, 2] * 2, [0] * 3 + [1] * 3
    return ForwardBatch(i32(np.arange(T) + 1), i32(pos), i32([r * 4 * BS + p for r, p in zip(row, pos)]), i32(row),
                        i32([[0, 1, 2, 3], [4, 5, 6, 7]]), i32(np.arange(T)), slot_of_row=i32([0, 1]),
                        first_token_of_row=i32([0, 3]), first_in_step=i32([0] * 3 + [3] * 3))


def assert_through_the_seam(want: collections.Counter, fn, *args):
    """`fn(*args)`, traced with abstract arrays (nothing runs), passes each weight of `want` to `Ops.linear` as
    many times as `want` says."""
    CALLS.clear()
    jax.eval_shape(fn, *args)
    got = collections.Counter(CALLS)
    assert got == want, f"projections missing from Ops.linear: {dict(want - got)}; unexpected: {dict(got - want)}"


OPS = CountingOps(block_size=BS, unroll=True)


@pytest.mark.parametrize("c", [config(), config(arch="qwen2", tie_word_embeddings=True), HYBRID],
                         ids=["llama", "qwen2_tied", "hybrid_gdn_moe"])
def test_every_projection_of_the_decoder_goes_through_ops_linear(c):
    """One forward of a decoder calls `Ops.linear` once per declared projection weight of each layer (attention,
    gated attention, Gated DeltaNet, MLP, router, experts, shared expert) and once for the head."""
    decoder = Decoder(c, OPS)
    params = schema.abstract(decoder.param_schema(), jnp.float32)
    state = schema.abstract(decoder.state_schema(CACHE), jnp.float32)
    want = projections(decoder.param_schema())
    if c.tie_word_embeddings:
        want["embed"] += 1   # the head
    assert_through_the_seam(want, lambda p, s: decoder.forward(p, s, batch()), params, state)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_every_projection_of_the_heads_goes_through_ops_linear(method):
    """A head's features, forward and logits call `Ops.linear` once per projection weight it declares (fc, its
    layers', its lm_head), and EAGLE-1 and MTP once more for the target's lm_head they borrow."""
    target = HYBRID if method == "mtp" else config(num_layers=4)
    head = {"eagle": EagleHead("eagle", config(), target, fc_bias=True, final_norm=True),
            "eagle3": EagleHead("eagle3", config(num_layers=1), target, draft_vocab_size=16),
            "mtp": MtpHead(HYBRID)}[method]
    params = schema.abstract(head.param_schema(), jnp.float32)
    target_params = schema.abstract(Decoder(target).param_schema(), jnp.float32)
    kv = schema.abstract(head.state_schema(CACHE), jnp.float32)["attention"]
    b, D = batch(), target.hidden_size

    def draft(params, target_params, kv):
        aux = jnp.ones((3, 6, D))
        feature = head.features(OPS, params, jnp.ones((6, D)), aux)
        out, kv = head.forward(OPS, params, target_params, kv, b.token_ids, feature, b)
        return head.logits(OPS, params, target_params, out), kv

    want = projections(head.param_schema())
    if method != "eagle3":
        want["lm_head"] += 1
    assert_through_the_seam(want, draft, params, target_params, kv)


def test_every_projection_of_the_eagle3_trainer_goes_through_ops_linear():
    """The trainer's head unrolled J steps: fc once, then each step its layer's projections and its lm_head."""
    from jaxspec.train.eagle3 import unrolled_logits
    head = EagleHead("eagle3", config(num_layers=1), config(num_layers=4), draft_vocab_size=16)
    param_schema = {k: v for k, v in head.param_schema().items() if k != "draft_to_target"}
    params = schema.abstract(param_schema, jnp.float32)
    J = 2
    want = collections.Counter({name: J * n for name, n in projections(param_schema).items()})
    want["fc"] = 1
    assert_through_the_seam(want, lambda p: unrolled_logits(head, p, jnp.ones((64, 32)), jnp.ones((2, 5), jnp.int32),
                                                            jnp.ones((2, 5, 96)), J, ops=OPS), params)
