"""Expert parallelism (GShard, Lepikhin et al. 2020): the experts of a mixture-of-experts layer split over
the data axis, each device's tokens sent to the devices holding their experts and back, by `all_to_all`.

    n devices on the data axis, E experts, each device holding E / n of them and its own rows of the batch

    device i:  route its tokens -> slots (E, C, d), expert-major    [purejax/nn/moe.py: route, dispatch]
               all_to_all: the slots of expert block j go to device j  -> (E / n, n * C, d)   [moe.to_experts]
               its E / n experts on the n * C slots (every device's tokens for them)
               all_to_all back                                          -> (E, C, d)   [moe.from_experts]
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

The two exchanges are written in purejax/nn/moe.py, beside the layer that issues them (as `linear` issues its
own psum under Megatron's tensor parallelism): the layer set sits below the parallel package and never
imports it. This module names the expert axis's role in a sharding table and re-exports them.
"""

from purejax.nn.moe import from_experts, to_experts

__all__ = ["EXPERT", "from_experts", "to_experts"]

EXPERT = "expert"  # the role of the expert axis in a sharding table (purejax/parallel/specs.py): the data axis
