"""purejax.optim.muon: Muon against optax.contrib.muon (default rule, stacked layers, schedules, decay masks,
bfloat16), Newton-Schulz against a float64 SVD, the GPT's matrix rule, checkpoints and a single trace."""

import functools

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optax.contrib import MuonDimensionNumbers

from purejax import checkpoint, optim
from purejax import tree as tree_lib
from purejax.optim.muon import KELLER_JORDAN_COEFFS

# A 2-D matrix, a tall one, an embedding, biases and a norm scale, and blocks stacked on a leading layer axis
# of 2 (a (2, 8, 16) weight is two matrices; a (2, 16) bias is two vectors, though it is 2-D).
SHAPES = {
    "wte": {"w": (12, 8)},
    "blocks": {"w": (2, 8, 16), "b": (2, 16), "ln": {"scale": (2, 8)}},
    "proj": {"w": (16, 8), "b": (8,)},
    "ln_f": {"scale": (8,)},
}
# The same choice of matrices in optax's terms: the blocks' weight is (layer, d_in, d_out), the rest plain.
OPTAX_DIMS = {
    "wte": {"w": None},
    "blocks": {"w": MuonDimensionNumbers(1, 2), "b": None, "ln": {"scale": None}},
    "proj": {"w": MuonDimensionNumbers(0, 1), "b": None},
    "ln_f": {"scale": None},
}
GPT_RULE = optim.matrix_leaves(stacked=("blocks",), exclude=("wte",))


def make_params(dtype=jnp.float32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s), dtype), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )


def _ours_default(lr, beta, wd, nesterov):
    return optim.muon(lr, beta=beta, weight_decay=wd, nesterov=nesterov)


def _optax_default(lr, beta, wd, nesterov):
    return optax.contrib.muon(lr, beta=beta, weight_decay=wd, nesterov=nesterov)


# Built once, so that the parity runner (jitted with the builders as static arguments) compiles once per pair.
DEFAULT_PAIRS = {
    nesterov: (
        functools.partial(_ours_default, nesterov=nesterov),
        functools.partial(_optax_default, nesterov=nesterov),
    )
    for nesterov in (True, False)
}


@pytest.mark.parametrize("nesterov", [True, False])
@settings(max_examples=4, deadline=None)
@given(lr=st.floats(1e-3, 5e-2), beta=st.floats(0.5, 0.99), wd=st.floats(0.0, 0.5))
def test_muon_matches_optax_with_the_default_rule(parity, nesterov, lr, beta, wd):
    """Default: every 2-D leaf is a matrix (the embedding and the stacked biases too), 3-D ones go to Adam."""
    parity(*DEFAULT_PAIRS[nesterov], dict(lr=lr, beta=beta, wd=wd), steps=50, params=make_params())


def _schedule(peak):
    return lambda count: peak * jnp.minimum(1.0, (count + 1) / 10) / (1 + 0.01 * count)  # warmup, then decay


def _not_proj(path, leaf):
    return path != "proj.w"


def _ours_stacked(lr, adam_lr, wd, adam_wd, *, nesterov, consistent_rms):
    return optim.muon(
        _schedule(lr),
        weight_decay=wd,
        weight_decay_mask=_not_proj,
        nesterov=nesterov,
        adam_b2=0.95,
        adam_weight_decay=adam_wd,
        adam_learning_rate=adam_lr,
        matrices=GPT_RULE,
        consistent_rms=consistent_rms,
    )


def _optax_stacked(lr, adam_lr, wd, adam_wd, *, nesterov, consistent_rms):
    def not_proj(params):  # optax hands the mask the Muon leaves only, the others masked out
        return jax.tree_util.tree_map_with_path(lambda path, _: tree_lib.path_to_str(path) != "proj.w", params)

    return optax.contrib.muon(
        _schedule(lr),
        weight_decay=wd,
        weight_decay_mask=not_proj,
        nesterov=nesterov,
        adam_b2=0.95,
        adam_weight_decay=adam_wd,
        adam_learning_rate=adam_lr,
        muon_weight_dimension_numbers=OPTAX_DIMS,
        consistent_rms=consistent_rms,
    )


