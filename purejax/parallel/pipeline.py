"""Pipeline parallelism: a layer-stacked model split into S stages over a "pipe" mesh axis, the batch into M
micro-batches, and a schedule (purejax/parallel/pipeline_schedules.py, a table of (step, stage) -> F(m) | B(m) | idle)
executed step by step under `lax.scan`, activations sent to the next stage and their gradients to the
previous one with `ppermute`. The runner knows no model; the model gives it two things:

    params   a dict whose "blocks" entry is layer-stacked (`stack.init`), split over "pipe" by `stage_specs`:
             device s holds blocks[s*L:(s+1)*L] (L = depth / S); every other entry is whole on every stage.
    stage    stage(params, x, micro, n_tokens, *, key, axes) -> (y, loss_share): this device's stage on one
             micro-batch `micro` = (inputs, targets). Stage 0 ignores x and embeds the inputs; every stage
             runs its blocks; the last stage returns its share of the loss, sum(its losses) / n_tokens, the
             others 0. `jax.lax.axis_index(axes.pipe)` tells a stage which one it is.
    width    the activations' last axis: x and y are (micro_batch, seq, width), the shape of the buffers.

The GPT's stage (embedding, blocks, tied head, cross-entropy) is models/gpt_pipeline.py, with the wrappers
its callers use. `width` is passed, not derived: the zero buffers must exist before any stage runs, and a
stage's output shape cannot be traced without an input of that shape.

    every step t, on every stage s at once (one program, `kind[t, s]` picks the branch):
        F(m): y = stage(x[m])                         keep x[m] (the stage's input) for the backward
        B(m): dparams, dx = vjp(stage, x[m])(dy[m])   the forward recomputed from the kept input
        y  -> stage s + 1   (ppermute)                it stores y as its x[m]
        dx -> stage s - 1   (ppermute)                it stores dx as its dy[m]

Memory. A stage keeps only its *inputs* (one activation per micro-batch in flight) and recomputes its
layers' forward inside the backward (`jax.vjp` at B time), as GPipe does with rematerialisation (Huang et
al. 2019, sec. 2.3). The buffer has `pipeline_schedules.buffer_slots(table)` slots, micro-batch m in slot m % K:
M for GPipe, at most S for 1F1B; that is the activation footprint the schedule buys.

The loss is the whole batch's mean over its counted targets (targets of -1 are ignored, the ignore index of
`losses.cross_entropy`): `n_tokens` counts them over the whole batch (and over `axes.data`), the last stage
adds sum(losses of m) / n_tokens for each m, so the sum over micro-batches is the mean over the whole batch,
and the gradient of each term is that micro-batch's share. With a key, micro-batch m gets
`jax.random.split(key, M)[m]` (as `optim.accumulate_gradients`); the stage derives its layers' keys from it.

The params whole on every stage (the GPT's embeddings and final norm) are used by some stages and not
others. Every stage holds them (replicated over "pipe"), each differentiates its own copy, and one `psum`
over "pipe" at the end of the step adds the stages' gradients; a stage that does not use them contributes
zeros. The blocks' gradients stay where their layers are.

Collectives per step, per device: 2 T collective-permutes of one micro-batch's activations (T = len(table);
idle steps send zeros: all devices run one program), and the all-reduce of the whole params' gradients and
the loss.

Inside the ordinary training step. A schedule computes the loss and the gradients together: its backwards
are interleaved with its forwards, so "forward, then let `jax.grad` run the backward" cannot express it.
`loss` hides that behind `jax.custom_vjp`, so that `optim.train_step` and `sharded_train_step` run it as
any other loss function (loss scale, gradient accumulation, clipping, the data-parallel psum, donation):

    primal (no gradient asked: evaluation)  `forward_loss`, the forwards alone, M + S - 1 steps
    fwd rule (under jax.grad)               `loss_and_grads`, the whole schedule; its gradients are the residuals
    bwd rule                                those gradients times the loss's cotangent (the loss scale)

Other axes. `axes.data` splits the batch: the token count and the loss are psummed over it (the gradients'
sum is `sharded_train_step`'s). `axes.model` is the stage's own business (the GPT's splits its blocks and
head Megatron-style). FSDP, context and sequence parallelism are refused.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray, Shaped

from purejax.nn import stack
from purejax.optim.accumulate import split_micro_batches
from purejax.parallel import pipeline_schedules
from purejax.parallel.mesh import PIPE, MeshAxes

Params = dict[str, Any]
Batch = tuple[Shaped[Array, "batch seq"], Shaped[Array, "batch seq"]]


# stage(params, x, micro, n_tokens, *, key, axes) -> (y, loss_share): see the module docstring;
# models/gpt_pipeline.stage_forward is one, with its shapes.
Stage = Callable[..., tuple[Float[Array, "micro_batch seq width"], Float[Array, ""]]]


def stage_specs(specs: Params, axis_name: str = PIPE) -> Params:
    """`specs` (e.g. `gpt_parallel.param_specs`) with every `blocks` leaf's layer axis split over `axis_name`."""

    def split_layers(spec: P) -> P:
        if len(spec) and spec[0] is not None:
            raise ValueError(f"pipeline: a block's layer axis is already split ({spec}); it must be whole")
        return P(axis_name, *tuple(spec)[1:])

    return {**specs, "blocks": jax.tree.map(split_layers, specs["blocks"], is_leaf=lambda x: isinstance(x, P))}


