"""What changes by itself on an accelerator, tested on a CPU: `--dtype=auto` (bfloat16 compute on a GPU or
TPU, float32 on a CPU), resolved once, printed and recorded in the checkpoint; and the table of bfloat16 peaks
that MFU is against. (cuDNN attention: tests/purejax/nn/test_attention.py.)"""

import jax
import pytest

from purejax import checkpoint
from purejax.precision import resolve_compute_dtype
from train.kit import peak_flops


@pytest.mark.parametrize(
    "name, platform, expected",
    [
        ("auto", "cpu", "float32"),
        ("auto", "gpu", "bfloat16"),
        ("auto", "tpu", "bfloat16"),
        ("float32", "gpu", "float32"),
        ("float16", "cpu", "float16"),
        ("bfloat16", "cpu", "bfloat16"),
    ],
)
def test_auto_compute_dtype_by_platform(name, platform, expected):
    assert resolve_compute_dtype(name, platform) == expected


@pytest.mark.parametrize(
    "device_kind, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),  # H100 SXM
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100-PCIE-40GB", 312),
        ("NVIDIA L4", 121),
        ("TPU v4", 275),
        ("TPU v5 lite", 197),  # v5e
        ("TPU v5", 459),  # v5p
        ("NVIDIA L40S", None),  # not in the table (and not an L4)
        ("cpu", None),
    ],
)
def test_peak_table_by_device_kind(device_kind, tflops):
    peak = peak_flops.accelerator_peak_flops(device_kind)
    assert peak == (None if tflops is None else tflops * 1e12)


@pytest.mark.parametrize("platform, expected", [("cpu", "float32"), ("gpu", "bfloat16")])
def test_train_gpt_resolves_auto_once_prints_and_records_it(tmp_path, monkeypatch, capsys, platform, expected):
    """`python -m train.gpt` with the default --dtype=auto on a (pretended) GPU trains in bfloat16,
    says so, and records the dtype that ran in the checkpoint's config; on a CPU, float32 as before."""
    from pydoc_data.topics import topics

    from train import gpt

    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(topics[k] for k in sorted(topics))[:20_000])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    gpt.main(
        [
            "--config=gpt_tiny",
            "--progress=false",
            "--peak_flops=1e11",
            f"--dataset={corpus}",
            "--out_dir=run",
            "--max_iters=1",
            "--eval_interval=1",
            "--eval_iters=1",
        ]
    )
    assert f"dtype: {expected} compute, float32 params, on {platform}" in capsys.readouterr().out
    info = checkpoint.read_metadata(tmp_path / "run" / "ckpt_00000001.msgpack")
    assert info.config["train"]["dtype"] == expected
    params = checkpoint.restore(tmp_path / "run" / "ckpt_00000001.msgpack")[0].params
    assert {leaf.dtype.name for leaf in jax.tree.leaves(params)} == {"float32"}  # float32 master weights
