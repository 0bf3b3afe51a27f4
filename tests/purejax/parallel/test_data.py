"""Data parallelism in `sharded_train_step`: one gradient all-reduce per optimizer step whatever the number of
micro-batches, counted in the compiled step (ops inside the micro-batch loop count once per micro-batch), on a
data-parallel 8 x 1 mesh and a 2D 4 x 2 one; and the D-times trap (8 simulated devices, parallel_child.py)."""

import pytest


@pytest.mark.parametrize("mesh", ["8x1", "4x2"])
@pytest.mark.parametrize("k", [1, 4])
def test_the_gradients_are_all_reduced_once_per_step(mesh_results, mesh, k):
    """Over the data axis, one device sends exactly the gradients of the params it holds (all of them on
    8 x 1, its tensor-parallel shards on 4 x 2) once, plus the loss's sum and token count once per
    micro-batch: nothing gradient-sized runs k times (DDP's `no_sync`, then one all-reduce). Without the
    step's local copies, each micro-batch would all-reduce every gradient again: k times the elements."""
    got = mesh_results["steps"][f"{mesh}-k{k}"]
    assert got["all-reduce@data"]["elements"] == got["replicated_local"] + 2 * k
    assert not any(name.startswith(("all-gather", "reduce-scatter")) for name in got)


def test_tensor_parallel_all_reduces_scale_with_the_tokens_not_the_micro_batches(mesh_results):
    """On 4 x 2 the activations' all-reduces over the model axis run in every micro-batch, each on 1/k of
    the rows: the same elements per step for k = 1 and k = 4."""
    steps = mesh_results["steps"]
    assert steps["4x2-k4"]["all-reduce@model"]["elements"] == steps["4x2-k1"]["all-reduce@model"]["elements"]


def test_the_d_times_trap_is_detectable(mesh_results):
    """The gradient of each shard's own mean loss with respect to the replicated params, then pmean: 8 times
    the true gradient on 8 data shards, because JAX's transpose of the implicit cast to varying has already
    summed the shards. The step differentiates each shard's own copy instead (its gradient equals one
    device's: test_step.py); this shows the naive one is detectably wrong, and exactly by 8."""
    trap = mesh_results["d_times_trap"]
    assert abs(trap["naive_over_single"] - 8.0) < 1e-4
    assert trap["naive_over_8_rel_err"] < 1e-5
