"""Loss scaling for float16 training: none, static, and dynamic (Micikevicius et al. 2018, "Mixed Precision
Training"; the semantics of jmp's loss scales and torch's `GradScaler`).

float16 stops at about 6e-8 (and loses precision below 6e-5), so small gradients computed in float16 flush to
zero. Multiplying the loss by S multiplies every gradient by S, lifting them into range; the optimizer then
sees the gradients divided by S again. Too large an S overflows to inf, which the dynamic scale detects:

    for each step:
        grads = unscale(grad(scale(loss)))
        if all_finite(grads):                    # apply the update
            counter += 1
            if counter == period:                # `period` finite steps in a row: try a larger scale
                counter = 0
                loss_scale = loss_scale * factor, unless that overflows float32
        else:                                    # skip the update, back off
            counter = 0
            loss_scale = max(min_loss_scale, loss_scale / factor)

Each scale is a NamedTuple whose every field is a leaf, so it survives jit, checkpoints and tree operations
whole: jmp's `DynamicLossScale` keeps `period` and `factor` as static data and drops `min_loss_scale` when it is
flattened, so a jitted step silently backs off below the minimum. bfloat16 has float32's range: it needs none.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from purejax.optim.base import PyTree


class NoLossScale(NamedTuple):
    """No scaling (float32 or bfloat16 training): every method returns its input."""

    @property
    def loss_scale(self) -> Float[Array, ""]:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: PyTree) -> PyTree:
        return tree

    def unscale(self, tree: PyTree) -> PyTree:
        return tree

    def adjust(self, grads_finite: Bool[Array, ""]) -> "NoLossScale":
        return self


def _times(tree: PyTree, factor: Float[Array, ""]) -> PyTree:
    """Every leaf of `tree` multiplied by the scalar `factor`."""
    return jax.tree_util.tree_map(lambda x: x * factor, tree)


class StaticLossScale(NamedTuple):
    """A fixed scale, e.g. 2**10 for a model whose gradient range is known."""

    loss_scale: Float[Array, ""]

    def scale(self, tree: PyTree) -> PyTree:
        return _times(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _times(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Bool[Array, ""]) -> "StaticLossScale":
        return self


class DynamicLossScale(NamedTuple):
    """The largest scale that keeps gradients finite, found as the module docstring describes."""

    loss_scale: Float[Array, ""]
    counter: Int[Array, ""]  # finite steps since the last change, 0 .. period - 1
    period: Int[Array, ""]
    factor: Float[Array, ""]
    min_loss_scale: Float[Array, ""]

    def scale(self, tree: PyTree) -> PyTree:
        return _times(tree, self.loss_scale)

    def unscale(self, tree: PyTree) -> PyTree:
        return _times(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: Bool[Array, ""]) -> "DynamicLossScale":
        """The scale for the next step, after a step whose gradients were finite or not."""
        grown = self.loss_scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        when_finite = jnp.where(self.counter == self.period - 1, grown, self.loss_scale)
        when_overflow = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        counter = ((self.counter + 1) % self.period) * grads_finite
        return self._replace(loss_scale=jnp.where(grads_finite, when_finite, when_overflow), counter=counter)


LossScale = NoLossScale | StaticLossScale | DynamicLossScale


def static_loss_scale(loss_scale: float | int) -> StaticLossScale:
    """A constant loss scale."""
    return StaticLossScale(jnp.asarray(loss_scale, jnp.float32))


def dynamic_loss_scale(
    initial: float | int = 2.0**15, period: int = 2000, factor: float | int = 2.0, min_loss_scale: float | int = 1.0
) -> DynamicLossScale:
    """A dynamic loss scale with jmp's defaults (torch's `GradScaler`: initial 2**16, period 2000, factor 2).

    Arguments:
        initial: the first scale; a power of two keeps scaling exact.
        period: finite steps in a row before the scale grows.
        factor: growth factor, and divisor on overflow.
        min_loss_scale: the scale never goes below this, however many overflows in a row.
    """
    if not (initial >= min_loss_scale > 0 and period >= 1 and factor > 1):
        raise ValueError(
            f"dynamic_loss_scale needs initial >= min_loss_scale > 0, period >= 1 and factor > 1; got "
            f"initial={initial}, min_loss_scale={min_loss_scale}, period={period}, factor={factor}"
        )
    return DynamicLossScale(
        loss_scale=jnp.asarray(initial, jnp.float32),
        counter=jnp.zeros((), jnp.int32),
        period=jnp.asarray(period, jnp.int32),
        factor=jnp.asarray(factor, jnp.float32),
        min_loss_scale=jnp.asarray(min_loss_scale, jnp.float32),
    )


def all_finite(tree: PyTree, axis_name: Any = None) -> Bool[Array, ""]:
    """True when no element of any leaf is inf or nan. With `axis_name` (inside `shard_map`, leaves sharded over
    those axes), True only when that holds on every device, so that all devices skip or apply together."""
    leaves = jax.tree_util.tree_leaves(tree)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) == 1
    return finite
