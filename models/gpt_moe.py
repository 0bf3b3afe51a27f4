"""The GPT with a mixture of experts in each block's MLP place: `MoEConfig`, a `gpt.GPTConfig` with four more
fields, chooses the block's feed-forward, so gpt.py's init, block and apply run it unchanged. The layer is the
shared one of purejax/nn/moe.py: n_experts MLPs of the dense one's shape (n_embd -> 4 n_embd -> n_embd), each
token through its expert_top_k of them, at most capacity_factor times an even share of tokens per expert.

    params["blocks"]["moe"] = {"router": (n_layer, n_embd, n_experts),
                               "experts": {"fc", "proj"}, every leaf (n_layer, n_experts, ...)}
    loss = cross-entropy + moe_aux_weight * mean over layers of the Switch load-balancing loss

Inside gpt.py's block the experts are the feed-forward alone (`MoEConfig.feed_forward` drops the statistics).
The training loss reads them: `block` here is the block with its statistics (`moe.apply`'s: the
load-balancing loss and the dropped share of assignments), which gpt_parallel sums over the blocks and
averages over the layers (`aux_loss`; `metrics` gives them to the training log).
The weight 0.01 is the Switch Transformer's (Fedus et al. 2021, sec. 2.2); the mean over layers keeps its
meaning whatever the depth. Dropout, when on, applies to the layer's output as to the dense MLP's.

Under a mesh (models/gpt_parallel.py, whose SHARDING_RULES place the experts) `MoEAxes` names the axes the
tokens are split over (the statistics are summed over them: the whole batch's) and the expert axis, with
expert parallelism (purejax/parallel/experts.py).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from models import gpt
from purejax import random as prandom
from purejax.nn import attention, dropout, initializers, layer_norm, moe
from purejax.parallel.mesh import MeshAxes

Params = dict[str, Any]
Stats = dict[str, Array]
FIELDS = ("n_experts", "expert_top_k", "capacity_factor", "moe_aux_weight")


@dataclasses.dataclass(frozen=True)
class MoEConfig(gpt.GPTConfig):
    """A GPT whose blocks hold a mixture of experts where the dense GPT has its MLP.

    Arguments (beside GPTConfig's):
        n_experts: experts per block (>= 2).
        expert_top_k: experts each token goes to, in [1, n_experts].
        capacity_factor: tokens an expert takes, as a multiple of an even share; 0: no token dropped.
        moe_aux_weight: the load-balancing loss's weight in the training loss.
    """

    n_experts: int = 8
    expert_top_k: int = 2
    capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        n, k, factor, weight = self.n_experts, self.expert_top_k, self.capacity_factor, self.moe_aux_weight
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"MoEConfig: n_experts must be an int >= 2 (a dense MLP: gpt.GPTConfig), got {n!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"MoEConfig: expert_top_k must be an int in [1, n_experts={n}], got {k!r}")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 0:
            raise ValueError(f"MoEConfig: capacity_factor must be a number >= 0 (0: no token dropped), got {factor!r}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"MoEConfig: moe_aux_weight must be a number >= 0, got {weight!r}")

    def init_feed_forward(
        self, key: PRNGKeyArray, *, w_init: initializers.Initializer, proj_init: initializers.Initializer
    ) -> Params:
        """{"moe": `moe.init`} with the dense MLP's initializers (GPT-2's: N(0, 0.02^2), the residual
        projection scaled)."""
        d = self.n_embd
        return {"moe": moe.init(key, d, 4 * d, self.n_experts, bias=self.bias, w_init=w_init, proj_init=proj_init)}

    def feed_forward(
        self,
        params: Params,
        h: Float[Array, "batch seq d_model"],
        *,
        key: PRNGKeyArray | None = None,
        axis_name: str | None = None,
    ) -> Float[Array, "batch seq d_model"]:
        """The experts as the block's feed-forward: `apply`'s output alone."""
        return apply(params["moe"], h, self, key=key, axis_name=axis_name)[0]


def gpt_config(fields: object) -> gpt.GPTConfig:
    """The config that saved `fields` (a checkpoint's config["model"]) describe: a MoEConfig when n_experts > 0,
    else a dense GPTConfig (the experts' fields left out, as a dense config saved with n_experts=0 holds them);
    a TypeError for anything but a mapping of GPTConfig's (or MoEConfig's) fields."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"a GPT config is a mapping of its fields, got {fields!r}")
    if fields.get("n_experts"):
        return MoEConfig(**fields)
    return gpt.GPTConfig(**{name: value for name, value in fields.items() if name not in FIELDS})


def n_experts(config: gpt.GPTConfig) -> int:
    """The experts per block: 0 for a dense GPT."""
    return config.n_experts if isinstance(config, MoEConfig) else 0


class MoEAxes(NamedTuple):
    """The mesh axes of `moe.apply`: `tokens` the tokens are split over, `experts` the experts (or None)."""

    tokens: tuple[str, ...] = ()
    experts: str | None = None


def apply(
    params: Params,
    h: Float[Array, "batch seq d_model"],
    config: MoEConfig,
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


def block(
    params: Params,
    x: Float[Array, "batch seq d_model"],
    config: MoEConfig,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str | None = None,
    moe_axes: MoEAxes | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Stats]:
    """`gpt.block` with the experts as its MLP, and their statistics: x + attn(ln_1(x)), then x + moe(ln_2(x)).
    Written out here (not `gpt.block`) because the statistics are a second output."""
    keys = prandom.named_keys(key, "attn", "mlp")  # all None in evaluation
    h = layer_norm.apply(params["ln_1"], x)
    x = x + attention.apply(params["attn"], h, config.attention, key=keys["attn"], axis_name=axis_name)
    h = layer_norm.apply(params["ln_2"], x)
    y, stats = apply(params["moe"], h, config, key=keys["mlp"], axis_name=axis_name, moe_axes=moe_axes)
    return x + y, stats


def no_stats(config: gpt.GPTConfig) -> Stats:
    """The statistics before the first block: zeros for a mixture of experts, none for a dense GPT."""
    return {"aux": jax.numpy.float32(0.0), "dropped": jax.numpy.float32(0.0)} if n_experts(config) else {}


def metrics(stats: Stats, config: gpt.GPTConfig) -> dict[str, Array]:
    """Per-layer means of the summed statistics, for the training log: the load-balancing loss (1 when
    balanced) and the share of token-expert assignments dropped at capacity."""
    return {"moe_aux": stats["aux"] / config.n_layer, "moe_dropped": stats["dropped"] / config.n_layer}


def aux_loss(stats: Stats, config: gpt.GPTConfig) -> Float[Array, ""]:
    """The term added to the loss: moe_aux_weight times the mean over layers of the load-balancing loss."""
    return config.moe_aux_weight * stats["aux"] / config.n_layer


def idle_params(params: Params, config: gpt.GPTConfig) -> int:
    """The expert parameters a token does not use: all but its expert_top_k of n_experts (0 when dense), left
    out of the FLOPs per token (`gpt_flops.flops_per_token`) as MoE papers count active parameters."""
    if not n_experts(config):
        return 0
    experts = sum(leaf.size for leaf in jax.tree.leaves(params["blocks"]["moe"]["experts"]))
    return experts * (config.n_experts - config.expert_top_k) // config.n_experts


def mesh_axes(config: gpt.GPTConfig, axes: MeshAxes, axis_sizes: Mapping[str, int]) -> MoEAxes:
    """The MoE axes of a GPT under `axes`, after checking that the mesh and the config go together: the
    tokens split over the data axis, the experts too with `axes.ep`; errors name what to change."""
    experts = n_experts(config)
    if axes.ep and not experts:
        raise ValueError(
            "gpt: expert parallelism (ep) splits the experts of mixture-of-experts layers, but the config is a "
            "dense GPTConfig; give a gpt_moe.MoEConfig (n_experts > 0) or drop ep"
        )
    if experts and (axes.context or axes.sequence_parallel or axes.pipe):
        raise ValueError(
            f"gpt: n_experts={experts} (mixture of experts) runs under data, tensor and expert "
            f"parallelism only, not with context, sequence or pipeline parallelism ({axes})"
        )
    n = axis_sizes[axes.data] if axes.ep else 1
    if experts % n:
        raise ValueError(
            f"gpt: n_experts={experts} cannot be split over the {n} devices of data axis "
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