def param_specs(params: Params, axis_name: str = PIPE) -> Params:
    """The pipe axis alone: P(axis_name) on the blocks' layer axis, P() (replicated) for every other entry."""
    return stage_specs(jax.tree.map(lambda _: P(), params), axis_name)


def loss(
    params: Params,
    batch: Batch,
    stage: Stage,
    table: pipeline_schedules.Table,
    *,
    width: int,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes,
) -> Float[Array, ""]:
    """The whole batch's loss, pipelined over `axes.pipe`, differentiable: its gradient is the one
    `loss_and_grads` computes while running `table` (see "Inside the ordinary training step" above). Call
    inside `shard_map` with the params placed by `stage_specs` and the batch split over `axes.data` only."""
    if axes.pipe is None or axes.fsdp or axes.context is not None or axes.sequence_parallel:
        raise ValueError(f"pipeline.loss: needs axes.pipe, and no fsdp, context or sequence parallelism; got {axes}")
    n_micro = pipeline_schedules.micro_batches(table)

    @jax.custom_vjp
    def pipelined(params, batch, key):
        return forward_loss(params, batch, stage, n_micro, width=width, key=key, axes=axes)

    def fwd(params, batch, key):
        return loss_and_grads(params, batch, stage, table, width=width, key=key, axes=axes)

    def bwd(grads, cotangent):
        return jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads), None, None

    pipelined.defvjp(fwd, bwd)
    return pipelined(params, batch, key)


def sharded_loss_and_grads(
    mesh: jax.sharding.Mesh, stage: Stage, table: pipeline_schedules.Table, *, width: int, axis_name: str = PIPE
) -> Callable[..., tuple[Float[Array, ""], Params]]:
    """`loss_and_grads` under `jax.jit(jax.shard_map(...))` over `mesh`: `fn(params, batch, key=None) ->
    (loss, grads)`, params placed by `param_specs` (`parallel.shard`), the batch and key replicated."""
    n_stages = mesh.shape[axis_name]
    if len(table[0]) != n_stages:
        raise ValueError(
            f"pipeline: a table of {len(table[0])} stages for {n_stages} stages ({axis_name!r}); "
            f"make the table for the mesh's stage count"
        )

    def run(params, batch, key=None):
        depth = stack.depth(params["blocks"], "params['blocks']")
        if depth % n_stages:
            raise ValueError(
                f"pipeline: params['blocks'] has {depth} layers for {n_stages} stages ({axis_name!r}); "
                f"the depth must be a multiple of the stage count"
            )
        specs = param_specs(params, axis_name)
        body = functools.partial(loss_and_grads, stage=stage, table=table, width=width, axes=MeshAxes(pipe=axis_name))
        sharded = jax.shard_map(
            lambda p, b, k: body(p, b, key=k), mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs)
        )
        return sharded(params, batch, key)

    return jax.jit(run)


