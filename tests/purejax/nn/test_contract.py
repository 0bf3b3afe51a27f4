"""The layer contract of docs/design.md, checked on the code itself: signatures (key first in init, key and
axis_name keyword-only, options keyword-only, state after the input), one name per concept, one place for a
dropout rate, initializers that are all factories, and ArrayLike inputs converted to jax arrays.

Signature rules that hold across the whole package are checked on every module of purejax.nn and
models; the finer rules are checked on the layers and models this contract was written with (LAYERS)."""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import textwrap
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import purejax.nn
from models import llama, llama_decode, mobilenet, mobilenet_config, mobilenet_torch
from models import mlp as mlp_model
from purejax.nn import (
    activations,
    batch_norm,
    conv,
    dropout,
    embedding,
    gated_mlp,
    initializers,
    layer_norm,
    linear,
    mlp,
    pooling,
    rms_norm,
    rotary,
    stack,
)

KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


def _modules(package):
    names = (m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


EVERY = _modules(purejax.nn) + _modules(models)
LAYERS = [
    activations,
    batch_norm,
    conv,
    dropout,
    embedding,
    initializers,
    layer_norm,
    linear,
    mlp,
    pooling,
    rms_norm,
    stack,
    mlp_model,
    mobilenet,
    mobilenet_config,
    mobilenet_torch,
    gated_mlp,
    rotary,
    llama,
    llama_decode,
]

# Synonyms that must not appear as a parameter or config field: the concept's one name is on the right.
SYNONYMS = {
    "d": "d_model",
    "dim": "d_model",
    "width": "d_model (or width_mult, a multiplier)",
    "hidden_size": "d_model",
    "n_heads": "n_head",
    "num_heads": "n_head",
    "d_hidden": "d_ff",
    "hidden_dim": "d_ff",
    "num_classes": "n_classes",
    "num_features": "channels",
    "features": "channels",
    "dropout_rate": "dropout",
    "p": "dropout",
}


def _functions(module):
    """Public functions defined in `module` (not imported into it)."""
    return {
        name: f
        for name, f in vars(module).items()
        if inspect.isfunction(f) and not name.startswith("_") and f.__module__ == module.__name__
    }


def _configs(module):
    return [
        c
        for c in vars(module).values()
        if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == module.__name__
    ]


def _where(module, name):
    return f"{module.__name__}.{name}"


@pytest.mark.parametrize("module", EVERY, ids=lambda m: m.__name__)
def test_every_init_takes_the_key_first(module):
    init = _functions(module).get("init")
    if init is not None:
        assert list(inspect.signature(init).parameters)[0] == "key", _where(module, "init")


@pytest.mark.parametrize("module", EVERY, ids=lambda m: m.__name__)
def test_key_and_axis_name_are_keyword_only_in_every_apply(module):
    for name, f in _functions(module).items():
        if not (name == "apply" or name.endswith("_apply") or name in ("loss", "attend", "decode", "generate")):
            continue
        params = inspect.signature(f).parameters
        for keyword in ("key", "axis_name"):
            if keyword in params:
                assert params[keyword].kind is KEYWORD_ONLY, f"{_where(module, name)}: {keyword} must be keyword-only"
                # no key means evaluation in an apply; a loss that must draw (rectified_flow's times) requires one
                if keyword == "axis_name" or "apply" in name:
                    assert params[keyword].default is None, f"{_where(module, name)}: {keyword} must default to None"


@pytest.mark.parametrize("module", EVERY, ids=lambda m: m.__name__)
def test_a_dropout_rate_given_by_a_config_is_not_also_a_keyword(module):
    for name, f in _functions(module).items():
        params = inspect.signature(f).parameters
        config = params.get("config")
        hints = typing.get_type_hints(f) if config is not None else {}
        config_type = hints.get("config")
        if isinstance(config_type, type) and "dropout" in _settings(config_type):
            doubled = {"dropout", "rate", "dropout_rate"} & set(params)
            assert not doubled, f"{_where(module, name)}: the rate is config.dropout, so not also {doubled}"


def _settings(config_type: type) -> set[str]:
    """A config's setting names: a dataclass's fields, or the attributes a Protocol of settings names
    (`models.gpt_moe.MoESettings`, the part of a GPTConfig the MoE file reads)."""
    if dataclasses.is_dataclass(config_type):
        return {f.name for f in dataclasses.fields(config_type)}
    return set(typing.get_type_hints(config_type))


@pytest.mark.parametrize("module", EVERY, ids=lambda m: m.__name__)
def test_config_fields_use_one_name_per_concept(module):
    for config in _configs(module):
        for field in dataclasses.fields(config):
            assert field.name not in SYNONYMS, f"{config.__name__}.{field.name}: call it {SYNONYMS[field.name]}"


@pytest.mark.parametrize("module", LAYERS, ids=lambda m: m.__name__)
def test_parameters_use_one_name_per_concept(module):
    for name, f in _functions(module).items():
        for param in inspect.signature(f).parameters:
            assert param not in SYNONYMS, f"{_where(module, name)}({param}=...): call it {SYNONYMS[param]}"


# Sizes with a default, which stay positional (a size, not an option): mlp's d_out defaults to d_in.
POSITIONAL_SIZES = {"purejax.nn.mlp.init": {"d_out"}, "purejax.nn.gated_mlp.init": {"d_out"}}


@pytest.mark.parametrize("module", LAYERS, ids=lambda m: m.__name__)
def test_options_of_init_and_apply_are_keyword_only(module):
    for name, f in _functions(module).items():
        if not (name in ("init", "apply", "loss") or name.endswith(("_init", "_apply"))):
            continue
        allowed = POSITIONAL_SIZES.get(_where(module, name), set())
        for param in inspect.signature(f).parameters.values():
            if param.default is not param.empty and param.name not in allowed:
                assert param.kind is KEYWORD_ONLY, f"{_where(module, name)}: option {param.name} must be keyword-only"


def test_stateful_apply_takes_the_state_after_the_input():
    assert list(inspect.signature(batch_norm.apply).parameters)[:3] == ["params", "x", "state"]
    assert list(inspect.signature(mobilenet.apply).parameters)[:4] == ["params", "x", "state", "config"]


FACTORY_ARGS = {"variance_scaling": (1.0, "fan_in", "normal")}  # the factories with required settings


def test_initializers_are_all_factories():
    factories = {name: f for name, f in _functions(initializers).items() if name != "fans"}
    assert {"zeros", "ones", "normal", "lecun_normal"} <= set(factories)
    key = jax.random.key(0)
    for name, factory in factories.items():
        assert not {"key", "shape"} & set(inspect.signature(factory).parameters), f"{name} is not a factory"
        init = factory(*FACTORY_ARGS.get(name, ()))
        w = init(key, (3, 4), jnp.bfloat16)
        assert w.shape == (3, 4) and w.dtype == jnp.bfloat16, name
    np.testing.assert_array_equal(initializers.zeros()(None, (2,), jnp.float32), np.zeros(2))
    np.testing.assert_array_equal(initializers.ones()(None, (2,), jnp.float32), np.ones(2))


def _array_like_calls():
    """(function of an input, numpy input), named by the layer, for every layer whose input is ArrayLike."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    images = rng.normal(size=(1, 4, 4, 3)).astype(np.float32)
    key = jax.random.key(0)
    dense, table = linear.init(key, 3, 5), embedding.init(key, 7, 3)
    config = mlp_model.MLPConfig(d_in=3, hidden=(4,), n_classes=2)
    calls = [
        ("linear", lambda a: linear.apply(dense, a), x),
        ("mlp", lambda a: mlp.apply(mlp.init(key, 3, 8), a), x),
        ("gated_mlp", lambda a: gated_mlp.apply(gated_mlp.init(key, 3, 8), a), x),
        ("rotary positions", lambda a: rotary.apply(jnp.ones((1, 2, 1, 4)), a), np.array([3, 4], np.int32)),
        ("layer_norm", lambda a: layer_norm.apply(layer_norm.init(None, 3), a), x),
        ("rms_norm", lambda a: rms_norm.apply(rms_norm.init(None, 3), a), x),
        (
            "batch_norm",
            lambda a: batch_norm.apply(batch_norm.init(None, 3), a, batch_norm.init_state(3), train=True)[0],
            x,
        ),
        ("dropout", lambda a: dropout.apply(a, rate=0.5, key=key), x),
        ("dropout without key", lambda a: dropout.apply(a, rate=0.5), x),
        ("embedding", lambda a: embedding.apply(table, a), np.array([[1, 2]], np.int32)),
        ("embedding.attend", lambda a: embedding.attend(table, a), x),
        ("conv", lambda a: conv.apply(conv.init(key, 3, 2, 3), a), images),
        ("avg_pool", lambda a: pooling.avg_pool(a, 2), images),
        ("max_pool", lambda a: pooling.max_pool(a, 2), images),
        ("global_avg_pool", pooling.global_avg_pool, images),
        ("models.mlp", lambda a: mlp_model.apply(mlp_model.init(key, config), a, config), x),
    ]
    return [pytest.param(fn, value, id=name) for name, fn, value in calls]


@pytest.mark.parametrize("fn, value", _array_like_calls())
def test_array_like_inputs_are_converted(fn, value):
    """A numpy input gives a jax array, equal to what the same values give as a jax array."""
    got = fn(value)
    assert isinstance(got, jax.Array), f"returned {type(got).__name__}"
    np.testing.assert_array_equal(got, fn(jnp.asarray(value)))


def _config_type(f) -> type | None:
    """The class annotated on `f`'s `config` parameter, if it has one."""
    if "config" not in inspect.signature(f).parameters:
        return None
    config_type = typing.get_type_hints(f).get("config")
    return config_type if isinstance(config_type, type) else None


LAYER_FUNCTIONS = ("init", "apply", "block", "hidden", "embed", "loss", "attend", "decode", "generate")


@pytest.mark.parametrize("module", EVERY, ids=lambda m: m.__name__)
def test_a_setting_in_the_config_is_not_also_an_argument(module):
    """Where a setting lives (docs/design.md): a layer's function that takes a config takes none of its settings
    again (a function that edits a config, as `gpt_surgery.crop_block_size`, takes the new value)."""
    for name, f in _functions(module).items():
        config_type = _config_type(f) if name in LAYER_FUNCTIONS or name.endswith(("_init", "_apply")) else None
        if config_type is not None:
            doubled = _settings(config_type) & set(inspect.signature(f).parameters)
            assert not doubled, f"{_where(module, name)}: {sorted(doubled)} are settings of its config"


@pytest.mark.parametrize("module", EVERY, ids=lambda m: m.__name__)
def test_init_and_apply_take_the_same_config(module):
    """A layer whose init takes a config is applied with that config: the settings both must agree on."""
    functions = _functions(module)
    if "init" in functions and "apply" in functions:
        made_with = _config_type(functions["init"])
        if made_with is not None:
            applied_with = _config_type(functions["apply"])
            assert applied_with is not None and issubclass(made_with, applied_with), _where(module, "apply")


NORMS = [
    (layer_norm.init, 8),
    (rms_norm.init, 8),
    (batch_norm.init, 8),
    (purejax.nn.group_norm.init, 8),
    (purejax.nn.instance_norm.init, 8),
]


@pytest.mark.parametrize("init, size", NORMS, ids=lambda v: getattr(v, "__module__", str(v)))
def test_layers_without_random_params_take_a_key_and_ignore_it(init, size):
    """A block hands every sublayer its named key; a norm's params are the same with it as without."""
    with_key, without = init(jax.random.key(0), size), init(None, size)
    assert jax.tree.structure(with_key) == jax.tree.structure(without)
    for a, b in zip(jax.tree.leaves(with_key), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)


BLOCK_INITS = [
    "purejax.nn.encoder_block.init",
    "models.gpt.init",
    "models.llama.init_block",
    "models.mobilenet.unit_init",
]


@pytest.mark.parametrize("where", BLOCK_INITS)
def test_a_block_gives_every_sublayer_its_named_key(where):
    """One calling style in a block: no sublayer's init is called with None (or without the block's keys) there."""
    module_name, name = where.rsplit(".", 1)
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module_name), name))))
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "init":
            first = call.args[0] if call.args else None
            named = isinstance(first, ast.Subscript) and isinstance(first.value, ast.Name) and first.value.id == "keys"
            assert named, f"{where}: {ast.unparse(call)} is not given keys[<its name>]"
