"""models.dit_diffusers against a foreign file layout: a diffusers `DiTTransformer2DModel` directory written here
with the `safetensors` reference library (names and shapes from diffusers' module tree, not from the importer's
tables), and an independent float64 numpy forward of diffusers' DiT on it (NCHW, the patch convolution, separate
q/k/v, flipped timestep features with frequency shift 1, a per-block embedder, the three LayerNorm epsilons).
Then the round trip back to that file, and every refusal."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest
import safetensors.numpy as reference

from models import dit, dit_diffusers
from purejax import tree as tree_lib

HF_CONFIG = {
    "_class_name": "DiTTransformer2DModel",
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 2,
    "out_channels": 4,
    "num_layers": 2,
    "dropout": 0.0,
    "norm_num_groups": 32,
    "attention_bias": True,
    "sample_size": 8,
    "patch_size": 2,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 5,
    "upcast_attention": False,
    "norm_type": "ada_norm_zero",
    "norm_elementwise_affine": False,
    "norm_eps": 0.1,
}
# norm_eps 0.1, not the default 1e-5: large enough that a norm using the wrong epsilon fails the comparison.
D, P, C, C_OUT, L, CLASSES, FREQ = 32, 2, 2, 4, 2, 5, 256
EMB = "norm1.emb."


def diffusers_state_dict(seed=0) -> dict[str, np.ndarray]:
    """Random float32 weights under diffusers' names; the embedder is one, copied into every block."""
    rng = np.random.default_rng(seed)

    def w(*shape):  # (out, in) or a bias; scaled so activations stay of order 1
        return (rng.normal(size=shape) / math.sqrt(shape[-1] if len(shape) > 1 else 10)).astype(np.float32)

    sd = {
        "pos_embed.proj.weight": w(D, C, P, P),
        "pos_embed.proj.bias": w(D),
        "proj_out_1.weight": w(2 * D, D),
        "proj_out_1.bias": w(2 * D),
        "proj_out_2.weight": w(P * P * C_OUT, D),
        "proj_out_2.bias": w(P * P * C_OUT),
    }
    emb = {
        "timestep_embedder.linear_1.weight": w(D, FREQ),
        "timestep_embedder.linear_1.bias": w(D),
        "timestep_embedder.linear_2.weight": w(D, D),
        "timestep_embedder.linear_2.bias": w(D),
        "class_embedder.embedding_table.weight": w(CLASSES + 1, D),
    }
    for i in range(L):
        block = {
            "norm1.linear.weight": w(6 * D, D),
            "norm1.linear.bias": w(6 * D),
            "ff.net.0.proj.weight": w(4 * D, D),
            "ff.net.0.proj.bias": w(4 * D),
            "ff.net.2.weight": w(D, 4 * D),
            "ff.net.2.bias": w(D),
        }
        for name in ("to_q", "to_k", "to_v", "to_out.0"):
            block[f"attn1.{name}.weight"], block[f"attn1.{name}.bias"] = w(D, D), w(D)
        block.update({EMB + k: v.copy() for k, v in emb.items()})
        sd.update({f"transformer_blocks.{i}.{k}": v for k, v in block.items()})
    return sd


def write_model(directory, sd=None, config=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG if config is None else config))
    reference.save_file(
        diffusers_state_dict() if sd is None else sd, directory / dit_diffusers.WEIGHTS_FILE, metadata={"format": "pt"}
    )
    return directory


# ---------------------------------------------------------------- diffusers' DiT in float64 numpy


