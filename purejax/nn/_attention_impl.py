"""Which code computes attention (`purejax.nn.attention.attend`) on this backend, and why.

Three implementations compute the same softmax(q k^T / sqrt(head_dim)) v: the "einsum" formulation written out
in purejax (the only one that drops attention probabilities), XLA's fused `jax.nn.dot_product_attention`, and
cuDNN's flash attention (the same function with `implementation="cudnn"`), which never materialises the
(seq, seq) logits and skips the masked half of a causal mask. cuDNN runs only when asked for by name (JAX's
default is XLA's on every backend), so `impl="auto"` asks for it on an NVIDIA GPU whenever the inputs qualify,
and says once why not when they do not. The limits are those `jax.nn.dot_product_attention` checks before
calling cuDNN (jax/_src/cudnn/fused_attention_stablehlo.py: `check_layout`, `check_is_flash_attention`).
"""

import functools
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

How = Literal["einsum", "xla", "cudnn"]


@dataclass(frozen=True)
class Backend:
    """What the choice depends on: the platform ("cpu", "gpu", "tpu") and, on an NVIDIA GPU, its CUDA compute
    capability ("9.0" for an H100); None on other platforms and on AMD GPUs (no cuDNN there)."""

    platform: str
    compute_capability: str | None = None


def this_backend() -> Backend:
    """The default backend, as `choose` reads it."""
    platform = jax.default_backend()
    capability = getattr(jax.devices()[0], "compute_capability", None) if platform == "gpu" else None
    return Backend(platform, capability if re.fullmatch(r"\d+\.\d+", str(capability)) else None)


def choose(impl: str, backend: Backend, dtype: Any, head_dim: int, *, dropout: bool, masked: bool) -> tuple[How, str]:
    """(the implementation, why) for `AttentionConfig.impl` (`impl`). A pure function of its arguments.

    Arguments:
        dtype: the dtype of q, k and v.
        dropout: whether attention probabilities are dropped in this call.
        masked: whether a mask other than the causal one of self-attention applies (a padding mask, a cache's
            filled positions): cuDNN would read it as an additive bias, so XLA's path takes it instead.
    """
    if impl == "einsum":
        return "einsum", "asked for (impl='einsum')"
    if dropout:
        return "einsum", "dropout on the attention probabilities: only the einsum formulation drops them"
    if impl == "fused":
        return "xla", "asked for (impl='fused')"
    if backend.platform == "cpu" and dtype == jnp.float16:
        return "einsum", "XLA:CPU cannot compile fused attention in float16 ('F16_F16_F32 not supported')"
    if backend.platform != "gpu":
        return "xla", f"cuDNN runs only on NVIDIA GPUs, this backend is {backend.platform!r}"
    refusal = cudnn_refusal(backend, dtype, head_dim, masked=masked)
    return ("xla", refusal) if refusal else ("cudnn", "an NVIDIA GPU and inputs cuDNN's flash attention takes")


def cudnn_refusal(backend: Backend, dtype: Any, head_dim: int, *, masked: bool) -> str | None:
    """Why cuDNN's flash attention cannot take these inputs on this GPU, or None when it can."""
    if backend.compute_capability is None:
        return "not an NVIDIA GPU (no CUDA compute capability), so no cuDNN"
    capability = tuple(int(part) for part in backend.compute_capability.split("."))
    if capability < (8, 0):
        return f"compute capability {backend.compute_capability}: cuDNN's flash attention needs 8.0 (Ampere) or newer"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (
            f"{jnp.dtype(dtype).name} inputs: cuDNN's flash attention takes bfloat16 or float16 "
            "(train with --dtype=bfloat16, or --dtype=auto on a GPU)"
        )
    largest = 256 if capability >= (9, 0) else 128  # Hopper and newer take the larger heads
    if head_dim % 8 or head_dim > largest:
        return f"head_dim {head_dim}: cuDNN's flash attention needs a multiple of 8, at most {largest} on this GPU"
    if masked:
        return "a mask besides the causal one (padding, or a cache's filled positions) would be an additive bias"
    return None


@functools.cache
def note_fallback(why: str) -> None:
    """Warn once per reason that attention on a GPU takes XLA's path rather than cuDNN's."""
    warnings.warn(f"purejax.nn.attention on a GPU: XLA's attention, not cuDNN's flash attention: {why}", stacklevel=2)


def pick(impl: str, q: Float[Array, "batch seq n_head head_dim"], *, dropout: bool, masked: bool) -> How:
    """`choose` for the queries `q` on this backend; on a GPU, notes once why "auto" did not take cuDNN."""
    backend = this_backend()
    how, why = choose(impl, backend, q.dtype, q.shape[-1], dropout=dropout, masked=masked)
    if backend.platform == "gpu" and impl == "auto" and how != "cudnn":
        note_fallback(why)
    return how
