"""The steps bench/gpt_anatomy.py compares, and how it times and reports them.

A `Setup` holds one config's model, initial weights and batch and builds any of bench/gpt_train.py's makers on
them. Beside purejax's step as it is: the same step with its matmuls in the 3-D form they had before the
investigation (`variant`, `traced_in`), with the layer scan unrolled, without donation, with AdamW as one fused
tree_map, and purejax's and NNX's forward and forward + backward alone. `medians` times named steps
interleaved; `table` prints a markdown table with the load average.
"""

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench import gpt_train_cases
from bench.gpt_train_nnx import nnx_model
from bench.gpt_train_purejax import make_purejax
from bench.gpt_train_recipe import TRAIN, xent
from bench.timing import interleaved_medians
from models import gpt
from purejax import optim
from purejax.precision import Policy
from train import gpt as train_gpt


@dataclasses.dataclass(frozen=True)
class Setup:
    """A config's model, the shared initial weights (purejax's layout, numpy) and the batch."""

    name: str
    case: gpt_train_cases.Case
    weights: dict
    x: np.ndarray
    y: np.ndarray

    @classmethod
    def make(cls, name: str) -> "Setup":
        """The setup of a gpt_train case by label: "baby", or "baby-bias" for the same model with biases."""
        base = name.removesuffix(gpt_train_cases.BIAS_SUFFIX)
        case = gpt_train_cases.cases([base], "true" if base != name else "false")[name]
        config = case.model
        weights = jax.tree.map(np.asarray, gpt.init(jax.random.key(0), config))
        data = np.random.default_rng(0).integers(0, config.vocab_size, (case.batch, config.block_size + 1), np.int32)
        return cls(name, case, weights, data[:, :-1], data[:, 1:])

    def build(self, make, **config_changes):
        """`make(weights, config, x, y)` as bench/gpt_train.py's makers take them, with the config changed."""
        return make(self.weights, dataclasses.replace(self.case.model, **config_changes), self.x, self.y)


def _linear_3d(params, x, *, axis_name=None):
    """purejax.nn.linear.apply as it was before this investigation: `x @ w` on the 3-D activations.

    Same maths as today's `matmul_rows` form (purejax/nn/_matmul.py). Why it mattered: differentiating `x @ w`
    for a 3-D x, JAX writes the weight gradient as dot_general(g, x) contracting (batch, seq), then a
    transpose; XLA:CPU folds that transpose into the producer of g (the GELU or residual backward fusion),
    which then writes its whole output transposed, a strided store that runs 10-50x slower than the same
    fusion written in order. Kept here as the "before" of the comparison."""
    assert axis_name is None, "the comparison covers the single-device model"
    y = x @ params["w"]
    return y + params["b"] if "b" in params else y


def _attend_3d(params, x):
    """purejax.nn.embedding.attend (the tied head) as it was before: `x @ table.T` on the 3-D activations."""
    return x @ params["w"].T


class variant:
    """Within this context, purejax's linear layers and tied head use the 3-D form they had before this
    investigation (`matmuls_3d`), and `purejax.nn.stack.scan` gets a `lax.scan` unroll (`unroll`). Only
    tracing sees the change: a step traced inside keeps it when it runs outside (`traced_in`)."""

    def __init__(self, matmuls_3d: bool = False, unroll: int | bool = 1):
        self.matmuls_3d, self.unroll = matmuls_3d, unroll

    def __enter__(self):
        from purejax.nn import embedding, linear, stack

        self.saved = linear.apply, embedding.attend, stack.scan
        if self.matmuls_3d:
            linear.apply, embedding.attend = _linear_3d, _attend_3d
        stack.scan = partial(stack.scan, unroll=self.unroll)

    def __exit__(self, *exc):
        from purejax.nn import embedding, linear, stack

        linear.apply, embedding.attend, stack.scan = self.saved


def traced_in(step, **changes):
    """`step` whose first call (the one that traces and compiles it) runs inside `variant(**changes)`; later
    calls reuse that compilation."""
    traced = False

    def traced_step():
        nonlocal traced
        if traced:
            return step()
        traced = True
        with variant(**changes):
            return step()

    return traced_step


