"""Activation rematerialisation ("gradient checkpointing", Chen et al. 2016, arXiv:1604.06174): keep fewer of
a block's intermediate values for the backward pass and recompute the rest from the block's input when the
gradient needs them. The forward pass runs about once more per block; the numbers do not change.

    layer = remat.wrap(layer, "block")            # keep only each block's input: jax.checkpoint
    layer = remat.wrap(layer, "dots_saveable")    # keep the matmul outputs, recompute the elementwise ops
    layer = remat.wrap(layer, "none")             # the function itself

A stack of n blocks without remat keeps every block's activations until the backward pass reaches it, so
memory grows with n times a block's intermediates (for a transformer: the attention scores, the MLP's d_ff
wide hidden layer, each LayerNorm's output). With "block" it keeps n block inputs plus one block's
intermediates at a time. A policy name chooses in between: which values `jax.checkpoint` may save, as
`jax.checkpoint_policies` defines them. docs/train-gpt.md measures what each choice saves at GPT-2 small.
"""

from collections.abc import Callable
from typing import Any

import jax

# The names in jax.checkpoint_policies that are policies themselves; the others there are factories that need
# arguments (names given with jax.ad_checkpoint.checkpoint_name, offload targets), which a setting cannot hold.
POLICIES = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)
CHOICES = ("none", "block", *POLICIES)


def check(remat: str) -> str:
    """`remat` if it names a choice (`CHOICES`), else a ValueError listing them."""
    if remat not in CHOICES:
        raise ValueError(
            f"remat={remat!r} is not 'none', 'block' or one of jax.checkpoint_policies' policies; "
            f"choose one of {list(CHOICES)}"
        )
    return remat


def wrap(fn: Callable[..., Any], remat: str, *, prevent_cse: bool = True) -> Callable[..., Any]:
    """`fn` under `jax.checkpoint` as `remat` says: "none" returns `fn` itself, "block" saves nothing but the
    arguments, a policy name saves what that policy allows.

    `prevent_cse=False` is right inside `lax.scan` (jax.checkpoint's docs): the scan already keeps XLA from
    merging the recomputation with the forward pass, and the guard would only cost time. Outside a scan
    (an unrolled loop of blocks) keep the default."""
    if check(remat) == "none":
        return fn
    policy = None if remat == "block" else getattr(jax.checkpoint_policies, remat)
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
