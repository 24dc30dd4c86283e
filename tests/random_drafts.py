"""Draft models made from a target for tests and benchmarks (no environment settings: conftest's CPU-only set-up
is not imported with it, so a GPU benchmark may use it too)."""
import dataclasses


def perturbed(model, noise: float, seed: int):
    """The same model with every weight matrix moved by `noise` times its own scale: a draft that agrees often."""
    import jax
    leaves, tree = jax.tree_util.tree_flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    moved = [x + noise * jax.numpy.std(x) * jax.random.normal(key, x.shape, x.dtype) if x.ndim > 1 else x
             for x, key in zip(leaves, keys)]
    return dataclasses.replace(model, params=jax.tree_util.tree_unflatten(tree, moved), name=model.name + "-draft")
