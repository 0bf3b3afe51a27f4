"""purejax.precision: parsing a policy, and `with_policy` casting params and inputs to the compute dtype, leaving
integers alone, and returning the output dtype. Policies must be usable as static jit arguments."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import precision
from purejax.nn import embedding, layer_norm, linear
from purejax.precision import Policy


def test_default_policy_is_float32():
    p = Policy()
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32,) * 3
    assert str(p) == "params=float32,compute=float32,output=float32"


def test_from_string_full_spec():
    p = Policy.from_string(" params=float32, compute=bfloat16 ,output=float16 ")
    assert p.param_dtype == jnp.float32 and p.compute_dtype == jnp.bfloat16 and p.output_dtype == jnp.float16
    assert Policy.from_string(str(p)) == p  # str is the spec format


def test_from_string_aliases_and_omitted_fields_default_to_float32():
    p = Policy.from_string("param=bfloat16,compute=bfloat16")
    assert p == Policy(jnp.bfloat16, jnp.bfloat16, jnp.float32)


def test_from_string_bare_dtype_sets_all_three():
    assert Policy.from_string("bfloat16") == Policy("bfloat16", "bfloat16", "bfloat16")
    assert Policy.from_string("float16").output_dtype == jnp.float16


def test_from_string_unknown_field():
    with pytest.raises(ValueError, match=r"unknown policy field 'activations'.*valid: params, compute, output"):
        Policy.from_string("params=float32,activations=bfloat16")


@pytest.mark.parametrize("spec", ["int32", "compute=int8", "params=float32,output=bool"])
def test_from_string_non_float_dtype(spec):
    with pytest.raises(ValueError, match=r"a policy dtype must be floating point, got (int32|int8|bool)"):
        Policy.from_string(spec)


@pytest.mark.parametrize("spec", ["bf16", "compute=float33", "params=float32,compute"])
def test_from_string_unknown_dtype(spec):
    with pytest.raises(ValueError, match=r"unknown dtype '.*'; use a name such as float32"):
        Policy.from_string(spec)


def test_policy_is_frozen_and_hashable_with_normalised_dtypes():
    a, b = Policy("bfloat16", "bfloat16", "float32"), Policy(jnp.bfloat16, np.dtype(jnp.bfloat16), np.float32)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.compute_dtype = jnp.float32  # type: ignore[misc]


def test_policy_is_a_static_jit_argument_without_retracing():
    @chex.assert_max_traces(n=2)
    def f(x, policy):
        return policy.cast_to_compute(x)

    f = jax.jit(f, static_argnums=1)
    x = jnp.ones(3)
    for _ in range(3):
        assert f(x, Policy.from_string("bfloat16")).dtype == jnp.bfloat16
        assert f(x, Policy(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)).dtype == jnp.bfloat16  # equal policy: cached
        assert f(x, Policy()).dtype == jnp.float32  # the second and last trace


def test_casts():
    p = Policy("float32", "bfloat16", "float16")
    t = {"w": jnp.ones(2), "ids": jnp.arange(2)}
    assert p.cast_to_param(t)["w"].dtype == jnp.float32
    assert p.cast_to_compute(t)["w"].dtype == jnp.bfloat16
    assert p.cast_to_output(t)["w"].dtype == jnp.float16
    assert p.cast_to_compute(t)["ids"].dtype == t["ids"].dtype


def test_with_policy_casts_params_and_inputs_to_compute_and_the_output_to_output_dtype():
    seen = {}

    def apply(params, x, ids, *, scale, eps=1.0, key=None):
        seen.update(w=params["w"].dtype, step=params["step"].dtype, x=x.dtype, ids=ids.dtype, scale=scale.dtype)
        seen.update(eps=eps, key=key)
        return {"y": (x @ params["w"]) * scale, "ids": ids, "count": params["step"]}

    policy = Policy.from_string("params=float32,compute=bfloat16,output=float16")
    params = {"w": jnp.ones((3, 2)), "step": jnp.zeros((), jnp.int32)}
    key = jax.random.key(0)
    out = precision.with_policy(apply, policy)(params, jnp.ones((4, 3)), jnp.arange(4), scale=jnp.float32(2), key=key)
    bf16, i32 = jnp.bfloat16, jnp.int32
    assert seen == dict(w=bf16, step=i32, x=bf16, ids=i32, scale=bf16, eps=1.0, key=key)
    assert out["y"].dtype == jnp.float16 and out["ids"].dtype == jnp.int32 and out["count"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out["y"], np.float32), np.full((4, 2), 6.0))


def test_with_policy_keeps_the_name_and_docstring():
    wrapped = precision.with_policy(linear.apply, Policy.from_string("bfloat16"))
    assert wrapped.__name__ == "apply" and wrapped.__doc__ == linear.apply.__doc__


def test_with_policy_on_real_layers_matches_a_manual_bf16_computation():
    params = linear.init(jax.random.key(0), 8, 4)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 8)), jnp.float32)
    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    y = jax.jit(precision.with_policy(linear.apply, policy))(params, x)
    want = x.astype(jnp.bfloat16) @ params["w"].astype(jnp.bfloat16) + params["b"].astype(jnp.bfloat16)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, want.astype(jnp.float32))

    # token ids pass through as integers; the table is cast
    table = embedding.init(jax.random.key(2), 10, 4)
    lookup = precision.with_policy(embedding.apply, Policy.from_string("compute=bfloat16,output=bfloat16"))
    e = lookup(table, jnp.arange(3))
    np.testing.assert_array_equal(e, table["w"][:3].astype(jnp.bfloat16))


def test_with_policy_norms_still_compute_in_float32():
    # layer_norm upcasts internally: its bf16 result is the float32 result rounded once, not bf16 arithmetic.
    x = jnp.asarray(np.random.default_rng(0).normal(5, 3, size=(4, 256)), jnp.float32)
    params = layer_norm.init(None, 256)
    y = precision.with_policy(layer_norm.apply, Policy.from_string("bfloat16"))(params, x)
    x_bf16 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    mean, var = x_bf16.mean(-1, keepdims=True), x_bf16.var(-1, keepdims=True)
    want = ((x_bf16 - mean) / np.sqrt(var + 1e-5)).astype(np.float32)
    assert y.dtype == jnp.bfloat16
    # one rounding to bf16 (relative error <= 2^-9) of an accurate result; bf16 arithmetic would be off by ~1e-2
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-8, atol=0)


def test_with_policy_casts_only_the_arguments_named_in_cast():
    """A diffusion model's time step (or BatchNorm's running statistics) must keep float32: name what to cast,
    by name or position, and the rest passes through; keyword and positional calls alike."""
    seen = {}

    def predict(params, z, t, *, key=None):
        seen.update(params=params["w"].dtype, z=z.dtype, t=t.dtype)
        return z * params["w"] + t

    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    params, z, t = {"w": jnp.ones(3)}, jnp.ones(3), jnp.full(3, 0.5)
    for cast in (("params", "z"), (0, 1), ("z", 0)):
        seen.clear()
        out = precision.with_policy(predict, policy, cast=cast)(params, z, t=t, key=None)
        assert seen == dict(params=jnp.bfloat16, z=jnp.bfloat16, t=jnp.float32) and out.dtype == jnp.float32
    seen.clear()
    precision.with_policy(predict, policy)(params, z, t)  # the default: every floating argument
    assert seen["t"] == jnp.bfloat16


def test_with_policy_cast_names_a_mistake():
    policy = Policy.from_string("bfloat16")
    with pytest.raises(ValueError, match=r"cast names \['inputs', 3\], .* of apply \(those are \['params', 'x', "):
        precision.with_policy(linear.apply, policy, cast=("params", "inputs", 3))
    with pytest.raises(TypeError, match=r"a collection of argument names or positions, e\.g\. \('params',\)"):
        precision.with_policy(linear.apply, policy, cast="params")
