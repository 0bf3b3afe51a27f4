"""The same starting point for every contender of bench/gpt_train.py: purejax's initial weights, perturbed so that
a peer that dropped a bias or a LayerNorm scale would not agree, and those weights in the layout the peers copy
into their own modules (`raw_weights`, `layers_of`).
"""

import jax
import numpy as np

from models import gpt, gpt_hf

PERTURBATION = {"scale": 0.1, "bias": 0.5, "b": 0.5}  # std of the noise on LayerNorm scales and biases, linear biases


def initial_weights(config):
    """purejax's `gpt.init` (key 0) as numpy, with every LayerNorm scale and bias and every linear bias moved off
    its initial 1 or 0 by normal noise (`PERTURBATION`'s std) from a fixed rng: at 1 and 0 a peer that dropped a
    bias or a LayerNorm scale would report the same loss as the others; moved, it is 2e-4 to 2e-3 away in
    float32 (relative; the check is at 1e-5: tests/bench/test_bench_gpt_train.py), while the initial loss stays
    as near ln(vocab) as before (bench/gpt_train.py's `run_case` checks it)."""
    weights = jax.tree.map(np.asarray, gpt.init(jax.random.key(0), config))
    rng = np.random.default_rng(1)

    def perturb(path, a):
        std = PERTURBATION.get(path[-1].key)
        return a if std is None else a + rng.normal(0.0, std, a.shape).astype(a.dtype)

    return jax.tree_util.tree_map_with_path(perturb, weights)


LAYERS = ("ln_1", "qkv", "attn_proj", "ln_2", "fc", "mlp_proj")  # a block's LayerNorms and linears, in order


def as_weight_bias(params):
    """purejax's LayerNorm {"scale"[, "bias"]} or linear {"w"[, "b"]} as {"w"[, "b"]}: the weight and the
    optional bias that every peer's LayerNorm and Linear modules hold."""
    names = {"scale": "w", "bias": "b"}
    return {names.get(k, k): v for k, v in params.items()}


def raw_weights(weights, config, stacked: bool):
    """purejax's layout -> {"wte", "wpe", "ln_f", "blocks"}: every LayerNorm and linear a {"w"[, "b"]} dict
    (`as_weight_bias`; a "b" when config.bias), the blocks a list of per-layer dicts {"ln_1", "qkv", ...}
    (`LAYERS`), or (stacked) one such dict over a leading layer axis. The fused qkv columns, weight and bias, go
    from purejax's per-head grouped order to nanoGPT's [q | k | v], which every peer splits in three (the same
    conversion as for Hugging Face files)."""
    b = weights["blocks"]
    qkv = {k: gpt_hf.QKV.to_theirs(np.asarray(v), config)[0] for k, v in b["attn"]["qkv"].items()}
    ours = {
        "ln_1": b["ln_1"],
        "qkv": qkv,
        "attn_proj": b["attn"]["proj"],
        "ln_2": b["ln_2"],
        "fc": b["mlp"]["fc"],
        "mlp_proj": b["mlp"]["proj"],
    }
    blocks = {name: as_weight_bias(ours[name]) for name in LAYERS}
    if not stacked:
        blocks = [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(config.n_layer)]
    return {
        "wte": weights["wte"]["w"],
        "wpe": weights["wpe"]["w"],
        "ln_f": as_weight_bias(weights["ln_f"]),
        "blocks": blocks,
    }


def layers_of(model, raw):
    """(module, its raw params {"w"[, "b"]}) for the final LayerNorm and every block's LayerNorms and linears: the
    peers' modules carry the raw params' names (`model.ln_f`, `model.blocks[i].qkv`, ...), so one walk serves
    every framework's weight copy."""
    pairs = [(model.ln_f, raw["ln_f"])]
    for block, p in zip(model.blocks, raw["blocks"], strict=True):
        pairs += [(getattr(block, name), p[name]) for name in LAYERS]
    return pairs
