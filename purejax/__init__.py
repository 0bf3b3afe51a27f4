"""purejax: a small pure-functional deep-learning framework for JAX.

Models are pairs of pure functions, `init(key, config) -> params` and `apply(params, inputs, ...) -> outputs`,
over plain nested dicts of arrays. See docs/design.md for the contract and why.
"""

__version__ = "0.1.0"

from purejax import losses, nn, precision, random, tree
