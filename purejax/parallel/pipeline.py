"""Pipeline parallelism for the GPT: the stacked blocks split into S stages over a "pipe" mesh axis, the
batch into M micro-batches, and a schedule (purejax/parallel/schedules.py, a table of (step, stage) ->
F(m) | B(m) | idle) executed step by step under `lax.scan`, activations sent to the next stage and their
gradients to the previous one with `ppermute`.

    device s holds blocks[s*L:(s+1)*L] (L = n_layer / S: `param_specs`, P("pipe") on the leading layer axis),
    and wte, wpe, ln_f whole.
    stage 0 embeds, the last stage applies ln_f, the tied head and the loss.

    every step t, on every stage s at once (one program, `kind[t, s]` picks the branch):
        F(m): y = stage(x[m])                         keep x[m] (the stage's input) for the backward
        B(m): dparams, dx = vjp(stage, x[m])(dy[m])   the forward recomputed from the kept input
        y  -> stage s + 1   (ppermute)                it stores y as its x[m]
        dx -> stage s - 1   (ppermute)                it stores dx as its dy[m]

Memory. A stage keeps only its *inputs* (one activation per micro-batch in flight) and recomputes its
layers' forward inside the backward (`jax.vjp` at B time), as GPipe does with rematerialisation (Huang et
al. 2019, sec. 2.3). The buffer has `schedules.buffer_slots(table)` slots, micro-batch m in slot m % K:
M for GPipe, at most S for 1F1B; that is the activation footprint the schedule buys.

The loss is the whole batch's mean over its counted tokens (targets of -1 are ignored, as `gpt.loss`): the
last stage adds sum(token losses of m) / (tokens counted in the whole batch) for each m, so the sum over
micro-batches is `gpt.loss` on the whole batch, and the gradient of each term is that micro-batch's share.
With dropout, micro-batch m uses `jax.random.split(key, M)[m]` (as `optim.accumulate_gradients`), and
inside it every layer gets `gpt.hidden`'s key for its global index: the masks do not depend on S.

The tied embedding. wte is used twice: by the embedding on stage 0 and by the head on the last stage.
Both hold it (it is replicated over "pipe"), each differentiates its own copy, and one `psum` over "pipe"
at the end of the step adds the two gradients, as Megatron-LM all-reduces the word embedding's gradient
between its first and last stage. The same psum collects wpe's (stage 0) and ln_f's (last stage)
gradients; every other stage contributes zeros. Holding wte twice costs vocab x n_embd params on two
devices; untying it would save that, but changes the model.

Collectives per step, per device: 2 T collective-permutes of one micro-batch's activations
(micro_batch x seq x n_embd elements, T = len(table) steps; idle steps send zeros, since all devices run
one program), and the all-reduce of wte, wpe, ln_f's gradients and the loss.

The blocks always run under `stack.scan` (`config.layers` and `config.remat` are not read: B recomputes
each stage's forward anyway). Pipelining composes with the other axes in principle (the batch split over
"data" as well, the blocks' heads over "model"); this page runs over the pipe axis alone.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Integer, PRNGKeyArray

from purejax import losses
from purejax import random as prandom
from purejax.models import gpt
from purejax.nn import dropout, embedding, layer_norm, stack
from purejax.optim.accumulate import split_micro_batches
from purejax.parallel import schedules

PIPE = "pipe"
Params = dict[str, Any]
Batch = tuple[Integer[Array, "batch seq"], Integer[Array, "batch seq"]]


def param_specs(params: Params, axis_name: str = PIPE) -> Params:
    """P(axis_name) on the leading layer axis of every `blocks` leaf (each stage its n_layer / S layers), P()
    (replicated) for wte, wpe and ln_f."""
    replicated = {k: jax.tree.map(lambda _: P(), v) for k, v in params.items()}
    return replicated | {"blocks": jax.tree.map(lambda _: P(axis_name), params["blocks"])}


def sharded_loss_and_grads(
    mesh: jax.sharding.Mesh, config: gpt.GPTConfig, table: schedules.Table, *, axis_name: str = PIPE
) -> Callable[..., tuple[Float[Array, ""], Params]]:
    """`loss_and_grads` under `jax.jit(jax.shard_map(...))` over `mesh`: `fn(params, batch, key=None) ->
    (loss, grads)`, params placed by `param_specs` (`parallel.shard`), the batch and key replicated."""
    n_stages = mesh.shape[axis_name]
    if config.n_layer % n_stages or len(table[0]) != n_stages:
        raise ValueError(
            f"pipeline: {config.n_layer} layers over {n_stages} stages ({axis_name!r}) with a table of "
            f"{len(table[0])} stages; n_layer must be a multiple of the stage count, and the table made for it"
        )

    def run(params, batch, key=None):
        specs = param_specs(params, axis_name)
        body = functools.partial(loss_and_grads, config=config, table=table, axis_name=axis_name)
        sharded = jax.shard_map(
            lambda p, b, k: body(p, b, key=k), mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs)
        )
        return sharded(params, batch, key)

    return jax.jit(run)


def stage_forward(
    params: Params,
    x: Float[Array, "micro_batch seq d_model"],
    micro: tuple[Integer[Array, "micro_batch seq"], Integer[Array, "micro_batch seq"]],
    n_tokens: Integer[Array, ""],
    config: gpt.GPTConfig,
    *,
    key: PRNGKeyArray | None,
    axis_name: str,
) -> tuple[Float[Array, "micro_batch seq d_model"], Float[Array, ""]]:
    """This device's stage on one micro-batch: (its output activations, its share of the loss). Stage 0
    replaces `x` by the embeddings; the last stage returns sum(token losses) / n_tokens, the others 0."""
    s, n_stages = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    idx, targets = micro
    dropout_on = key is not None and config.dropout > 0
    keys = prandom.named_keys(key, "embd", "blocks") if dropout_on else {"embd": None}

    def embed():
        h = embedding.apply(params["wte"], idx) + embedding.apply(params["wpe"], jnp.arange(idx.shape[1]))
        return dropout.apply(h, rate=config.dropout, key=keys["embd"])

    x = jax.lax.cond(s == 0, embed, lambda: x)
    n_local = stack.depth(params["blocks"], "params['blocks']")
    if dropout_on:  # this stage's layers' keys: gpt.hidden's, at their global indices
        layer_keys = stack.layer_keys(keys["blocks"], n_local * n_stages)
        layer_keys = jax.lax.dynamic_slice_in_dim(layer_keys, s * n_local, n_local)
        x, _ = stack.scan(lambda p, x, k: (gpt.block(p, x, config, key=k), None), params["blocks"], x, xs=layer_keys)
    else:
        x = stack.scan(lambda p, x: gpt.block(p, x, config), params["blocks"], x)

    def head_loss():
        logits = embedding.attend(params["wte"], layer_norm.apply(params["ln_f"], x))
        per_token = losses.cross_entropy(logits, targets, ignore_index=-1)
        return jnp.sum(jnp.where(targets != -1, per_token, 0.0)) / n_tokens

    return x, jax.lax.cond(s == n_stages - 1, head_loss, lambda: _varying(jnp.zeros(()), axis_name))


def loss_and_grads(
    params: Params,
    batch: Batch,
    config: gpt.GPTConfig,
    table: schedules.Table,
    *,
    key: PRNGKeyArray | None = None,
    axis_name: str = PIPE,
) -> tuple[Float[Array, ""], Params]:
    """`gpt.loss` on the whole batch and its gradients, pipelined by `table` over `axis_name`; call inside
    `jax.shard_map` with the params placed by `param_specs` and the batch replicated. The gradients come
    back placed like the params (the blocks' split over the stages, the others summed over them)."""
    n_micro = 1 + max(op[1] for row in table for op in row if op is not None)
    schedules.check(table, jax.lax.axis_size(axis_name), n_micro)
    micro_batches = split_micro_batches(batch, n_micro)
    n_tokens = jnp.sum(batch[1] != -1)
    keys = None if key is None else jax.random.split(key, n_micro)
    # this device's own copy of the replicated params: their gradients stay local until the psum below
    local = {k: v if k == "blocks" else _varying(v, axis_name) for k, v in params.items()}

    def forward(p, x, m):
        micro = jax.tree.map(lambda a: a[m], micro_batches)
        k = None if keys is None else keys[m]
        return stage_forward(p, x, micro, n_tokens, config, key=k, axis_name=axis_name)

    slots = schedules.buffer_slots(table)
    x0 = jnp.zeros((slots, *micro_batches[0].shape[1:], config.n_embd), jax.tree.leaves(params)[0].dtype)
    carry = (*_varying((x0, x0), axis_name), jax.tree.map(jnp.zeros_like, local), _varying(jnp.zeros(()), axis_name))
    step = functools.partial(_run_step, forward, local, axis_name=axis_name, slots=slots)
    pad = ((0, 0), (1, 1))  # an idle stage on either side, so every stage reads its neighbours' entries
    (_, _, grads, loss), _ = jax.lax.scan(step, carry, tuple(jnp.pad(a, pad) for a in schedules.as_arrays(table)))
    shared, loss = jax.lax.psum(({k: v for k, v in grads.items() if k != "blocks"}, loss), axis_name)
    return loss, {**shared, "blocks": grads["blocks"]}


def _run_step(forward, params, carry, row, *, axis_name: str, slots: int):
    """One time step of the schedule on this stage, then the two `ppermute`s. `carry` is (kept inputs,
    received output gradients, accumulated gradients, accumulated loss); `row` is (kind, micro-batch) of
    every stage at this step, padded with an idle stage at both ends (stage s is entry s + 1)."""
    xs, dys, grads, loss = carry
    s, n_stages = jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)
    (kind, m), (prev_kind, prev_m), (next_kind, next_m) = (
        tuple(jax.lax.dynamic_index_in_dim(r, i, keepdims=False) for r in row) for i in (s + 1, s, s + 2)
    )
    x, dy = xs[m % slots], dys[m % slots]
    zero_grads = jax.tree.map(jnp.zeros_like, grads)

    def idle():
        return jnp.zeros_like(x), jnp.zeros_like(x), zero_grads, jnp.zeros_like(loss)

    def fwd():
        y, loss_m = forward(params, x, m)
        return y, jnp.zeros_like(x), zero_grads, loss_m

    def bwd():  # the forward recomputed from the kept input, then its vjp; the loss's cotangent is 1
        _, vjp = jax.vjp(lambda p, x: forward(p, x, m), params, x)
        dparams, dx = vjp((dy, jnp.ones_like(loss)))
        return jnp.zeros_like(x), dx, dparams, jnp.zeros_like(loss)

    y, dx, dparams, loss_m = jax.lax.switch(kind, (idle, fwd, bwd))
    if n_stages > 1:
        y = jax.lax.ppermute(y, axis_name, [(i, i + 1) for i in range(n_stages - 1)])
        dx = jax.lax.ppermute(dx, axis_name, [(i + 1, i) for i in range(n_stages - 1)])
    # keep what the neighbours sent, in the slot of the micro-batch they worked on
    xs = xs.at[prev_m % slots].set(jnp.where(prev_kind == schedules.FORWARD, y, xs[prev_m % slots]))
    dys = dys.at[next_m % slots].set(jnp.where(next_kind == schedules.BACKWARD, dx, dys[next_m % slots]))
    grads = jax.tree.map(jnp.add, grads, dparams)
    return (xs, dys, grads, loss + loss_m), None


def _varying(tree: Any, axis_name: str) -> Any:
    """Every leaf of `tree` (replicated over `axis_name`) typed as varying over it, its values unchanged."""
    return jax.tree.map(lambda a: jax.lax.pcast(a, axis_name, to="varying"), tree)
