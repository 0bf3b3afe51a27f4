"""purejax.nn.stack: scan equals loop (values and gradients), one trace for init, a program that does not
grow with depth, "auto" choosing by depth, per-layer keys and per-layer key/value caches, lossless
stack/unstack, and the errors."""

import dataclasses

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from models import gpt
from purejax import tree
from purejax.nn import attention, attention_cache, layer_norm, mlp, stack
from purejax.nn.attention import AttentionConfig

D = 8
# rank 2 on purpose: XLA:CPU compiles random draws (dropout masks) of higher rank far more slowly
X = jax.random.normal(jax.random.key(1), (4, D))


def block_init(key):
    return {"ln": layer_norm.init(None, D), "mlp": mlp.init(key, D, 2 * D)}


def block_apply(params, x):
    return x + mlp.apply(params["mlp"], layer_norm.apply(params["ln"], x))


# jitted, so each test compiles one program instead of dispatching (and compiling) every primitive eagerly
init = jax.jit(stack.init, static_argnums=(1, 2))


@pytest.fixture(scope="module")
def stacked():
    return init(jax.random.key(0), 3, block_init)


def test_init_stacks_in_one_trace():
    traces = []

    def counted_init(key):
        traces.append(1)
        return block_init(key)

    shapes = jax.eval_shape(lambda key: stack.init(key, 5, counted_init), jax.random.key(0))
    assert len(traces) == 1
    assert stack.depth(shapes) == 5
    chex.assert_shape(shapes["mlp"]["fc"]["w"], (5, D, 2 * D))


def small_init(key):
    return {"w": jax.random.normal(key, (D, D)), "b": jnp.zeros(D)}


def test_layer_params_depend_on_the_index_alone():
    key = jax.random.key(0)
    three, five = stack.unstack(init(key, 3, small_init)), stack.unstack(init(key, 5, small_init))
    for i in range(3):
        chex.assert_trees_all_equal(three[i], five[i])
        # and they are what the documented rule gives, layer by layer without vmap
        chex.assert_trees_all_close(three[i], small_init(jax.random.fold_in(key, i)), rtol=1e-6, atol=1e-7)
    assert not np.allclose(three[0]["w"], three[1]["w"])


def test_stack_unstack_round_trip_is_bit_exact():
    def layer(i):  # mixed dtypes, a scalar leaf and a nested dict
        w = jax.random.normal(jax.random.key(i), (3, 2), jnp.bfloat16)
        return {"w": w, "step": jnp.int32(i), "m": {"v": jnp.full(2, i / 3)}}

    layers = [layer(i) for i in range(4)]
    stacked = stack.stack(layers)
    assert stacked["w"].dtype == jnp.bfloat16 and stacked["step"].shape == (4,)
    back = stack.unstack(stacked)
    assert len(back) == 4
    for got, want in zip(back, layers):
        chex.assert_trees_all_equal(got, want, strict=True)
    chex.assert_trees_all_equal(stack.stack(back), stacked, strict=True)


def test_scan_equals_loop_values_and_gradients(stacked):
    layers = stack.unstack(stacked)
    x = X

    def scan_loss(stacked, x):
        return jnp.sum(stack.scan(block_apply, stacked, x) ** 2)

    def loop_loss(layers, x):
        return jnp.sum(stack.loop(block_apply, layers, x) ** 2)

    (v_scan, (g_scan, gx_scan)) = jax.jit(jax.value_and_grad(scan_loss, argnums=(0, 1)))(stacked, x)
    (v_loop, (g_loop, gx_loop)) = jax.jit(jax.value_and_grad(loop_loss, argnums=(0, 1)))(layers, x)
    np.testing.assert_allclose(v_scan, v_loop, rtol=1e-6)
    chex.assert_trees_all_close(g_scan, stack.stack(g_loop), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(gx_scan, gx_loop, rtol=1e-5, atol=1e-5)


def _count_eqns(jaxpr):
    return sum(1 + sum(_count_eqns(sub) for sub in jax.extend.core.jaxprs_in_params(e.params)) for e in jaxpr.eqns)


def test_scan_program_does_not_grow_with_depth():
    layer = jax.eval_shape(block_init, jax.random.key(0))  # shapes are all a jaxpr needs

    def size(run, n):
        stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), layer)
        params = [layer] * n if run is stack.loop else stacked
        return _count_eqns(jax.make_jaxpr(lambda p, x: run(block_apply, p, x))(params, X).jaxpr)

    assert size(stack.scan, 2) == size(stack.scan, 8)
    assert size(stack.loop, 8) > 3 * size(stack.loop, 2)  # the unrolled loop does grow: the check can fail


