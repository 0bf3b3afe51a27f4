"""Layers as init/apply pairs over plain dicts. Each module is one layer: `linear.init(key, 3, 4)` builds its
params, `linear.apply(params, x)` runs it. Stateless functions (activations, dropout, pooling) have no init.
Every layer follows the contract in docs/design.md, section 2: `init(key, <sizes>, *, <options>)`,
`apply(params, x, [state], *, <options>, key=None, axis_name=None)`, initializers that are factories."""

from purejax.nn import (
    activations,
    attention,
    attention_cache,
    attention_masks,
    batch_norm,
    conv,
    conv_transpose,
    cross_attention,
    dropout,
    embedding,
    encoder_block,
    gated_mlp,
    group_norm,
    gru,
    initializers,
    instance_norm,
    layer_norm,
    linear,
    lstm,
    mlp,
    patch_embedding,
    pooling,
    recurrent,
    rms_norm,
    rotary,
    serial,
    stack,
    upsample,
)
from purejax.nn._check import check_dim, check_keys, check_shape  # the checks every layer makes, for models to reuse
