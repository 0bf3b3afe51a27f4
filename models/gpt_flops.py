"""What a GPT (models/gpt.py) costs: its parameters, its FLOPs per token and the model FLOPs utilisation of a
throughput, nanoGPT's `get_num_params` and `estimate_mfu`.

    gpt_flops.num_params(params)                       # non-embedding parameters, as nanoGPT counts
    gpt_flops.estimate_mfu(config, tokens_per_second, peak_flops)
"""

import jax

from models import gpt, gpt_moe
from models.gpt import GPTConfig, Params
from purejax import tree as tree_lib


def num_params(params: Params, non_embedding: bool = True) -> int:
    """Number of parameters. With `non_embedding`, the position embeddings are left out, as nanoGPT counts;
    the token embeddings stay in because they are also the output head's weights."""
    return tree_lib.count(params) - (tree_lib.count(params["wpe"]) if non_embedding else 0)


def flops_per_token(config: GPTConfig) -> int:
    """Forward plus backward FLOPs per token, nanoGPT's estimate (PaLM paper, appendix B): 6N for the matmuls
    with the N non-embedding parameters (a token's expert_top_k experts of n_experts, with experts), plus
    12 * n_layer * n_head * head_dim * block_size for attention."""
    shapes = jax.eval_shape(lambda: gpt.init(jax.random.key(0), config))
    n = num_params(shapes) - gpt_moe.idle_params(shapes, config)
    return 6 * n + 12 * config.n_layer * config.n_head * (config.n_embd // config.n_head) * config.block_size


def estimate_mfu(config: GPTConfig, tokens_per_second: float | int, peak_flops: float | int) -> float:
    """Model FLOPs utilisation: the FLOPs the model needs per second at this throughput, as a fraction of the
    hardware's `peak_flops` (nanoGPT compares with an A100's 312e12 bfloat16 FLOP/s)."""
    if peak_flops <= 0:
        raise ValueError(f"estimate_mfu: peak_flops must be positive, got {peak_flops}")
    return flops_per_token(config) * tokens_per_second / peak_flops
