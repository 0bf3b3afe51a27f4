"""The GPT's mixture-of-experts MLP (`GPTConfig.n_experts > 0`): each block's MLP replaced by the shared
layer of purejax/nn/moe.py, n_experts MLPs of the dense one's shape (n_embd -> 4 n_embd -> n_embd), each
token through its expert_top_k of them, at most capacity_factor times an even share of tokens per expert.

    params["blocks"]["moe"] = {"router": (n_layer, n_embd, n_experts),
                               "experts": {"fc", "proj"}, every leaf (n_layer, n_experts, ...)}
    loss = cross-entropy + moe_aux_weight * mean over layers of the Switch load-balancing loss

In gpt.py's block the experts are one more feed-forward choice (`feed_forward`, which drops the statistics).
The loss reads them: `block` is the block with its statistics (`moe.apply`'s: the load-balancing loss and the
dropped share of assignments), which gpt_parallel sums over the blocks and averages over the layers
(`aux_loss`; `metrics` gives them to the training log).
The weight 0.01 is the Switch Transformer's (Fedus et al. 2021, sec. 2.2); the mean over layers keeps its
meaning whatever the depth. Dropout, when on, applies to the layer's output as to the dense MLP's.

Under a mesh (models/gpt_parallel.py, whose SHARDING_RULES place the experts) `MoEAxes` names the axes the
tokens are split over (the statistics are summed over them: the whole batch's) and the expert axis, with
expert parallelism (purejax/parallel/experts.py).
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import attention, dropout, initializers, layer_norm, moe
from purejax.parallel.mesh import MeshAxes

Params = dict[str, Any]
Stats = dict[str, Array]


@runtime_checkable
class MoESettings(Protocol):
    """The settings of a GPT this file reads; `gpt.GPTConfig` has them all. A protocol rather than the class,
    because gpt.py imports this file: naming the settings keeps the import one way."""

    n_layer: int
    n_embd: int
    dropout: float
    bias: bool
    n_experts: int
    expert_top_k: int
    capacity_factor: float | None
    moe_aux_weight: float

    @property
    def activation(self) -> Callable[[Array], Array]: ...

    @property
    def attention(self) -> attention.AttentionConfig: ...


class MoEAxes(NamedTuple):
    """The mesh axes of `moe.apply`: `tokens` the tokens are split over, `experts` the experts (or None)."""

    tokens: tuple[str, ...] = ()
    experts: str | None = None


def check_config(config: MoESettings) -> None:
    """GPTConfig's checks of the four MoE fields, with the field names in the errors."""
    n, k, factor, weight = config.n_experts, config.expert_top_k, config.capacity_factor, config.moe_aux_weight
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n == 1:
        raise ValueError(f"GPTConfig: n_experts must be 0 (a dense MLP) or an int >= 2, got {n!r}")
    if n and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n):
        raise ValueError(f"GPTConfig: expert_top_k must be an int in [1, n_experts={n}], got {k!r}")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 0:
        raise ValueError(f"GPTConfig: capacity_factor must be a number >= 0 (0: no token dropped), got {factor!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
        raise ValueError(f"GPTConfig: moe_aux_weight must be a number >= 0, got {weight!r}")


def init(
    key: PRNGKeyArray, config: MoESettings, *, w_init: initializers.Initializer, proj_init: initializers.Initializer
) -> Params:
    """`moe.init` with the dense MLP's initializers (GPT-2's: N(0, 0.02^2), the residual projection scaled)."""
    d = config.n_embd
    return moe.init(key, d, 4 * d, config.n_experts, bias=config.bias, w_init=w_init, proj_init=proj_init)


def apply(
    params: Params,
    h: Float[Array, "batch seq d_model"],
    config: MoESettings,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    moe_axes: MoEAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Stats]:
    """The MoE in place of the block's MLP: (output, stats), dropout on the output when a key is given."""
    axes = MoEAxes() if moe_axes is None else moe_axes
    capacity = config.capacity_factor or None
    y, stats = moe.apply(
        params,
        h,
        top_k=config.expert_top_k,
        capacity_factor=capacity,
        activation=config.activation,
        axis_name=axis_name,
        token_axes=axes.tokens,
        expert_axis=axes.experts,
    )
    return dropout.apply(y, rate=config.dropout, key=key), stats


def feed_forward(
    params: Params, h: Float[Array, "batch seq d_model"], config: MoESettings, **kwargs: Any
) -> Float[Array, "batch seq d_model"]:
    """The mixture of experts as the block's feed-forward (`gpt.feed_forward`): `apply`'s output alone."""
    return apply(params, h, config, **kwargs)[0]


def block(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    config: MoESettings,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    moe_axes: MoEAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Stats]:
    """`gpt.block` with the experts as its MLP, and their statistics: x + attn(ln_1(x)), then x + moe(ln_2(x)).
    Written out here (not `gpt.block` with `feed_forward`) because the statistics are a second output."""
    keys = prandom.named_keys(key, "attn", "mlp") if key is not None else {"attn": None, "mlp": None}
    h = layer_norm.apply(params["ln_1"], x)
    x = x + attention.apply(params["attn"], h, config.attention, key=keys["attn"], axis_name=axis_name)
    h = layer_norm.apply(params["ln_2"], x)
    y, stats = apply(params["moe"], h, config, key=keys["mlp"], axis_name=axis_name, moe_axes=moe_axes)
    return x + y, stats


def no_stats(config: MoESettings) -> Stats:
    """The statistics before the first block: zeros for a mixture of experts, none for a dense GPT."""
    return {"aux": jax.numpy.float32(0.0), "dropped": jax.numpy.float32(0.0)} if config.n_experts else {}


def metrics(stats: Stats, config: MoESettings) -> dict[str, Array]:
    """Per-layer means of the summed statistics, for the training log: the load-balancing loss (1 when
    balanced) and the share of token-expert assignments dropped at capacity."""
    return {"moe_aux": stats["aux"] / config.n_layer, "moe_dropped": stats["dropped"] / config.n_layer}


def aux_loss(stats: Stats, config: MoESettings) -> Float[Array, ""]:
    """The term added to the loss: moe_aux_weight times the mean over layers of the load-balancing loss."""
    return config.moe_aux_weight * stats["aux"] / config.n_layer


def idle_params(params: Params, config: MoESettings) -> int:
    """The expert parameters a token does not use: all but its expert_top_k of n_experts (0 when dense), left
    out of the FLOPs per token (`gpt_flops.flops_per_token`) as MoE papers count active parameters."""
    if not config.n_experts:
        return 0
    experts = sum(leaf.size for leaf in jax.tree.leaves(params["blocks"]["moe"]["experts"]))
    return experts * (config.n_experts - config.expert_top_k) // config.n_experts


def mesh_axes(config: MoESettings, axes: MeshAxes, axis_sizes: Mapping[str, int]) -> MoEAxes:
    """The MoE axes of a GPT under `axes`, after checking that the mesh and the config go together: the
    tokens split over the data axis, the experts too with `axes.ep`; errors name what to change."""
    if axes.ep and not config.n_experts:
        raise ValueError(
            "gpt: expert parallelism (ep) splits the experts of mixture-of-experts layers, but "
            "n_experts=0 (dense MLPs); set n_experts > 0 or drop ep"
        )
    if config.n_experts and (axes.context or axes.sequence_parallel or axes.pipe):
        raise ValueError(
            f"gpt: n_experts={config.n_experts} (mixture of experts) runs under data, tensor and expert "
            f"parallelism only, not with context, sequence or pipeline parallelism ({axes})"
        )
    n = axis_sizes[axes.data] if axes.ep else 1
    if config.n_experts % n:
        raise ValueError(
            f"gpt: n_experts={config.n_experts} cannot be split over the {n} devices of data axis "
            f"{axes.data!r} (ep); pick n_experts divisible by {n}"
        )
    return MoEAxes(tokens=(axes.data,) if axes.data else (), experts=axes.data if axes.ep else None)


def fsdp_specs(rule_specs: Params, fsdp_specs: Params, axes: MeshAxes) -> Params:
    """fsdp x ep: FSDP's specs for every param but the experts, which keep their expert-parallel split (over
    the data axis already: each device's own experts, never gathered). Without ep, FSDP's for all."""
    if not axes.ep:
        return fsdp_specs
    moe_specs = {**fsdp_specs["blocks"]["moe"], "experts": rule_specs["blocks"]["moe"]["experts"]}
    return {**fsdp_specs, "blocks": {**fsdp_specs["blocks"], "moe": moe_specs}}


def gathered_specs(layer_specs: Params, axes: MeshAxes) -> Params:
    """The specs by which FSDP gathers one block's params: with ep, the experts' left out (P(): not gathered)."""
    if not axes.ep:
        return layer_specs
    experts = jax.tree.map(lambda s: P(), layer_specs["moe"]["experts"], is_leaf=lambda s: isinstance(s, P))
    return {**layer_specs, "moe": {**layer_specs["moe"], "experts": experts}}
