"""The GPT and purejax.parallel.sharded_train_step on 8 simulated devices (parallel_child.py computes, these
tests judge): loss and gradients of data, tensor, 2D and fully sharded parallelism equal one device's; a step
with or without micro-batches, and three AdamW steps with clipping, give the same params; the optimizer's
global norm reduces each leaf over its own axes; dropout masks differ where they must and agree where they
must; the errors. The step's collectives are counted in test_data.py (data parallel) and test_fsdp.py."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from purejax import optim, parallel
from purejax.parallel.step import batch_axes

MESHES = ["8x1", "8x1-fsdp", "4x2", "4x2-fsdp", "1x8"]
STEPS = ["8x1-k1", "8x1-k4", "4x2-k1", "4x2-k4", "8x1-fsdp-k1", "8x1-fsdp-k4", "4x2-fsdp-k2", "1x8-k2"]


@pytest.mark.parametrize("mesh", MESHES)
def test_loss_and_gradients_equal_one_device(mesh_results, mesh):
    got = mesh_results["equivalence"][mesh]
    assert got["loss_rel_err"] < 1e-5
    worst = max(got["grad_rel_err"], key=got["grad_rel_err"].get)
    assert got["grad_rel_err"][worst] < 1e-4, (worst, got["grad_rel_err"][worst])
    assert got["grads_misplaced"] == []  # each gradient comes back split like its param


@pytest.mark.parametrize("case", STEPS)
def test_a_step_with_or_without_micro_batches_equals_one_device(mesh_results, case):
    """The sharded step (the data-parallel sum once, after k micro-batches) against one device's step on the
    whole batch at once: the params and the reported loss, the whole batch's."""
    got = mesh_results["steps"][case]
    assert not isinstance(got, str), got  # the error the sharded step raised
    assert got["params_rel_err"] < 1e-5
    assert got["loss_rel_err"] < 1e-6


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


def test_global_norm_reduces_each_leaf_over_its_own_axes(mesh_results):
    """A leaf split over (data, model), one over model, one replicated, on 4 x 2: the norm of the whole tree;
    psum-ming every leaf over every axis (the naive form) counts replicated parts several times."""
    got = mesh_results["global_norm"]
    assert abs(got["ours"] - got["numpy"]) < 1e-5 * got["numpy"]
    assert got["naive"] > 1.2 * got["numpy"]


def test_the_step_gives_each_data_shard_its_own_dropout_key(mesh_results):
    """The key loss_fn receives in `sharded_train_step` differs over the data axis (each shard's rows are
    other examples); the model itself folds in nothing for the data axis."""
    for mesh in ("4x2-fsdp", "8x1"):
        assert mesh_results["training"][mesh]["keys_differ_over_data"] == 1.0


def test_dropout_agrees_over_model_and_differs_over_data(mesh_results):
    """Every row of the batch the same, 2 x 4 mesh, the key folded as the step folds it: the activations
    (replicated over model) are identical on the 4 model shards, and different on the 2 data shards."""
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
    heads = "n_kv_head=4 key/value heads cannot be split over the 8 devices of mesh axis 'model'"
    assert heads in errors["attention_heads"]
    assert "shape mismatch: wte.w: expected (32, 32), got (64, 32)" in errors["unsharded_params"]
    assert "parallel.shard(params, param_specs" in errors["unsharded_params"]


def test_a_tensor_parallel_block_all_reduces_twice_forward_and_twice_backward(mesh_results):
    """Megatron's count: per block, one all-reduce after attention and one after the MLP in the forward pass
    (g), and their mirror images (f) on the inputs' gradients in the backward pass, each of batch x seq x
    d_model elements (XLA may merge two independent ones into one tuple all-reduce, so elements are counted)."""
    hlo = mesh_results["tp_block_hlo"]
    activations = 2 * 16 * 32  # the block test's batch x seq x d_model
    forward = hlo["forward"]["all-reduce@model"]
    assert forward["ops"] == 2 and forward["elements"] == 2 * activations
    assert hlo["forward_backward"]["all-reduce@model"]["elements"] == 4 * activations
    assert set(hlo["forward_backward"]) == {"all-reduce@model"}  # nothing gathered or scattered


def test_the_data_axes_are_those_the_batch_is_split_over():
    assert batch_axes(P("data")) == ("data",)
    assert batch_axes((P("data", None), {"mask": P(("data", "pod"))})) == ("data", "pod")
    assert batch_axes(P()) == batch_axes(P(None)) == ()


def test_the_step_refuses_the_settings_it_makes_itself():
    mesh = parallel.make_mesh(1, 1)
    state = optim.init_train_state({"w": jax.numpy.ones(2)}, optim.sgd(0.1), jax.random.key(0))
    specs = parallel.state_specs(state, {"w": P()})
    for name in ("grad_reduce", "local_params", "param_specs"):
        with pytest.raises(ValueError, match=f"sets \\['{name}'\\] itself"):
            parallel.sharded_train_step(mesh, specs, P(), loss_fn=lambda p, b, k: (0.0, {}), **{name: None})
