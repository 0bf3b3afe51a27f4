"""Test-session set-up: run-time shape and type checking of everything in `purejax` and `models`.

jaxtyping's import hook decorates every annotated function in those packages with beartype as they are
imported, so a wrong shape or dtype fails at the call with the argument's name. It must be installed before
anything imports purejax, which is why it lives here, at the top of the root conftest. Training runs outside
the tests do not pay for it.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtyping import install_import_hook  # noqa: E402

install_import_hook(["purejax", "models"], "beartype.beartype")
