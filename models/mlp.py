"""An MLP classifier: the smallest complete purejax model, and the one the tutorial builds.

    x (batch, d_in) -> [linear -> activation -> dropout] * len(hidden) -> linear -> logits (batch, n_classes)

params: {"hidden_0": linear, "hidden_1": linear, ..., "head": linear}. Each part's key is folded in from its
name (purejax.random.named_keys), so changing the head never changes the hidden layers' initialisation.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from purejax import losses
from purejax import random as prandom
from purejax.nn import activations, check_keys, dropout, initializers, linear


@dataclass(frozen=True)
class MLPConfig:
    """Static description of the model; frozen and hashable so it can be a static argument to jax.jit."""

    d_in: int = 64
    hidden: tuple[int, ...] = (128, 128)
    n_classes: int = 10
    activation: str = "relu"
    dropout: float = 0.0

    def __post_init__(self):
        if self.d_in <= 0 or self.n_classes <= 1 or any(h <= 0 for h in self.hidden):
            raise ValueError(f"MLPConfig: sizes must be positive and n_classes >= 2, got {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MLPConfig: dropout must be in [0, 1), got {self.dropout}")
        activations.get(self.activation)  # unknown names fail here, not at the first forward pass
        object.__setattr__(self, "hidden", tuple(self.hidden))

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"hidden_{i}" for i in range(len(self.hidden))) + ("head",)


def init(key: PRNGKeyArray, config: MLPConfig) -> dict:
    """He-normal hidden layers (for ReLU), LeCun-normal head, zero biases."""
    keys = prandom.named_keys(key, *config.layer_names)
    sizes = (config.d_in, *config.hidden, config.n_classes)
    params = {}
    for name, d_in, d_out in zip(config.layer_names, sizes[:-1], sizes[1:]):
        w_init = initializers.lecun_normal() if name == "head" else initializers.he_normal()
        params[name] = linear.init(keys[name], d_in, d_out, w_init=w_init)
    return params


def apply(
    params: dict, x: Float[ArrayLike, "batch d_in"], config: MLPConfig, *, key: PRNGKeyArray | None = None
) -> Float[Array, "batch n_classes"]:
    """Logits. With a `key`, dropout is applied after each hidden activation (training); without, none is."""
    check_keys(params, "models.mlp", required=config.layer_names)
    act = activations.get(config.activation)
    h = jnp.asarray(x)
    for i, name in enumerate(config.layer_names[:-1]):
        h = act(linear.apply(params[name], h))
        h = dropout.apply(h, rate=config.dropout, key=None if key is None else jax.random.fold_in(key, i))
    return linear.apply(params["head"], h)


def loss(
    params: dict,
    batch: tuple[Float[ArrayLike, "batch d_in"], Int[ArrayLike, " batch"]],
    config: MLPConfig,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, ""]:
    """Mean cross-entropy of the batch `(x, labels)`; dropout on when a key is given."""
    x, labels = batch
    return jnp.mean(losses.cross_entropy(apply(params, x, config, key=key), jnp.asarray(labels)))
