"""How Shampoo sees a parameter: a matrix per layer, cut into blocks, each preconditioned on its own.

A tensor of more than two dimensions is the matrix (all dims but the last merged, the last): a HWIO kernel is
(kh * kw * in, out). Leaves under `stacked` prefixes have leading layer axes: a batch of matrices. Sides over
`block_size` are cut into blocks, the last zero-padded (a zero row of G adds a decoupled zero row and column to
its statistic: nothing changes). Inside `shard_map`, a device holding a slice of a parameter (FSDP, tensor
parallelism) cuts its slice, which must be made of whole blocks of the whole matrix.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@dataclass(frozen=True)
class BlockLayout:
    """A parameter (this device's slice of it, on a mesh) seen as `layers` leading axes, then a (rows, cols)
    matrix per layer cut into (row_block, col_block) blocks."""

    shape: tuple[int, ...]
    layers: int
    rows: int
    cols: int
    row_block: int
    col_block: int
    split_over: tuple[str, ...] = ()  # the mesh axes the parameter is split over

    @property
    def grid(self) -> tuple[int, int]:
        """The number of (row, column) blocks, the last of each padded."""
        return -(-self.rows // self.row_block), -(-self.cols // self.col_block)

    def blocks(self, x: Array) -> Float[Array, "*layers row_blocks col_blocks row_block col_block"]:
        """`x` (of `shape`) as float32 blocks, zero-padded to whole blocks."""
        leading, (row_blocks, col_blocks) = self.shape[: self.layers], self.grid
        matrix = x.astype(jnp.float32).reshape(*leading, self.rows, self.cols)
        padding = [(0, row_blocks * self.row_block - self.rows), (0, col_blocks * self.col_block - self.cols)]
        matrix = jnp.pad(matrix, [(0, 0)] * self.layers + padding)
        return jnp.swapaxes(matrix.reshape(*leading, row_blocks, self.row_block, col_blocks, self.col_block), -3, -2)

    def merge(self, blocks: Float[Array, "*layers row_blocks col_blocks row_block col_block"]) -> Array:
        """The inverse of `blocks`: the parameter's shape again, the padding dropped."""
        leading, (row_blocks, col_blocks) = self.shape[: self.layers], self.grid
        matrix = jnp.swapaxes(blocks, -3, -2).reshape(
            *leading, row_blocks * self.row_block, col_blocks * self.col_block
        )
        return matrix[..., : self.rows, : self.cols].reshape(self.shape)


def block_layout(
    name: str, shape: Sequence[int], stacked: Sequence[str], block_size: int, max_dim: int, spec: Sequence[Any] = ()
) -> BlockLayout | None:
    """The layout of the parameter `name` (this device's `shape` of it, split as `spec` says, inside
    `shard_map`; a leading layer axis per `stacked` prefix it lies under), or None if Shampoo leaves it to the
    graft: fewer than two dims per layer, or a side of the whole matrix over `max_dim`. Raises when a device's
    slice is not made of whole blocks of the whole matrix."""
    layers = sum(name == prefix or name.startswith(prefix + ".") for prefix in stacked)
    if len(shape) < layers:
        raise ValueError(
            f"scale_by_shampoo(stacked={tuple(stacked)}): {name} has shape {tuple(shape)}, so it has "
            f"no leading layer axis: is it really under a stacked subtree?"
        )
    padded_spec = (*spec, *[None] * (len(shape) - len(spec)))
    entries = [(entry,) if isinstance(entry, str) else tuple(entry or ()) for entry in padded_spec]
    splits = [math.prod(jax.lax.axis_size(axis) for axis in axes) for axes in entries]
    full = [size * split for size, split in zip(shape, splits)]
    if len(shape) - layers < 2:
        return None
    full_rows, full_cols = math.prod(full[layers:-1]), full[-1]
    if max(full_rows, full_cols) > max_dim:
        return None
    rows, cols = math.prod(shape[layers:-1]), shape[-1]
    row_block, col_block = min(full_rows, block_size), min(full_cols, block_size)
    misaligned = any(split > 1 for split in splits[layers + 1 : -1]) or (splits[layers] > 1 and rows % row_block)
    if misaligned or (splits[-1] > 1 and cols % col_block):
        raise ValueError(
            f"scale_by_shampoo: {name} {tuple(full)} is split {tuple(spec)} over the mesh, so a device holds "
            f"{rows} x {cols} of its {full_rows} x {full_cols} matrix, which blocks of {row_block} x {col_block} "
            f"do not tile as they tile the whole (a split dim must be the first or the last of a layer's): pick "
            f"a block_size dividing the slice, or leave the parameter to the graft (max_dim)"
        )
    split_over = tuple(axis for axes in entries for axis in axes)
    return BlockLayout(tuple(shape), layers, rows, cols, row_block, col_block, split_over)


def per_block(layout: BlockLayout | None, make: Callable[[int], Array]) -> tuple[Array, Array] | tuple[None, None]:
    """(left, right): `make(side)`, a (side, side) matrix, for each block of a preconditioned parameter, side
    its row block on the left and its column block on the right; (None, None) for a parameter left to the graft."""
    if layout is None:
        return None, None
    leading = (*layout.shape[: layout.layers], *layout.grid)
    return tuple(jnp.broadcast_to(make(side), (*leading, side, side)) for side in (layout.row_block, layout.col_block))
