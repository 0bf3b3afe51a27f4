"""Does writing the optimizer by hand cost anything? One AdamW update with gradient clipping on a GPT-2-small
params tree (124,439,808 float32 parameters), purejax against optax, in one run.

    python -m bench.optim [--repeats 15]

Both sides: clip the gradients to global norm 1.0, then AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on
the weight matrices and embeddings only, nanoGPT's settings), then add the updates to the params. Each step is
jitted with the params and the optimizer state donated (updated in place, as a training loop does), and timed
interleaved (A, B, B, A, ...) so machine noise hits both alike; the table gives the medians and their ratio.
A second pair without the clipping is the control: the same algorithm written two ways.

Memory: the optimizer state's size in parameter-sized buffers (AdamW needs its two moments, nothing more), and
XLA's compiled memory analysis of each step: the temporary buffers it allocates beyond its arguments and
outputs, in MB and in parameter-sized buffers. Each pair's parameters are compared after the timed steps.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from purejax import optim
from purejax import tree as tree_lib

# GPT-2 small as models/gpt.py lays it out: the 12 blocks' leaves stacked on a leading layer axis, the output
# head tied to wte. Vocabulary 50257 (GPT-2's own, unpadded) makes the famous 124M.
N_LAYER, D, VOCAB, BLOCK_SIZE = 12, 768, 50257, 1024
SHAPES = {
    "wte": {"w": (VOCAB, D)},
    "wpe": {"w": (BLOCK_SIZE, D)},
    "blocks": {
        "ln_1": {"scale": (N_LAYER, D), "bias": (N_LAYER, D)},
        "attn": {
            "qkv": {"w": (N_LAYER, D, 3 * D), "b": (N_LAYER, 3 * D)},
            "proj": {"w": (N_LAYER, D, D), "b": (N_LAYER, D)},
        },
        "ln_2": {"scale": (N_LAYER, D), "bias": (N_LAYER, D)},
        "mlp": {
            "fc": {"w": (N_LAYER, D, 4 * D), "b": (N_LAYER, 4 * D)},
            "proj": {"w": (N_LAYER, 4 * D, D), "b": (N_LAYER, D)},
        },
    },
    "ln_f": {"scale": (D,), "bias": (D,)},
}


def is_matrix(path: str, leaf) -> bool:
    """nanoGPT decays 2-d weights and embeddings, not biases or LayerNorm gains; here blocks carry a layer axis."""
    return leaf.ndim - path.startswith("blocks.") >= 2


def make_tree(seed: int, scale: float):
    leaves, treedef = jax.tree_util.tree_flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    make = jax.jit(lambda k, shape: scale * jax.random.normal(k, shape), static_argnums=1)
    return jax.tree_util.tree_unflatten(treedef, [make(k, s) for k, s in zip(keys, leaves)])


def purejax_optimizer(clip: bool):
    adamw = optim.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1, mask=is_matrix)
    return optim.chain(clip=optim.clip_by_global_norm(1.0), adamw=adamw) if clip else adamw


def optax_optimizer(clip: bool, params):
    mask = tree_lib.unflatten_like(params, {p: is_matrix(p, x) for p, x in tree_lib.flatten(params).items()})
    adamw = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1, mask=mask)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw) if clip else adamw


def compiled_step(optimizer, apply_updates, params, state, grads):
    def step(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()


def measure(clip: bool, grads, repeats: int) -> dict[str, dict]:
    """Both sides of one configuration: median step time, state and temporary bytes, final params."""
    sides = {}
    for name, optimizer, apply_updates in (
        ("purejax", purejax_optimizer(clip), optim.apply_updates),
        ("optax", optax_optimizer(clip, grads), optax.apply_updates),
    ):
        params = make_tree(0, 0.02)
        state = jax.jit(optimizer.init)(params)
        step = compiled_step(optimizer, apply_updates, params, state, grads)
        sides[name] = {
            "step": step,
            "params": params,
            "state": state,
            "times": [],
            "temp_bytes": step.memory_analysis().temp_size_in_bytes,  # buffers beyond the arguments and outputs
            "state_bytes": tree_lib.nbytes(state),
        }
    order = list(sides.values())
    for round_ in range(repeats + 1):  # round 0 warms up and is dropped; the order alternates
        for side in order if round_ % 2 else order[::-1]:
            start = time.perf_counter()
            side["params"], side["state"] = side["step"](side["params"], side["state"], grads)
            jax.block_until_ready(side["params"])
            side["times"].append(time.perf_counter() - start)
    for side in sides.values():
        side["ms"] = 1e3 * statistics.median(side["times"][1:])
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per optimizer (median reported)")
    args = parser.parse_args()

    grads = make_tree(1, 1e-3)
    param_bytes = tree_lib.nbytes(grads)
    device = jax.devices()[0]
    print(
        f"GPT-2 small ({tree_lib.count(grads):,} float32 params, {param_bytes / 1e6:.0f} MB), {device.platform} "
        f"({device.device_kind}), jax {jax.__version__}, optax {optax.__version__}, median of {args.repeats} "
        "donated jitted steps\n"
    )
    print("| step | optimizer | median ms | ratio to optax | state (param-sized) | step temporaries MB (param-sized) |")
    print("|---|---|---|---|---|---|")
    differences = {}
    for clip, label in ((True, "AdamW + clip_by_global_norm"), (False, "AdamW (control)")):
        sides = measure(clip, grads, args.repeats)
        for name, side in sides.items():
            state, temp = side["state_bytes"] / param_bytes, side["temp_bytes"]
            ratio = side["ms"] / sides["optax"]["ms"]
            cells = [
                label,
                name,
                f"{side['ms']:.1f}",
                f"{ratio:.3f}",
                f"{state:.2f}",
                f"{temp / 1e6:.1f} ({temp / param_bytes:.2f})",
            ]
            print("| " + " | ".join(cells) + " |")
        ours, theirs = (jax.tree_util.tree_leaves(sides[name]["params"]) for name in ("purejax", "optax"))
        differences[label] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(ours, theirs))
        del sides
    for label, difference in differences.items():
        print(
            f"\n{label}: largest relative difference of the two sides' params after {args.repeats + 1} steps: "
            f"{difference:.1e}"
        )
        np.testing.assert_array_less(difference, 1e-5)


if __name__ == "__main__":
    main()
