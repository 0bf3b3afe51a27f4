"""bench/gpt_train.py's GPT written in dm-haiku (`haiku` peer): the same maths, weights and optimizer.

Modules are created inside one `hk.transform`ed function with chosen names (`h0_qkv`, `h0_ln_1`, ...), so the
params are a flat dict that purejax's weights copy into directly (with `config.bias`, the Linears' "b" and the
LayerNorms' "offset" too); the blocks run as a Python loop, as the NNX
and Equinox peers run theirs. The step is one `jax.jit` of value_and_grad + optax (the
same `optax_adamw` as the NNX and Equinox peers), params and optimizer state donated. In bfloat16 the params
are cast to the compute dtype inside the loss and the gradients come back float32 (purejax's `with_policy`).
"""

from functools import partial

import jax
import jax.numpy as jnp
import optax

from bench.gpt_train_recipe import causal_attention, optax_adamw, to_compute, xent
from bench.gpt_train_weights import raw_weights


def forward(idx, config):
    """Logits (batch, seq, vocab) of token ids (batch, seq); called inside `hk.transform`."""
    import haiku as hk

    def layer_norm(name, x):  # statistics in float32 whatever the compute dtype, as every peer's
        norm = hk.LayerNorm(axis=-1, create_scale=True, create_offset=config.bias, eps=1e-5, name=name)
        return norm(x.astype(jnp.float32)).astype(x.dtype)

    def linear(name, width, x):
        return hk.Linear(width, with_bias=config.bias, name=name)(x)

    b, t = idx.shape
    d, n_head = config.n_embd, config.n_head
    wte = hk.Embed(config.vocab_size, config.n_embd, name="wte")
    x = wte(idx) + hk.Embed(config.block_size, config.n_embd, name="wpe")(jnp.arange(t))
    heads = lambda a: a.reshape(b, t, n_head, d // n_head)  # noqa: E731
    for i in range(config.n_layer):
        q, k, v = jnp.split(linear(f"h{i}_qkv", 3 * d, layer_norm(f"h{i}_ln_1", x)), 3, axis=-1)
        x = x + linear(f"h{i}_attn_proj", d, causal_attention(heads(q), heads(k), heads(v)).reshape(b, t, d))
        h = jax.nn.gelu(linear(f"h{i}_fc", 4 * d, layer_norm(f"h{i}_ln_2", x)), approximate=False)
        x = x + linear(f"h{i}_mlp_proj", d, h)
    return layer_norm("ln_f", x) @ wte.embeddings.T.astype(x.dtype)  # the tied head


def haiku_params(weights, config):
    """purejax's weights in the Haiku params' names: {"wte": {"embeddings"}, "h0_qkv": {"w"[, "b"]},
    "h0_ln_1": {"scale"[, "offset"]}, ...}."""
    r = raw_weights(weights, config, stacked=False)
    norm = lambda p: {"scale": p["w"]} | ({"offset": p["b"]} if "b" in p else {})  # noqa: E731
    params = {"wte": {"embeddings": r["wte"]}, "wpe": {"embeddings": r["wpe"]}, "ln_f": norm(r["ln_f"])}
    for i, p in enumerate(r["blocks"]):
        params |= {f"h{i}_{name}": norm(p[name]) for name in ("ln_1", "ln_2")}
        params |= {f"h{i}_{name}": p[name] for name in ("qkv", "attn_proj", "fc", "mlp_proj")}  # Haiku's {"w", "b"}
    return jax.tree.map(jnp.array, params)


def make_haiku(weights, config, x, y, dtype="float32"):
    """The `haiku` peer's step, built as bench/gpt_train.py's makers are: purejax's weights copied into the
    transformed model's params (their shapes checked against the model's own), one jitted step returning the loss."""
    import haiku as hk

    model = hk.without_apply_rng(hk.transform(partial(forward, config=config)))
    x, y = jnp.asarray(x), jnp.asarray(y)
    params = haiku_params(weights, config)
    expected = jax.tree.map(jnp.shape, jax.eval_shape(model.init, jax.random.key(0), x))
    if jax.tree.map(jnp.shape, params) != expected:  # the copied weights must be exactly the modules' params
        raise ValueError(f"haiku params {jax.tree.map(jnp.shape, params)} are not the model's {expected}")
    tx = optax_adamw()

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        loss_fn = lambda p: xent(model.apply(to_compute(p, dtype), x), y)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)

    def step():
        nonlocal params, opt_state
        params, opt_state, loss = train_step(params, opt_state, x, y)
        return loss

    return step
