"""The GPT and purejax.parallel.sharded_train_step on 8 simulated devices (parallel_child.py computes, these
tests judge): loss and gradients of data, tensor, 2D and fully sharded parallelism equal one device's; three
AdamW steps with clipping give the same params; the optimizer's global norm reduces each leaf over its own
axes; dropout masks differ where they must and agree where they must; the errors."""

import pytest

MESHES = ["8x1", "8x1-fsdp", "4x2", "4x2-fsdp", "2x4", "1x8"]


@pytest.mark.parametrize("mesh", MESHES)
def test_loss_and_gradients_equal_one_device(mesh_results, mesh):
    got = mesh_results["equivalence"][mesh]
    assert got["loss_rel_err"] < 1e-5
    worst = max(got["grad_rel_err"], key=got["grad_rel_err"].get)
    assert got["grad_rel_err"][worst] < 1e-4, (worst, got["grad_rel_err"][worst])
    assert got["grads_misplaced"] == []  # each gradient comes back split like its param


@pytest.mark.parametrize("mesh", ["4x2-fsdp", "8x1"])
def test_three_adamw_steps_with_clipping_equal_one_device(mesh_results, mesh):
    """Clipping is active (max norm 0.5 < the first grad norm, 1.57), so a norm reduced over the wrong axes
    would change every update."""
    training = mesh_results["training"]
    got = training[mesh]
    assert training["ref_grad_norms"][0] > 0.5
    for norm, ref in zip(got["grad_norms"], training["ref_grad_norms"]):
        assert abs(norm - ref) < 1e-5 * ref
    assert got["params_rel_err"] < 1e-4
    assert got["opt_state_rel_err"] < 1e-4


@pytest.mark.parametrize("mesh", ["4x2-fsdp", "1x8"])
def test_micro_batches_on_a_mesh_with_split_params_equal_one_device(mesh_results, mesh):
    got = mesh_results["micro_batches"][mesh]
    assert not isinstance(got, str), got  # the error the sharded step raised
    assert got < 1e-5


def test_global_norm_reduces_each_leaf_over_its_own_axes(mesh_results):
    """A leaf split over (data, model), one over model, one replicated, on 4 x 2: the norm of the whole tree;
    psum-ming every leaf over every axis (the naive form) counts replicated parts several times."""
    got = mesh_results["global_norm"]
    assert abs(got["ours"] - got["numpy"]) < 1e-5 * got["numpy"]
    assert got["naive"] > 1.2 * got["numpy"]


def test_dropout_agrees_over_model_and_differs_over_data(mesh_results):
    """Every row of the batch the same, 2 x 4 mesh: the activations (replicated over model) are identical on
    the 4 model shards, and different on the 2 data shards."""
    got = mesh_results["dropout"]
    assert got["max_diff_across_model"] == 0.0
    assert got["max_diff_across_data"] > 0.1


def test_head_sharded_attention_draws_its_own_dropout_masks(mesh_results):
    """Identical heads on different model shards give identical outputs without dropout, different ones with
    it: each shard's attention probabilities get masks of their own."""
    got = mesh_results["attention_dropout"]
    assert got["without_dropout"] < 1e-5
    assert got["with_dropout"] > 0.1


def test_errors_under_a_mesh(mesh_results):
    errors = mesh_results["errors"]
    assert "n_kv_head=4 key/value heads cannot be split over the 8 devices of mesh axis 'model'" in errors["attention_heads"]
    assert "shape mismatch: wte.w: expected (32, 32), got (64, 32)" in errors["unsharded_params"]
    assert "parallel.shard(params, param_specs" in errors["unsharded_params"]


def test_a_tensor_parallel_block_all_reduces_twice_forward_and_twice_backward(mesh_results):
    """Megatron's count: per block, one all-reduce after attention and one after the MLP in the forward pass
    (g), and their mirror images (f) on the inputs' gradients in the backward pass, each of batch x seq x
    d_model elements (XLA may merge two independent ones into one tuple all-reduce, so elements are counted)."""
    hlo = mesh_results["tp_block_hlo"]
    activations = 2 * 16 * 32  # the block test's batch x seq x d_model
    assert hlo["forward"]["all-reduce"] == 2 and hlo["forward"]["all-reduce elements"] == 2 * activations
    assert hlo["forward_backward"]["all-reduce elements"] == 4 * activations
    assert hlo["forward_backward"]["all-gather"] == hlo["forward_backward"]["reduce-scatter"] == 0