@pytest.mark.parametrize("nesterov, consistent_rms", [(True, None), (False, None), (True, 0.2)])
def test_muon_matches_optax_on_stacked_layers_with_schedules_and_decay_masks(parity, nesterov, consistent_rms):
    """Blocks stacked on a layer axis are orthogonalised one layer at a time, as optax with a batch axis in
    its dimension numbers; a scheduled Muon rate, a separate Adam rate, both decays (one masked)."""
    opts = dict(nesterov=nesterov, consistent_rms=consistent_rms)
    ours, theirs = functools.partial(_ours_stacked, **opts), functools.partial(_optax_stacked, **opts)
    parity(ours, theirs, dict(lr=0.02, adam_lr=3e-3, wd=0.1, adam_wd=0.01), steps=50, params=make_params())


def test_muon_in_bfloat16_matches_optax_to_bfloat16_rounding(close):
    """bfloat16 params and gradients: the momentum and Newton-Schulz run in bfloat16 on both sides."""
    params = make_params(jnp.bfloat16)
    grads = jax.tree_util.tree_map(lambda p: p[::-1] * 0.5, params)

    @functools.partial(jax.jit, static_argnums=0)
    def three_steps(make):
        tx = make()
        state, out = tx.init(params), []
        for _ in range(3):
            updates, state = tx.update(grads, state, params)
            out.append(updates)
        return out

    ours = three_steps(lambda: optim.muon(0.02, matrices=GPT_RULE))
    theirs = three_steps(lambda: optax.contrib.muon(0.02, muon_weight_dimension_numbers=OPTAX_DIMS))
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree_util.tree_leaves(ours))
    close(ours, theirs, rtol=2**-8)  # one bfloat16 ulp (they agree bit for bit on CPU with jax 0.10.2)


def _svd_reference(x: np.ndarray, coeffs=(3.4445, -4.7750, 2.0315), steps: int = 5, eps: float = 1e-8):
    """Newton-Schulz computed on the singular values, in float64: U p(p(...p(S/||x||_F)...)) V^T."""
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    a, b, c = coeffs
    s = s / (np.sqrt(np.sum(s**2)) + eps)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ vt, u @ vt


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_newton_schulz_against_a_float64_svd(shape):
    """Singular vectors kept, each singular value mapped by the quintic five times; starting from 1% of the
    Frobenius norm or more they land in [0.68, 1.14], so the result is U V^T to within 0.32."""
    rng = np.random.default_rng(1)
    q1, _ = np.linalg.qr(rng.normal(size=(shape[0], shape[0])))
    q2, _ = np.linalg.qr(rng.normal(size=(shape[1], shape[1])))
    k = min(shape)
    s = np.geomspace(1.0, 0.04, k)  # condition number 25; the smallest is about 2% of the Frobenius norm
    x = (q1[:, :k] * s) @ q2[:k, :] * 3.0
    got = np.asarray(optim.newton_schulz(jnp.asarray(x, jnp.float32)), np.float64)
    want, polar = _svd_reference(x)
    np.testing.assert_allclose(got, want, atol=2e-6)
    singular = np.linalg.svd(got, compute_uv=False)
    assert singular.min() > 0.68 and singular.max() < 1.14, singular
    assert np.linalg.norm(got - polar, ord=2) < 0.32


def test_newton_schulz_orthogonalises_each_layer_of_a_stack_on_its_own():
    """A (layer, d_in, d_out) stack is that many matrices: each normalised by its own norm, so a layer 1000x
    larger than the others changes nothing in them (optax's batch axis, not one tall matrix)."""
    rng = np.random.default_rng(2)
    stack = rng.normal(size=(3, 6, 10)) * np.array([1.0, 1000.0, 0.01])[:, None, None]
    got = np.asarray(optim.newton_schulz(jnp.asarray(stack, jnp.float32)), np.float64)
    for layer in range(3):
        np.testing.assert_allclose(got[layer], _svd_reference(stack[layer])[0], atol=2e-6)


