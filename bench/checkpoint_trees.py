"""The two trees bench/checkpoint.py saves and loads: GPT-2 small's parameters (124M, float32) with an AdamW
state (optax's, mu and nu), 1.5 GB ("adamw"); and the same parameters in bfloat16, 249 MB ("bf16"). Every leaf
is random, so nothing compresses; `abstract_tree` gives the shapes and dtypes alone, which the loaders take as
the tree to restore into.
"""

import functools

import jax
import jax.numpy as jnp
import optax

CASES = {"adamw": "GPT-2 small params + AdamW state, float32", "bf16": "GPT-2 small params, bfloat16"}


def gpt2_shapes(d: int = 768, n_layer: int = 12, vocab: int = 50257, n_ctx: int = 1024) -> dict:
    """GPT-2 small's parameter shapes (124M), in purejax's naming."""

    def linear(d_in, d_out):
        return {"w": (d_in, d_out), "b": (d_out,)}

    def norm():
        return {"scale": (d,), "bias": (d,)}

    block = {
        "ln_1": norm(),
        "attn": {"qkv": linear(d, 3 * d), "proj": linear(d, d)},
        "ln_2": norm(),
        "mlp": {"fc": linear(d, 4 * d), "proj": linear(4 * d, d)},
    }
    return {"wte": (vocab, d), "wpe": (n_ctx, d), "blocks": [block] * n_layer, "ln_f": norm()}


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random(key, shape, dtype):
    return jax.random.uniform(key, shape, jnp.float32, -1, 1).astype(dtype)  # fused: no float32 temporary


def abstract_tree(case: str):
    """The case's tree as shapes and dtypes (`jax.ShapeDtypeStruct` leaves), nothing allocated."""
    is_shape = lambda s: isinstance(s, tuple) and all(isinstance(d, int) for d in s)  # noqa: E731
    dtype = jnp.bfloat16 if case == "bf16" else jnp.float32
    params = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, dtype), gpt2_shapes(), is_leaf=is_shape)
    if case == "bf16":
        return params
    return {"params": params, "opt_state": jax.eval_shape(optax.adamw(3e-4).init, params)}


def make_tree(case: str):
    """The tree, every leaf random (so nothing compresses), made one leaf at a time without temporaries."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract_tree(case))
    key = jax.random.key(0)
    made = [_random(jax.random.fold_in(key, i), x.shape, x.dtype) for i, x in enumerate(leaves)]
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, made))
