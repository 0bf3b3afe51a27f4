"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): fine-tune a frozen model by
learning a low-rank change to some of its weight matrices, as a pure function of `(base, adapters)`.

For every selected weight W (d_in, d_out) the adapters hold A (d_in, r) and B (r, d_out), and the model runs
with

    W' = W + (alpha / r) * A @ B                                     (Hu et al., eq. 3; scale alpha / r, sec. 4.1)

A is random (uniform with bound 1/sqrt(d_in), the Kaiming-uniform init of Microsoft's loralib and of Hugging
Face peft; or `a_init=`), B is zero, so before the first step W' = W and the model is exactly the base.

    config = lora.LoraConfig(targets=("blocks.attn.qkv.w", "blocks.mlp.*.w"), rank=8, alpha=16)
    adapters = lora.init(key, base, config)          # {"blocks": {"attn": {"qkv": {"w": {"a", "b"}}}, ...}}
    loss_fn = lora.frozen(model_loss, base, config)  # (adapters, *args) -> model_loss(merge(base, adapters), *args)
    params = lora.merge(base, adapters, config)      # W + scale * A @ B, for export or plain inference

Selection: `targets` are dotted param paths (purejax.tree) where `*` matches one whole path component (or part
of one, as in fnmatch: `blocks.mlp.*.w`, `blocks.attn.q*.w`). A weight under a stacked subtree (the GPT's
`blocks`, stacked on a leading n_layer axis for `lax.scan`; `LoraConfig.stacked`) gets one adapter per layer:
A (n_layer, d_in, r), B (n_layer, r, d_out); the last two axes are (d_in, d_out), `purejax.nn.linear`'s layout.

How the adapters reach the model: merged on the fly. `frozen` merges inside the loss, so the model's own
`apply`/`loss` runs unchanged on plain params, and under `jit` XLA forms W' once per adapted weight per step.
The other formulation, x @ W + scale * (x @ A) @ B, never forms W', but it needs the layers to know about
adapters: a dict of arrays per layer is the layer contract (docs/design.md, section 2), and `purejax.nn.linear`
cannot tell an adapter from a weight. docs/lora.md measures both (bench/lora.py builds the low-rank one
outside that contract) and explains why merging is the default here. For the same reason dropout on the
adapter's input (Hu et al.'s lora_dropout) is not offered: it needs x, which only the low-rank form sees;
merging would drop entries of A, which is a different regulariser.

