"""purejax.nn's layers against torch itself: the layer built by torch with torch's own initialisation, its
weights copied across by the rule docs/migration-pytorch.md states for it, then the forward values, the input's
gradient and every weight's gradient compared, for a random cotangent, to float32 rounding. Odd sizes, strides,
paddings, dilations and groups; torch's channels-first images moved to channels last.

torch is not a test dependency (PyPI's torch pulls gigabytes of CUDA packages; the bench extra pins a CPU
build), so this file runs where torch is installed and is skipped elsewhere; the numpy references of each
layer's own test file run everywhere."""

from collections.abc import Callable

import jax
import numpy as np
import pytest

from purejax.nn import (
    conv,
    conv_transpose,
    cross_attention,
    encoder_block,
    group_norm,
    gru,
    instance_norm,
    lstm,
    patch_embedding,
    recurrent,
    upsample,
)
from purejax.nn.attention import qkv_permutation

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOL = dict(rtol=2e-5, atol=2e-5)


def channels_last(a: np.ndarray) -> np.ndarray:
    return np.moveaxis(a, 1, -1)


def same(a: np.ndarray) -> np.ndarray:
    return a


def compare(
    torch_fn: Callable,
    weights: dict,
    convert: Callable[[dict], dict],
    purejax_fn: Callable,
    x,
    move: Callable[[np.ndarray], np.ndarray] = channels_last,
    move_out: Callable[[np.ndarray], np.ndarray] | None = None,
) -> None:
    """torch_fn(x) against purejax_fn(convert(weights), move(x)): outputs, the input's gradient and the weights'
    gradients (torch's mapped by `convert`, a permutation or reshape, so the same rule maps gradients)."""
    move_out = move_out or move
    for w in weights.values():
        w.grad = None  # a module compared twice starts from no gradient each time
    x = x.detach().requires_grad_()
    y = torch_fn(x)
    cotangent = torch.randn_like(y)
    y.backward(cotangent)
    params = convert({name: w.detach().numpy() for name, w in weights.items()})
    y_ours, vjp = jax.vjp(purejax_fn, params, move(x.detach().numpy()))
    np.testing.assert_allclose(y_ours, move_out(y.detach().numpy()), **TOL)
    grad_params, grad_x = vjp(move_out(cotangent.numpy()))
    np.testing.assert_allclose(grad_x, move(x.grad.numpy()), **TOL)
    want = convert({name: w.grad.numpy() for name, w in weights.items()})
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), grad_params, want)


def conv_weights(module) -> dict:
    return {"w": module.weight, "b": module.bias}


@pytest.mark.parametrize(
    "dims, stride, padding, dilation, groups",
    [(1, 2, 1, 1, 1), (2, (2, 1), (1, 2), (1, 2), 3), (3, 1, 1, 2, 1), (2, 3, 0, 1, 1)],
)
def test_conv(dims, stride, padding, dilation, groups):
    torch.manual_seed(0)
    module = getattr(torch.nn, f"Conv{dims}d")(
        3, 6, 3, stride=stride, padding=padding, dilation=dilation, groups=groups
    )
    x = torch.randn(2, 3, *[9, 8, 7][:dims])
    order = (*range(2, 2 + dims), 1, 0)  # (out, in/groups, *k) to (*k, in/groups, out)
    pads = [(p, p) for p in np.broadcast_to(padding, (dims,)).tolist()]

    def apply(params, x):
        return conv.apply(params, x, stride=stride, padding=pads, dilation=dilation, groups=groups)

    compare(module, conv_weights(module), lambda w: {"w": w["w"].transpose(order), "b": w["b"]}, apply, x)


@pytest.mark.parametrize(
    "dims, stride, padding, output_padding, dilation, groups",
    [(1, 2, 1, 1, 1, 1), (2, (2, 3), (1, 0), (1, 2), 1, 2), (3, 2, 1, 0, 2, 1)],
)
def test_conv_transpose(dims, stride, padding, output_padding, dilation, groups):
    torch.manual_seed(1)
    cls = getattr(torch.nn, f"ConvTranspose{dims}d")
    options = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation, groups=groups)
    module = cls(4, 6, 3, **options)
    x = torch.randn(2, 4, *[7, 6, 5][:dims])
    order = (*range(2, 2 + dims), 0, 1)  # (in, out/groups, *k) to (*k, in, out/groups)

    def apply(params, x):
        return conv_transpose.apply(params, x, **options)

    compare(module, conv_weights(module), lambda w: {"w": w["w"].transpose(order), "b": w["b"]}, apply, x)


