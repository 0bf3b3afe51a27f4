"""models.llama_hf: tiny Llama directories written here in Hugging Face's layout with the real `safetensors`
package (one file, and shards with their index), loaded, and checked against an independent float64 numpy
Llama that reads the Hugging Face tensors directly, as transformers' modeling_llama does (q_proj rows in
rotate-half order, `repeat_kv`); greedy generation; the export round trip tensor by tensor; every mismatch
and unsupported setting named."""

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference

from models import llama, llama_decode, llama_hf
from purejax import tree as tree_lib
from purejax.nn import rotary

VOCAB, D_MODEL, N_HEAD, D_FF, N_LAYER, MAX_POS = 61, 32, 4, 48, 2, 16
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": D_MODEL,
    "intermediate_size": D_FF,
    "num_hidden_layers": N_LAYER,
    "num_attention_heads": N_HEAD,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POS,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": True,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # every band: wavelengths 6, 63, 628 and 6283
VARIANTS = {
    "gqa": {},
    "mqa-tied-llama3": {"num_key_value_heads": 1, "tie_word_embeddings": True, "rope_scaling": LLAMA3},
    "mha-linear-old-key": {"num_key_value_heads": 4, "rope_scaling": {"type": "linear", "factor": 2.0}},
}


def hf_tensors(hf_config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random Llama weights named and shaped as LlamaForCausalLM stores them (nn.Linear weights (out, in))."""
    rng = np.random.default_rng(seed)
    d, head_dim, kv = D_MODEL, D_MODEL // N_HEAD, hf_config["num_key_value_heads"]

    def normal(*shape, scale=0.3, mean=0.0):
        return (mean + scale * rng.normal(size=shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": normal(VOCAB, d), "model.norm.weight": normal(d, mean=1.0)}
    for i in range(N_LAYER):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": normal(d, mean=1.0),
            p + "self_attn.q_proj.weight": normal(N_HEAD * head_dim, d),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, d),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, d),
            p + "self_attn.o_proj.weight": normal(d, N_HEAD * head_dim),
            p + "post_attention_layernorm.weight": normal(d, mean=1.0),
            p + "mlp.gate_proj.weight": normal(D_FF, d),
            p + "mlp.up_proj.weight": normal(D_FF, d),
            p + "mlp.down_proj.weight": normal(d, D_FF),
        }
    if not hf_config["tie_word_embeddings"]:
        out["lm_head.weight"] = normal(VOCAB, d)
    return out


def write_dir(path, tensors: dict, hf_config: dict, shards: int = 1):
    """config.json and the weights, in one file or in `shards` files with model.safetensors.index.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    if shards == 1:
        reference.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    names, weight_map = list(tensors), {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        reference.save_file({n: tensors[n] for n in part}, path / shard, metadata={"format": "pt"})
        weight_map |= {n: shard for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def hf_inverse_frequencies(hf_config: dict, head_dim: int) -> np.ndarray:
    """transformers' default, linear and llama3 rope initialisations, written from their description."""
    inv_freq = 1.0 / hf_config["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    scaling = hf_config["rope_scaling"] or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        old, low, high = (
            scaling["original_max_position_embeddings"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / scaling["factor"], inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / scaling["factor"] + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled)
    return inv_freq


def numpy_llama(tensors: dict, ids: np.ndarray, hf_config: dict) -> np.ndarray:
    """LlamaForCausalLM's forward pass in float64, straight off the Hugging Face tensors."""
    t = {name: np.asarray(v, np.float64) for name, v in tensors.items()}
    n_head, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    b, s = ids.shape
    head_dim = hf_config["hidden_size"] // n_head
    freqs = np.arange(s)[:, None] * hf_inverse_frequencies(hf_config, head_dim)[None]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))

    def rms(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + hf_config["rms_norm_eps"]) * w

    def rotate_half(x):
        return np.concatenate([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], -1)

    def heads(x, n):  # (b, s, n * head_dim) -> (b, n, s, head_dim)
        return x.reshape(b, s, n, head_dim).transpose(0, 2, 1, 3)

    x = t["model.embed_tokens.weight"][ids]
    for i in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q, k, v = (
            heads(h @ t[p + f"self_attn.{n}_proj.weight"].T, m) for n, m in (("q", n_head), ("k", n_kv), ("v", n_kv))
        )
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)  # repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim) + np.triu(np.full((s, s), -np.inf), 1)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        x = x + (weights @ v).transpose(0, 2, 1, 3).reshape(b, s, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return rms(x, t["model.norm.weight"]) @ head.T


IDS = np.random.default_rng(1).integers(0, VOCAB, (2, MAX_POS))
apply = jax.jit(llama.apply, static_argnums=2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loaded_weights_give_the_logits_of_a_numpy_llama(tmp_path, variant):
    hf_config = HF_CONFIG | VARIANTS[variant]
    tensors = hf_tensors(hf_config)
    params, config = llama_hf.load(write_dir(tmp_path / "llama", tensors, hf_config, shards=1 + (variant == "gqa")))
    assert (config.n_kv_head, config.tie_embeddings) == (
        hf_config["num_key_value_heads"],
        hf_config["tie_word_embeddings"],
    )
    np.testing.assert_allclose(apply(params, IDS, config), numpy_llama(tensors, IDS, hf_config), rtol=1e-4, atol=1e-4)


def test_greedy_generation_equals_greedy_numpy(tmp_path):
    hf_config = HF_CONFIG | VARIANTS["mqa-tied-llama3"]
    tensors = hf_tensors(hf_config, seed=3)
    params, config = llama_hf.load(write_dir(tmp_path / "llama", tensors, hf_config))
    prompt, n_new = IDS[:, :4], 8
    tokens = prompt
    for _ in range(n_new):  # the whole sequence through the numpy model at every step, no cache
        logits = numpy_llama(tensors, tokens, hf_config)[:, -1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0] > 1e-3).all()  # no near-tie that float32 rounding could flip
        tokens = np.concatenate([tokens, logits.argmax(-1)[:, None]], axis=1)
    got = llama_decode.generate(params, prompt, config, key=jax.random.key(0), max_new_tokens=n_new, temperature=0.0)
    np.testing.assert_array_equal(got, tokens)


@pytest.mark.parametrize("shard_bytes", [None, 20_000], ids=["single-file", "sharded"])
def test_save_writes_what_was_loaded_tensor_by_tensor(tmp_path, shard_bytes):
    hf_config = HF_CONFIG | VARIANTS["mqa-tied-llama3"]
    tensors = hf_tensors(hf_config)
    params, config = llama_hf.load(write_dir(tmp_path / "in", tensors, hf_config))
    llama_hf.save(params, config, tmp_path / "out", max_shard_bytes=shard_bytes)

    out = tmp_path / "out"
    if shard_bytes is None:
        written = reference.load_file(out / "model.safetensors")  # read by the reference package
        assert not (out / "model.safetensors.index.json").exists()
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert not (out / "model.safetensors").exists()
        written = {n: a for shard in shards for n, a in reference.load_file(out / shard).items()}
        assert index["weight_map"].keys() == written.keys()
        assert index["metadata"]["total_size"] == sum(a.nbytes for a in written.values())
    assert sorted(written) == sorted(tensors)  # LlamaForCausalLM's names; no lm_head: it is tied
    for name, value in tensors.items():
        assert written[name].dtype == value.dtype, name
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    exported = json.loads((out / "config.json").read_text())
    assert {k: exported[k] for k in exported.keys() & hf_config.keys()} == {
        k: hf_config[k] for k in exported.keys() & hf_config.keys()
    }
    assert set(hf_config) - set(exported) == {"bos_token_id", "eos_token_id", "use_cache", "pretraining_tp"}
    again, config_again = llama_hf.load(out)
    assert config_again == config
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_saving_again_replaces_the_other_form(tmp_path):
    """A single file left beside a newer index would be read instead of it (load_pretrained prefers it), and
    stale shards would mislead: each save removes the files of the other form."""
    params, config = llama_hf.load(write_dir(tmp_path / "in", hf_tensors(HF_CONFIG), HF_CONFIG))
    out = tmp_path / "out"
    llama_hf.save(params, config, out)
    llama_hf.save(params, config, out, max_shard_bytes=20_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert not (out / "model.safetensors").exists() and len(shards) > 1
    llama_hf.save(params, config, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_bfloat16_files_keep_their_dtype_both_ways(tmp_path):
    tensors = {n: v.astype(ml_dtypes.bfloat16) for n, v in hf_tensors(HF_CONFIG).items()}
    params, config = llama_hf.load(write_dir(tmp_path / "in", tensors, HF_CONFIG), dtype=None)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    llama_hf.save(params, config, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    written = reference.load_file(tmp_path / "out" / "model.safetensors")
    for name, value in tensors.items():
        assert written[name].dtype == value.dtype and np.array_equal(written[name], value), name


def test_every_mismatch_is_named_at_once(tmp_path):
    tensors = hf_tensors(HF_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"]  # missing
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, D_MODEL + 1), np.float32)  # misshapen
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.zeros(8, np.float32)  # unexpected (a Qwen 3 tensor)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)  # a buffer: ignored
    with pytest.raises(tree_lib.TreeMismatchError) as error:
        llama_hf.load(write_dir(tmp_path / "bad", tensors, HF_CONFIG))
    message = str(error.value)
    for expected in [
        "n_kv_head=2",
        "missing:        model.layers.1.mlp.up_proj.weight",
        "unexpected:     model.layers.0.self_attn.q_norm.weight",
        f"shape mismatch: model.layers.0.self_attn.k_proj.weight: expected (16, {D_MODEL}), got (16, {D_MODEL + 1})",
    ]:
        assert expected in message, message
    assert "inv_freq" not in message and message.count("\n") == 3


def test_a_stored_tied_head_must_be_the_embedding(tmp_path):
    hf_config = HF_CONFIG | {"tie_word_embeddings": True}
    tensors = hf_tensors(hf_config)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    llama_hf.load(write_dir(tmp_path / "tied", tensors, hf_config))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        llama_hf.load(write_dir(tmp_path / "untied", tensors, hf_config))


def test_unsupported_settings_in_config_json_are_listed_together():
    bad = HF_CONFIG | {
        "attention_bias": True,
        "hidden_act": "gelu",
        "head_dim": 16,
        "rope_scaling": {"rope_type": "yarn"},
    }
    with pytest.raises(ValueError) as error:
        llama_hf.config_from_hf(bad, source="x/config.json")
    for expected in [
        "x/config.json: unsupported",
        "attention_bias=true",
        "hidden_act 'gelu'",
        "head_dim=16",
        "rope_type 'yarn'",
    ]:
        assert expected in str(error.value)
    with pytest.raises(ValueError, match=r"missing \['num_hidden_layers'\]"):
        llama_hf.config_from_hf({k: v for k, v in HF_CONFIG.items() if k != "num_hidden_layers"})


@pytest.mark.parametrize(
    "scaling",
    [None, rotary.LinearScaling(2.0), rotary.Llama3Scaling(32.0, 1.0, 4.0, 8192)],
    ids=["none", "linear", "llama3"],
)
def test_config_round_trips(scaling):
    config = llama.LlamaConfig(
        vocab_size=VOCAB,
        n_layer=3,
        n_head=8,
        n_kv_head=2,
        d_model=64,
        d_ff=96,
        max_seq_len=128,
        rope_theta=500000.0,
        rope_scaling=scaling,
        norm_eps=1e-6,
    )
    assert llama_hf.config_from_hf(llama_hf.config_to_hf(config)) == config
    newer = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}  # transformers 5 moved rope_theta
    assert llama_hf.config_from_hf(HF_CONFIG | newer).rope_theta == 1e6


def test_directories_without_safetensors_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        llama_hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin is torch's pickle format"):
        llama_hf.load(tmp_path)
