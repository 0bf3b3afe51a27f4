"""models.dit against independent numpy references: patchify, the 2-D position table and the timestep
embedding (both frequency conventions) from their formulas, adaLN-Zero's identity at initialisation, the
whole forward pass in float64 numpy on random weights, MicroDiT's masking, the mixture of experts, and errors.

The numpy forward treats attention as a black box (`purejax.nn.attention.apply`, tested against its own
reference in tests/purejax/nn/test_attention.py): its fused qkv column layout is that layer's business."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import dit, dit_embeddings, dit_moe
from purejax import tree as tree_lib
from purejax.nn import attention

CONFIG = dit.DiTConfig(
    input_size=8,
    patch_size=2,
    in_channels=2,
    d_model=32,
    n_layer=2,
    n_head=2,
    n_classes=5,
    freq_dim=16,
    time_scale=1000.0,
)
B = 3

apply = jax.jit(dit.apply, static_argnames="config")
apply_masked = jax.jit(dit.apply_masked, static_argnames=("config", "mask_ratio"))
init = jax.jit(dit.init, static_argnames="config")


@functools.cache
def random_params(config=CONFIG, seed=0):
    """The initialised params plus N(0, 0.2^2) numpy noise on every leaf, so the zero-initialised modulation
    and final layer are non-trivial too."""
    rng = np.random.default_rng(seed)
    noise = lambda a: a + rng.normal(0, 0.2, a.shape).astype(np.float32)  # noqa: E731
    return jax.tree.map(noise, init(jax.random.key(seed), config))


def inputs(config=CONFIG, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, config.input_size, config.input_size, config.in_channels)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(rng.uniform(size=B), jnp.float32), jnp.asarray([0, 3, config.n_classes])


# ---------------------------------------------------------------- numpy references


def numpy_patchify(x, p):
    b, h, w, c = x.shape
    return np.stack(
        [x[:, i * p : (i + 1) * p, j * p : (j + 1) * p].reshape(b, -1) for i in range(h // p) for j in range(w // p)],
        axis=1,
    )


def numpy_sincos_2d(d, grid):
    """Element by element: token (row, col), feature k. DiT's quarter-size frequency table 10000^(-i/(d/4));
    [sin, cos] of the column in the first half, of the row in the second."""
    quarter = d // 4
    table = np.zeros((grid * grid, d))
    for row in range(grid):
        for col in range(grid):
            for i in range(quarter):
                w = 10000.0 ** (-i / quarter)
                table[row * grid + col, [i, quarter + i, 2 * quarter + i, 3 * quarter + i]] = [
                    math.sin(col * w),
                    math.cos(col * w),
                    math.sin(row * w),
                    math.cos(row * w),
                ]
    return table


def numpy_timestep_dit(t, dim, max_period=10000.0):
    """DiT's TimestepEmbedder.timestep_embedding: freqs exp(-ln(P) * i / half), [cos, sin]."""
    half = dim // 2
    freqs = np.exp(-math.log(max_period) * np.arange(half) / half)
    args = np.asarray(t, np.float64)[:, None] * freqs
    emb = np.concatenate([np.cos(args), np.sin(args)], -1)
    return np.concatenate([emb, np.zeros_like(emb[:, :1])], -1) if dim % 2 else emb


def numpy_timestep_diffusers(t, dim, max_period=10000.0):
    """diffusers' get_timestep_embedding(flip_sin_to_cos=True, downscale_freq_shift=1)."""
    half = dim // 2
    exponent = -math.log(max_period) * np.arange(half) / (half - 1)
    emb = np.asarray(t, np.float64)[:, None] * np.exp(exponent)[None]
    emb = np.concatenate([np.sin(emb), np.cos(emb)], -1)
    return np.concatenate([emb[:, half:], emb[:, :half]], -1)  # flip_sin_to_cos