Only the adapters train: the loss is differentiated with respect to them alone, so the optimizer state is
built from the adapters (no buffer of the base's size) and the base, read through `stop_gradient`, gets no
gradient. The base may be held in bfloat16 while the adapters stay float32: `merge` computes in float32 and
returns each adapted weight in the promoted dtype (float32), so the small early changes are not rounded away.
`save`/`load` keep the adapters alone in a small checkpoint, with the LoraConfig in its header.
"""

import fnmatch
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from purejax import checkpoint
from purejax import random as prandom
from purejax import tree as tree_lib

PyTree = Any
Initializer = Callable[[PRNGKeyArray, tuple[int, ...], Any], jax.Array]


@dataclass(frozen=True)
class LoraConfig:
    """Which weights get adapters, of what rank, and how strongly they count; frozen and hashable (a static
    argument to `jax.jit`).

    Arguments:
        targets: dotted path patterns of the weights to adapt (see the module docstring for `*`).
        rank: r, the inner dimension of A @ B.
        alpha: the adapters' output is scaled by alpha / rank (Hu et al. sec. 4.1), so that a change of rank
            needs no change of learning rate; alpha = rank is a scale of 1.
        stacked: dotted paths of the subtrees whose leaves carry a leading layer axis (`purejax.nn.stack`), as
            in `optim.ndim_at_least`: a weight under one gets an adapter per layer.
    """

    targets: tuple[str, ...]
    rank: int = 8
    alpha: float = 16.0
    stacked: tuple[str, ...] = ("blocks",)

    def __post_init__(self):
        if isinstance(self.targets, str):  # a lone string would be read as a tuple of characters
            raise TypeError(f"LoraConfig: targets must be a tuple of path patterns, got the string {self.targets!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "stacked", tuple(self.stacked))
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"LoraConfig: targets must be non-empty path patterns, got {self.targets!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraConfig: rank must be a positive int, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraConfig: alpha must be a positive finite number, got {self.alpha!r}")

    def layer_axes(self, path: str) -> int:
        """How many leading layer axes the leaf at `path` has: one per stacked subtree it lies under."""
        return sum(path == p or path.startswith(p + ".") for p in self.stacked)

    @property
    def scale(self) -> float:
        """alpha / rank: the factor on A @ B."""
        return self.alpha / self.rank


def matches(pattern: str, path: str) -> bool:
    """Whether the dotted `path` matches `pattern`: the same number of components, each matching by fnmatch
    (`*` is any one component, never a dot)."""
    parts, names = pattern.split("."), path.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def select(base: PyTree, config: LoraConfig) -> list[str]:
    """The dotted paths of the weights `config.targets` selects, in `tree.flatten`'s order. Every pattern must
    match something, and only matrices: leaves with 2 dimensions besides the layer axes of `config.stacked`."""
    flat = tree_lib.flatten(base)
    chosen = [path for path in flat if any(matches(p, path) for p in config.targets)]
    unmatched = [p for p in config.targets if not any(matches(p, path) for path in flat)]
    if unmatched:
        matrices = ", ".join(path for path, x in flat.items() if jnp.ndim(x) - config.layer_axes(path) == 2)
        raise ValueError(
            f"lora: the target(s) {unmatched} match no param path; `*` matches one dotted component. "
            f"The matrices are: {matrices}"
        )
    wrong = [
        f"{path} {tree_lib.describe(flat[path])}"
        for path in chosen
        if jnp.ndim(flat[path]) - config.layer_axes(path) != 2
    ]
    if wrong:
        raise ValueError(
            f"lora: adapters need weight matrices (d_in, d_out) (after the layer axes of the stacked "
            f"subtrees {config.stacked}), but the targets select {wrong}; narrow the pattern, e.g. "
            "`blocks.mlp.*.w` rather than `blocks.mlp.*.*`"
        )
    return chosen


def init(
    key: PRNGKeyArray,
    base: PyTree,
    config: LoraConfig,
    *,
    a_init: Initializer | None = None,
    dtype: Any = jnp.float32,
) -> PyTree:
    """Adapters for the weights `config` selects in `base`: `{path...: {"a": A, "b": B}}`, a tree of the
    selected paths only. A from `a_init` (default: uniform with bound 1/sqrt(d_in), loralib's Kaiming
    uniform) drawn per layer for stacked weights, B zeros; both in `dtype` (float32), whatever the base's.
    Each weight's key is `fold_in(key, crc32(path))` (`purejax.random`), so adding a target changes no other.
    """
    flat = tree_lib.flatten(base)
    adapters = {}
    for path in select(base, config):
        *lead, d_in, d_out = jnp.shape(flat[path])
        draw = a_init or _uniform(1 / math.sqrt(d_in))
        a = _per_layer(draw, prandom.fold_in_name(key, path), lead, (d_in, config.rank), dtype)
        adapters[path] = {"a": a, "b": jnp.zeros((*lead, config.rank, d_out), dtype)}
    return tree_lib.unflatten(adapters)


def _per_layer(draw: Initializer, key: PRNGKeyArray, lead: list[int], shape: tuple[int, int], dtype: Any) -> jax.Array:
    """`draw(key_i, shape)` for each layer i of the leading axes `lead`, stacked: every layer its own draw, with
    the fan-in of one layer's matrix (an initializer given the stacked shape would count the layers in it)."""
    keys = jax.random.split(key, math.prod(lead))
    return jax.vmap(lambda k: draw(k, shape, dtype))(keys).reshape(*lead, *shape)


def _uniform(bound: float) -> Initializer:
    def draw(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return draw


def delta(adapter: dict[str, jax.Array], scale: float) -> jax.Array:
    """scale * A @ B in float32 (at least), at full matmul precision: the same change on every backend."""
    a, b = adapter["a"], adapter["b"]
    dtype = jnp.promote_types(a.dtype, jnp.float32)
    product = jnp.matmul(a.astype(dtype), b.astype(dtype), precision=jax.lax.Precision.HIGHEST)
    return scale * product


def adapted(base: PyTree, adapters: PyTree, config: LoraConfig) -> dict[str, tuple[jax.Array, dict]]:
    """`{path: (weight, {"a", "b"})}` for every adapter, checked against `base`: each path must name a weight
    whose shape fits the adapter's A (*lead, d_in, rank) and B (*lead, rank, d_out)."""
    flat, pairs = tree_lib.flatten(base), {}
    for path, leaf in tree_lib.flatten(adapters).items():
        weight_path, _, part = path.rpartition(".")
        if part not in ("a", "b") or weight_path not in flat:
            raise ValueError(
                f"lora: the adapters hold {path!r}, but the base has no weight {weight_path!r} "
                "(adapters are {path: {'a', 'b'}} for paths of the base); were they made for another "
                "model?"
            )
        pairs.setdefault(weight_path, (flat[weight_path], {}))[1][part] = leaf
    for path, (w, ab) in pairs.items():
        *lead, d_in, d_out = jnp.shape(w)
        want = {"a": (*lead, d_in, config.rank), "b": (*lead, config.rank, d_out)}
        got = {k: tuple(jnp.shape(ab.get(k))) if k in ab else None for k in want}
        if got != want:
            raise ValueError(
                f"lora: the adapter of {path} {tree_lib.describe(w)} has A {got['a']} and B {got['b']}, "
                f"but rank {config.rank} needs A {want['a']} and B {want['b']}"
            )
    return pairs


def merge(base: PyTree, adapters: PyTree, config: LoraConfig) -> PyTree:
    """The params the model runs with: each adapted W as W + scale * A @ B, computed in float32 and returned in
    the promoted dtype of W and the adapters (float32 for a bfloat16 base with float32 adapters: the change is
    not rounded to the base's precision); every other leaf is `base`'s own array. Cast with
    `purejax.tree.cast_floating` to export in the base's dtype."""
    flat = tree_lib.flatten(base)
    for path, (w, ab) in adapted(base, adapters, config).items():
        dtype = jnp.promote_types(w.dtype, ab["a"].dtype)
        flat[path] = (w.astype(jnp.float32) + delta(ab, config.scale)).astype(dtype)
    return tree_lib.unflatten_like(base, flat)


def unmerge(merged: PyTree, adapters: PyTree, config: LoraConfig, *, dtype: Any = None) -> PyTree:
    """The inverse of `merge`: each adapted W' as W' - scale * A @ B, in `dtype` (default W's own). The same
    product d is subtracted that was added, so the result is W exactly when A @ B is zero, and otherwise
    within one unit in the last place of W + d: the rounding of W + d in `merge` and of the difference here,
    half a unit each (none where W + d has a smaller ulp than W). Keep the base to get it back bit for bit."""
    flat = tree_lib.flatten(merged)
    for path, (w, ab) in adapted(merged, adapters, config).items():
        flat[path] = (w.astype(jnp.float32) - delta(ab, config.scale)).astype(dtype or w.dtype)
    return tree_lib.unflatten_like(merged, flat)


def frozen(fn: Callable[..., Any], base: PyTree, config: LoraConfig) -> Callable[..., Any]:
    """`fn(params, *args, **kwargs)` (a model's `apply` or `loss`) as a function of the adapters alone:
    `(adapters, *args, **kwargs) -> fn(merge(stop_gradient(base), adapters), *args, **kwargs)`.

    Differentiate it, or give it to `optim.train_step` as the loss, and the gradients, the optimizer state and
    the updates exist for the adapters only; `stop_gradient` makes sure no gradient reaches `base` even when
    the caller differentiates with respect to it. Under `jit`, pass `base` as an argument of the jitted
    function and call `frozen` inside it (a closed-over array would be baked into the program as a constant).
    """

    def with_adapters(adapters: PyTree, *args: Any, **kwargs: Any) -> Any:
        return fn(merge(jax.lax.stop_gradient(base), adapters, config), *args, **kwargs)

    return with_adapters


def save(path: str | os.PathLike, adapters: PyTree, config: LoraConfig, **metadata: Any) -> Path:
    """Write the adapters alone (a small file: rank * (d_in + d_out) numbers per weight and layer) with `config`
    in the checkpoint's header, so that `load` needs nothing else."""
    return checkpoint.save(path, adapters, config={"lora": asdict(config)}, metadata=metadata or None)


def load(path: str | os.PathLike) -> tuple[PyTree, LoraConfig]:
    """(adapters, config) from a file written by `save`; the adapters as jax arrays in their saved dtypes."""
    info = checkpoint.read_metadata(path)
    saved = info.config.get("lora") if isinstance(info.config, dict) else None
    if not isinstance(saved, dict):
        raise ValueError(
            f"lora.load: {path} records no LoRA config (its config is {info.config!r}); was it "
            "written by purejax.lora.save?"
        )
    config = LoraConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    adapters, _ = checkpoint.restore(path)
    return jax.tree.map(jnp.asarray, adapters), config
