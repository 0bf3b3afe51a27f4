"""An independent float64 numpy Llama, the reference the tests hold models/llama.py (and its Hugging Face
import) to. It follows Hugging Face's modeling_llama step by step rather than purejax's code: separate q, k, v
heads cut out of the grouped qkv columns one by one, rotary by `rotate_half` on a cos/sin table, grouped-query
attention by repeating each key/value head (`repeat_kv`), a -inf causal mask, SwiGLU, RMSNorm.

    logits = forward(params, idx, config)                 # (batch, seq, vocab), float64
    tokens = greedy(params, prompt, config, n_new)        # arg-max decoding over the full forward

`params` are purejax's (any arrays; converted to float64), `config` a `LlamaConfig`.
"""

import math

import numpy as np


def inverse_frequencies(head_dim, theta, scaling):
    """theta^(-2i / head_dim), then the scaling written as Meta's Llama 3.1 `apply_scaling` loop."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    if not hasattr(scaling, "low_freq_factor"):  # linear: positions / factor
        return inv_freq / scaling.factor
    old = scaling.original_max_seq_len
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / scaling.factor)
        else:
            smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
            out.append((1 - smooth) * freq / scaling.factor + smooth * freq)
    return np.array(out)


def rotate(x, positions, inv_freq):
    """Hugging Face's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, x (batch, heads, seq, head_dim)."""
    freqs = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # (seq, head_dim)
    half = x.shape[-1] // 2
    rotate_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def split_qkv(w, config):
    """The grouped qkv columns ([q_0 .. q_{g-1} k_0 v_0 | ...] per key/value head) as separate q (d, n_head,
    hd), k and v (d, n_kv_head, hd) weights, cut out head by head."""
    hd, g = config.head_dim, config.n_head // config.n_kv_head
    q, k, v = [], [], []
    for j in range(config.n_kv_head):
        base = j * (g + 2) * hd
        q += [w[:, base + i * hd : base + (i + 1) * hd] for i in range(g)]
        k.append(w[:, base + g * hd : base + (g + 1) * hd])
        v.append(w[:, base + (g + 1) * hd : base + (g + 2) * hd])
    return np.stack(q, 1), np.stack(k, 1), np.stack(v, 1)


def attention(p, x, positions, config):
    batch, seq, _ = x.shape
    wq, wk, wv = split_qkv(p["qkv"]["w"], config)
    q, k, v = (np.einsum("bsd,dhe->bhse", x, w) for w in (wq, wk, wv))
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    q, k = rotate(q, positions, inv_freq), rotate(k, positions, inv_freq)
    group = config.n_head // config.n_kv_head
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # repeat_kv: query head h reads h // group
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(config.head_dim)
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
    return out @ p["proj"]["w"]


def swiglu(p, x):
    gate = x @ p["gate"]["w"]
    return (gate / (1 + np.exp(-gate)) * (x @ p["up"]["w"])) @ p["down"]["w"]


def forward(params, idx, config, positions=None):
    """Logits (batch, seq, vocab) in float64 for token ids `idx` at `positions` (default arange(seq))."""
    params = _float64(params)
    idx = np.asarray(idx)
    positions = np.arange(idx.shape[1]) if positions is None else np.asarray(positions)
    x = params["embed"]["w"][idx]
    for i in range(config.n_layer):
        p = _layer(params["blocks"], i)
        x = x + attention(p["attn"], rms_norm(x, p["attn_norm"]["scale"], config.norm_eps), positions, config)
        x = x + swiglu(p["mlp"], rms_norm(x, p["mlp_norm"]["scale"], config.norm_eps))
    h = rms_norm(x, params["norm"]["scale"], config.norm_eps)
    return h @ (params["embed"]["w"].T if config.tie_embeddings else params["head"]["w"])


def greedy(params, prompt, config, n_new):
    """The prompt followed by `n_new` arg-max tokens, recomputing the full forward for each."""
    tokens = np.asarray(prompt)
    for _ in range(n_new):
        tokens = np.concatenate([tokens, forward(params, tokens, config)[:, -1].argmax(-1)[:, None]], axis=1)
    return tokens


def _float64(tree):
    if isinstance(tree, dict):
        return {k: _float64(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)


def _layer(blocks, i):
    return {k: _layer(v, i) for k, v in blocks.items()} if isinstance(blocks, dict) else blocks[i]