def test_group_norm_and_instance_norm():
    torch.manual_seed(2)
    module = torch.nn.GroupNorm(3, 6, eps=1e-4)
    with torch.no_grad():
        module.weight.normal_(), module.bias.normal_()  # not the identity, so the scale and bias are exercised
    x = torch.randn(2, 6, 5, 3) * 3 + 1
    norm_weights = {"scale": module.weight, "bias": module.bias}
    apply = lambda p, x: group_norm.apply(p, x, num_groups=3, eps=1e-4)  # noqa: E731
    compare(module, norm_weights, same, apply, x)
    one_d = lambda p, x: group_norm.apply(p, x, num_groups=3, eps=1e-4, spatial_dims=1)  # noqa: E731
    compare(module, norm_weights, same, one_d, torch.randn(4, 6, 9))
    instance = torch.nn.InstanceNorm1d(4)
    compare(instance, {}, same, lambda p, x: instance_norm.apply(p, x, spatial_dims=1), torch.randn(3, 4, 7))


@pytest.mark.parametrize(
    "shape, mode, options",
    [
        ((2, 3, 5), "nearest", dict(scale_factor=3)),
        ((1, 2, 4, 3), "nearest", dict(size=(7, 5))),
        ((1, 2, 3, 2, 4), "nearest", dict(scale_factor=2)),
        ((2, 3, 4, 3), "bilinear", dict(scale_factor=2)),
        ((1, 2, 4, 3), "bilinear", dict(size=(7, 5))),
        ((1, 1, 6, 5), "bilinear", dict(size=(4, 3))),
    ],
)
def test_upsample(shape, mode, options):
    resize = getattr(upsample, mode)
    spatial = {"spatial_dims": len(shape) - 2} if mode == "nearest" else {}
    extra = {"align_corners": False} if mode == "bilinear" else {}
    torch_fn = lambda x: F.interpolate(x, mode=mode, **options, **extra)  # noqa: E731
    compare(torch_fn, {}, same, lambda p, x: resize(x, **options, **spatial), torch.randn(*shape))


def test_cross_attention_with_a_key_padding_mask():
    torch.manual_seed(3)
    d, heads, d_context = 8, 2, 6
    module = torch.nn.MultiheadAttention(d, heads, kdim=d_context, vdim=d_context, batch_first=True)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])  # torch: True at padding
    config = cross_attention.CrossAttentionConfig(d_model=d, n_head=heads, d_context=d_context)
    context = torch.randn(2, 5, d_context)
    weights = {
        "q": module.q_proj_weight,
        "k": module.k_proj_weight,
        "v": module.v_proj_weight,
        "in_b": module.in_proj_bias,
        "proj": module.out_proj.weight,
        "proj_b": module.out_proj.bias,
    }

    def convert(w):
        head_dim = d // heads
        k, v = (w[name].T.reshape(d_context, heads, 1, head_dim) for name in ("k", "v"))
        kv_b = w["in_b"][d:].reshape(2, heads, head_dim).transpose(1, 0, 2).reshape(-1)
        return {
            "q": {"w": w["q"].T, "b": w["in_b"][:d]},
            "kv": {"w": np.concatenate([k, v], axis=2).reshape(d_context, 2 * d), "b": kv_b},
            "proj": {"w": w["proj"].T, "b": w["proj_b"]},
        }

    torch_fn = lambda x: module(x, context, context, key_padding_mask=padding, need_weights=False)[0]  # noqa: E731

    def apply(params, x):
        return cross_attention.apply(params, x, context.numpy(), config, kv_mask=~padding.numpy())

    compare(torch_fn, weights, convert, apply, torch.randn(2, 4, d), move=same)


