"""Pipeline parallelism for the GPT: the stacked blocks split into S stages over a "pipe" mesh axis, the
batch into M micro-batches, and a schedule (purejax/parallel/schedules.py, a table of (step, stage) ->
F(m) | B(m) | idle) executed step by step under `lax.scan`, activations sent to the next stage and their
gradients to the previous one with `ppermute`.

    device s holds blocks[s*L:(s+1)*L] (L = n_layer / S: `stage_specs`, "pipe" on the leading layer axis),
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
gradients; every other stage contributes zeros.

Collectives per step, per device: 2 T collective-permutes of one micro-batch's activations (T = len(table);
idle steps send zeros: all devices run one program), and the all-reduce of wte, wpe, ln_f's gradients and the loss.

Inside the ordinary training step. A schedule computes the loss and the gradients together: its backwards
are interleaved with its forwards, so "forward, then let `jax.grad` run the backward" cannot express it.
`loss` hides that behind `jax.custom_vjp`, so that `optim.train_step` and `sharded_train_step` run it as
any other loss function (loss scale, gradient accumulation, clipping, the data-parallel psum, donation):

    primal (no gradient asked: evaluation)  `forward_loss`, the forwards alone, M + S - 1 steps
    fwd rule (under jax.grad)               `loss_and_grads`, the whole schedule; its gradients are the residuals
    bwd rule                                those gradients times the loss's cotangent (the loss scale)

Other axes. `axes.data` splits the batch: the token count and the loss are psummed over it (the gradients'
sum is `sharded_train_step`'s). `axes.model` splits each stage's blocks, wte's rows and the head's vocabulary
Megatron-style (`gpt.block`'s psums inside every stage). FSDP, context and sequence parallelism are refused.
The blocks run under `stack.scan` (`config.layers`, `config.remat` unread: B recomputes the forward anyway).
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
from purejax.parallel.mesh import PIPE, MeshAxes

Params = dict[str, Any]
Batch = tuple[Integer[Array, "batch seq"], Integer[Array, "batch seq"]]


def stage_specs(specs: Params, axis_name: str = PIPE) -> Params:
    """`specs` (e.g. `gpt_parallel.param_specs`) with every `blocks` leaf's layer axis split over `axis_name`."""

    def split_layers(spec: P) -> P:
        if len(spec) and spec[0] is not None:
            raise ValueError(f"pipeline: a block's layer axis is already split ({spec}); it must be whole")
        return P(axis_name, *tuple(spec)[1:])

    return {**specs, "blocks": jax.tree.map(split_layers, specs["blocks"], is_leaf=lambda x: isinstance(x, P))}


def param_specs(params: Params, axis_name: str = PIPE) -> Params:
    """The pipe axis alone: P(axis_name) on the blocks' layer axis, P() (replicated) for wte, wpe and ln_f."""
    return stage_specs(jax.tree.map(lambda _: P(), params), axis_name)


def loss(
    params: Params,
    batch: Batch,
    config: gpt.GPTConfig,
    table: schedules.Table,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes,
) -> Float[Array, ""]:
    """`gpt.loss` on the whole batch, pipelined over `axes.pipe`, differentiable: its gradient is the one
    `loss_and_grads` computes while running `table` (see "Inside the ordinary training step" above). Call
    inside `shard_map` with the params placed by `stage_specs` and the batch split over `axes.data` only."""
    if axes.pipe is None or axes.fsdp or axes.context is not None or axes.sequence_parallel:
        raise ValueError(f"pipeline.loss: needs axes.pipe, and no fsdp, context or sequence parallelism; got {axes}")
    n_micro = schedules.micro_batches(table)

    @jax.custom_vjp
    def pipelined(params, batch, key):
        return forward_loss(params, batch, config, n_micro, key=key, axes=axes)

    def fwd(params, batch, key):
        return loss_and_grads(params, batch, config, table, key=key, axes=axes)

    def bwd(grads, cotangent):
        return jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads), None, None

    pipelined.defvjp(fwd, bwd)
    return pipelined(params, batch, key)


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
        body = functools.partial(loss_and_grads, config=config, table=table, axes=MeshAxes(pipe=axis_name))
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
    axes: MeshAxes,
) -> tuple[Float[Array, "micro_batch seq d_model"], Float[Array, ""]]:
    """This device's stage on one micro-batch: (its output activations, its share of the loss). Stage 0
    replaces `x` by the embeddings; the last stage returns sum(token losses) / n_tokens, the others 0.
    Under `axes.model` the embedding, blocks and cross-entropy are gpt.py's vocab- and head-parallel ones."""
    s, n_stages = jax.lax.axis_index(axes.pipe), jax.lax.axis_size(axes.pipe)
    idx, targets = micro
    dropout_on = key is not None and config.dropout > 0
    keys = prandom.named_keys(key, "embd", "blocks") if dropout_on else {"embd": None}

    def embed():
        positions = embedding.apply(params["wpe"], jnp.arange(idx.shape[1]))
        h = embedding.apply(params["wte"], idx, axis_name=axes.model) + positions
        return dropout.apply(h, rate=config.dropout, key=keys["embd"])

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


