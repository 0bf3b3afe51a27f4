r"""The Llama of models/llama.py on a device mesh: who holds which slice of every param, and the same
forward pass and loss on this device's shards, inside `jax.shard_map` (as gpt_parallel.py for the GPT).

    mesh = parallel.make_mesh(dp=2, tp=4)
    axes = parallel.MeshAxes.of(mesh, fsdp=True)
    specs = param_specs(config, axes, mesh.shape)      # a PartitionSpec per param
    params = parallel.shard(params, specs, mesh)       # each device receives its slices
    def loss_fn(params, batch, key):                   # for parallel.sharded_train_step (Llama has no dropout)
        return loss(params, batch, config, axes=axes), {}

- `axes.model`: Megatron-LM tensor parallelism (Shoeybi et al. 2019), llama.py's `axis_name`. Query heads,
  SwiGLU units and the vocabulary are split over it: qkv, gate and up column-parallel, proj and down
  row-parallel (one psum after attention, one after the MLP), the embedding, the head and the cross-entropy
  vocab-parallel. The key/value heads are split with their query heads while there are at least as many as
  devices (n_kv_head divisible by tp: each device holds whole groups, `SHARDING_RULES`). With fewer
  (Llama 3 70B's 8 on 16 devices, multi-query's 1 on any), they are replicated: see `own_heads`.
- `axes.data`: the batch is split over it; the loss is the whole batch's mean (sum and count psummed).
- `axes.fsdp`: ZeRO-3, every matrix also split over the data axis at rest (`parallel.fsdp_specs`), the
  top-level ones gathered once per pass, each block's inside the scan under `jax.checkpoint`.
`MeshAxes()` (or None) is one device: `apply` and `loss` are then llama.py's, unchanged.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from models import llama, on_mesh
from models.llama import LlamaConfig, Params
from purejax import parallel
from purejax.nn import embedding, rms_norm, stack
from purejax.parallel import MODEL, MeshAxes

# Rows read top down, first match wins; MODEL is the tensor-parallel axis's role. Leaves under "blocks" have
# a leading layer axis, never split.
SHARDING_RULES: tuple[tuple[str, P], ...] = (
    (r"embed\.w", P(MODEL, None)),  # vocab-parallel embedding (and tied head): rows split
    (r"head\.w", P(None, MODEL)),  # column-parallel head: each device the logits of its slice of the vocabulary
    (r"blocks\.attn\.qkv\.w", P(None, None, MODEL)),  # column-parallel: whole kv groups per device
    (r"blocks\.attn\.proj\.w", P(None, MODEL, None)),  # row-parallel: the rows of this device's query heads
    (r"blocks\.mlp\.(gate|up)\.w", P(None, None, MODEL)),  # column-parallel, the same units of both
    (r"blocks\.mlp\.down\.w", P(None, MODEL, None)),  # row-parallel
    (r".*", P()),  # the RMSNorm scales: replicated
)
# Fewer key/value heads than devices: qkv's d_model rows split at rest, gathered whole in each layer (`own_heads`).
FEW_KV_HEADS_RULE: tuple[str, P] = (r"blocks\.attn\.qkv\.w", P(None, MODEL, None))


def replicates_kv(config: LlamaConfig, tp: int) -> bool:
    """Whether `tp` tensor-parallel devices are more than the key/value heads, which are then replicated."""
    return config.n_kv_head % tp != 0


def param_specs(config: LlamaConfig, axes: MeshAxes, axis_sizes: Mapping[str, int]) -> Params:
    """A PartitionSpec for every param of a Llama with `config` run under `axes` on a mesh with these axis
    sizes (`mesh.shape`): `SHARDING_RULES` (with `FEW_KV_HEADS_RULE` first when `replicates_kv`), plus the
    data axis on every matrix with `axes.fsdp`. Raises if a split would be uneven, naming what to change."""
    tp = on_mesh.tensor_parallel_size(config, ("n_head", "d_ff", "vocab_size"), axes, axis_sizes, "llama")
    if replicates_kv(config, tp) and tp % config.n_kv_head:
        raise ValueError(
            f"llama: n_kv_head={config.n_kv_head} key/value heads on {tp} tensor-parallel devices: each device "
            f"needs whole key/value heads (n_kv_head divisible by {tp}) or an equal share of one head's query "
            f"heads ({tp} divisible by n_kv_head); pick another tp"
        )
    rules = (FEW_KV_HEADS_RULE, *SHARDING_RULES) if replicates_kv(config, tp) else SHARDING_RULES
    shapes = on_mesh.param_shapes(llama.init, config)
    return on_mesh.param_specs(shapes, rules, {MODEL: axes.model}, axes, axis_sizes)


def own_heads(layer: Params, config: LlamaConfig, axis: str) -> Params:
    """Inside `shard_map`, one layer's params with qkv replaced by this device's columns when the key/value
    heads are fewer than the `axis` devices: its n_head / tp query heads and a copy of the one key/value head
    they read, laid out as the grouped qkv of a model with tp key/value heads (one per device). qkv is kept
    split on its rows at rest and all-gathered here; under `jax.grad` the gather's transpose, a
    reduce-scatter, sums the copies' gradients into the one key/value head, as on one device."""
    tp, device = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    per_device, sharing = config.n_head // tp, tp // config.n_kv_head  # query heads; devices per kv head
    group, head_dim = config.n_head // config.n_kv_head, config.head_dim
    w = jax.lax.all_gather(layer["attn"]["qkv"]["w"], axis, axis=0, tiled=True)  # (d_model, qkv_width)
    groups = w.reshape(config.d_model, config.n_kv_head, group + 2, head_dim)  # [q.. k v] per kv head
    mine = jax.lax.dynamic_index_in_dim(groups, device // sharing, axis=1, keepdims=False)
    queries = jax.lax.dynamic_slice_in_dim(mine, (device % sharing) * per_device, per_device, axis=1)
    qkv = jnp.concatenate([queries, mine[:, group:]], axis=1).reshape(config.d_model, -1)
    return {**layer, "attn": {**layer["attn"], "qkv": {**layer["attn"]["qkv"], "w": qkv}}}


def hidden(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: LlamaConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, "batch seq d_model"]:
    """`llama.hidden` on this device's shards of the params and of the batch (replicated over `axes.model`);
    `key` is unused (no dropout), as in llama.py."""
    return _forward(params, idx, config, axes)[1]


def apply(
    params: Params,
    idx: Integer[ArrayLike, "batch seq"],
    config: LlamaConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, "batch seq vocab"]:
    """`llama.apply` on this device's shards: the logits of its rows of the batch, for its slice of the
    vocabulary under tensor parallelism."""
    params, h = _forward(params, idx, config, axes)
    return llama.unembed(params, h, config)


def loss(
    params: Params,
    batch: tuple[Integer[ArrayLike, "batch seq"], Integer[ArrayLike, "batch seq"]],
    config: LlamaConfig,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes | None = None,
) -> Float[Array, ""]:
    """`llama.loss` over the whole batch, every data shard's rows together (`on_mesh.cross_entropy`): the
    token losses' sum and count psummed over `axes.data` before dividing. The same value on every device."""
    axes = MeshAxes() if axes is None else axes
    return on_mesh.cross_entropy(apply(params, batch[0], config, axes=axes), batch[1], axes)


def _forward(params: Params, idx: Any, config: LlamaConfig, axes: MeshAxes | None) -> tuple[Params, Array]:
    """(params with the top-level ones gathered under FSDP, llama.hidden's output), after checking that the
    params are this device's shards. With replicated key/value heads the blocks run as a model with one
    key/value head per device (`own_heads` hands each layer that layout)."""
    axes = MeshAxes() if axes is None else axes
    if axes == MeshAxes():
        return params, llama.hidden(params, idx, config)
    shapes = on_mesh.param_shapes(llama.init, config)
    params, specs, sizes = on_mesh.enter(params, config, axes, param_specs, shapes, "llama params")
    tp = sizes.get(axes.model, 1)
    wrap = _layer_wrapper(config, axes, parallel.layer_specs(specs["blocks"]), tp)
    run_as = dataclasses.replace(config, n_kv_head=tp) if replicates_kv(config, tp) else config
    idx = jnp.asarray(idx)
    llama.check_inputs(params, idx, run_as, axis_name=axes.model)
    positions = jnp.arange(idx.shape[1])
    x = embedding.apply(params["embed"], idx, axis_name=axes.model)

    def layer(layer_params, x, key):  # llama.hidden's layer, wrapped
        return llama.block(layer_params, x, positions, run_as, axis_name=axes.model)

    x = stack.run(layer, params["blocks"], x, mode=config.layers, remat=config.remat, wrap=wrap)
    return params, rms_norm.apply(params["norm"], x, eps=config.norm_eps)


def _layer_wrapper(config: LlamaConfig, axes: MeshAxes, specs: Params, tp: int) -> Callable | None:
    """What each layer does to its params before it runs: all-gather them over the data axis (FSDP), then
    take this device's heads (`own_heads`), under `jax.checkpoint`, so that the backward pass gathers again
    rather than keeping every layer's whole params (as `parallel.gathered`). None when there is nothing to do."""
    few_kv = replicates_kv(config, tp)
    if not (axes.fsdp or few_kv):
        return None

    def wrap(layer: Callable) -> Callable:
        def on_own_params(params: Params, x: Array, key: None) -> Array:
            params = parallel.gather(params, specs, axes.data) if axes.fsdp else params
            return layer(own_heads(params, config, axes.model) if few_kv else params, x, key)

        return jax.checkpoint(on_own_params, policy=jax.checkpoint_policies.nothing_saveable)

    return wrap


def check_shards(params: Params, config: LlamaConfig, specs: Params) -> None:
    """Inside `shard_map`: raise, naming every leaf, unless each param is this device's shard as `specs` say."""
    parallel.check_shards(params, on_mesh.param_shapes(llama.init, config), specs, "llama params")
