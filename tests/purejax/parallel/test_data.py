"""purejax.parallel.data: one gradient all-reduce per param, and the D-times trap (8 simulated devices,
parallel_child.py)."""


def test_a_data_parallel_gradient_all_reduces_exactly_the_params(mesh_results):
    """8 x 1: the compiled program all-reduces every param's gradient once (XLA may merge them into tuple
    all-reduces, so elements are counted) plus the loss's sum and count; nothing is gathered or scattered."""
    hlo = mesh_results["equivalence"]["8x1"]["hlo"]
    assert hlo["all-reduce elements"] == mesh_results["training"]["n_params"] + 2
    assert hlo["all-gather"] == hlo["reduce-scatter"] == 0


def test_a_data_parallel_train_step_all_reduces_exactly_the_params(mesh_results):
    """The whole step (AdamW, clipping): the norm of replicated gradients needs no further reduction."""
    hlo = mesh_results["training"]["8x1"]["step_hlo"]
    assert hlo["all-reduce elements"] == mesh_results["training"]["n_params"] + 2


def test_the_d_times_trap_is_detectable(mesh_results):
    """The gradient of each shard's own mean loss, then pmean: 8 times the true gradient on 8 data shards,
    because JAX's transpose of the implicit pvary has already summed the shards. Our step's gradient (the
    equivalence tests) is the true one; this shows the naive one is detectably wrong, and exactly by 8."""
    trap = mesh_results["d_times_trap"]
    assert abs(trap["naive_over_single"] - 8.0) < 1e-4
    assert trap["naive_over_8_rel_err"] < 1e-5
