"""Expert parallelism (GShard, Lepikhin et al. 2020): the experts of a mixture-of-experts layer split over
the data axis, each device's tokens sent to the devices holding their experts and back, by `all_to_all`.

    n devices on the data axis, E experts, each device holding E / n of them and its own rows of the batch

    device i:  route its tokens -> slots (E, C, d), expert-major    [purejax/nn/moe.py: route, dispatch]
               all_to_all: the slots of expert block j go to device j  -> (E / n, n * C, d)
               its E / n experts on the n * C slots (every device's tokens for them)
               all_to_all back                                          -> (E, C, d)
               combine its tokens' outputs, gate-weighted              [moe.combine]

The expert axis is the data axis (GShard's and DeepSpeed-MoE's choice): the tokens are already split over it,
so no new mesh axis and no extra copy of the batch. A param split over the data axis is the device's own in
the training step (purejax/parallel/step.py): the experts' gradients get no all-reduce; `jax.grad` turns the
two all_to_alls into two more, which bring each expert the gradient from every device's tokens. Under FSDP
the other matrices are also split over the data axis (`fsdp x ep`); the experts, split already, are not
gathered.

Capacity is per device: C = ceil(capacity_factor * tokens on the device * top_k / E), and a device drops
only its own tokens (GShard's groups). So the layer on n devices equals the single-device layer applied to
each device's tokens separately; it equals the single-device layer on the whole batch exactly when no token
is dropped (capacity_factor None or large enough). The load-balancing loss and the drop counts are summed
over the data axis: the whole batch's.

Bytes: each all_to_all sends (n - 1) / n of a device's E * C * d slots (the part for other devices), two
forward and two backward per MoE layer.
"""

from typing import Any

import jax
from jaxtyping import Array, Float

EXPERT = "expert"  # the role of the expert axis in a sharding table (purejax/parallel/specs.py): the data axis


def to_experts(
    slots: Float[Array, "n_experts capacity d_model"], axis_name: str, experts: Any = None
) -> Float[Array, "local_experts n_capacity d_model"]:
    """Inside `shard_map`: this device's slots for every expert, sent to the devices holding them; comes back
    with the slots of this device's E / n experts from every device (device order along the slot axis).
    With `experts` (this device's stacked expert params) checks that they are E / n of E."""
    n, n_experts = jax.lax.axis_size(axis_name), slots.shape[0]
    if n_experts % n:
        raise ValueError(f"expert parallelism: {n_experts} experts cannot be split over the {n} devices of axis "
                         f"{axis_name!r}; pick n_experts divisible by {n}")  # fmt: skip
    held = {leaf.shape[0] for leaf in jax.tree.leaves(experts)}
    if experts is not None and held != {n_experts // n}:
        raise ValueError(f"expert parallelism: this device holds {sorted(held)} experts, but {n_experts} split over "
                         f"the {n} devices of {axis_name!r} are {n_experts // n} each; were the params placed "
                         f"with the experts' leading axis split over {axis_name!r}?")  # fmt: skip
    return jax.lax.all_to_all(slots, axis_name, split_axis=0, concat_axis=1, tiled=True)


def from_experts(
    out: Float[Array, "local_experts n_capacity d_model"], axis_name: str
) -> Float[Array, "n_experts capacity d_model"]:
    """Inside `shard_map`: the inverse of `to_experts`, each device's slots' outputs back to it."""
    return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=0, tiled=True)
