"""models.llama_parallel: the layout without a mesh (every param gets a spec, impossible splits named), and the
model on 8 simulated CPU devices (llama_parallel_child.py, run once per session in a child process) against
the single-device llama.py: loss and gradients with the key/value heads split and replicated, with and
without FSDP."""

import dataclasses
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from models import llama, llama_parallel
from purejax import tree as tree_lib
from purejax.parallel import MeshAxes
from tests.children import child_results

HERE = Path(__file__).resolve().parent
CONFIG = llama.LlamaConfig(vocab_size=64, n_layer=2, n_head=8, n_kv_head=4, d_model=32, d_ff=48, max_seq_len=16)


def specs_of(config, axes, sizes) -> dict:
    return tree_lib.flatten(llama_parallel.param_specs(config, axes, sizes))


def test_param_specs_are_megatron_style_and_cover_every_param():
    specs = specs_of(CONFIG, MeshAxes("data", "model"), {"data": 2, "model": 4})
    assert specs["embed.w"] == P("model", None) and specs["head.w"] == P(None, "model")
    assert specs["blocks.attn.qkv.w"] == P(None, None, "model")  # 4 kv heads on 4 devices: one group each
    assert specs["blocks.attn.proj.w"] == P(None, "model", None)
    assert specs["blocks.mlp.gate.w"] == specs["blocks.mlp.up.w"] == P(None, None, "model")
    assert specs["blocks.mlp.down.w"] == P(None, "model", None)
    assert specs["norm.scale"] == specs["blocks.attn_norm.scale"] == P()
    tied = dataclasses.replace(CONFIG, tie_embeddings=True)
    assert set(specs_of(tied, MeshAxes(model="model"), {"model": 4})) == set(specs) - {"head.w"}


def test_fewer_kv_heads_than_devices_split_qkv_rows_and_fsdp_adds_the_data_axis():
    config = dataclasses.replace(CONFIG, n_kv_head=2)
    assert llama_parallel.replicates_kv(config, 4) and not llama_parallel.replicates_kv(config, 2)
    assert specs_of(config, MeshAxes(model="model"), {"model": 4})["blocks.attn.qkv.w"] == P(None, "model", None)
    assert specs_of(config, MeshAxes(model="model"), {"model": 2})["blocks.attn.qkv.w"] == P(None, None, "model")
    fsdp = specs_of(config, MeshAxes("data", "model", fsdp=True), {"data": 2, "model": 4})
    assert fsdp["blocks.attn.qkv.w"] == P(None, "model", "data")
    assert fsdp["embed.w"] == P("model", "data") and fsdp["head.w"] == P("data", "model")
    assert fsdp["blocks.mlp_norm.scale"] == P()  # vectors stay replicated


def test_param_specs_name_what_tensor_parallelism_cannot_split():
    axes = MeshAxes(model="model")
    with pytest.raises(ValueError, match="n_head=8 cannot be split over the 16 devices"):
        llama_parallel.param_specs(CONFIG, axes, {"model": 16})
    with pytest.raises(ValueError, match="vocab_size=63 cannot be split over the 2 devices"):
        llama_parallel.param_specs(dataclasses.replace(CONFIG, vocab_size=63), axes, {"model": 2})
    config = dataclasses.replace(CONFIG, n_head=12, n_kv_head=3, d_model=48)
    with pytest.raises(ValueError, match="n_kv_head=3 key/value heads on 2 tensor-parallel devices"):
        llama_parallel.param_specs(config, axes, {"model": 2})


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory) -> dict:
    """What llama_parallel_child.py measured on 8 simulated CPU devices."""
    return child_results(HERE / "llama_parallel_child.py", tmp_path_factory.mktemp("llama_parallel"))


MODES = ["2x4-kv4", "1x8-kv1-tied", "2x4-kv2-fsdp", "4x2-kv4-fsdp-tied"]


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_equal_one_device(mesh_results, mode):
    result = mesh_results["equivalence"][mode]
    assert result["loss_rel_err"] < 1e-6, result
    worst = max(result["grad_rel_err"].items(), key=lambda item: item[1])
    assert worst[1] < 1e-5, worst  # float32 rounding: the psums add in another order than one device's matmul
    assert result["grads_misplaced"] == []


def test_kv_heads_are_gathered_only_when_replicated(mesh_results):
    """Whole kv groups per device: no collective moves qkv over the model axis. Replicated kv heads: qkv is
    all-gathered in every layer (forward, and again in the recomputed backward) and its gradient
    reduce-scattered."""
    results = mesh_results["equivalence"]
    assert results["2x4-kv4"]["all-gather@model"] == 0 and results["2x4-kv4"]["reduce-scatter@model"] == 0
    for mode in ("1x8-kv1-tied", "2x4-kv2-fsdp"):
        assert results[mode]["qkv_spec"].startswith("P(None, 'model'"), results[mode]
        assert results[mode]["all-gather@model"] >= 2 * CONFIG.n_layer, results[mode]
        assert results[mode]["reduce-scatter@model"] >= CONFIG.n_layer, results[mode]


def test_unsharded_params_are_named(mesh_results):
    message = mesh_results["errors"]["unsharded_params"]
    assert "llama params (this device's shards" in message and "blocks.attn.qkv.w" in message, message
