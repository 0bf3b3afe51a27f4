"""purejax.parallel.fsdp: which dimension each param is split on, and the collectives of a compiled FSDP
training step (8 simulated devices, parallel_child.py): params gathered twice (forward, and again for the
backward pass), gradients reduce-scattered once per micro-batch."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from purejax import parallel


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
        "wte": P("model", "data"),
        "wpe": P("data", None),
        "odd": P(),
        "blocks": {"w": P(None, "data", None), "b": P()},  # vectors (biases, LayerNorms) stay replicated
    }


def test_layer_specs_drop_the_layer_axis():
    assert parallel.layer_specs({"w": P(None, "data", "model")}) == {"w": P("data", "model")}


@pytest.mark.parametrize("k", [1, 4])
def test_fsdp_step_collectives(mesh_results, k):
    """8 x 1 FSDP, one step with k micro-batches, as one device executes it. ZeRO-3's trade-off: every
    micro-batch reduce-scatters the gradients of the split params (each device keeps 1/8), so no device ever
    holds a whole gradient, at the price of k reduce-scatters per step (data parallelism sums once). Each
    block's matrices are gathered twice per micro-batch (forward, and again for the recomputed backward);
    the top-level ones (wte, wpe) once per pass, which XLA may hoist out of the micro-batch loop as they do
    not change within a step. The replicated vectors' gradients are summed once, with the loss's two sums per
    micro-batch and the global norm's one over the split leaves."""
    got, n_layer, devices = mesh_results["steps"][f"8x1-fsdp-k{k}"], 2, 8
    top, layer = got["split_local_top"], got["split_local_layer"]
    assert got["reduce-scatter@data"]["elements"] == k * (top + n_layer * layer)
    blocks_gathered = k * 2 * n_layer * layer * devices
    assert blocks_gathered + top * devices <= got["all-gather@data"]["elements"] <= blocks_gathered + k * top * devices
    assert got["all-reduce@data"]["elements"] == got["replicated_local"] + 2 * k + 1
    assert got["params_rel_err"] < 1e-5


def test_fsdp_shards_the_optimizer_state_with_the_params(mesh_results):
    got = mesh_results["training"]["4x2-fsdp"]  # wte (64, 32): rows over model (2), columns over data (4)
    assert got["wte_local_shape"] == got["mu_wte_local_shape"] == [32, 8]
