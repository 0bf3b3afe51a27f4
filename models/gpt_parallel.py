r"""The GPT of models/gpt.py on a device mesh: who holds which slice of every param, and the same
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
  `jax.checkpoint` (`parallel.gathered` wraps the block: `stack.run`'s `wrap`); `jax.grad` turns each
  all-gather into a reduce-scatter.
- `axes.context`: context parallelism, the sequence split over it in zig-zag order
  (`purejax.parallel.context.to_ring_order` reorders a batch): each device embeds its tokens at their global
  positions, attention runs as a ring (`purejax.parallel.ring_attention`, n-1 `ppermute`s of a key/value
  block per layer), everything else is per token; the loss's sum and count are psummed over it too. Attention
  dropout is refused (the ring has none).
- `axes.sequence_parallel`: Megatron sequence parallelism (`purejax.parallel.sequence`): between the
  tensor-parallel regions each device of `axes.model` holds its slice of the sequence; each block's two psums
  become an all-gather before and a reduce-scatter after each region, and the head gathers the whole sequence.
`MeshAxes()` (or None) is one device: `apply` and `loss` are then gpt.py's, unchanged.
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from models import gpt, gpt_moe, on_mesh
from models.gpt import GPTConfig, Params
from purejax import parallel
from purejax import random as prandom
from purejax.nn import attention, embedding, layer_norm, linear, stack
from purejax.parallel import MODEL, MeshAxes, context, sequence
from purejax.parallel.experts import EXPERT
from purejax.parallel.ring_attention import ring_attention

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
    # mixture of experts (gpt_moe.py; leading axes: layer, expert): the experts over EXPERT (the data axis with
    # expert parallelism, parallel/experts.py, else whole), each expert's MLP Megatron-split as the dense one
    (r"blocks\.moe\.experts\.fc\.w", P(None, EXPERT, None, MODEL)),  # column-parallel
    (r"blocks\.moe\.experts\.fc\.b", P(None, EXPERT, MODEL)),
    (r"blocks\.moe\.experts\.proj\.w", P(None, EXPERT, MODEL, None)),  # row-parallel
    (r"blocks\.moe\.experts\.proj\.b", P(None, EXPERT)),
    (r".*", P()),  # wpe, LayerNorms, the row-parallel biases, the MoE router: replicated
)
VOCAB_HINT = " (the training program pads it up to a multiple of tp)"


def param_specs(config: GPTConfig, axes: MeshAxes, axis_sizes: Mapping[str, int]) -> Params:
    """A PartitionSpec for every param of a GPT with `config` run under `axes` on a mesh with these axis sizes
    (`mesh.shape`): `SHARDING_RULES`, plus the data axis on every matrix with `axes.fsdp`
    (`purejax.parallel.fsdp_specs`). Raises if a split would be uneven, naming the size to change."""
    on_mesh.tensor_parallel_size(config, ("n_head", "vocab_size"), axes, axis_sizes, "gpt", VOCAB_HINT)
    gpt_moe.mesh_axes(config, axes, axis_sizes)  # checks the MoE options against the mesh
    roles = {MODEL: axes.model, EXPERT: axes.data if axes.ep else None}
    keep = functools.partial(gpt_moe.fsdp_specs, axes=axes)  # with ep, the experts stay split as the rules say
    return on_mesh.param_specs(
        on_mesh.param_shapes(gpt.init, config), SHARDING_RULES, roles, axes, axis_sizes, keep=keep
    )


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
    params, h, _ = _forward(params, idx, config, key, axes)
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
    their count are psummed over `axes.data` (and `axes.context`) before dividing, so a shard with more
    ignored targets (-1) weighs less, as on one device. The same value on every device. With experts
    (a `gpt_moe.MoEConfig`), plus the weighted load-balancing loss: `loss_and_metrics`'s loss."""
    return loss_and_metrics(params, batch, config, key=key, axes=axes)[0]


