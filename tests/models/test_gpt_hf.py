"""models.gpt_hf: tiny GPT-2 directories written here in Hugging Face's layout with the real `safetensors`
package, loaded, and checked against an independent float64 numpy GPT-2 that reads the Hugging Face tensors
directly; the export round trip; mismatch reports; config.json handling. With PUREJAX_HF_GPT2_DIR pointing
at a local copy of GPT-2 (nothing is downloaded), the same check runs on the real weights."""

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy as reference

from models import gpt, gpt_hf
from purejax import tree as tree_lib

N_LAYER, N_EMBD, N_HEAD, VOCAB, N_POSITIONS = 2, 32, 4, 53, 16
HF_CONFIG = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-05,
    "n_ctx": N_POSITIONS,
    "n_embd": N_EMBD,
    "n_head": N_HEAD,
    "n_inner": None,
    "n_layer": N_LAYER,
    "n_positions": N_POSITIONS,
    "vocab_size": VOCAB,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "scale_attn_weights": True,
}

apply = jax.jit(gpt.apply, static_argnums=2)


def hf_tensors(seed=0, n_layer=N_LAYER, prefix="transformer.", buffers=True) -> dict[str, np.ndarray]:
    """Random GPT-2 weights named and shaped as transformers stores them (Conv1D weights are (in, out))."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=0.2, mean=0.0):
        return (mean + scale * rng.normal(size=shape)).astype(np.float32)

    c = N_EMBD
    out = {"wte.weight": normal(VOCAB, c), "wpe.weight": normal(N_POSITIONS, c)}
    for i in range(n_layer):
        h = f"h.{i}."
        out |= {
            h + "ln_1.weight": normal(c, mean=1.0),
            h + "ln_1.bias": normal(c),
            h + "attn.c_attn.weight": normal(c, 3 * c),
            h + "attn.c_attn.bias": normal(3 * c),
            h + "attn.c_proj.weight": normal(c, c),
            h + "attn.c_proj.bias": normal(c),
            h + "ln_2.weight": normal(c, mean=1.0),
            h + "ln_2.bias": normal(c),
            h + "mlp.c_fc.weight": normal(c, 4 * c),
            h + "mlp.c_fc.bias": normal(4 * c),
            h + "mlp.c_proj.weight": normal(4 * c, c),
            h + "mlp.c_proj.bias": normal(c),
        }
        if buffers:  # what older transformers versions saved: the causal mask and the masked-out value
            out[h + "attn.bias"] = np.tril(np.ones((N_POSITIONS, N_POSITIONS), np.float32))[None, None]
            out[h + "attn.masked_bias"] = np.array(-1e4, np.float32)
    out |= {"ln_f.weight": normal(c, mean=1.0), "ln_f.bias": normal(c)}
    return {prefix + name: value for name, value in out.items()}


def write_dir(path: Path, tensors: dict, config: dict = HF_CONFIG) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    reference.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def numpy_gpt2(tensors: dict, ids: np.ndarray, n_head: int) -> np.ndarray:
    """GPT-2's forward pass in float64, read straight off the Hugging Face tensors: Conv1D is x @ W + b,
    c_attn's columns are q | k | v, LayerNorm eps 1e-5, tanh GELU, the head is wte transposed."""
    t = {name.removeprefix("transformer."): np.asarray(v, np.float64) for name, v in tensors.items()}
    n_layer = len({name.split(".")[1] for name in t if name.startswith("h.")})
    b, s = ids.shape
    c = t["wte.weight"].shape[1]
    d = c // n_head

    def ln(x, name):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * t[name + ".weight"] + t[name + ".bias"]

    def conv1d(x, name):
        return x @ t[name + ".weight"] + t[name + ".bias"]

    def gelu_new(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    x = t["wte.weight"][ids] + t["wpe.weight"][np.arange(s)]
    for i in range(n_layer):
        qkv = conv1d(ln(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn")
        q, k, v = (qkv[..., j * c : (j + 1) * c].reshape(b, s, n_head, d).transpose(0, 2, 1, 3) for j in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + np.triu(np.full((s, s), -np.inf), 1)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        x = x + conv1d((weights @ v).transpose(0, 2, 1, 3).reshape(b, s, c), f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(ln(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    return ln(x, "ln_f") @ t["wte.weight"].T


IDS = np.random.default_rng(1).integers(0, VOCAB, (2, N_POSITIONS))


@pytest.mark.parametrize(
    "layout",
    [dict(prefix="transformer.", buffers=True), dict(prefix="", buffers=False), dict(prefix="", buffers=True)],
    ids=["prefixed-with-buffers", "bare", "bare-with-buffers"],
)
def test_loaded_weights_give_the_logits_of_a_numpy_gpt2(tmp_path, layout):
    tensors = hf_tensors(**layout)
    params, config = gpt_hf.load(write_dir(tmp_path / "gpt2", tensors))
    assert config == gpt.GPTConfig(
        block_size=N_POSITIONS,
        vocab_size=VOCAB,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_embd=N_EMBD,
        dropout=0.0,
        bias=True,
        gelu="tanh",
    )
    np.testing.assert_allclose(apply(params, IDS, config), numpy_gpt2(tensors, IDS, N_HEAD), rtol=1e-4, atol=1e-4)


def test_a_stored_tied_head_is_accepted_and_an_untied_one_refused(tmp_path):
    tensors = hf_tensors()
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()  # no prefix, as GPT2LMHeadModel names it
    gpt_hf.load(write_dir(tmp_path / "tied", tensors))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from wte.weight"):
        gpt_hf.load(write_dir(tmp_path / "untied", tensors))


def test_export_then_import_is_bit_exact_and_matches_transformers_layout(tmp_path):
    tensors = hf_tensors()
    params, config = gpt_hf.load(write_dir(tmp_path / "in", tensors))
    gpt_hf.save(params, config, tmp_path / "out")

    written = reference.load_file(tmp_path / "out" / "model.safetensors")  # read by the reference package
    weights = {k: v for k, v in tensors.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert sorted(written) == sorted(weights)  # GPT2LMHeadModel's names, no buffers, no lm_head
    for name, value in weights.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    exported_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert gpt_hf.config_from_hf(exported_config) == config

    again, config_again = gpt_hf.load(tmp_path / "out")
    assert config_again == config
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_export_without_prefix_and_with_exact_gelu_round_trips(tmp_path):
    params, config = gpt_hf.load(write_dir(tmp_path / "in", hf_tensors()))
    config = dataclasses.replace(config, gelu="exact")  # exports as activation_function "gelu"
    gpt_hf.save(params, config, tmp_path / "out", prefix="")
    assert "wte.weight" in reference.load_file(tmp_path / "out" / "model.safetensors")
    again, config_again = gpt_hf.load(tmp_path / "out")
    assert config_again == config
    tree_lib.assert_like(again, params)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_every_mismatch_is_named_at_once(tmp_path):
    tensors = hf_tensors()
    del tensors["transformer.h.1.mlp.c_fc.bias"]  # missing
    tensors["transformer.h.0.attn.c_proj.weight"] = np.zeros((N_EMBD, N_EMBD + 1), np.float32)  # wrong shape
    tensors["transformer.h.0.attn.rotary.weight"] = np.zeros(3, np.float32)  # unexpected
    tensors |= {k.replace("h.1.", "h.2."): v for k, v in hf_tensors().items() if ".h.1.ln_1" in k}  # a third layer
    with pytest.raises(tree_lib.TreeMismatchError) as error:
        gpt_hf.load(write_dir(tmp_path / "bad", tensors))
    message = str(error.value)
    for expected in [
        "missing:        h.1.mlp.c_fc.bias",
        "unexpected:     h.0.attn.rotary.weight",
        "unexpected:     h.2.ln_1.weight",
        "unexpected:     h.2.ln_1.bias",
        f"shape mismatch: h.0.attn.c_proj.weight: expected ({N_EMBD}, {N_EMBD}), got ({N_EMBD}, {N_EMBD + 1})",
    ]:
        assert expected in message, message


def test_unsupported_settings_in_config_json_are_listed_together():
    bad = HF_CONFIG | {"activation_function": "relu", "n_inner": 7, "layer_norm_epsilon": 1e-6}
    with pytest.raises(ValueError) as error:
        gpt_hf.config_from_hf(bad)
    for expected in ["activation_function 'relu'", "n_inner=7", "layer_norm_epsilon=1e-06"]:
        assert expected in str(error.value)
    with pytest.raises(ValueError, match=r"missing \['n_layer'\]"):
        gpt_hf.config_from_hf({k: v for k, v in HF_CONFIG.items() if k != "n_layer"})


def test_directories_without_safetensors_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        gpt_hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is torch's pickle format"):
        gpt_hf.load(tmp_path)


def test_sharded_checkpoints_are_read(tmp_path):
    tensors = hf_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, shard_names in shards.items():
        reference.save_file({n: tensors[n] for n in shard_names}, tmp_path / shard)
    index = {"weight_map": {n: shard for shard, shard_names in shards.items() for n in shard_names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    params, config = gpt_hf.load(tmp_path)
    np.testing.assert_array_equal(params["blocks"]["mlp"]["fc"]["w"][1], tensors["transformer.h.1.mlp.c_fc.weight"])


def test_bias_free_models_cannot_be_exported(tmp_path):
    config = gpt.GPTConfig(block_size=8, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16, bias=False)
    with pytest.raises(ValueError, match="bias=False cannot be exported"):
        gpt_hf.save({}, config, tmp_path)


REAL_GPT2 = os.environ.get("PUREJAX_HF_GPT2_DIR")


@pytest.mark.skipif(not REAL_GPT2, reason="set PUREJAX_HF_GPT2_DIR to a local Hugging Face GPT-2 directory")
def test_real_gpt2_matches_numpy():
    """The real GPT-2 (any size): our logits against the numpy GPT-2 on the same file, and the export round
    trip. Token ids 15496, 11, 314, 1101 are "Hello, I'm" in GPT-2's vocabulary."""
    from purejax import safetensors

    params, config = gpt_hf.load(REAL_GPT2)
    ids = np.array([[15496, 11, 314, 1101, 257, 3303, 2746, 11]])
    tensors = safetensors.load(Path(REAL_GPT2) / "model.safetensors")
    expected = numpy_gpt2(tensors, ids, config.n_head)
    np.testing.assert_allclose(apply(params, ids, config), expected, rtol=2e-3, atol=2e-3)
