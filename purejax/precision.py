"""A dtype policy: which dtype parameters are stored in, which the computation runs in, which outputs leave in.

    policy = Policy.from_string("params=float32,compute=bfloat16,output=float32")
    apply_bf16 = with_policy(model.apply, policy)

Only floating-point arrays are cast; integer inputs (token ids), bools and keys pass through. Whatever the
compute dtype, purejax's norms, softmax and losses upcast to float32 internally: their reductions are where
low precision hurts first. `cast=` names the arguments to cast when some floating inputs must stay as they
are (a diffusion time step, BatchNorm's running statistics):

    loss = with_policy(loss_fn, policy, cast=("params", "batch"))   # model_state and key pass through
"""

import inspect
from collections.abc import Callable, Collection
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


def resolve_compute_dtype(name: str, platform: str) -> str:
    """A compute dtype's name, with "auto" made concrete for `platform` (`jax.default_backend()`): bfloat16 on
    a GPU or TPU, whose matrix units run it at several times their float32 rate (mixed precision with float32
    params, as nanoGPT trains on a GPU), float32 on a CPU. Other names are returned as they are."""
    if name != "auto":
        return name
    return "bfloat16" if platform in ("gpu", "tpu") else "float32"


def with_policy(apply: Callable, policy: Policy, *, cast: Collection[str | int] | None = None) -> Callable:
    """`apply` run under `policy`: floating array arguments are cast to the compute dtype, floating outputs to
    the output dtype. Non-array arguments (configs, flags, keys) are passed through untouched.

    Arguments:
        cast: the arguments to cast, by name or by position in `apply`'s signature, e.g. `("params", "x")`
            or `(0, 1)`; the others pass through as they are. None (the default): every argument that holds
            floating arrays.
    """
    if cast is None:
        selected = None
    else:
        signature, selected = _selected_parameters(apply, cast)

    def cast_arg(x: Any) -> Any:
        return policy.cast_to_compute(x) if _has_arrays(x) else x

    @wraps(apply)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if selected is None:
            args = tuple(cast_arg(a) for a in args)
            kwargs = {k: cast_arg(v) for k, v in kwargs.items()}
        else:
            bound = signature.bind(*args, **kwargs)
            for name in selected & set(bound.arguments):
                bound.arguments[name] = cast_arg(bound.arguments[name])
            args, kwargs = bound.args, bound.kwargs
        return policy.cast_to_output(apply(*args, **kwargs))

    return wrapped


def _selected_parameters(apply: Callable, cast: Collection[str | int]) -> tuple[inspect.Signature, set[str]]:
    """`apply`'s signature and the names of the parameters `cast` selects; unknown names or positions raise."""
    if isinstance(cast, (str, int)):
        raise TypeError(f"with_policy: cast must be a collection of argument names or positions, e.g. ({cast!r},)")
    try:
        signature = inspect.signature(apply)
    except (TypeError, ValueError) as e:
        raise TypeError(f"with_policy(cast=...) needs {apply!r}'s signature to find the arguments: {e}") from None
    names = [n for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    selected, unknown = set(), []
    for item in cast:
        if isinstance(item, int) and not isinstance(item, bool) and -len(names) <= item < len(names):
            selected.add(names[item])
        elif isinstance(item, str) and item in names:
            selected.add(item)
        else:
            unknown.append(item)
    if unknown:
        name = getattr(apply, "__name__", type(apply).__name__)
        raise ValueError(f"with_policy: cast names {unknown}, which are not parameters of {name} (those are {names})")
    return signature, selected


def _has_arrays(x: Any) -> bool:
    return any(hasattr(leaf, "dtype") for leaf in jax.tree_util.tree_leaves(x))
