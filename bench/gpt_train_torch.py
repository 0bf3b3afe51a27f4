"""The PyTorch peers of bench/gpt_train.py (`torch`, `torch-compile`): nanoGPT's model and train.py loop body in
eager PyTorch, optionally with the model under `torch.compile`, on the GPU when JAX runs on one.
"""

from functools import partial

import jax
import numpy as np

from bench.gpt_train_recipe import GRAD_CLIP, TRAIN, nanogpt_lr
from bench.gpt_train_weights import layers_of, raw_weights


def torch_model(weights, config):
    import torch
    import torch.nn.functional as F
    from torch import nn

    linear, layer_norm = partial(nn.Linear, bias=config.bias), partial(nn.LayerNorm, bias=config.bias)

    class Block(nn.Module):
        def __init__(self, d, n_head):
            super().__init__()
            self.n_head = n_head
            self.ln_1, self.ln_2 = layer_norm(d), layer_norm(d)
            self.qkv, self.attn_proj = linear(d, 3 * d), linear(d, d)
            self.fc, self.mlp_proj = linear(d, 4 * d), linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            qkv = self.qkv(self.ln_1(x)).split(d, 2)
            q, k, v = (a.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for a in qkv)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
            self.blocks = nn.ModuleList([Block(c.n_embd, c.n_head) for _ in range(c.n_layer)])
            self.ln_f = layer_norm(c.n_embd)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied head
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    model = GPT(config)
    r = raw_weights(weights, config, stacked=False)
    with torch.no_grad():
        model.wte.weight.copy_(torch.from_numpy(np.array(r["wte"])))
        model.wpe.weight.copy_(torch.from_numpy(np.array(r["wpe"])))
        for module, p in layers_of(model, r):
            module.weight.copy_(torch.from_numpy(np.array(p["w"].T)))  # torch's Linear is (out, in)
            if "b" in p:
                module.bias.copy_(torch.from_numpy(np.array(p["b"])))
    return model


def make_torch(weights, config, x, y, compile=False, dtype="float32"):
    """nanoGPT's train.py loop body: set the lr, loss.backward(), clip_grad_norm_, AdamW step. On the GPU when
    JAX runs on one (then each step ends with a synchronize, so the timer sees the GPU's work), with nanoGPT's
    GPU settings: fused AdamW, and bfloat16 under torch.autocast when `dtype` is bfloat16."""
    import contextlib

    import torch

    torch.set_num_threads(2)
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("JAX runs on a GPU but this torch has no CUDA: install a CUDA build of torch")
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    model = torch_model(weights, config).to(device)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": TRAIN.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=TRAIN.learning_rate, betas=(TRAIN.beta1, TRAIN.beta2), fused=device == "cuda")
    forward = torch.compile(model) if compile else model
    x, y = (torch.from_numpy(np.asarray(a, np.int64)).to(device) for a in (x, y))

    def autocast():
        return torch.autocast(device, dtype=getattr(torch, dtype)) if dtype != "float32" else contextlib.nullcontext()

    it = 0

    def step():
        nonlocal it
        for group in opt.param_groups:
            group["lr"] = float(nanogpt_lr(it))
        with autocast():
            loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        if device == "cuda":
            torch.cuda.synchronize()
        return loss.detach()

    return step