def loss_and_metrics(
    params: Params,
    batch: tuple[Integer[ArrayLike, "batch seq"], Integer[ArrayLike, "batch seq"]],
    config: GPTConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """(`loss`, the mixture of experts' metrics for the training log (`gpt_moe.metrics`; {} when dense)):
    the cross-entropy plus moe_aux_weight times the load-balancing loss, both the whole batch's."""
    axes = MeshAxes() if axes is None else axes
    params, h, stats = _forward(params, batch[0], config, key, axes)
    ce = on_mesh.cross_entropy(embedding.attend(params["wte"], h), batch[1], axes)
    return (ce + gpt_moe.aux_loss(stats, config), gpt_moe.metrics(stats, config)) if stats else (ce, {})


def _forward(params: Params, idx: Any, config: GPTConfig, key: Any, axes: MeshAxes | None) -> tuple[Params, Array, Any]:
    """(params with the top-level ones gathered under FSDP, gpt.hidden's output, the MoE statistics), after
    checking that the params are this device's shards."""
    axes = MeshAxes() if axes is None else axes
    if axes == MeshAxes():
        return params, *_hidden(params, idx, config, key)
    shapes = on_mesh.param_shapes(gpt.init, config)
    params, specs, sizes = on_mesh.enter(params, config, axes, param_specs, shapes, "gpt params")
    wrap = None
    if axes.fsdp:  # each block's params gathered inside the scan, as it runs
        layer_specs = gpt_moe.gathered_specs(parallel.layer_specs(specs["blocks"]), axes)
        wrap = functools.partial(parallel.gathered, specs=layer_specs, axis=axes.data)
    if axes.context is not None:
        return params, _context_hidden(params, idx, config, key, axes, wrap), {}
    if axes.sequence_parallel:
        return params, _sequence_hidden(params, idx, config, key, axes.model, wrap), {}
    moe_axes = gpt_moe.mesh_axes(config, axes, sizes)
    return params, *_hidden(params, idx, config, key, axes.model, wrap, moe_axes)


def _dropout_keys(key: PRNGKeyArray | None, config: GPTConfig) -> dict[str, Any]:
    """gpt.hidden's keys: the embedding's dropout and the blocks' (None when dropout is off)."""
    if key is None or config.dropout == 0:
        return {"embd": None, "blocks": None}
    return prandom.named_keys(key, "embd", "blocks")


def _run(layer: Callable, params: Params, x: Any, config: GPTConfig, key: Any, wrap: Callable | None) -> Any:
    """The blocks as gpt.hidden runs them (`stack.run`), each wrapped by `wrap` (FSDP's gather) if given."""
    return stack.run(layer, params["blocks"], x, mode=config.layers, remat=config.remat, key=key, wrap=wrap)


def _hidden(
    params: Params,
    idx: Any,
    config: GPTConfig,
    key: PRNGKeyArray | None,
    axis_name: str | None = None,
    wrap: Callable | None = None,
    moe_axes: gpt_moe.MoEAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], gpt_moe.Stats]:
    """`gpt.hidden` with `wrap` around each block, and a mixture of experts' statistics summed over the blocks
    (`gpt_moe.block`; {} when dense)."""
    idx = jnp.asarray(idx)
    gpt.check_inputs(params, idx, config, axis_name=axis_name)
    keys = _dropout_keys(key, config)
    x = gpt.embed(params, idx, config, key=keys["embd"], axis_name=axis_name)

    def dense_layer(p, x, key):
        return gpt.block(p, x, config, key=key, axis_name=axis_name)

    def experts_layer(p, carry, key):  # the statistics summed in the carry
        x, stats = gpt_moe.block(p, carry[0], config, key=key, axis_name=axis_name, moe_axes=moe_axes)
        return x, jax.tree.map(jnp.add, carry[1], stats)

    if not gpt_moe.n_experts(config):
        return layer_norm.apply(params["ln_f"], _run(dense_layer, params, x, config, keys["blocks"], wrap)), {}
    x, stats = _run(experts_layer, params, (x, gpt_moe.no_stats(config)), config, keys["blocks"], wrap)
    return layer_norm.apply(params["ln_f"], x), stats


