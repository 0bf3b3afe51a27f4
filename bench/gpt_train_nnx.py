"""The Flax NNX peers of bench/gpt_train.py (`nnx`, `nnx-tree`, `nnx-split`): one NNX GPT holding purejax's
weights, trained with optax (`optax_adamw`) under `nnx.jit` in graph mode, in tree mode (`graph=False`), or
split once into a graph definition and a state that a functional `jax.jit` step merges inside.
"""

from functools import partial

import jax
import jax.numpy as jnp

from bench.gpt_train_recipe import causal_attention, optax_adamw, xent
from bench.gpt_train_weights import layers_of, raw_weights


def nnx_model(weights, config, dtype="float32"):
    """Flax NNX modules computing in `dtype` with float32 params (flax's `dtype` and `param_dtype`)."""
    from flax import nnx

    kw = {"dtype": jnp.dtype(dtype), "param_dtype": jnp.float32}
    linear = partial(nnx.Linear, use_bias=config.bias, **kw)
    layer_norm = partial(nnx.LayerNorm, epsilon=1e-5, use_bias=config.bias, **kw)

    class Block(nnx.Module):
        def __init__(self, d, n_head, rngs):
            self.n_head = n_head
            self.ln_1 = layer_norm(d, rngs=rngs)
            self.qkv = linear(d, 3 * d, rngs=rngs)
            self.attn_proj = linear(d, d, rngs=rngs)
            self.ln_2 = layer_norm(d, rngs=rngs)
            self.fc = linear(d, 4 * d, rngs=rngs)
            self.mlp_proj = linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            b, t, d = x.shape
            q, k, v = (a.reshape(b, t, self.n_head, d // self.n_head) for a in jnp.split(self.qkv(self.ln_1(x)), 3, -1))
            x = x + self.attn_proj(causal_attention(q, k, v).reshape(b, t, d))
            return x + self.mlp_proj(jax.nn.gelu(self.fc(self.ln_2(x)), approximate=False))

    class GPT(nnx.Module):
        def __init__(self, c, rngs):
            self.wte = nnx.Embed(c.vocab_size, c.n_embd, rngs=rngs, **kw)
            self.wpe = nnx.Embed(c.block_size, c.n_embd, rngs=rngs, **kw)
            self.blocks = nnx.List([Block(c.n_embd, c.n_head, rngs) for _ in range(c.n_layer)])
            self.ln_f = layer_norm(c.n_embd, rngs=rngs)

        def __call__(self, idx):
            x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.wte.attend(self.ln_f(x))

    model = GPT(config, nnx.Rngs(0))
    r = raw_weights(weights, config, stacked=False)
    model.wte.embedding[...], model.wpe.embedding[...] = jnp.array(r["wte"]), jnp.array(r["wpe"])
    for module, p in layers_of(model, r):
        weight = module.scale if isinstance(module, nnx.LayerNorm) else module.kernel  # kernels (in, out), as ours
        weight[...] = jnp.array(p["w"])
        if "b" in p:
            module.bias[...] = jnp.array(p["b"])
    return model


def make_nnx(weights, config, x, y, mode="graph", dtype="float32"):
    """mode "graph": nnx.jit; "tree": nnx.jit(graph=False); "split": nnx.split once, jax.jit + nnx.merge."""
    from flax import nnx

    graph = mode != "tree"
    model = nnx_model(weights, config, dtype)
    optimizer = nnx.Optimizer(model, optax_adamw(), wrt=nnx.Param)
    x, y = jnp.asarray(x), jnp.asarray(y)

    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: xent(m(x), y), graph=graph)(model)
        optimizer.update(model, grads)
        return loss

    if mode == "split":
        graphdef, state = nnx.split((model, optimizer))

        @partial(jax.jit, donate_argnums=0)
        def split_step(state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss = train_step(model, optimizer, x, y)
            return nnx.state((model, optimizer)), loss

        def step():
            nonlocal state
            state, loss = split_step(state, x, y)
            return loss

        return step
    jitted = nnx.jit(train_step, graph=graph)
    return lambda: jitted(model, optimizer, x, y)
