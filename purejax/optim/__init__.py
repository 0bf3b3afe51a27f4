"""purejax.optim: optimizers as pure gradient transformations, written out by hand.

Every optimizer is an `init(params) -> state` / `update(grads, state, params) -> (updates, state)` pair
(optax's convention, so the two libraries mix), built by `chain`ing small named parts:

    optimizer = chain(clip=clip_by_global_norm(1.0), adam=scale_by_adam(), lr=scale_by_learning_rate(3e-4))

Files, one idea each: `base` (the pair, chain, apply_updates), `sgd`, `adam`, `lion`, `rmsprop`, `adafactor`,
`shampoo` (with `matrix_roots`, its inverse p-th roots), `muon` (Newton-Schulz orthogonalised momentum),
`weight_decay` (decoupled decay and masks),
`learning_rate` (the rate in the state), `schedules`, `clipping`,
`accumulate` (micro-batches), `ema` (parameter averages), `loss_scale` (float16), `train_step` (all of it).
See docs/optim.md.
"""

from purejax.optim import schedules
from purejax.optim.accumulate import MultiStepsState, accumulate_gradients, multi_steps, split_micro_batches
from purejax.optim.adafactor import (
    Factored,
    FactoredRmsState,
    Unfactored,
    adafactor,
    scale_by_factored_rms,
    scale_by_param_block_rms,
)
from purejax.optim.adam import AdamState, adam, adamw, scale_by_adam
from purejax.optim.base import (
    EmptyState,
    GradientTransformation,
    Schedule,
    apply_updates,
    bias_correction,
    chain,
    extra_args_for,
    identity,
    safe_increment,
    stateless,
)
from purejax.optim.clipping import GlobalNormState, clip, clip_by_block_rms, clip_by_global_norm, clip_to_norm
from purejax.optim.ema import ParamEMA, ParamEMAState, ema_warmup, param_ema
from purejax.optim.learning_rate import (
    LearningRateState,
    ScheduleState,
    get_learning_rate,
    scale_by_learning_rate,
    set_learning_rate,
)
from purejax.optim.lion import LionState, lion, scale_by_lion
from purejax.optim.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoLossScale,
    StaticLossScale,
    all_finite,
    dynamic_loss_scale,
    static_loss_scale,
)
from purejax.optim.muon import MuonState, matrix_leaves, muon, newton_schulz, scale_by_muon
from purejax.optim.rmsprop import CenteredRmsState, RmsState, rmsprop, scale_by_rms
from purejax.optim.sgd import TraceState, sgd, trace
from purejax.optim.shampoo import Kronecker, ShampooState, scale_by_shampoo, shampoo
from purejax.optim.train_step import TrainState, init_train_state, train_step
from purejax.optim.weight_decay import add_decayed_weights, ndim_at_least, resolve_mask

__all__ = [
    "AdamState",
    "CenteredRmsState",
    "DynamicLossScale",
    "EmptyState",
    "Factored",
    "FactoredRmsState",
    "GlobalNormState",
    "GradientTransformation",
    "Kronecker",
    "LearningRateState",
    "LionState",
    "LossScale",
    "MultiStepsState",
    "MuonState",
    "NoLossScale",
    "ParamEMA",
    "ParamEMAState",
    "RmsState",
    "Schedule",
    "ScheduleState",
    "ShampooState",
    "StaticLossScale",
    "TraceState",
    "TrainState",
    "Unfactored",
    "accumulate_gradients",
    "adafactor",
    "adam",
    "adamw",
    "add_decayed_weights",
    "all_finite",
    "apply_updates",
    "bias_correction",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_to_norm",
    "dynamic_loss_scale",
    "ema_warmup",
    "extra_args_for",
    "get_learning_rate",
    "identity",
    "init_train_state",
    "lion",
    "matrix_leaves",
    "multi_steps",
    "muon",
    "ndim_at_least",
    "newton_schulz",
    "param_ema",
    "resolve_mask",
    "rmsprop",
    "safe_increment",
    "scale_by_adam",
    "scale_by_factored_rms",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_param_block_rms",
    "scale_by_rms",
    "scale_by_shampoo",
    "schedules",
    "set_learning_rate",
    "sgd",
    "shampoo",
    "split_micro_batches",
    "static_loss_scale",
    "stateless",
    "train_step",
    "trace",
]
