"""The GPT as a pipeline stage (purejax/parallel/pipeline.py runs the schedule): `stage_forward` is what one
device computes on one micro-batch, and `loss`, `sharded_loss_and_grads` are the runner's with the GPT filled in.

    device s holds blocks[s*L:(s+1)*L] (L = n_layer / S) and wte, wpe, ln_f whole.
    stage 0 embeds (wte, wpe, dropout), every stage runs its blocks, the last stage applies ln_f, the tied
    head and the cross-entropy: its loss share is sum(token losses) / n_tokens, `gpt.loss`'s mean cut in parts.

The tied embedding. wte is used twice: by the embedding on stage 0 and by the head on the last stage.
Both hold it (it is replicated over "pipe"), each differentiates its own copy, and the runner's one `psum`
over "pipe" at the end of the step adds the two gradients, as Megatron-LM all-reduces the word embedding's
gradient between its first and last stage. The same psum collects wpe's (stage 0) and ln_f's (last stage)
gradients; every other stage contributes zeros.

Dropout. Micro-batch m gets the runner's `jax.random.split(key, M)[m]`, and inside it every layer gets
`gpt.hidden`'s key for its *global* index (`stack.layer_keys` over all n_layer, this stage's slice of them):
the masks do not depend on S, and a pipeline of M micro-batches draws one device's gradient accumulation's.

Under `axes.model` each stage's blocks, wte's rows and the head's vocabulary are split Megatron-style
(`gpt.block`'s psums run inside every stage). The blocks run under `stack.scan` (`config.layers` and
`config.remat` are unread: the runner's backward recomputes the forward anyway).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer, PRNGKeyArray

from models import gpt
from purejax import losses
from purejax import random as prandom
from purejax.nn import embedding, layer_norm, stack
from purejax.parallel import pipeline
from purejax.parallel import pipeline_schedules as schedules
from purejax.parallel.mesh import PIPE, MeshAxes


def stage_forward(
    params: gpt.Params,
    x: Float[Array, "micro_batch seq d_model"],
    micro: tuple[Integer[Array, "micro_batch seq"], Integer[Array, "micro_batch seq"]],
    n_tokens: Integer[Array, ""],
    *,
    config: gpt.GPTConfig,
    key: PRNGKeyArray | None,
    axes: MeshAxes,
) -> tuple[Float[Array, "micro_batch seq d_model"], Float[Array, ""]]:
    """This device's stage on one micro-batch: (its output activations, its share of the loss). Stage 0
    replaces `x` by the embeddings; the last stage returns sum(token losses) / n_tokens, the others 0.
    Under `axes.model` the embedding, blocks and cross-entropy are gpt.py's vocab- and head-parallel ones."""
    s, n_stages = jax.lax.axis_index(axes.pipe), jax.lax.axis_size(axes.pipe)
    idx, targets = micro
    dropout_on = key is not None and config.dropout > 0
    keys = prandom.named_keys(key if dropout_on else None, "embd", "blocks")

    def embed():
        return gpt.embed(params, idx, config, key=keys["embd"], axis_name=axes.model)

    x = jax.lax.cond(s == 0, embed, lambda: x)
    n_local = stack.depth(params["blocks"], "params['blocks']")
    block = functools.partial(gpt.block, config=config, axis_name=axes.model)
    if dropout_on:  # this stage's layers' keys: gpt.hidden's, at their global indices
        layer_keys = stack.layer_keys(keys["blocks"], n_local * n_stages)
        layer_keys = jax.lax.dynamic_slice_in_dim(layer_keys, s * n_local, n_local)
        x, _ = stack.scan(lambda p, x, k: (block(p, x, key=k), None), params["blocks"], x, xs=layer_keys)
    else:
        x = stack.scan(lambda p, x: block(p, x), params["blocks"], x)

    def head_loss():
        logits = embedding.attend(params["wte"], layer_norm.apply(params["ln_f"], x))
        per_token = losses.cross_entropy(logits, targets, ignore_index=-1, axis_name=axes.model)
        return jnp.sum(jnp.where(targets != -1, per_token, 0.0)).astype(jnp.float32) / n_tokens

    zero = jnp.zeros_like(x[0, 0, 0], jnp.float32)  # varying over the axes the loss varies over
    return x, jax.lax.cond(s == n_stages - 1, head_loss, lambda: zero)


def loss(
    params: gpt.Params,
    batch: tuple[Integer[Array, "batch seq"], Integer[Array, "batch seq"]],
    config: gpt.GPTConfig,
    table: schedules.Table,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes,
) -> Float[Array, ""]:
    """`gpt.loss` on the whole batch, pipelined by `table` over `axes.pipe`, differentiable (`pipeline.loss`).
    Call inside `shard_map`, the params placed by `pipeline.stage_specs`, the batch split over `axes.data` only."""
    stage = functools.partial(stage_forward, config=config)
    return pipeline.loss(params, batch, stage, table, width=config.n_embd, key=key, axes=axes)


def sharded_loss_and_grads(
    mesh: jax.sharding.Mesh, config: gpt.GPTConfig, table: schedules.Table, *, axis_name: str = PIPE
) -> Callable[..., tuple[Float[Array, ""], gpt.Params]]:
    """`fn(params, batch, key=None) -> (loss, grads)`: `gpt.loss` and its gradients by `table` over `mesh`
    (`pipeline.sharded_loss_and_grads`), the params placed by `pipeline.param_specs`."""
    stage = functools.partial(stage_forward, config=config)
    return pipeline.sharded_loss_and_grads(mesh, stage, table, width=config.n_embd, axis_name=axis_name)
