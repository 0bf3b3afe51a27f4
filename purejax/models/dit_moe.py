"""A mixture-of-experts MLP for DiT's backbone blocks (`DiTConfig.n_experts > 0`, after MicroDiT, Sehwag et al.
2024, arXiv:2407.15811): token-choice top-k routing over n_experts MLPs of the same shape as the dense one.

params: {"router": linear (d_model, n_experts), no bias; "experts": mlp (d_model -> d_ff -> d_model), every
leaf stacked on a leading expert axis}.

    gates    = top_k of softmax(router(x)), renormalised over the chosen experts (Shazeer et al. 2017; Mixtral)
    output   = sum over each token's top_k experts of gate * expert(x)

With top_k = 1 the gate is the chosen expert's softmax probability itself (Switch Transformer): renormalised
it would always be 1, and the router would get no gradient. Every expert runs on every token and the
unchosen outputs get weight 0: exact, simple, and cheap for the few experts of a small model; it is not the
dispatch a large MoE needs. MicroDiT itself uses expert-choice routing in every other block; no
load-balancing loss is applied here.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from purejax import random as prandom
from purejax.nn import activations, initializers, linear, mlp, stack

Params = dict[str, Any]


def init(key: PRNGKeyArray, d_model: int, d_ff: int, n_experts: int) -> Params:
    """A router with small normal weights N(0, 0.02^2): near-uniform routing at the start, but not every token
    tied on the same experts, as zeros would make them; xavier-uniform experts, as DiT's dense MLP."""
    keys, xavier = prandom.named_keys(key, "router", "experts"), initializers.xavier_uniform()
    return {
        "router": linear.init(keys["router"], d_model, n_experts, bias=False, w_init=initializers.normal(0.02)),
        "experts": stack.init(keys["experts"], n_experts, lambda k: mlp.init(k, d_model, d_ff, w_init=xavier)),
    }


def apply(params: Params, x: Float[ArrayLike, "batch seq d_model"], *, top_k: int) -> Float[Array, "batch seq d_model"]:
    """Each token through its top_k experts, weighted by its gates (see the module docstring). The routing
    is computed in float32 whatever x's dtype."""
    x = jnp.asarray(x)
    logits = linear.apply(params["router"], x).astype(jnp.float32)
    top, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    gates = top if top_k == 1 else top / jnp.sum(top, axis=-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(chosen, logits.shape[-1]) * gates[..., None], axis=-2)  # (batch, seq, E)
    outs = jax.vmap(lambda p: mlp.apply(p, x, activation=activations.gelu_tanh))(params["experts"])
    return jnp.einsum("bse,ebsd->bsd", weights.astype(x.dtype), outs)
