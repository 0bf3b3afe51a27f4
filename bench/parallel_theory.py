"""What each parallel mode should send over the wire, from the model's sizes alone: the Megatron / ZeRO /
ring-attention / pipeline figures that bench/parallel.py sets beside the collectives it counts in the compiled
programs. Elements per device in one training step (float32: 4 bytes each):

    DP     all-reduce      P + 2                           P params, 2 = the loss's sum and token count
    TP     all-reduce      4 L A + 2 A + 3 N + 2           A = batch x seq x d_model per device, N = batch x seq:
                                                           2 per block forward (g), 2 backward (f), the
                                                           vocab-parallel embedding (forward) and tied head
                                                           (backward), the cross-entropy's max, sum of exp and
                                                           label logit, the loss's two sums
    2D     all-reduce      both, with A and N per data group, and the params' local shards
    FSDP   all-gather      2 S_blocks + S_top              S: params split over data, gathered whole; blocks
                                                           twice (forward, recomputed backward)
           + with TP       + L A                           the recomputed block repeats its attention psum
           reduce-scatter  S / D                           each device keeps 1/D of the split gradients
           all-reduce      P - S + 2                       the replicated vectors' gradients
    SP     all-gather      (4 L + 2) A                     Megatron sequence parallelism (TP over T devices):
           reduce-scatter  (4 L + 2) A / T                 each of TP's activation all-reduces becomes an
                                                           all-gather of the whole sequence and a
                                                           reduce-scatter to this device's slice of it
           all-reduce      3 N + P_rep + 1 (+ DP's)        the cross-entropy's, the global norm's; P_rep: the
                                                           params outside the regions (LayerNorms, row-parallel
                                                           biases, wpe) saw a slice of the tokens: their
                                                           gradients summed over the model axis
    EP     all-to-all      4 L E C d                       every MLP a mixture of E experts split over data, C
                                                           slots each per device (the capacity): the slots to
                                                           the experts and back, forward and backward; 6 L
                                                           with FSDP (each block's forward recomputed)
           all-reduce      DP's (not the experts) + 2 L E + 1    the routing statistics: expert counts and
                                                           probabilities per layer, the token count once;
                                                           3 L E with FSDP (the recomputed counts)
           + with TP       each expert's MLP psums the (E, C, d) slots where the dense MLP psums A

Context parallelism (CP n on a 1 x n ring, DP x CP on a (dp, cp) mesh): the same full training step, the
batch in zig-zag ring order split over (data, context), `gpt_parallel.loss` under `MeshAxes.context`. With
t = seq / n tokens and B_d = batch / dp rows per device, d_kv = n_kv_head x head_dim:

    collective-permute  2 L (n-1) ops of 2 B_d t d_kv     ring attention: each layer's forward passes one
                                                           device's k and v block on n-1 times, and autodiff
                                                           sends their cotangents back n-1 times (remat off)
    all-reduce          P + 2                              every gradient summed over data and context, and
                                                           the loss's sum and count

Pipeline parallelism (PP S, `gpt_pipeline.sharded_loss_and_grads`: the loss and the gradients, no optimizer step;
the blocks split over S stages, the batch into M micro-batches, a schedule of T = 2 (M + S - 1) steps):

    collective-permute  2 T ops of (B / M) seq d_model    every step one activation sent forward and one
                                                           gradient back (idle steps send zeros: one program)
    all-reduce          1 op of P_shared + 1               wte, wpe and ln_f's gradients (every stage holds
                                                           them) and the loss, summed over the stages
"""

from functools import partial

import jax
import numpy as np

from models import gpt, gpt_moe
from purejax import parallel
from purejax import tree as tree_lib
from purejax.nn import moe


