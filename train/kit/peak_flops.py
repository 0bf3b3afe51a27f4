"""The accelerator's peak FLOP/s that MFU (model FLOPs utilisation) is a fraction of."""

import re

# Dense (no sparsity) bfloat16 peak FLOP/s by `jax.Device.device_kind`, first match wins: the vendors' data
# sheets. NVIDIA lists tensor-core rates "with sparsity", twice the dense ones: H100 SXM 1,979 TFLOPS, H100 PCIe
# 1,513, H100 NVL 1,671 (H100 datasheet); H200 SXM 1,979, H200 NVL 1,671 (H200 datasheet); L4 242 (L4 datasheet).
# A100 312 dense (A100 datasheet). Google Cloud's TPU pages: v4 275, v5e ("TPU v5 lite") 197, v5p ("TPU v5") 459.
PEAK_BF16_FLOPS = (
    (r"H100.*PCIe", 756e12),
    (r"H[12]00 NVL", 835e12),
    (r"H100|H200", 989e12),
    (r"A100", 312e12),
    (r"\bL4\b", 121e12),
    (r"TPU v4", 275e12),
    (r"TPU v5 ?(lite|e)", 197e12),
    (r"TPU v5", 459e12),
)


def accelerator_peak_flops(device_kind: str) -> float | None:
    """The dense bfloat16 peak of the accelerator `device_kind` names ("NVIDIA H100 80GB HBM3", "TPU v4"), or
    None for a device the table does not know (and for CPUs)."""
    return next((flops for pattern, flops in PEAK_BF16_FLOPS if re.search(pattern, device_kind)), None)


def peak_flops(given: float = 0.0) -> tuple[float | None, str]:
    """What MFU is a fraction of, and where that figure comes from: `given` (`--peak_flops`) when positive,
    else the accelerator's dense bfloat16 peak from its data sheet (`PEAK_BF16_FLOPS`, nanoGPT's convention),
    else None: a CPU, or an accelerator the table does not know, has no stable published peak to divide by.

    A rate measured at start-up is not used: on a shared machine it moved from 14 to 86 GFLOP/s between runs,
    so the same step read as 1% or 124% MFU. A figure a user cannot trust is worse than none."""
    if given > 0:
        return given, f"MFU against {given / 1e12:g} TFLOP/s (--peak_flops)"
    import jax

    device = jax.devices()[0]
    table = accelerator_peak_flops(device.device_kind) if device.platform != "cpu" else None
    if table is None:
        return None, f"no MFU: {device.device_kind!r} has no known peak (--peak_flops=FLOP/s sets one)"
    return table, f"MFU against {table / 1e12:g} TFLOP/s ({device.device_kind}, dense bfloat16, data sheet)"