def test_newton_schulz_keeps_the_dtype_of_its_input():
    coeffs = tuple(jnp.asarray(k, jnp.float32) for k in KELLER_JORDAN_COEFFS)
    assert optim.newton_schulz(jnp.ones((2, 4, 6), jnp.bfloat16), coeffs).dtype == jnp.bfloat16


def test_matrix_leaves_picks_the_gpt_hidden_matrices():
    """On purejax's GPT: the four weight matrices per block; not wte (the embedding and the tied head), wpe,
    biases or LayerNorm scales (which the layer axis makes 2-D)."""
    from models import gpt

    config = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    shapes = jax.eval_shape(lambda: gpt.init(jax.random.key(0), config))
    rule = optim.matrix_leaves(stacked=("blocks",), exclude=("wte", "wpe"))
    chosen = [path for path, on in tree_lib.flatten(optim.resolve_mask(rule, shapes)).items() if on]
    assert chosen == ["blocks.attn.proj.w", "blocks.attn.qkv.w", "blocks.mlp.fc.w", "blocks.mlp.proj.w"]
    default = optim.resolve_mask(optim.matrix_leaves(), shapes)
    assert default["wte"]["w"] and default["blocks"]["ln_1"]["scale"] and not default["blocks"]["attn"]["qkv"]["w"]


def test_state_is_named_holds_each_leaf_once_and_checkpoints(tmp_path):
    params = make_params()
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    tx = optim.muon(_schedule(0.02), adam_learning_rate=3e-3, matrices=GPT_RULE)
    step = jax.jit(tx.update)
    state = step(grads, tx.init(params), params)[1]
    checkpoint.save(tmp_path / "muon.msgpack", state, step=1)
    names = [leaf.path for leaf in checkpoint.read_metadata(tmp_path / "muon.msgpack").leaves]
    adam_leaves = ["blocks.b", "blocks.ln.scale", "ln_f.scale", "proj.b", "wte.w"]
    assert sorted(names) == sorted(
        [
            "muon.count",
            "muon.mu.blocks.w",
            "muon.mu.proj.w",
            "adam.count",
            "lr.count",
            "lr.learning_rate",
            "lr_adam.learning_rate",
        ]
        + [f"adam.{m}.{p}" for m in ("mu", "nu") for p in adam_leaves]
    )
    restored, _ = checkpoint.restore(tmp_path / "muon.msgpack", like=state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, step(grads, restored, params), step(grads, state, params))


def test_learning_rates_are_read_from_the_state_and_the_step_traces_once():
    params = make_params()
    tx = optim.muon(0.02, adam_learning_rate=3e-3, matrices=GPT_RULE)
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(None)
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    state = tx.init(params)
    for seed in range(3):
        params, state = step(params, state, make_params(seed=seed + 1))
    state = optim.set_learning_rate(state, 1e-3)  # both rates, as traced values: no new trace
    params, state = step(params, state, make_params(seed=9))
    assert len(traces) == 1
    assert float(optim.get_learning_rate(state)) == pytest.approx(1e-3)  # Muon's ("lr" comes before "lr_adam")
    assert float(optim.get_learning_rate(tx.init(params))) == pytest.approx(0.02)
    assert float(tx.init(params)["lr_adam"].learning_rate) == pytest.approx(3e-3)


def test_errors_name_the_leaf_that_is_not_a_matrix():
    tx = optim.scale_by_muon()
    params = {"proj": {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}}
    with pytest.raises(ValueError, match=r"proj\.b has shape \(3,\).*matrices="):
        tx.update(params, tx.init(params))
    with pytest.raises((ValueError, jaxtyping.TypeCheckError)):  # the latter where the tests check annotations
        optim.newton_schulz(jnp.ones(3))
    with pytest.raises(ValueError, match="blocks.b has shape"):  # a scalar under blocks has no layer axis
        optim.resolve_mask(optim.matrix_leaves(stacked=("blocks",)), {"blocks": {"b": jnp.ones(())}})
