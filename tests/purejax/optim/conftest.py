"""Shared helpers for the optimizer tests: a random params tree, and a parity runner that drives a purejax
optimizer and its optax (or other) reference side by side on the same gradients.

The runner is jitted once per pair of builders; hyperparameters are traced arguments, so hypothesis can try
many values without recompiling. It compiles with XLA:CPU's fusion emitters, as a user's program does, even
where the suite turns them off to compile faster (tests/conftest.py): the older emitters fuse the two
optimizers' arithmetic differently, and 50 steps of Muon then differ by about 1e-6 where they agree bit for bit.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bench.suite_compile import OLDER_EMITTERS
from purejax import optim

# Leaf shapes chosen to cover scalars, vectors, matrices in both orientations and a 3-d leaf (Adafactor factors
# the two largest axes), nested dicts and a list.
SHAPES = {
    "w": (6, 4),
    "b": (4,),
    "blocks": [{"w": (3, 5), "scale": ()}, {"w": (5, 3), "scale": ()}],
    "conv": (2, 3, 4),
}


def make_params(seed: int = 0, shapes=SHAPES) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def gradient_sequence(params, steps: int, seed: int = 42):
    """`steps` random gradient trees stacked on a leading axis, drawn with numpy (outside any compiled code:
    jax's random-number code would dominate the compile time of these small tests)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=(steps, *p.shape)), p.dtype), params)


USERS_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if OLDER_EMITTERS in os.environ.get("XLA_FLAGS", "") else {}


@functools.partial(jax.jit, static_argnums=(0, 1), compiler_options=USERS_EMITTERS)
def _run_pair(make_ours, make_theirs, hparams, params, grads):
    ours, theirs = make_ours(**hparams), make_theirs(**hparams)

    def body(carry, g):
        p1, s1, p2, s2 = carry
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = theirs.update(g, s2, p2)
        return (optim.apply_updates(p1, u1), s1, optax.apply_updates(p2, u2), s2), None

    (p1, _, p2, _), _ = jax.lax.scan(body, (params, ours.init(params), params, theirs.init(params)), grads)
    return p1, p2


def assert_close(got, want, rtol: float = 1e-6) -> None:
    """Elementwise relative error at most `rtol`, with an absolute floor of `rtol` times the largest magnitude in
    the whole tree: a parameter that happens to sit near zero has passed through values of the tree's scale, and
    float32 rounding there (a few 1e-8) is all the difference there can be."""
    scale = max(float(np.max(np.abs(np.asarray(w, np.float64)))) for w in jax.tree_util.tree_leaves(want))
    jax.tree_util.tree_map(
        lambda g, w: np.testing.assert_allclose(
            np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=rtol * scale
        ),
        got,
        want,
    )


def check_parity(make_ours, make_theirs, hparams: dict, steps: int = 100, rtol: float = 1e-6, params=None):
    """Run both optimizers `steps` steps from the same params on the same random gradients; the final params
    must agree to `rtol` (float32 rounding: the two programs may round a sum differently now and then)."""
    params = make_params() if params is None else params
    hparams = {k: jnp.asarray(v, jnp.float32) for k, v in hparams.items()}
    p1, p2 = _run_pair(make_ours, make_theirs, hparams, params, gradient_sequence(params, steps))
    moved = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(p2), jax.tree_util.tree_leaves(params))
    )
    assert moved > 1e-4, f"the parameters barely moved ({moved:.1e}): the comparison would prove nothing"
    assert_close(p1, p2, rtol)
    return p1, p2


@pytest.fixture(scope="session")
def parity():
    return check_parity


@pytest.fixture(scope="session")
def close():
    return assert_close


@pytest.fixture(scope="session")
def sample_params():
    """The params tree the parity tests run on (shapes: SHAPES)."""
    return make_params()
