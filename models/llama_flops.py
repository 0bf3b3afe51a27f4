"""What a Llama (models/llama.py) costs: its parameters and its FLOPs per token, as models/gpt_flops.py counts
a GPT's.

    llama_flops.num_params(params)      # without the input embedding, unless it is also the head
    llama_flops.flops_per_token(config)
"""

import functools

import jax

from models import llama
from models.llama import LlamaConfig, Params
from purejax import tree as tree_lib


def num_params(params: Params, non_embedding: bool = True) -> int:
    """Number of parameters; with `non_embedding`, without the input embedding unless it is also the head
    (tied, Llama 3.2's small models): a lookup costs no FLOPs, a head does."""
    untied_embed = non_embedding and "head" in params
    return tree_lib.count(params) - (tree_lib.count(params["embed"]) if untied_embed else 0)


def flops_per_token(config: LlamaConfig) -> int:
    """Forward plus backward FLOPs per token at the longest context, the GPT's estimate (PaLM paper, appendix
    B): 6N for the matmuls with the N non-embedding parameters, plus 12 * n_layer * n_head * head_dim *
    max_seq_len for attention."""
    shapes = jax.eval_shape(functools.partial(llama.init, config=config), jax.random.key(0))
    attention = 12 * config.n_layer * config.n_head * config.head_dim * config.max_seq_len
    return 6 * num_params(shapes) + attention