def make_purejax_3d(weights, config, x, y, unroll: int | bool = 1):
    """gpt_train's purejax step with the matmuls in their former 3-D form."""
    return traced_in(make_purejax(weights, config, x, y), matmuls_3d=True, unroll=unroll)


def make_purejax_unrolled(weights, config, x, y):
    """gpt_train's purejax step with the layer scan fully unrolled."""
    return traced_in(make_purejax(weights, config, x, y), unroll=True)


def fused_adamw(cfg: train_gpt.GPTSettings) -> optim.GradientTransformation:
    """train/gpt.py's AdamW (warmup-cosine rate, decay on `train_gpt.decays`) written as ONE tree_map over
    (grad, mu, nu, param) instead of the chain adam -> weight decay -> learning rate: the comparison for
    "does chaining transforms cost anything once XLA has fused the step?"."""
    from purejax.optim.weight_decay import resolve_mask

    schedule = optim.schedules.warmup_cosine(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr)
    b1, b2, eps, wd = cfg.beta1, cfg.beta2, 1e-8, cfg.weight_decay

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": jax.tree.map(jnp.zeros_like, params)}

    def update(grads, state, params):
        count = state["count"] + 1
        lr = schedule(state["count"])
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)

        def leaf(g, m, v, p, decay):
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * jnp.square(g)
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            return -lr * (u + wd * p if decay else u), m, v

        out = jax.tree.map(leaf, grads, state["mu"], state["nu"], params, resolve_mask(train_gpt.decays, params))
        pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=lambda t: isinstance(t, tuple))  # noqa: E731
        return pick(0), {"count": count, "mu": pick(1), "nu": pick(2)}

    return optim.GradientTransformation(init, update)


def make_purejax_variant(weights, config, x, y, *, donate=True, optimizer="chain"):
    """make_purejax with the donation and the optimizer's form as parameters."""
    tx = train_gpt.make_optimizer(TRAIN) if optimizer == "chain" else fused_adamw(TRAIN)
    return make_purejax(weights, config, x, y, optimizer=tx, donate=donate)


def make_purejax_part(weights, config, x, y, *, part):
    """purejax's loss alone ("fwd") or its gradient ("fwd+bwd"), jitted as train_step takes them."""
    loss_fn = train_gpt.make_loss_fn(config, Policy(jnp.float32, "float32", jnp.float32))
    params, batch, key = jax.tree.map(jnp.array, weights), (jnp.asarray(x), jnp.asarray(y)), jax.random.key(0)
    fn = (lambda p: loss_fn(p, batch, key)[0]) if part == "fwd" else jax.grad(lambda p: loss_fn(p, batch, key)[0])
    fn = jax.jit(fn)
    return lambda: fn(params)


def make_nnx_part(weights, config, x, y, *, part):
    """The NNX peer's loss alone or its gradient, split once and merged inside jax.jit (as `nnx-split`)."""
    from flax import nnx

    graphdef, state = nnx.split(nnx_model(weights, config))
    x, y = jnp.asarray(x), jnp.asarray(y)

    def loss(state):
        return xent(nnx.merge(graphdef, state)(x), y)

    fn = jax.jit(loss if part == "fwd" else jax.grad(loss))
    return lambda: fn(state)


def table(header, rows) -> None:
    """`rows` under `header` as a markdown table, then the load average: the timings share the machine."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(f"(load average {os.getloadavg()[0]:.1f})", flush=True)


def medians(steps: dict, setup: Setup, repeats: int | None = None) -> dict[str, float]:
    """Interleaved median ms per step of each named step function, gpt_train's sampling for the config."""
    case = setup.case
    iters = None if case.sample_seconds else 1  # small: one step per sample
    seconds = interleaved_medians(
        list(steps.values()), (), repeats or case.repeats + 2, iters=iters, sample_seconds=case.sample_seconds or 0.05
    )
    return {name: s * 1e3 for name, s in zip(steps, seconds)}