def layer_norm(x, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def positions(d, grid):
    """diffusers' get_2d_sincos_pos_embed: meshgrid(w, h), the first half embeds grid[0] (the column)."""

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    mesh = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))  # (w, h)
    return np.concatenate([one_d(d // 2, mesh[0]), one_d(d // 2, mesh[1])], axis=1)


def timestep_features(t, dim=FREQ):
    """get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=1)."""
    half = dim // 2
    args = np.asarray(t, np.float64)[:, None] * np.exp(-math.log(10000) * np.arange(half) / (half - 1))[None]
    return np.concatenate([np.cos(args), np.sin(args)], axis=-1)


def numpy_forward(sd, x, t, y, norm_eps):
    """DiTTransformer2DModel.forward on NCHW `x`, from diffusers' modules (attention written out per head)."""
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    lin = lambda a, name: a @ sd[name + ".weight"].T + sd[name + ".bias"]  # noqa: E731
    b, g, hd = x.shape[0], x.shape[2] // P, D // 2
    patches = x.reshape(b, C, g, P, g, P)
    h = np.einsum("bcipjq,dcpq->bijd", patches, sd["pos_embed.proj.weight"]).reshape(b, g * g, D)
    h = h + sd["pos_embed.proj.bias"] + positions(D, g)

    def conditioning(i):
        e = f"transformer_blocks.{i}.{EMB}"
        temb = lin(silu(lin(timestep_features(t), e + "timestep_embedder.linear_1")), e + "timestep_embedder.linear_2")
        return temb + sd[e + "class_embedder.embedding_table.weight"][y]

    for i in range(L):
        blk = f"transformer_blocks.{i}."
        chunks = np.split(lin(silu(conditioning(i)), blk + "norm1.linear"), 6, axis=1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (c[:, None] for c in chunks)
        a = layer_norm(h, 1e-6) * (1 + scale_msa) + shift_msa  # AdaLayerNormZero's own norm: eps 1e-6
        q, k, v = (lin(a, blk + f"attn1.to_{n}").reshape(b, -1, 2, hd).transpose(0, 2, 1, 3) for n in "qkv")
        logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        attn = ((probs / probs.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(b, -1, D)
        h = h + gate_msa * lin(attn, blk + "attn1.to_out.0")
        m = layer_norm(h, norm_eps) * (1 + scale_mlp) + shift_mlp  # norm3: the config's norm_eps
        h = h + gate_mlp * lin(gelu_tanh(lin(m, blk + "ff.net.0.proj")), blk + "ff.net.2")
    shift, scale = (c[:, None] for c in np.split(lin(silu(conditioning(0)), "proj_out_1"), 2, axis=1))
    out = lin(layer_norm(h, 1e-6) * (1 + scale) + shift, "proj_out_2")  # norm_out: eps 1e-6
    out = np.einsum("nhwpqc->nchpwq", out.reshape(b, g, g, P, P, C_OUT))
    return out.reshape(b, C_OUT, g * P, g * P)


# ---------------------------------------------------------------- tests


def test_forward_matches_numpy_on_a_diffusers_file(tmp_path):
    params, config = dit_diffusers.load(write_model(tmp_path / "dit"))
    assert (config.d_model, config.n_layer, config.n_head, config.freq_shift) == (D, L, 2, 1.0)
    assert config.mlp_norm_eps == 0.1
    assert config.learn_sigma and config.n_classes == CLASSES
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, C, 8, 8))
    t, y = np.array([0, 37, 999]), np.array([0, 4, CLASSES])  # DDPM's integer steps; the last label is null
    out = jax.jit(dit.apply, static_argnames="config")(params, x.transpose(0, 2, 3, 1).astype(np.float32), t, y, config)
    want = numpy_forward(diffusers_state_dict(), x, t, y, norm_eps=0.1)
    np.testing.assert_allclose(np.asarray(out).transpose(0, 3, 1, 2), want, rtol=1e-4, atol=1e-4)


def test_export_writes_back_the_same_file(tmp_path):
    """load then save reproduces every tensor bit for bit under its name (per-block copies included), and a
    config.json with the same settings; a pipeline directory (model_index.json + transformer/) loads too."""
    write_model(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    params, config = dit_diffusers.load(tmp_path / "pipe")
    dit_diffusers.save(params, config, tmp_path / "out")
    written = reference.load_file(tmp_path / "out" / dit_diffusers.WEIGHTS_FILE)
    original = diffusers_state_dict()
    assert sorted(written) == sorted(original)
    for name, value in original.items():
        assert written[name].dtype == value.dtype and written[name].shape == value.shape, name
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: saved[k] for k in HF_CONFIG} == HF_CONFIG
    assert dit_diffusers.load(tmp_path / "out")[1] == config


def test_a_converted_dit_config_with_the_old_class_name_loads():
    """diffusers' first DiT conversions are Transformer2DModel configs without norm_eps (then 1e-5)."""
    old = {
        **{k: v for k, v in HF_CONFIG.items() if k != "norm_eps"},
        "_class_name": "Transformer2DModel",
        "cross_attention_dim": None,
        "num_vector_embeds": None,
    }
    config = dit_diffusers.config_from_diffusers(old, time_scale=1000.0)
    assert config.mlp_norm_eps == 1e-5 and config.time_scale == 1000.0 and config.freq_shift == 1.0
    with pytest.raises(ValueError, match="sample_size=None is not a positive int"):
        dit_diffusers.config_from_diffusers({k: v for k, v in old.items() if k != "sample_size"})


def test_differing_per_block_embedders_are_refused(tmp_path):
    sd = diffusers_state_dict()
    name = f"transformer_blocks.1.{EMB}timestep_embedder.linear_1.weight"
    sd[name] = sd[name] + np.float32(0.01)
    with pytest.raises(ValueError, match=r"(?s)every block.*" + name.replace(".", r"\.") + ": max .* 0.01"):
        dit_diffusers.load(write_model(tmp_path / "dit", sd))


def test_every_mismatched_tensor_is_named(tmp_path):
    sd = diffusers_state_dict()
    del sd["transformer_blocks.1.attn1.to_k.bias"]
    sd["transformer_blocks.0.norm2.weight"] = np.ones(D, np.float32)  # an affine norm this model does not have
    sd["proj_out_2.weight"] = sd["proj_out_2.weight"][:8]  # learned sigma dropped from the weights only
    with pytest.raises(tree_lib.TreeMismatchError) as error:
        dit_diffusers.load(write_model(tmp_path / "dit", sd))
    message = str(error.value)
    assert "missing:        transformer_blocks.1.attn1.to_k.bias" in message
    assert "unexpected:     transformer_blocks.0.norm2.weight" in message
    assert "shape mismatch: proj_out_2.weight: expected (16, 32), got (8, 32)" in message


def test_a_saved_position_table_must_be_dits(tmp_path):
    sd = diffusers_state_dict()
    sd["pos_embed.pos_embed"] = positions(D, 4)[None].astype(np.float32)
    dit_diffusers.load(write_model(tmp_path / "ok", sd))
    sd["pos_embed.pos_embed"] = 2 * sd["pos_embed.pos_embed"]
    with pytest.raises(ValueError, match="pos_embed.pos_embed of shape .* is not DiT's fixed 2-D sin-cos table"):
        dit_diffusers.load(write_model(tmp_path / "bad", sd))


def test_unsupported_settings_are_listed_together():
    bad = {**HF_CONFIG, "norm_type": "ada_norm", "activation_fn": "geglu", "cross_attention_dim": 768}
    with pytest.raises(ValueError, match="(?s)norm_type='ada_norm'.*activation_fn='geglu'.*cross_attention_dim=768"):
        dit_diffusers.config_from_diffusers(bad)
    with pytest.raises(ValueError, match="out_channels=3"):
        dit_diffusers.config_from_diffusers({**HF_CONFIG, "out_channels": 3})
    with pytest.raises(ValueError, match="'UNet2DModel' is not a diffusers DiT"):
        dit_diffusers.config_from_diffusers({**HF_CONFIG, "_class_name": "UNet2DModel"})


def test_export_refuses_what_diffusers_cannot_express(tmp_path):
    config = dit.DiTConfig(
        input_size=8,
        patch_size=2,
        in_channels=2,
        d_model=32,
        n_layer=1,
        n_head=2,
        n_classes=5,
        mlp_ratio=2.0,
        n_mixer=1,
    )  # freq_shift 0: DiT's own convention
    params = jax.jit(dit.init, static_argnames="config")(jax.random.key(0), config)
    with pytest.raises(ValueError, match="(?s)n_mixer=1.*mlp_ratio=2.0.*freq_shift=0.0"):
        dit_diffusers.save(params, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="freq_shift=0.0"):  # nor is such a config used to read a diffusers file
        dit_diffusers.from_diffusers(diffusers_state_dict(), dataclasses.replace(config, n_mixer=0, mlp_ratio=4.0))


def test_a_directory_without_weights_says_what_it_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="(?s)found .*diffusion_pytorch_model.bin.*pickle"):
        dit_diffusers.load(tmp_path)