def _scans(jaxpr):
    return sum(
        (e.primitive.name == "scan") + sum(map(_scans, jax.extend.core.jaxprs_in_params(e.params))) for e in jaxpr.eqns
    )


def _has_scan(fn, *args):
    return _scans(jax.make_jaxpr(fn)(*args).jaxpr) > 0


@pytest.mark.parametrize("n", [1, stack.AUTO_LOOP_DEPTH, stack.AUTO_LOOP_DEPTH + 1])
def test_apply_auto_loops_shallow_stacks_and_scans_deep_ones(n):
    """`apply(mode, ...)` runs `scan` or `loop` by name; "auto" unrolls up to AUTO_LOOP_DEPTH layers (the
    program has no scan), scans beyond, and either way computes what the explicit forms compute."""
    params = init(jax.random.key(0), n, block_init)
    assert stack.resolve("auto", n) == ("loop" if n <= stack.AUTO_LOOP_DEPTH else "scan")
    assert stack.resolve("auto", n, remat=True) == "scan"  # XLA:CPU schedules a loop's recomputation away
    assert [stack.resolve(m, n, remat=True) for m in ("scan", "loop")] == ["scan", "loop"]  # explicit modes stay
    assert _has_scan(lambda p, x: stack.apply("auto", block_apply, p, x), params, X) == (n > stack.AUTO_LOOP_DEPTH)
    assert _has_scan(lambda p, x: stack.apply("scan", block_apply, p, x), params, X)
    assert not _has_scan(lambda p, x: stack.apply("loop", block_apply, p, x), params, X)
    want = jax.jit(lambda p, x: stack.loop(block_apply, stack.unstack(p), x))(params, X)
    for mode in stack.MODES:
        got = jax.jit(lambda p, x, mode=mode: stack.apply(mode, block_apply, p, x))(params, X)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=mode)
    # per-layer inputs and outputs ride along as in scan and loop: here each layer adds its index
    x, ys = stack.apply("auto", lambda p, x, i: (x + i, i * 2), params, X, xs=jnp.arange(n))
    np.testing.assert_allclose(x, X + n * (n - 1) / 2, rtol=1e-6)
    np.testing.assert_array_equal(ys, 2 * np.arange(n))


@pytest.mark.parametrize("remat", ["none", "block"])
def test_gpt_layers_auto_computes_what_scan_computes(remat):
    """GPTConfig(layers="auto") at 2 layers: unrolled without remat, a scan with it, the loss of layers="scan"."""
    config = gpt.GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=16, remat=remat, layers="auto")
    params = gpt.init(jax.random.key(0), config)
    idx = jax.random.randint(jax.random.key(1), (2, 8), 0, 16)
    loss = jax.jit(lambda p, c: gpt.loss(p, (idx, idx), c), static_argnums=1)
    assert _has_scan(lambda p: gpt.loss(p, (idx, idx), config), params) == (remat != "none")
    np.testing.assert_allclose(
        loss(params, config), loss(params, dataclasses.replace(config, layers="scan")), rtol=1e-6
    )


def test_per_layer_dropout_keys(stacked):
    x = X

    def block(params, x, key):
        h = mlp.apply(params["mlp"], layer_norm.apply(params["ln"], x), dropout=0.5, key=key)
        return x + h, None

    run_scan = jax.jit(lambda p, x, k: stack.scan(block, p, x, xs=k))
    keys = stack.layer_keys(jax.random.key(1), 3)
    y_scan, ys = run_scan(stacked, x, keys)
    y_loop, _ = jax.jit(lambda p, x, k: stack.loop(block, stack.unstack(p), x, xs=k))(stacked, x, keys)
    assert ys is None
    np.testing.assert_allclose(y_scan, y_loop, rtol=1e-5, atol=1e-6)
    y_same, _ = run_scan(stacked, x, jnp.stack([keys[0]] * 3))
    assert not np.allclose(y_scan, y_same)  # each layer really got its own key
    key_2 = jax.random.fold_in(jax.random.key(1), 2)
    chex.assert_trees_all_equal(jax.random.key_data(keys[2]), jax.random.key_data(key_2))