def numpy_forward(params, x, t, y, config):
    """DiT in float64 numpy, from the paper and the reference code; attention is the black box."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    gelu = lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))  # noqa: E731
    lin = lambda a, q: a @ q["w"] + q["b"]  # noqa: E731

    def ln(a):
        return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-6)

    def attn(q, a):
        q32 = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), q)
        return np.asarray(attention.apply(q32, jnp.asarray(a, jnp.float32), config.attention), np.float64)

    h = lin(numpy_patchify(np.asarray(x, np.float64), config.patch_size), p["patch"])
    h = h + numpy_sincos_2d(config.d_model, config.grid)
    temb = numpy_timestep_dit(config.time_scale * np.asarray(t, np.float64), config.freq_dim)
    c = lin(silu(lin(temb, p["t_mlp"]["fc"])), p["t_mlp"]["proj"]) + p["classes"]["w"][np.asarray(y)]
    for layer in range(config.n_layer):
        q = jax.tree.map(lambda a, i=layer: a[i], p["blocks"])
        s1, sc1, g1, s2, sc2, g2 = (m[:, None] for m in np.split(lin(silu(c), q["adaln"]), 6, -1))
        h = h + g1 * attn(q["attn"], ln(h) * (1 + sc1) + s1)
        h = h + g2 * lin(gelu(lin(ln(h) * (1 + sc2) + s2, q["mlp"]["fc"])), q["mlp"]["proj"])
    shift, scale = (m[:, None] for m in np.split(lin(silu(c), p["final"]["adaln"]), 2, -1))
    out = lin(ln(h) * (1 + scale) + shift, p["final"]["proj"])
    pp, g, c_out = config.patch_size, config.grid, config.out_channels
    image = np.zeros((x.shape[0], config.input_size, config.input_size, c_out))
    for k in range(g * g):
        i, j = divmod(k, g)
        image[:, i * pp : (i + 1) * pp, j * pp : (j + 1) * pp] = out[:, k].reshape(-1, pp, pp, c_out)
    return image


# ---------------------------------------------------------------- embeddings


def test_patchify_matches_the_loops_and_unpatchify_inverts_it():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)), jnp.float32)
    tokens = dit_embeddings.patchify(x, 4)
    assert tokens.shape == (2, 4, 48)
    np.testing.assert_array_equal(tokens, numpy_patchify(np.asarray(x), 4))
    np.testing.assert_array_equal(dit_embeddings.unpatchify(tokens, 4, 3), x)


def test_position_table_matches_the_formula():
    np.testing.assert_allclose(dit_embeddings.sincos_2d(32, 4), numpy_sincos_2d(32, 4), atol=1e-6)


@pytest.mark.parametrize("dim", [16, 17])
def test_timestep_embedding_both_conventions(dim):
    t = np.array([0.0, 1.0, 17.0, 999.0])
    np.testing.assert_allclose(dit_embeddings.timestep_embedding(t, dim), numpy_timestep_dit(t, dim), atol=2e-4)
    if dim % 2 == 0:
        got = dit_embeddings.timestep_embedding(t, dim, freq_shift=1.0)
        np.testing.assert_allclose(got, numpy_timestep_diffusers(t, dim), atol=2e-4)
        assert not np.allclose(got, numpy_timestep_dit(t, dim), atol=1e-2)  # the conventions really differ


# ---------------------------------------------------------------- the model


def test_adaln_zero_blocks_are_the_identity_at_init_and_the_model_outputs_zero():
    params = init(jax.random.key(0), CONFIG)
    x, t, y = inputs()
    tokens = jnp.asarray(np.random.default_rng(2).normal(size=(B, CONFIG.seq, CONFIG.d_model)), jnp.float32)
    c = jnp.asarray(np.random.default_rng(3).normal(size=(B, CONFIG.d_model)), jnp.float32)
    layer0 = jax.tree.map(lambda a: a[0], params["blocks"])
    np.testing.assert_array_equal(jax.jit(dit.block, static_argnums=3)(layer0, tokens, c, CONFIG), tokens)
    np.testing.assert_array_equal(apply(params, x, t, y, CONFIG), 0.0)


def test_forward_matches_numpy_on_random_weights():
    params, (x, t, y) = random_params(), inputs()
    out = apply(params, x, t, y, CONFIG)
    assert out.shape == (B, 8, 8, 4)  # learned sigma: twice the input channels
    np.testing.assert_allclose(out, numpy_forward(params, x, t, y, CONFIG), rtol=2e-4, atol=2e-4)
    loop = dataclasses.replace(CONFIG, layers="loop")
    np.testing.assert_allclose(apply(params, x, t, y, loop), out, rtol=1e-5, atol=1e-5)
    velocity = jax.jit(dit.velocity, static_argnums=4)(params, x, t, y, CONFIG)
    np.testing.assert_allclose(velocity, out[..., :2], atol=1e-5)


def test_init_follows_dit():
    params = init(jax.random.key(0), CONFIG)
    flat = tree_lib.flatten(params)
    zero = [k for k, v in flat.items() if not np.any(v)]
    assert {"blocks.adaln.w", "blocks.adaln.b", "final.adaln.w", "final.proj.w", "final.proj.b"} <= set(zero)
    assert abs(float(np.std(flat["classes.w"])) - 0.02) < 0.005 and flat["classes.w"].shape == (6, 32)
    bound = math.sqrt(6 / (8 + 32))  # xavier-uniform on the (patch*patch*channels, d_model) projection
    assert 0.9 * bound < float(np.max(np.abs(flat["patch.w"]))) <= bound


def test_presets():
    xl = dit.preset("XL/2")
    assert (xl.n_layer, xl.d_model, xl.n_head, xl.patch_size, xl.seq) == (28, 1152, 16, 2, 256)
    shapes = jax.eval_shape(functools.partial(dit.init, config=dit.preset("S/8")), jax.random.key(0))
    assert 30e6 < tree_lib.count(shapes) < 35e6  # DiT-S/8: 33M parameters (table 4 of the paper)
    with pytest.raises(ValueError, match="unknown name 'XL/3'"):
        dit.preset("XL/3")


# ---------------------------------------------------------------- MicroDiT


MICRO = dataclasses.replace(CONFIG, n_mixer=1, learn_sigma=False)


def test_masking_keeps_a_fixed_number_of_whole_patches():
    params, (x, t, y) = random_params(MICRO), inputs(MICRO)
    out, kept = apply_masked(params, x, t, y, MICRO, key=jax.random.key(5), mask_ratio=0.75)
    assert kept.shape == (B, 8, 8, 1)
    per_patch = np.asarray(dit_embeddings.patchify(kept, 2))  # (batch, 16 patches, 4 pixels)
    assert (per_patch.all(-1) | ~per_patch.any(-1)).all()  # whole patches
    np.testing.assert_array_equal(per_patch.all(-1).sum(1), 4)  # 16 - round(0.75 * 16)
    assert not np.any(np.asarray(out)[~np.broadcast_to(kept, out.shape)])  # dropped patches output 0
    assert not np.array_equal(kept[0], kept[1])  # each sample draws its own patches


def test_mask_ratio_zero_is_the_plain_forward():
    params, (x, t, y) = random_params(MICRO), inputs(MICRO)
    out, kept = apply_masked(params, x, t, y, MICRO, key=jax.random.key(5), mask_ratio=0.0)
    assert np.asarray(kept).all()
    np.testing.assert_allclose(out, apply(params, x, t, y, MICRO), rtol=1e-5, atol=1e-5)


def test_dropped_patches_reach_the_kept_ones_only_through_the_mixer():
    """Deferred masking's point: with a patch-mixer, a dropped patch still informs the kept ones; without one
    (plain masked DiT), it cannot."""
    x, t, y = inputs(MICRO)
    key = jax.random.key(6)
    for config, influences in ((MICRO, True), (dataclasses.replace(MICRO, n_mixer=0), False)):
        params = random_params(config)
        out, kept = apply_masked(params, x, t, y, config, key=key, mask_ratio=0.5)
        x2 = jnp.where(kept, x, x + 1.0)  # change only the dropped patches
        out2, kept2 = apply_masked(params, x2, t, y, config, key=key, mask_ratio=0.5)
        np.testing.assert_array_equal(kept, kept2)
        assert (not np.allclose(out, out2, atol=1e-6)) == influences


@pytest.mark.parametrize("top_k", [1, 2])
def test_mixture_of_experts_matches_numpy(top_k):
    config = dataclasses.replace(CONFIG, n_experts=4, top_k=top_k)
    params = random_params(config)
    moe = jax.tree.map(lambda a: a[0], params["blocks"]["moe"])
    h = np.random.default_rng(7).normal(size=(2, 5, 32))
    got = jax.jit(dit_moe.apply, static_argnames="top_k")(moe, jnp.asarray(h, jnp.float32), top_k=top_k)

    p = jax.tree.map(lambda a: np.asarray(a, np.float64), moe)
    gelu = lambda a: 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))  # noqa: E731
    want = np.zeros_like(h)
    for b in range(2):
        for s in range(5):
            logits = h[b, s] @ p["router"]["w"]
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            top = np.argsort(-probs)[:top_k]
            for e in top:
                q = jax.tree.map(lambda a, i=e: a[i], p["experts"])
                expert = gelu(h[b, s] @ q["fc"]["w"] + q["fc"]["b"]) @ q["proj"]["w"] + q["proj"]["b"]
                gate = probs[e] if top_k == 1 else probs[e] / probs[top].sum()  # Switch's gate; Mixtral's
                want[b, s] += gate * expert
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    x, t, y = inputs(config)
    assert np.isfinite(np.asarray(apply(params, x, t, y, config))).all()


def test_the_router_learns_with_one_expert_per_token_and_starts_untied():
    """top_k=1 must still pass a gradient to the router (a renormalised gate would always be 1), and the
    router must not start at zeros, which would tie every token on expert 0."""
    config = dataclasses.replace(CONFIG, n_experts=4, top_k=1)
    moe = jax.tree.map(lambda a: a[0], dit.init(jax.random.key(0), config)["blocks"]["moe"])
    h = jnp.asarray(np.random.default_rng(7).normal(size=(2, 5, 32)), jnp.float32)
    grad = jax.grad(lambda p: jnp.sum(dit_moe.apply(p, h, top_k=1) ** 2))(moe)
    assert float(jnp.abs(grad["router"]["w"]).max()) > 1e-3
    chosen = jnp.argmax(h @ moe["router"]["w"], axis=-1)
    assert len(set(np.asarray(chosen).ravel().tolist())) > 1


def test_a_mask_ratio_that_keeps_no_patch_is_refused():
    params = random_params(CONFIG)
    x, t, y = inputs(CONFIG)
    ratio = (CONFIG.seq - 0.4) / CONFIG.seq  # below 1, but rounds every patch away
    with pytest.raises(ValueError, match="keeps none of them"):
        dit.apply_masked(params, x, t, y, CONFIG, key=jax.random.key(0), mask_ratio=ratio)


def test_a_missing_mixer_block_is_named():
    config = dataclasses.replace(CONFIG, n_mixer=2)
    params = random_params(config)
    params["mixer"] = jax.tree.map(lambda a: a[:1], params["mixer"])
    x, t, y = inputs(config)
    with pytest.raises(ValueError, match="1 mixer blocks, but .* needs .* and 2"):
        apply(params, x, t, y, config)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"input_size": 9}, "not divisible by patch_size"),
        ({"d_model": 30, "n_head": 2}, "divisible by 4"),
        ({"n_head": 5}, "not divisible by n_head"),
        ({"n_experts": 2, "top_k": 3}, "top_k=3 is more than n_experts=2"),
        ({"freq_shift": 8.0}, "freq_shift"),
        ({"mlp_norm_eps": 0.0}, "mlp_norm_eps must be positive"),
        ({"time_scale": float("nan")}, "time_scale must be positive"),
    ],
)
def test_impossible_configs_are_rejected(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **fields)


def test_bad_inputs_name_what_is_wrong():
    params, (x, t, y) = random_params(), inputs()
    with pytest.raises(ValueError, match=r"x has shape \(3, 8, 8, 3\), expected \(batch, 8, 8, 2\)"):
        dit.apply(params, jnp.zeros((3, 8, 8, 3)), t, y, CONFIG)
    with pytest.raises(ValueError, match=r"t has shape \(2,\), expected \(3,\)"):
        dit._check_inputs(params, x, t[:2], y, CONFIG)  # under the test suite's jaxtyping hook, apply's
        # annotations catch this first; a training run has no hook and gets this message
    with pytest.raises(ValueError, match="made with another config"):
        dit.apply(params, x, t, y, dataclasses.replace(CONFIG, n_layer=3))
    with pytest.raises(ValueError, match="mask_ratio must be in"):
        dit.apply_masked(params, x, t, y, CONFIG, key=jax.random.key(0), mask_ratio=1.0)
