"""Layers as init/apply pairs over plain dicts. Each module is one layer: `linear.init(key, 3, 4)` builds its
params, `linear.apply(params, x)` runs it. Stateless functions (activations, dropout, pooling) have no init."""

from purejax.nn import (
    activations,
    attention,
    batch_norm,
    conv,
    dropout,
    embedding,
    initializers,
    layer_norm,
    linear,
    mlp,
    pooling,
    rms_norm,
    stack,
)
from purejax.nn._check import check_dim, check_keys  # the checks every layer makes, for models to reuse