def test_encoder_block_is_torchs_pre_norm_encoder_layer():
    torch.manual_seed(4)
    d, heads, d_ff = 12, 3, 20
    module = torch.nn.TransformerEncoderLayer(
        d, heads, d_ff, dropout=0.0, activation="gelu", norm_first=True, batch_first=True
    )
    config = encoder_block.EncoderBlockConfig(d_model=d, n_head=heads, d_ff=d_ff)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    named = dict(module.named_parameters())
    perm = qkv_permutation(config.attention)

    def convert(w):
        norm = lambda name: {"scale": w[f"{name}.weight"], "bias": w[f"{name}.bias"]}  # noqa: E731
        linear = lambda name: {"w": w[f"{name}.weight"].T, "b": w[f"{name}.bias"]}  # noqa: E731
        qkv = {"w": w["self_attn.in_proj_weight"].T[:, perm], "b": w["self_attn.in_proj_bias"][perm]}
        return {
            "ln_1": norm("norm1"),
            "attn": {"qkv": qkv, "proj": linear("self_attn.out_proj")},
            "ln_2": norm("norm2"),
            "mlp": {"fc": linear("linear1"), "proj": linear("linear2")},
        }

    module.eval()  # the fast path is off under autograd anyway; eval so no dropout whatever the defaults
    torch_fn = lambda x: module(x, src_key_padding_mask=padding)  # noqa: E731
    apply = lambda p, x: encoder_block.apply(p, x, config, kv_mask=~padding.numpy())  # noqa: E731
    compare(torch_fn, named, convert, apply, torch.randn(2, 6, d), move=same)


def test_patch_embedding_is_a_strided_convolution():
    torch.manual_seed(5)
    module = torch.nn.Conv2d(3, 8, kernel_size=4, stride=4)
    torch_fn = lambda x: module(x).flatten(2).transpose(1, 2)  # noqa: E731
    convert = lambda w: {"w": w["w"].transpose(2, 3, 1, 0).reshape(-1, 8), "b": w["b"]}  # noqa: E731
    apply = lambda p, x: patch_embedding.apply(p, x, patch_size=4)  # noqa: E731
    compare(torch_fn, conv_weights(module), convert, apply, torch.randn(2, 3, 8, 12), move_out=same)


def recurrent_weights(module, suffix: str = "") -> dict:
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return {f"{name}{suffix}": getattr(module, f"{name}_l0{suffix}") for name in names}


def recurrent_params(w: dict, suffix: str = "") -> dict:
    return {
        "w_ih": w[f"weight_ih{suffix}"].T,
        "w_hh": w[f"weight_hh{suffix}"].T,
        "b_ih": w[f"bias_ih{suffix}"],
        "b_hh": w[f"bias_hh{suffix}"],
    }


@pytest.mark.parametrize("layer", [lstm, gru], ids=["lstm", "gru"])
def test_recurrent_layers_with_an_initial_state(layer):
    torch.manual_seed(6)
    module = (torch.nn.LSTM if layer is lstm else torch.nn.GRU)(5, 7, batch_first=True)
    h0, c0 = torch.randn(1, 3, 7), torch.randn(1, 3, 7)
    torch_state = (h0, c0) if layer is lstm else h0
    state = {"h": h0[0].numpy(), "c": c0[0].numpy()} if layer is lstm else {"h": h0[0].numpy()}
    torch_fn = lambda x: module(x, torch_state)[0]  # noqa: E731
    apply = lambda p, x: layer.apply(p, x, state)[0]  # noqa: E731
    compare(torch_fn, recurrent_weights(module), recurrent_params, apply, torch.randn(3, 6, 5), move=same)


def test_bidirectional_gru_over_packed_sequences():
    """torch's bidirectional GRU over a packed batch of different lengths, as `recurrent.bidirectional` with
    `lengths`: the outputs at the real steps (torch pads the rest with zeros, as purejax does)."""
    torch.manual_seed(7)
    module = torch.nn.GRU(4, 5, batch_first=True, bidirectional=True)
    lengths = torch.tensor([6, 3, 1])
    weights = {**recurrent_weights(module), **recurrent_weights(module, "_reverse")}

    def torch_fn(x):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = module(packed)
        return torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=6)[0]

    def convert(w):
        return {"forward": recurrent_params(w), "backward": recurrent_params(w, "_reverse")}

    zeros = {"forward": gru.init_state(3, 5), "backward": gru.init_state(3, 5)}
    apply = lambda p, x: recurrent.bidirectional(gru.apply, p, x, zeros, lengths=lengths.numpy())[0]  # noqa: E731
    compare(torch_fn, weights, convert, apply, torch.randn(3, 6, 4), move=same)
