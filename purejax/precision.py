"""A dtype policy: which dtype parameters are stored in, which the computation runs in, which outputs leave in.

    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    apply_bf16 = with_policy(model.apply, policy)

Only floating-point arrays are cast; integer inputs (token ids), bools and keys pass through. Whatever the
compute dtype, purejax's norms, softmax and losses upcast to float32 internally: their reductions are where
low precision hurts first.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from purejax import tree as tree_lib

_ALIASES = {"params": "param_dtype", "param": "param_dtype", "compute": "compute_dtype", "output": "output_dtype"}


def _dtype(name: Any) -> np.dtype:
    try:
        dtype = jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"unknown dtype {name!r}; use a name such as float32, bfloat16 or float16") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"a policy dtype must be floating point, got {dtype.name}")
    return dtype


@dataclass(frozen=True)
class Policy:
    """Parameter, compute and output dtypes. Frozen and hashable, so it can be a static argument to jit."""

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, name, _dtype(getattr(self, name)))

    @classmethod
    def from_string(cls, spec: str) -> "Policy":
        """Parse `"params=float32,compute=bfloat16,output=float32"`; a bare dtype (`"bfloat16"`) sets all three.

        Omitted fields default to float32, so losses and metrics leave the model in full precision."""
        spec = spec.strip()
        if "=" not in spec:
            return cls(spec, spec, spec)
        fields = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, value = part.partition("=")
            if name.strip() not in _ALIASES:
                raise ValueError(f"unknown policy field {name.strip()!r} in {spec!r}; valid: params, compute, output")
            fields[_ALIASES[name.strip()]] = value.strip()
        return cls(**fields)

    def cast_to_param(self, tree: Any) -> Any:
        return tree_lib.cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        return tree_lib.cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return tree_lib.cast_floating(tree, self.output_dtype)

    def __str__(self) -> str:
        return f"params={self.param_dtype.name},compute={self.compute_dtype.name},output={self.output_dtype.name}"


def with_policy(apply: Callable, policy: Policy) -> Callable:
    """`apply` run under `policy`: floating params and array arguments are cast to the compute dtype, floating
    outputs to the output dtype. Non-array arguments (configs, flags, keys) are passed through untouched."""

    def cast_arg(x):
        return policy.cast_to_compute(x) if _has_arrays(x) else x

    @wraps(apply)
    def wrapped(*args, **kwargs):
        args = tuple(cast_arg(a) for a in args)
        kwargs = {k: cast_arg(v) for k, v in kwargs.items()}
        return policy.cast_to_output(apply(*args, **kwargs))

    return wrapped


def _has_arrays(x: Any) -> bool:
    return any(hasattr(leaf, "dtype") for leaf in jax.tree_util.tree_leaves(x))
