r"""The GPT of purejax/models/gpt.py on a device mesh: who holds which slice of every param, and the same
forward pass and loss on this device's shards, inside `jax.shard_map`.

    mesh = parallel.make_mesh(dp=4, tp=2)
    axes = parallel.MeshAxes.of(mesh, fsdp=False)
    specs = param_specs(config, axes, mesh.shape)      # a PartitionSpec per param, from SHARDING_RULES
    params = parallel.shard(params, specs, mesh)       # each device receives its slices
    def loss_fn(params, batch, key):                   # for parallel.sharded_train_step
        return loss(params, batch, config, key=key, axes=axes), {}

What each axis of `axes` (a `purejax.parallel.MeshAxes`) does here; docs/parallelism.md draws it:
- `axes.model`: Megatron-LM tensor parallelism (Shoeybi et al. 2019), gpt.py's `axis_name`: heads, MLP
  units and vocabulary split over it; one psum after attention and one after the MLP in every block, the
  embedding and the cross-entropy vocab-parallel (the logits are never gathered).
- `axes.data`: the batch is split over it. `loss` is the mean over the whole batch: the token losses' sum and
  count are psummed over the data axis before dividing. Nothing else is: the gradients' all-reduce and each
  shard's dropout key belong to the training step (purejax/parallel/step.py), not to the model.
- `axes.fsdp`: ZeRO-3, every matrix also split over the data axis at rest (`parallel.fsdp_specs`): wte and wpe
  are all-gathered once per pass, each block's params inside the scan, one layer at a time under
  `jax.checkpoint` (`parallel.gathered`); `jax.grad` turns each all-gather into a reduce-scatter.
`MeshAxes()` (or None) is one device: `apply` and `loss` are then gpt.py's, unchanged.
"""

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from purejax import losses, parallel
from purejax.models import gpt
from purejax.models.gpt import GPTConfig, Params
from purejax.nn import embedding
from purejax.parallel import MODEL, MeshAxes

# Megatron-LM's layout, rows read top down, first match wins. MODEL is the role of the tensor-parallel axis
# (None when it is off). Leaves under "blocks" have a leading layer axis, never split.
SHARDING_RULES: tuple[tuple[str, P], ...] = (
    (r"wte\.w", P(MODEL, None)),  # vocab-parallel embedding and tied head: rows split
    (r"blocks\.attn\.qkv\.w", P(None, None, MODEL)),  # column-parallel: whole groups of heads per device
    (r"blocks\.attn\.qkv\.b", P(None, MODEL)),
    (r"blocks\.attn\.proj\.w", P(None, MODEL, None)),  # row-parallel: psum, then the replicated bias
    (r"blocks\.mlp\.fc\.w", P(None, None, MODEL)),  # column-parallel
    (r"blocks\.mlp\.fc\.b", P(None, MODEL)),
    (r"blocks\.mlp\.proj\.w", P(None, MODEL, None)),  # row-parallel
    (r".*", P()),  # wpe, LayerNorms, the row-parallel biases: replicated
)


@functools.cache
def _shapes(config: GPTConfig) -> Params:
    """The params' global shapes (ShapeDtypeStructs), traced once per config."""
    return jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))


def param_specs(config: GPTConfig, axes: MeshAxes, axis_sizes: Mapping[str, int]) -> Params:
    """A PartitionSpec for every param of a GPT with `config` run under `axes` on a mesh with these axis sizes
    (`mesh.shape`): `SHARDING_RULES`, plus the data axis on every matrix with `axes.fsdp`
    (`purejax.parallel.fsdp_specs`). Raises if a split would be uneven, naming the size to change."""
    tp = axis_sizes[axes.model] if axes.model is not None else 1
    for name, value in (("n_head", config.n_head), ("vocab_size", config.vocab_size)):
        if value % tp:
            hint = " (the training program pads it up to a multiple of tp)" if name == "vocab_size" else ""
            raise ValueError(
                f"gpt: {name}={value} cannot be split over the {tp} devices of tensor-parallel axis "
                f"{axes.model!r}; tensor parallelism needs {name} divisible by {tp}{hint}"
            )
    shapes = _shapes(config)
    specs = parallel.specs_from_rules(shapes, SHARDING_RULES, {MODEL: axes.model})
    if axes.fsdp:
        specs = parallel.fsdp_specs(shapes, specs, axes.data, axis_sizes[axes.data], stacked=("blocks",))
    parallel.check_divisible(shapes, specs, axis_sizes)
    return specs


def hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, "batch seq d_model"]:
    """`gpt.hidden` on this device's shards of the params and of the batch (replicated over `axes.model`).
    `key` is used as given: under data parallelism each data shard needs its own (`sharded_train_step`
    folds in the shard's index)."""
    return _forward(params, idx, config, key, axes)[1]


def apply(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, "batch seq vocab"]:
    """`gpt.apply` on this device's shards: the logits of its rows of the batch, for its slice of the
    vocabulary under tensor parallelism."""
    params, h = _forward(params, idx, config, key, axes)
    return embedding.attend(params["wte"], h)  # the tied head (wte whole over the data axis, even with FSDP)


def loss(
    params: Params,
    batch: tuple[Integer[ArrayLike, "batch seq"], Integer[ArrayLike, "batch seq"]],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, ""]:
    """`gpt.loss` over the whole batch, every data shard's rows together: the sum of the token losses and
    their count are psummed over `axes.data` before dividing, so a shard with more ignored targets (-1)
    weighs less, as on one device. The same value on every device."""
    axes = MeshAxes() if axes is None else axes
    idx, targets = batch
    logits = apply(params, idx, config, key=key, axes=axes)
    per_token = losses.cross_entropy(logits, targets, ignore_index=-1, axis_name=axes.model)
    return losses.masked_mean(per_token, jnp.asarray(targets) != -1, axis_name=axes.data)


def _forward(params: Params, idx: Any, config: GPTConfig, key: Any, axes: MeshAxes | None) -> tuple[Params, Array]:
    """(params with the top-level ones gathered under FSDP, gpt.hidden's output), after checking that the
    params are this device's shards."""
    axes = MeshAxes() if axes is None else axes
    if axes == MeshAxes():
        return params, gpt.hidden(params, idx, config, key=key)
    sizes = {name: jax.lax.axis_size(name) for name in (axes.data, axes.model) if name is not None}
    specs = param_specs(config, axes, sizes)
    check_shards(params, config, specs)
    wrap_block = None
    if axes.fsdp:  # the top-level matrices once per pass; each block's inside the scan, as it runs
        top = {name: value for name, value in params.items() if name != "blocks"}
        params = {**parallel.gather(top, {name: specs[name] for name in top}, axes.data), "blocks": params["blocks"]}
        layer_specs = parallel.layer_specs(specs["blocks"])
        wrap_block = functools.partial(parallel.gathered, specs=layer_specs, axis=axes.data)
    return params, gpt.hidden(params, idx, config, key=key, axis_name=axes.model, wrap_block=wrap_block)


def check_shards(params: Params, config: GPTConfig, specs: Params) -> None:
    """Inside `shard_map`: raise, naming every leaf, unless each param is this device's shard as `specs` say."""
    parallel.check_shards(params, _shapes(config), specs, "gpt params")