def forward_loss(
    params: Params,
    batch: Batch,
    stage: Stage,
    n_micro: int,
    *,
    width: int,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes,
) -> Float[Array, ""]:
    """The whole batch's loss by the forwards alone: at step t stage s runs micro-batch t - s (if there is
    one) on what stage s - 1 sent at step t - 1, M + S - 1 steps, no buffer. Evaluation's pass."""
    forward, x0, loss0, local = _setup(params, batch, stage, width, n_micro, key, axes, slots=1)
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
    stage: Stage,
    table: pipeline_schedules.Table,
    *,
    width: int,
    key: PRNGKeyArray | None = None,
    axes: MeshAxes = MeshAxes(pipe=PIPE),
) -> tuple[Float[Array, ""], Params]:
    """The whole batch's loss and its gradients, pipelined by `table` over `axes.pipe`, inside
    `shard_map` (params placed by `stage_specs`, the batch split over `axes.data` only). The gradients are
    placed like the params; under `axes.data` they are this shard's share, still to be summed over it."""
    n_micro = pipeline_schedules.micro_batches(table)
    pipeline_schedules.check(table, jax.lax.axis_size(axes.pipe), n_micro)
    slots = pipeline_schedules.buffer_slots(table)
    forward, x0, loss0, local = _setup(params, batch, stage, width, n_micro, key, axes, slots)
    carry = (x0, x0, jax.tree.map(jnp.zeros_like, local), loss0)
    step = functools.partial(_run_step, forward, local, axis_name=axes.pipe, slots=slots)
    pad = ((0, 0), (1, 1))  # an idle stage on either side, so every stage reads its neighbours' entries
    (_, _, grads, loss), _ = jax.lax.scan(
        step, carry, tuple(jnp.pad(a, pad) for a in pipeline_schedules.as_arrays(table))
    )
    shared = jax.lax.psum({k: v for k, v in grads.items() if k != "blocks"}, axes.pipe)
    return jax.lax.psum(loss, _reduced(axes)), {**shared, "blocks": grads["blocks"]}


def _setup(params, batch, stage, width, n_micro, key, axes, slots):
    """(forward(params, x, m) -> (y, loss share) of micro-batch m, the zero activations buffer of `slots`
    micro-batches, a zero loss, this device's own copy of the params), typed varying over the pipe axis and
    every axis the batch varies over."""
    micro_batches = split_micro_batches(batch, n_micro)
    n_tokens = jnp.sum(batch[1] != -1)
    n_tokens = n_tokens if axes.data is None else jax.lax.psum(n_tokens, axes.data)
    keys = None if key is None else jax.random.split(key, n_micro)

    def forward(p, x, m):
        micro = jax.tree.map(lambda a: a[m], micro_batches)
        return stage(p, x, micro, n_tokens, key=None if keys is None else keys[m], axes=axes)

    # this device's own copy of the replicated params: their gradients stay local until the psum over "pipe"
    local = {k: v if k == "blocks" else _varying(v, axes.pipe) for k, v in params.items()}
    dtype = jax.tree.leaves(params)[0].dtype
    zero = _varying(jnp.zeros_like(batch[0][0, 0], dtype), axes.pipe)  # varying as the batch is, and over pipe
    x0 = zero + jnp.zeros((slots, *micro_batches[0].shape[1:], width), dtype)
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
    xs = xs.at[prev_m % slots].set(jnp.where(prev_kind == pipeline_schedules.FORWARD, y, xs[prev_m % slots]))
    dys = dys.at[next_m % slots].set(jnp.where(next_kind == pipeline_schedules.BACKWARD, dx, dys[next_m % slots]))
    grads = jax.tree.map(jnp.add, grads, dparams)
    return (xs, dys, grads, loss + loss_m), None


def _reduced(axes: MeshAxes) -> tuple[str, ...]:
    """The axes the loss is summed over: the stages (only the last one's is non-zero) and the data shards."""
    return tuple(a for a in (axes.pipe, axes.data) if a is not None)


def _varying(tree: Any, axis_name: str) -> Any:
    """Every leaf of `tree` (replicated over `axis_name`) typed as varying over it, its values unchanged."""
    return jax.tree.map(lambda a: jax.lax.pcast(a, axis_name, to="varying"), tree)