def test_kv_caches_stacked_along_the_layer_axis():
    """A 3-layer attention stack decoded token by token: the caches ride along the layer axis (the scan body
    gets a layer's cache and returns its new one), decoding compiles once, and equals the full forward."""
    config = AttentionConfig(D, 2, n_kv_head=1, causal=True)
    n_layer, batch, seq = 3, 2, 4
    stacked = stack.stack([attention.init(jax.random.key(i), config) for i in range(n_layer)])
    x = jax.random.normal(jax.random.key(1), (batch, seq, D))

    full = stack.scan(lambda p, x: x + attention.apply(p, x, config), stacked, x)

    def block(params, x, cache):
        y, cache = attention_cache.decode(params, x, cache, config)
        return x + y, cache

    @chex.assert_max_traces(n=1)
    def step(caches, x_t):
        y_t, caches = stack.scan(block, stacked, x_t[:, None], xs=caches)
        return caches, y_t[:, 0]

    caches = stack.stack([attention_cache.init_cache(config, batch, seq)] * n_layer)
    caches, ys = jax.jit(lambda c, xs: jax.lax.scan(step, c, xs))(caches, jnp.swapaxes(x, 0, 1))
    np.testing.assert_allclose(jnp.swapaxes(ys, 0, 1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(caches["index"], [[seq] * batch] * n_layer)

    # the loop form, a prompt of 2 tokens then 2 more in one call, agrees too
    loop = jax.jit(lambda p, x, c: stack.loop(block, stack.unstack(p), x, xs=c))
    caches = stack.stack([attention_cache.init_cache(config, batch, seq)] * n_layer)
    y_prompt, caches = loop(stacked, x[:, :2], caches)
    y_rest, _ = loop(stacked, x[:, 2:], caches)
    np.testing.assert_allclose(jnp.concatenate([y_prompt, y_rest], 1), full, rtol=1e-5, atol=1e-5)


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="n must be a positive int"):
        stack.init(jax.random.key(0), 0, block_init)
    ragged = {"a": jnp.ones((3, 2)), "b": jnp.ones((4,))}
    with pytest.raises(ValueError, match=r"same leading layer axis, got a: float32\[3,2\], b: float32\[4\]"):
        stack.scan(lambda p, x: x, ragged, jnp.ones(2))
    stacked = {"w": jnp.ones((3, 2))}
    with pytest.raises(ValueError, match="xs has 2 layers on its leading axis, but the params have 3"):
        stack.scan(lambda p, x, k: (x, None), stacked, jnp.ones(2), xs=jnp.ones((2, 5)))
    with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'scan', 'loop'\), got 'vmap'"):
        stack.apply("vmap", lambda p, x: x, stacked, jnp.ones(2))
    with pytest.raises(ValueError, match="non-empty list"):
        stack.loop(lambda p, x: x, [], jnp.ones(2))
    with pytest.raises(tree.TreeMismatchError, match=r"layer 1 .*\n.*shape mismatch: w: expected \(2,\), got \(3,\)"):
        stack.stack([{"w": jnp.ones(2)}, {"w": jnp.ones(3)}])
    with pytest.raises(tree.TreeMismatchError, match=r"missing: \s*b"):
        stack.stack([{"w": jnp.ones(2), "b": jnp.ones(2)}, {"w": jnp.ones(2)}])


def test_run_gives_layer_i_the_key_folded_with_i_in_every_mode(stacked):
    """`stack.run`: one block signature with or without a key; layer i draws with fold_in(key, i) (what
    `scan` with `xs=layer_keys(key, n)` gives), the same in scan and loop and under remat; no key, no dropout."""

    def layer(params, x, key):
        return x + mlp.apply(params["mlp"], layer_norm.apply(params["ln"], x), dropout=0.5, key=key)

    key = jax.random.key(3)
    by_hand, _ = stack.scan(lambda p, x, k: (layer(p, x, k), None), stacked, X, xs=stack.layer_keys(key, 3))
    run = jax.jit(
        lambda p, x, k, mode, remat: stack.run(layer, p, x, mode=mode, remat=remat, key=k), static_argnums=(3, 4)
    )
    for mode, remat in (("scan", "none"), ("loop", "none"), ("scan", "block"), ("auto", "none")):
        np.testing.assert_allclose(run(stacked, X, key, mode, remat), by_hand, rtol=1e-5, atol=1e-6)
    no_key = jax.jit(lambda p, x: stack.run(layer, p, x, mode="scan"))(stacked, X)
    np.testing.assert_allclose(no_key, stack.scan(block_apply, stacked, X), rtol=1e-6, atol=1e-6)
    assert not np.allclose(no_key, by_hand)  # the key really dropped units


def test_run_wraps_each_layer_inside_the_remat(stacked):
    """`wrap` (FSDP's gather, in gpt_parallel) wraps the layer function once, and counts as remat for "auto"."""
    wrapped = []

    def wrap(layer):
        wrapped.append(layer)
        return lambda p, x, k: layer(p, x, k) * 1.0

    y = stack.run(lambda p, x, k: block_apply(p, x), stacked, X, mode="auto", wrap=wrap)
    np.testing.assert_allclose(y, stack.scan(block_apply, stacked, X), rtol=1e-6, atol=1e-6)
    assert len(wrapped) == 1
