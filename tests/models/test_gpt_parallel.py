"""models.gpt_parallel's layout without a mesh: every param gets a spec, Megatron-style, and impossible splits
are named. The model on a mesh (8 simulated devices) is tested in tests/purejax/parallel."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import gpt, gpt_parallel
from purejax import tree as tree_lib
from purejax.parallel import MeshAxes
from tests.models.test_gpt import CONFIG, make_params
from tests.purejax.nn.test_stack import _has_scan


def test_param_specs_cover_every_param_megatron_style():
    config = dataclasses.replace(CONFIG, vocab_size=40)
    sizes = {"data": 2, "model": 4}
    specs = tree_lib.flatten(gpt_parallel.param_specs(config, MeshAxes("data", "model"), sizes))
    assert specs["wte.w"] == P("model", None) and specs["wpe.w"] == P()
    assert specs["blocks.attn.qkv.w"] == P(None, None, "model")
    assert specs["blocks.attn.proj.w"] == P(None, "model", None)
    assert specs["blocks.mlp.fc.b"] == P(None, "model") and specs["blocks.mlp.proj.b"] == P()
    fsdp = tree_lib.flatten(gpt_parallel.param_specs(config, MeshAxes("data", "model", fsdp=True), sizes))
    assert fsdp["wte.w"] == P("model", "data") and fsdp["blocks.mlp.proj.w"] == P(None, "model", "data")
    assert fsdp["blocks.ln_1.scale"] == P()  # vectors stay replicated
    assert set(specs) == set(tree_lib.flatten(make_params()))


def test_param_specs_name_what_tensor_parallelism_cannot_split():
    axes = MeshAxes(model="model")
    with pytest.raises(ValueError, match="n_head=4 cannot be split over the 8 devices .* divisible by 8"):
        gpt_parallel.param_specs(CONFIG, axes, {"model": 8})
    with pytest.raises(ValueError, match="vocab_size=37 cannot be split over the 2 devices .* pads it up"):
        gpt_parallel.param_specs(CONFIG, axes, {"model": 2})


AXES = {  # the second mesh axis ("model") as a tensor, sequence or context axis; the batch's spec with it
    "tp": (lambda fsdp: MeshAxes("data", "model", fsdp=fsdp), P("data")),
    "sp": (lambda fsdp: MeshAxes("data", "model", fsdp=fsdp, sequence_parallel=True), P("data")),
    "cp": (lambda fsdp: MeshAxes("data", context="model", fsdp=fsdp), P("data", "model")),
}


@pytest.mark.parametrize("split", list(AXES))
@pytest.mark.parametrize(
    ("remat", "fsdp", "scans"), [("none", False, False), ("block", False, True), ("none", True, True)]
)
def test_layers_auto_on_a_mesh_scans_rematerialised_blocks(split, remat, fsdp, scans):
    """`layers="auto"` on a mesh decides as on one device (`stack.run`, which the sequence- and
    context-parallel paths share): 2 layers unrolled, but a scan when the blocks are rematerialised, by `remat`
    or by FSDP's gather under jax.checkpoint (unrolled, XLA:CPU keeps every layer's gathered params: 21 against
    5 MB of scratch for a 4-layer, 256-wide GPT on 8 devices, dp=8). Traced on an abstract 2 x 4 mesh: no
    devices, nothing compiled; the inputs carry their shardings, as jax 0.12's shard_map requires."""
    config = dataclasses.replace(CONFIG, vocab_size=40, layers="auto", remat=remat)
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    make_axes, batch_spec = AXES[split]
    axes = make_axes(fsdp)
    specs = gpt_parallel.param_specs(config, axes, dict(mesh.shape))
    shapes = jax.eval_shape(functools.partial(gpt.init, config=config), jax.random.key(0))

    def sharded(shape, spec):
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(sharded, shapes, specs)
    idx = sharded(jax.ShapeDtypeStruct((4, config.block_size), jnp.int32), batch_spec)
    loss = jax.shard_map(
        lambda p, b: gpt_parallel.loss(p, b, config, axes=axes), mesh=mesh, in_specs=(specs, batch_spec), out_specs=P()
    )
    assert _has_scan(loss, params, (idx, idx)) == scans