def theory(
    config: gpt.GPTConfig, specs, dp: int, tp: int, fsdp: bool, *, batch: int, sp: bool = False, ep: bool = False
) -> dict[str, int]:
    """The elements per device each collective of a training step on a (dp, tp) mesh should move, for params
    split as `specs` (`gpt_parallel.param_specs`) and a global batch of `batch` rows: the table above."""
    shapes = tree_lib.flatten(jax.eval_shape(partial(gpt.init, config=config), jax.random.key(0)))
    specs = dict(zip(shapes, jax.tree.leaves(specs)))
    sizes = {parallel.DATA: dp, parallel.MODEL: tp}
    local = {p: int(np.prod(parallel.local_shape(s.shape, specs[p], sizes))) for p, s in shapes.items()}
    n_tokens = batch // dp * config.block_size
    a = n_tokens * config.n_embd
    slots = 0  # a MoE layer's (E, C, d) slots
    experts = gpt_moe.n_experts(config)
    if experts:
        slots = (
            config.n_embd
            * config.n_experts
            * moe.capacity(n_tokens, config.n_experts, config.expert_top_k, config.capacity_factor or None)
        )
    # the global norm: one scalar psum per distinct set of axes the gradients are split over
    out = {
        "all-reduce": len({tuple(sorted(e for e in s if e)) for s in specs.values()} - {()}),
        "all-gather": 0,
        "reduce-scatter": 0,
        "all-to-all": 0,
    }
    if tp > 1:
        # per block, forward and backward, attention's psum and the MLP's (on the slots with experts)
        activations = config.n_layer * (2 * a + 2 * (slots if experts else a)) + 2 * a
        out["all-reduce"] += 3 * n_tokens + (0 if sp else activations)
        if sp:  # each all-reduce now a reduce-scatter and an all-gather; the params outside the regions see
            # a slice of the sequence: their gradients summed over the model axis
            out["all-gather"] += activations
            out["reduce-scatter"] += activations // tp
            out["all-reduce"] += sum(n for p, n in local.items() if parallel.MODEL not in specs[p])
    if dp > 1:
        replicated = sum(n for p, n in local.items() if parallel.DATA not in specs[p])
        own = {p for p in local if ep and ".experts." in p}  # the device's own experts: never gathered or summed
        split = {p: n * dp for p, n in local.items() if parallel.DATA in specs[p] and p not in own}  # FSDP
        out["all-reduce"] += replicated + 2
        blocks = sum(n for p, n in split.items() if p.startswith("blocks."))
        out["all-gather"] += 2 * blocks + sum(split.values()) - blocks
        out["reduce-scatter"] += sum(split.values()) // dp
        if fsdp and tp > 1:  # the backward pass recomputes each block: its attention all-reduce again
            out["all-reduce"] += config.n_layer * a
        if experts:  # the routing's expert counts and probabilities, and the token count (once); the
            # block recomputed under FSDP sums the counts again (the load-balancing loss's gradient needs them)
            out["all-reduce"] += config.n_layer * (3 if fsdp else 2) * config.n_experts + 1
        if ep:  # the slots to the experts and back, forward and backward (and the recomputed forward's, FSDP)
            out["all-to-all"] += (6 if fsdp else 4) * config.n_layer * slots
    return out


def context_theory(config: gpt.GPTConfig, n_params: int, batch: int, dp: int, cp: int) -> dict[str, tuple]:
    """{kind: (ops or None where XLA decides how many, elements per device)} of a context-parallel training step
    on a (dp, cp) mesh: the table above."""
    kv_width = config.attention.n_kv_head * (config.n_embd // config.n_head)
    kv_block = 2 * (batch // dp) * (config.block_size // cp) * kv_width  # one device's k and v
    permutes = 2 * config.n_layer * (cp - 1)
    return {"collective-permute": (permutes, permutes * kv_block), "all-reduce": (None, n_params + 2)}


def micro_batch_activation(config: gpt.GPTConfig, batch: int, n_micro: int) -> int:
    """The elements of one micro-batch's activations (batch / M, seq, d_model): what a pipeline stage sends."""
    return batch // n_micro * config.block_size * config.n_embd


def pipeline_theory(config: gpt.GPTConfig, n_shared: int, batch: int, n_micro: int, n_stages: int) -> dict:
    """{kind: (ops, elements per device)} of the pipelined loss and gradients: the table above; `n_shared`, the
    elements of the params every stage holds (all but the blocks)."""
    activation = micro_batch_activation(config, batch, n_micro)
    steps = 2 * (n_micro + n_stages - 1)
    return {"collective-permute": (2 * steps, 2 * steps * activation), "all-reduce": (1, n_shared + 1)}
