"""The Equinox peer of bench/gpt_train.py (`equinox`): an `eqx.Module` GPT that runs one sequence at a time
(vmapped over the batch, as Equinox layers act on one example), purejax's weights put in with `eqx.tree_at`,
optax's AdamW (`optax_adamw`) and `eqx.filter_jit` with everything but the batch donated.
"""

from functools import partial

import jax
import jax.numpy as jnp

from bench.gpt_train_recipe import causal_attention, optax_adamw, to_compute, xent
from bench.gpt_train_weights import layers_of, raw_weights


def equinox_model(weights, config):
    import equinox as eqx

    linear = partial(eqx.nn.Linear, use_bias=config.bias)
    layer_norm = partial(eqx.nn.LayerNorm, eps=1e-5, use_bias=config.bias)

    class Block(eqx.Module):
        ln_1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        attn_proj: eqx.nn.Linear
        ln_2: eqx.nn.LayerNorm
        fc: eqx.nn.Linear
        mlp_proj: eqx.nn.Linear
        n_head: int = eqx.field(static=True)

        def __init__(self, d, n_head, key):
            keys = jax.random.split(key, 4)
            self.n_head = n_head
            self.ln_1, self.ln_2 = layer_norm(d), layer_norm(d)
            self.qkv = linear(d, 3 * d, key=keys[0])
            self.attn_proj = linear(d, d, key=keys[1])
            self.fc = linear(d, 4 * d, key=keys[2])
            self.mlp_proj = linear(4 * d, d, key=keys[3])

        def __call__(self, x):  # one sequence (seq, d): Equinox layers act on one example
            t, d = x.shape
            qkv = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln_1)(x)), 3, -1)
            q, k, v = (a.reshape(t, self.n_head, d // self.n_head) for a in qkv)
            x = x + jax.vmap(self.attn_proj)(causal_attention(q, k, v).reshape(t, d))
            h = jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.ln_2)(x)), approximate=False)
            return x + jax.vmap(self.mlp_proj)(h)

    class GPT(eqx.Module):
        wte: eqx.nn.Embedding
        wpe: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm

        def __init__(self, c, key):
            keys = jax.random.split(key, c.n_layer + 2)
            self.wte = eqx.nn.Embedding(c.vocab_size, c.n_embd, key=keys[0])
            self.wpe = eqx.nn.Embedding(c.block_size, c.n_embd, key=keys[1])
            self.blocks = [Block(c.n_embd, c.n_head, k) for k in keys[2:]]
            self.ln_f = layer_norm(c.n_embd)

        def __call__(self, idx):  # one sequence of ids (seq,) -> logits (seq, vocab)
            x = self.wte.weight[idx] + self.wpe.weight[: idx.shape[0]]
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.ln_f)(x) @ self.wte.weight.T

    model = GPT(config, jax.random.key(0))
    r = raw_weights(weights, config, stacked=False)
    parts = {"weight": "w", "bias": "b"} if config.bias else {"weight": "w"}  # Equinox's names: ours (else None)

    def where(m):
        return (m.wte.weight, m.wpe.weight, *[getattr(module, a) for module, _ in layers_of(m, r) for a in parts])

    # Equinox's Linear weights are (out, in); .T leaves the 1-D LayerNorm weights and the biases as they are
    new = [r["wte"], r["wpe"], *[p[ours].T for _, p in layers_of(model, r) for ours in parts.values()]]
    return eqx.tree_at(where, model, [jnp.array(a) for a in new])


def make_equinox(weights, config, x, y, dtype="float32"):
    import equinox as eqx

    tx = optax_adamw()
    model = equinox_model(weights, config)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @partial(eqx.filter_jit, donate="all-except-first")
    def train_step(batch, model, opt_state):
        def loss_fn(model):  # in bfloat16: the model cast inside the loss, the gradients float32
            return xent(jax.vmap(to_compute(model, dtype))(batch[0]), batch[1])

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    batch = (jnp.asarray(x), jnp.asarray(y))

    def step():
        nonlocal model, opt_state
        model, opt_state, loss = train_step(batch, model, opt_state)
        return loss

    return step