def forward_loss(
    params: Params,
    batch: Batch,
    config: gpt.GPTConfig,
    n_micro: int,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes,
) -> Float[Array, ""]:
    """`gpt.loss` on the whole batch by the forwards alone: at step t stage s runs micro-batch t - s (if
    there is one) on what stage s - 1 sent at step t - 1, M + S - 1 steps, no buffer. Evaluation's pass."""
    forward, x0, loss0, local = _setup(params, batch, config, n_micro, key, axes, slots=1)
    s, n_stages = jax.lax.axis_index(axes.pipe), jax.lax.axis_size(axes.pipe)

    def step(carry, t):
        x, total = carry
        m = t - s
        y, loss_m = jax.lax.cond(
            (m >= 0) & (m < n_micro),
            lambda: forward(local, x, jnp.clip(m, 0, n_micro - 1)),
            lambda: (jnp.zeros_like(x), jnp.zeros_like(total)),
        )
        if n_stages > 1:
            y = jax.lax.ppermute(y, axes.pipe, [(i, i + 1) for i in range(n_stages - 1)])
        return (y, total + loss_m), None

    (_, total), _ = jax.lax.scan(step, (x0[0], loss0), jnp.arange(n_micro + n_stages - 1))
    return jax.lax.psum(total, _reduced(axes))


def loss_and_grads(
    params: Params,
    batch: Batch,
    config: gpt.GPTConfig,
    table: schedules.Table,
    *,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes = MeshAxes(pipe=PIPE),
) -> tuple[Float[Array, ""], Params]:
    """`gpt.loss` on the whole batch and its gradients, pipelined by `table` over `axes.pipe`, inside
    `shard_map` (params placed by `stage_specs`, the batch split over `axes.data` only). The gradients are
    placed like the params; under `axes.data` they are this shard's share, still to be summed over it."""
    n_micro = schedules.micro_batches(table)
    schedules.check(table, jax.lax.axis_size(axes.pipe), n_micro)
    slots = schedules.buffer_slots(table)
    forward, x0, loss0, local = _setup(params, batch, config, n_micro, key, axes, slots)
    carry = (x0, x0, jax.tree.map(jnp.zeros_like, local), loss0)
    step = functools.partial(_run_step, forward, local, axis_name=axes.pipe, slots=slots)
    pad = ((0, 0), (1, 1))  # an idle stage on either side, so every stage reads its neighbours' entries
    (_, _, grads, loss), _ = jax.lax.scan(step, carry, tuple(jnp.pad(a, pad) for a in schedules.as_arrays(table)))
    shared = jax.lax.psum({k: v for k, v in grads.items() if k != "blocks"}, axes.pipe)
    return jax.lax.psum(loss, _reduced(axes)), {**shared, "blocks": grads["blocks"]}


def _setup(params, batch, config, n_micro, key, axes, slots):
    """(forward(params, x, m) -> (y, loss share) of micro-batch m, the zero activations buffer of `slots`
    micro-batches, a zero loss, this device's own copy of the params), typed varying over the pipe axis and
    every axis the batch varies over."""
    micro_batches = split_micro_batches(batch, n_micro)
    n_tokens = jnp.sum(batch[1] != -1)
    n_tokens = n_tokens if axes.data is None else jax.lax.psum(n_tokens, axes.data)
    keys = None if key is None else jax.random.split(key, n_micro)

    def forward(p, x, m):
        micro = jax.tree.map(lambda a: a[m], micro_batches)
        return stage_forward(p, x, micro, n_tokens, config, key=None if keys is None else keys[m], axes=axes)

    # this device's own copy of the replicated params: their gradients stay local until the psum over "pipe"
    local = {k: v if k == "blocks" else _varying(v, axes.pipe) for k, v in params.items()}
    dtype = jax.tree.leaves(params)[0].dtype
    zero = _varying(jnp.zeros_like(batch[0][0, 0], dtype), axes.pipe)  # varying as the batch is, and over pipe
    x0 = zero + jnp.zeros((slots, *micro_batches[0].shape[1:], config.n_embd), dtype)
    return forward, x0, zero.astype(jnp.float32), local


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


def _reduced(axes: MeshAxes) -> tuple[str, ...]:
    """The axes the loss is summed over: the stages (only the last one's is non-zero) and the data shards."""
    return tuple(a for a in (axes.pipe, axes.data) if a is not None)


def _varying(tree: Any, axis_name: str) -> Any:
    """Every leaf of `tree` (replicated over `axis_name`) typed as varying over it, its values unchanged."""
    return jax.tree.map(lambda a: jax.lax.pcast(a, axis_name, to="varying"), tree)
