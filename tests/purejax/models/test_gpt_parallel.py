"""models.gpt_parallel's layout without a mesh: every param gets a spec, Megatron-style, and impossible splits
are named. The model on a mesh (8 simulated devices) is tested in tests/purejax/parallel."""

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from purejax import tree as tree_lib
from purejax.models import gpt_parallel
from purejax.parallel import MeshAxes
from tests.purejax.models.test_gpt import CONFIG, make_params


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
