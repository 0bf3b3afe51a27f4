"""What the mesh pages of the GPT and the Llama (gpt_parallel.py, llama_parallel.py) share: the params' global
shapes, a PartitionSpec per param from a model's rules (plus FSDP's data axis), the step into `shard_map` (this
device's shards checked, the top-level params gathered under FSDP) and the loss over the whole batch.

    shapes = on_mesh.param_shapes(gpt.init, config)
    specs = on_mesh.param_specs(shapes, SHARDING_RULES, roles, axes, axis_sizes)
    params, specs, sizes = on_mesh.enter(params, config, axes, param_specs, shapes, "gpt params")  # in shard_map
    loss = on_mesh.cross_entropy(logits, targets, axes)
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer

from purejax import losses, parallel
from purejax.parallel import MeshAxes

Params = dict[str, Any]


@functools.cache
def param_shapes(init: Callable[..., Params], config: Any) -> Params:
    """The params' global shapes (ShapeDtypeStructs) of `init(key, config)`, traced once per model and config
    (the key made inside the trace too: nothing is computed, nor compiled)."""
    return jax.eval_shape(lambda: init(jax.random.key(0), config=config))


def tensor_parallel_size(
    config: Any, names: tuple[str, ...], axes: MeshAxes, axis_sizes: Mapping[str, int], model: str, hint: str = ""
) -> int:
    """The devices of `axes.model` (1 without it), after checking that each of the config's `names` splits
    evenly over them; `hint` is added to the vocabulary's error."""
    tp = axis_sizes[axes.model] if axes.model is not None else 1
    for name in names:
        if getattr(config, name) % tp:
            raise ValueError(
                f"{model}: {name}={getattr(config, name)} cannot be split over the {tp} devices of tensor-parallel "
                f"axis {axes.model!r}; tensor parallelism needs {name} divisible by {tp}"
                + (hint if name == "vocab_size" else "")
            )
    return tp


def param_specs(
    shapes: Params,
    rules: tuple[tuple[str, Any], ...],
    roles: Mapping[str, str | None],
    axes: MeshAxes,
    axis_sizes: Mapping[str, int],
    *,
    keep: Callable[[Params, Params], Params] | None = None,
) -> Params:
    """A PartitionSpec per param: the first of `rules` that matches its path, the roles (MODEL, ...) named by
    `roles`, plus the data axis on every matrix with `axes.fsdp` (`keep(rule_specs, fsdp_specs)` may keep
    some params as the rules say). Raises if a split would be uneven."""
    specs = parallel.specs_from_rules(shapes, rules, roles)
    if axes.fsdp:
        fsdp = parallel.fsdp_specs(shapes, specs, axes.data, axis_sizes[axes.data], stacked=("blocks",))
        specs = fsdp if keep is None else keep(specs, fsdp)
    parallel.check_divisible(shapes, specs, axis_sizes)
    return specs


def enter(
    params: Params, config: Any, axes: MeshAxes, param_specs: Callable[..., Params], shapes: Params, what: str
) -> tuple[Params, Params, dict[str, int]]:
    """Inside `shard_map`: (the params with the top-level ones all-gathered under FSDP, once per pass; the
    specs; the axis sizes), after checking, naming every leaf, that each param is this device's shard."""
    sizes = {name: jax.lax.axis_size(name) for name in (axes.data, axes.model) if name is not None}
    specs = param_specs(config, axes, sizes)
    parallel.check_shards(params, shapes, specs, what)
    if axes.fsdp:  # the top-level matrices once per pass; each block's inside the scan, as it runs
        top = {name: value for name, value in params.items() if name != "blocks"}
        params = {**parallel.gather(top, {name: specs[name] for name in top}, axes.data), "blocks": params["blocks"]}
    return params, specs, sizes


def cross_entropy(
    logits: Float[Array, "batch seq vocab"], targets: Integer[ArrayLike, "batch seq"], axes: MeshAxes
) -> Float[Array, ""]:
    """The mean token loss of the whole batch from this device's logits (its slice of the vocabulary under
    `axes.model`): the sum and count of the token losses psummed over `axes.data` (and `axes.context`) before
    dividing, so a shard with more ignored targets (-1) weighs less, as on one device."""
    per_token = losses.cross_entropy(logits, targets, ignore_index=-1, axis_name=axes.model)
    if axes.context is None:
        return losses.masked_mean(per_token, jnp.asarray(targets) != -1, axis_name=axes.data)
    mask = (jnp.asarray(targets) != -1).astype(jnp.float32)
    total, count = jnp.sum(per_token.astype(jnp.float32) * mask), jnp.sum(mask)
    total, count = jax.lax.psum((total, count), tuple(a for a in (axes.data, axes.context) if a is not None))
    return total / jnp.maximum(count, 1.0)
