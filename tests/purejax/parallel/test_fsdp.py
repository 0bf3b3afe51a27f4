"""purejax.parallel.fsdp: which dimension each param is split on, and the collectives of a compiled FSDP
gradient (8 simulated devices, parallel_child.py): params gathered twice (forward, and again for the
backward pass), gradients reduce-scattered once."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from purejax import parallel

B, T, D = 8, 16, 32  # parallel_child.py's batch, block and width


def test_fsdp_specs_split_matrices_on_their_first_free_divisible_dimension():
    shapes = {
        "wte": jnp.zeros((64, 32)),  # split over model on rows: data takes the columns
        "wpe": jnp.zeros((16, 32)),
        "odd": jnp.zeros((6, 10)),  # no dimension divisible by 4: stays whole
        "blocks": {"w": jnp.zeros((4, 32, 8)), "b": jnp.zeros((4, 8))},  # leading layer axis never split
    }
    specs = {"wte": P("model", None), "wpe": P(), "odd": P(), "blocks": {"w": P(), "b": P()}}
    got = parallel.fsdp_specs(shapes, specs, "data", 4, stacked=("blocks",))
    assert got == {
        "wte": P("model", "data"), "wpe": P("data", None), "odd": P(),
        "blocks": {"w": P(None, "data", None), "b": P()},  # vectors (biases, LayerNorms) stay replicated
    }  # fmt: skip


def test_layer_specs_drop_the_layer_axis():
    assert parallel.layer_specs({"w": P(None, "data", "model")}) == {"w": P("data", "model")}


def test_fsdp_gradient_collectives(mesh_results):
    """8 x 1 FSDP: the top-level matrices (wte, wpe) are gathered once, each block's matrices once in the
    forward scan and once in the backward scan (its loop body appears once in the program, whatever the
    depth); gradients of split params are reduce-scattered (each device keeps 1/8), the replicated vectors'
    gradients all-reduced with the loss's two sums."""
    got = mesh_results["equivalence"]["8x1-fsdp"]
    hlo, split, split_blocks, n_layer = got["hlo"], got["split_over_data"], got["split_over_data_blocks"], 2
    top, per_layer = split - split_blocks, split_blocks // n_layer
    assert hlo["all-gather elements"] == top + 2 * per_layer
    assert hlo["reduce-scatter elements"] == (top + per_layer) // 8
    n_params = mesh_results["training"]["n_params"]
    assert hlo["all-reduce elements"] == n_params - split + 2
    assert hlo["all-to-all"] == hlo["collective-permute"] == 0


def test_fsdp_shards_the_optimizer_state_with_the_params(mesh_results):
    got = mesh_results["training"]["4x2-fsdp"]  # wte (64, 32): rows over model (2), columns over data (4)
    assert got["wte_local_shape"] == got["mu_wte_local_shape"] == [32, 8]
