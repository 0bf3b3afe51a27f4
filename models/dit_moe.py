"""DiT's mixture-of-experts MLP (`DiTConfig.n_experts > 0`, after MicroDiT, Sehwag et al. 2024,
arXiv:2407.15811): the shared layer of purejax/nn/moe.py with DiT's choices.

params: moe.init's, {"router": linear (d_model, n_experts), no bias; "experts": mlp (d_model -> d_ff ->
d_model) stacked on a leading expert axis}, xavier-uniform experts as DiT's dense MLP, GELU(tanh).

Token-choice top-k routing without a capacity limit: no token is dropped, so every token goes through its
top_k experts, gate-weighted (gates renormalised over the chosen experts for top_k > 1, the probability
itself for top_k = 1). The DiT adds no load-balancing loss: its training loss is the flow-matching loss
alone, as before the layer was shared (the statistics are computed and discarded). MicroDiT itself uses
expert-choice routing in every other block.
"""

from typing import Any

from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax.nn import activations, moe

Params = dict[str, Any]


def init(key: PRNGKeyArray, d_model: int, d_ff: int, n_experts: int) -> Params:
    """`moe.init` with its defaults: a N(0, 0.02^2) router, xavier-uniform experts with biases."""
    return moe.init(key, d_model, d_ff, n_experts)


def apply(params: Params, x: Float[ArrayLike, "batch seq d_model"], *, top_k: int) -> Float[Array, "batch seq d_model"]:
    """Each token through its top_k experts, weighted by its gates, none dropped (`moe.apply` with no
    capacity limit). The routing is computed in float32 at least, whatever x's dtype."""
    return moe.apply(params, x, top_k=top_k, capacity_factor=None, activation=activations.gelu_tanh)[0]
