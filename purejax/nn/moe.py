"""A mixture-of-experts MLP: token-choice top-k routing over n_experts MLPs, each expert taking at most
`capacity` tokens (Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al. 2020).

params: {"router": linear (d_model, n_experts), no bias; "experts": mlp (d_model -> d_ff -> d_model), every
leaf stacked on a leading expert axis}.

    probs    = softmax(router(x))                   per token, in float32 at least (also for bfloat16 x)
    chosen   = the top_k experts of each token; gates renormalised over them for top_k > 1 (Mixtral); with
               top_k = 1 the gate is the probability itself (Switch: renormalised it would be 1, no gradient)
    position = each assignment's place in its expert's queue: a cumsum over one-hots (GShard), every token's
               first choice ahead of any second choice
    kept     = position < capacity, C = ceil(capacity_factor * tokens * top_k / n_experts) (at most tokens)
    dispatch   x of each kept assignment written to slot (expert, position) of an (E, C, d) buffer
    experts    expert e's MLP on its C slots
    combine    y = sum over each token's kept assignments of gate * its expert's output

A dropped assignment contributes 0 (the residual stream carries the token past the layer). capacity_factor
None (or 0) means C = tokens: nothing is ever dropped, and the layer is exactly every token through its top_k
experts. Dispatch and combine are a scatter and a gather by slot index, the same maths as GShard's one-hot
(tokens, E, C) einsums without materialising them.

`stats` holds the Switch Transformer's load-balancing loss and the drop accounting:

    aux     = n_experts * sum_e f_e * P_e,  f_e = share of the tokens' top_k choices that picked e (before
              capacity), P_e = mean router probability of e; 1 when balanced (Fedus et al. eq. 4, with f over
              all top_k choices divided by top_k, so that top_k does not scale it)
    dropped = share of the token-expert assignments dropped because their expert was full

With `token_axes` (inside `shard_map`, the axes the tokens are split over) f, P and the counts are summed
over them first: `aux` is the whole batch's, the same on every device. Capacity stays per device (GShard's
groups): each device routes and drops its own tokens. With `expert_axis` the experts are split over that
axis too (expert parallelism, purejax/parallel/experts.py): two all_to_alls (`to_experts` and
`from_experts`, below) move the slots to the devices holding their experts and back.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Integer, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import activations, initializers, linear, mlp, stack
from purejax.nn._check import check_dim, check_keys

Params = dict[str, Any]


def init(
    key: PRNGKeyArray,
    d_model: int,
    d_ff: int,
    n_experts: int,
    *,
    bias: bool = True,
    w_init: initializers.Initializer = initializers.xavier_uniform(),
    proj_init: initializers.Initializer | None = None,
    router_init: initializers.Initializer = initializers.normal(0.02),
) -> Params:
    """A router with small normal weights N(0, 0.02^2) by default: near-uniform routing at the start, but
    not every token tied on the same experts, as zeros would make them; n_experts MLPs as `mlp.init` builds
    them (`w_init`, `proj_init`, `bias`), stacked."""
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 2:
        raise ValueError(f"moe.init: n_experts must be an int >= 2, got {n_experts!r}")
    keys = prandom.named_keys(key, "router", "experts")
    expert = lambda k: mlp.init(k, d_model, d_ff, bias=bias, w_init=w_init, proj_init=proj_init)  # noqa: E731
    return {
        "router": linear.init(keys["router"], d_model, n_experts, bias=False, w_init=router_init),
        "experts": stack.init(keys["experts"], n_experts, expert),
    }


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert: ceil(capacity_factor * tokens * top_k / n_experts), at most `tokens` (an expert
    gets each token at most once); `tokens` when capacity_factor is None or 0 (nothing dropped)."""
    if capacity_factor is None or capacity_factor == 0:
        return tokens
    if not isinstance(capacity_factor, int | float) or isinstance(capacity_factor, bool) or capacity_factor < 0:
        raise ValueError(f"moe: capacity_factor must be None or a number >= 0, got {capacity_factor!r}")
    return min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts))


class Routing(NamedTuple):
    """Where each of the top_k assignments of each token goes: `slot` = expert * capacity + position in the
    (E * C) flattened slots (E * C, one past the end, when dropped), and its `gate` (0 when dropped)."""

    slot: Integer[Array, "top_k tokens"]
    gate: Float[Array, "top_k tokens"]


def route(
    router: Params, x: Float[Array, "tokens d_model"], *, top_k: int, capacity: int, token_axes: tuple[str, ...] = ()
) -> tuple[Routing, dict[str, Array]]:
    """The routing of the module docstring: each assignment's slot and gate, and `stats` (aux, dropped)."""
    logits = linear.apply(router, x)
    probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)  # (T, E)
    n_tokens, n_experts = probs.shape
    top, chosen = jax.lax.top_k(probs, top_k)  # (T, k)
    gates = top if top_k == 1 else top / jnp.sum(top, axis=-1, keepdims=True)
    choice = jax.nn.one_hot(chosen.T, n_experts, dtype=jnp.int32)  # (k, T, E): first choices first (GShard)
    queue = jnp.cumsum(choice.reshape(top_k * n_tokens, n_experts), axis=0).reshape(choice.shape)
    position = jnp.sum((queue - 1) * choice, axis=-1)  # (k, T): the place in its expert's queue
    kept = position < capacity
    slot = jnp.where(kept, chosen.T * capacity + position, n_experts * capacity)
    sums = (jnp.sum(choice, axis=(0, 1)), jnp.sum(probs, axis=0), jnp.sum(~kept), jnp.asarray(n_tokens, probs.dtype))
    if token_axes:  # the whole batch's statistics, the same on every device
        sums = jax.lax.psum(sums, token_axes)
    chose, prob, dropped, total = sums
    aux = n_experts * jnp.sum(chose / (total * top_k) * prob / total)
    stats = {"aux": aux, "dropped": dropped / (total * top_k)}
    return Routing(slot, jnp.where(kept, gates.T, 0.0)), stats