def _context_hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch t"],
    config: GPTConfig,
    key: PRNGKeyArray | None,
    axes: MeshAxes,
    wrap: Callable | None,
) -> Float[Array, "batch t d_model"]:
    """`gpt.hidden` for this device's tokens of a sequence split over `axes.context` (zig-zag order): wpe at
    their global positions, and each block's attention through the ring (`_ring_attention`)."""
    if key is not None and config.dropout > 0:
        raise ValueError(
            f"gpt: dropout={config.dropout} with context parallelism (axis {axes.context!r}), but ring attention "
            f"cannot drop attention probabilities; train with dropout=0 or without context parallelism"
        )
    idx = jnp.asarray(idx)
    gpt.check_inputs(params, idx, config, axis_name=axes.model)
    n = jax.lax.axis_size(axes.context)
    if n * idx.shape[1] > config.block_size:
        raise ValueError(
            f"gpt: {n} devices of context axis {axes.context!r} hold {idx.shape[1]} tokens each, a sequence of "
            f"{n * idx.shape[1]}, but block_size is only {config.block_size}; crop the input before splitting it"
        )
    positions = context.positions(jax.lax.axis_index(axes.context), n, idx.shape[1], zigzag=True)
    x = embedding.apply(params["wte"], idx, axis_name=axes.model) + embedding.apply(params["wpe"], positions)
    ring = functools.partial(_ring_attention, context_axis=axes.context)

    def layer(p, x, key):  # no dropout under context parallelism (checked above): the key is unused
        return gpt.block(p, x, config, axis_name=axes.model, attend=ring)

    return layer_norm.apply(params["ln_f"], _run(layer, params, x, config, None, wrap))


def _ring_attention(
    params: Params,
    h: Float[Array, "batch t d_model"],
    config: attention.AttentionConfig,
    *,
    key: None = None,
    axis_name: str | None = None,
    context_axis: str,
) -> Float[Array, "batch t d_model"]:
    """`attention.apply` (no dropout) with ring attention over `context_axis` on this device's heads."""
    batch, t, _ = h.shape
    q, k, v = attention.qkv_heads(params, h, config, axis_name=axis_name)
    out = ring_attention(q, k, v, axis_name=context_axis, zigzag=True).reshape(batch, t, -1)
    return linear.apply(params["proj"], out, axis_name=axis_name)


def _sequence_hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: GPTConfig,
    key: PRNGKeyArray | None,
    axis: str,
    wrap: Callable | None,
) -> Float[Array, "batch seq d_model"]:
    """`gpt.hidden` with the residual stream on this device's slice of the sequence (`axis`): the vocab-parallel
    embedding reduce-scattered, each block on the slice, ln_f on it, then the whole sequence gathered for the
    vocab-parallel head. The dropout keys are gpt.hidden's, so the masks are tensor parallelism's."""
    idx = jnp.asarray(idx)
    gpt.check_inputs(params, idx, config, axis_name=axis)
    sequence.check_length(idx.shape[1], axis)
    if gpt_moe.n_experts(config):
        raise ValueError(f"gpt: sequence parallelism has the dense MLP only, but n_experts={config.n_experts}")
    keys = _dropout_keys(key, config)
    positions = sequence.local_slice(jnp.arange(idx.shape[1]), axis, axis=0)
    x = sequence.scatter(embedding.vocab_shard_rows(params["wte"], idx, axis_name=axis), axis)
    x = x + embedding.apply(params["wpe"], positions)
    x = sequence.local_dropout(x, rate=config.dropout, key=keys["embd"], axis_name=axis)

    def layer(p, x, key):  # the block on this device's slice: both sublayers gather before, scatter after
        mlp = functools.partial(_sequence_mlp, config=config)
        return gpt.block(p, x, config, key=key, axis_name=axis, attend=sequence.attention, feed_forward=mlp)

    x = _run(layer, params, x, config, keys["blocks"], wrap)
    return sequence.gather(layer_norm.apply(params["ln_f"], x), axis)


def _sequence_mlp(p: Params, h: Array, *, config: GPTConfig, key: Any = None, axis_name: str) -> Array:
    """The block's MLP (`GPTConfig.feed_forward`) on this device's slice of the sequence (`sequence.mlp`)."""
    return sequence.mlp(p["mlp"], h, activation=config.activation, dropout=config.dropout, key=key, axis_name=axis_name)


def check_shards(params: Params, config: GPTConfig, specs: Params) -> None:
    """Inside `shard_map`: raise, naming every leaf, unless each param is this device's shard as `specs` say."""
    parallel.check_shards(params, on_mesh.param_shapes(gpt.init, config), specs, "gpt params")