def dispatch(
    x: Float[Array, "tokens d_model"], routing: Routing, n_experts: int, capacity: int
) -> Float[Array, "n_experts capacity d_model"]:
    """Each kept assignment's token written into its slot; empty slots hold zeros, dropped ones go nowhere."""
    top_k = routing.slot.shape[0]
    slots = jnp.zeros((n_experts * capacity, x.shape[-1]), x.dtype)
    slots = slots.at[routing.slot.reshape(-1)].add(jnp.tile(x, (top_k, 1)), mode="drop")
    return slots.reshape(n_experts, capacity, x.shape[-1])


def combine(out: Float[Array, "n_experts capacity d_model"], routing: Routing) -> Float[Array, "tokens d_model"]:
    """y = sum over each token's assignments of gate * the output in its slot (0 for a dropped one)."""
    flat = out.reshape(-1, out.shape[-1])
    picked = flat.at[routing.slot].get(mode="fill", fill_value=0)  # (k, T, d)
    return jnp.sum(routing.gate[..., None].astype(out.dtype) * picked, axis=0)


def apply(
    params: Params,
    x: Float[ArrayLike, "*batch d_model"],
    *,
    top_k: int,
    capacity_factor: float | None,
    activation: Callable[[Array], Array] = activations.gelu,
    axis_name: str | None = None,
    token_axes: tuple[str, ...] = (),
    expert_axis: str | None = None,
) -> tuple[Float[Array, "*batch d_model"], dict[str, Array]]:
    """(y, stats): every token through its kept top_k experts (the module docstring), y shaped as x.

    Arguments:
        capacity_factor: slots per expert as a multiple of an even share; None or 0: no token dropped.
        axis_name: Megatron tensor parallelism inside each expert (`mlp.apply`'s axis_name).
        token_axes: the mesh axes the tokens are split over; stats are summed over them.
        expert_axis: the experts' leading axis is split over this mesh axis (one of `token_axes`): each device
            holds n_experts / n of them, and the slots travel by all_to_all (purejax/parallel/experts.py).
    """
    check_keys(params, "moe", required=("router", "experts"))
    x = jnp.asarray(x)
    w = params["router"]["w"]
    check_dim("moe", "x", x, -1, w.shape[0], f"params['router']['w'] of shape {tuple(w.shape)}")
    n_experts = w.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"moe: top_k must be an int in [1, n_experts={n_experts}], got {top_k!r}")
    if expert_axis is not None and expert_axis not in token_axes:
        raise ValueError(
            f"moe: expert_axis {expert_axis!r} must be one of the token axes {token_axes}: each "
            f"device routes its own tokens to the experts of the others"
        )
    tokens = x.reshape(-1, x.shape[-1])
    slots_per_expert = capacity(tokens.shape[0], n_experts, top_k, capacity_factor)
    routing, stats = route(params["router"], tokens, top_k=top_k, capacity=slots_per_expert, token_axes=token_axes)
    slots = dispatch(tokens, routing, n_experts, slots_per_expert)  # (E, C, d)
    if expert_axis is not None:
        slots = to_experts(slots, expert_axis, params["experts"])  # (E / n, n * C, d)
    run = lambda p, s: mlp.apply(p, s, activation=activation, axis_name=axis_name)  # noqa: E731
    out = jax.vmap(run)(params["experts"], slots)
    if expert_axis is not None:
        out = from_experts(out, expert_axis)  # (E, C, d) again, this device's tokens' outputs
    return combine(out, routing).reshape(x.shape), stats


def to_experts(
    slots: Float[Array, "n_experts capacity d_model"], axis_name: str, experts: Any = None
) -> Float[Array, "local_experts n_capacity d_model"]:
    """Inside `shard_map`: this device's slots for every expert, sent to the devices holding them; comes back
    with the slots of this device's E / n experts from every device (device order along the slot axis).
    With `experts` (this device's stacked expert params) checks that they are E / n of E."""
    n, n_experts = jax.lax.axis_size(axis_name), slots.shape[0]
    if n_experts % n:
        raise ValueError(
            f"expert parallelism: {n_experts} experts cannot be split over the {n} devices of axis "
            f"{axis_name!r}; pick n_experts divisible by {n}"
        )
    held = {leaf.shape[0] for leaf in jax.tree.leaves(experts)}
    if experts is not None and held != {n_experts // n}:
        raise ValueError(
            f"expert parallelism: this device holds {sorted(held)} experts, but {n_experts} split over "
            f"the {n} devices of {axis_name!r} are {n_experts // n} each; were the params placed "
            f"with the experts' leading axis split over {axis_name!r}?"
        )
    return jax.lax.all_to_all(slots, axis_name, split_axis=0, concat_axis=1, tiled=True)


def from_experts(
    out: Float[Array, "local_experts n_capacity d_model"], axis_name: str
) -> Float[Array, "n_experts capacity d_model"]:
    """Inside `shard_map`: the inverse of `to_experts`, each device's slots' outputs back to it."""
    return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=0, tiled=True)
