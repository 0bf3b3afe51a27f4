"""bench/gpt_generate.py without timing anything: the bytes and FLOPs of a cached decoding step, the two sides of
the roofline its step time is measured against, each counted a second, independent way."""

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from bench import gpt_generate, suite_compile
from models import gpt, gpt_decode
from tests.children import child_results

TINY = gpt.GPTConfig(block_size=16, vocab_size=11, n_layer=2, n_head=2, n_embd=8)
BENCH = gpt.GPTConfig(block_size=256, vocab_size=65, n_layer=6, n_head=6, n_embd=384)  # what the bench runs


def _shapes(config):
    return jax.eval_shape(lambda: gpt.init(jax.random.key(0), config))


def _dot_flops(jaxpr) -> int:
    """2 x (multiply-adds) of every dot_general in `jaxpr` and the jaxprs inside it (jit, loops, conds)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            depth = np.prod([eqn.invars[0].aval.shape[d] for d in contracting])
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape) * depth)
        total += sum(_dot_flops(sub) for sub in jax_core.jaxprs_in_params(eqn.params))
    return total


@pytest.mark.parametrize("batch", [1, 3])
def test_step_flops_count_every_matrix_product_of_the_step(batch):
    """The formula equals the matrix products traced in `decode_step` of one token per row."""
    params = gpt.init(jax.random.key(0), TINY)
    weights, attention = gpt_generate.step_flops(params, TINY, batch)
    cache, idx = gpt_decode.init_cache(TINY, batch), jnp.zeros((batch, 1), jnp.int32)
    traced = jax.make_jaxpr(lambda p, c, i: gpt_decode.decode_step(p, c, i, TINY))(params, cache, idx)
    assert weights + attention == _dot_flops(traced.jaxpr)


def test_step_flops_of_the_bench_model_by_hand():
    """6 x 384 with a 65-token tied head: 12 d^2 weights per layer (qkv 3 d^2, proj d^2, MLP 8 d^2) and d x 65,
    twice per row; the attention 4 d x 256 per layer and row (scores and weighted values over every slot).
    XLA's cost analysis of the compiled step counts these and a few percent more (the norms, softmax, GELU)."""
    d, n_layer, block = 384, 6, 256
    for batch in (1, 8):
        weights, attention = gpt_generate.step_flops(_shapes(BENCH), BENCH, batch)
        assert weights == 2 * batch * (12 * n_layer * d * d + 65 * d)
        assert attention == 4 * batch * n_layer * d * block
    total = sum(gpt_generate.step_flops(_shapes(BENCH), BENCH, 8))
    assert total == 189_143_040
    assert 1.0 <= gpt_generate.xla_flops(_shapes(BENCH), BENCH, 8) / total < 1.05


def test_step_bytes_are_the_params_and_the_whole_cache():
    """float32 params (12 d^2 + 13 d per layer with biases, the final norm, both embeddings) and every layer's
    keys and values for all block slots of every row: 47.8 MB at batch 1 and 80.8 MB at batch 8."""
    d, n_layer, block, vocab = 384, 6, 256, 65
    n_params = n_layer * (12 * d * d + 13 * d) + 2 * d + (vocab + block) * d
    for batch, total in ((1, 47.8e6), (8, 80.8e6)):
        param_bytes, cache_bytes = gpt_generate.step_bytes(_shapes(BENCH), BENCH, batch)
        assert param_bytes == 4 * n_params
        assert cache_bytes == 4 * 2 * n_layer * batch * block * d
        assert abs(param_bytes + cache_bytes - total) < 0.05e6


PROFILED = gpt.GPTConfig(block_size=32, vocab_size=11, n_layer=2, n_head=2, n_embd=16)


def _compile_generate(out: str) -> None:
    """Child process: write `generate`'s optimized HLO (batch 3, a prompt of 4) as gpt_generate_profile reads it."""
    from bench import gpt_generate_profile

    _, hlo_text, cache, steps = gpt_generate_profile.generate_program(PROFILED, 3, prompt_len=4)
    Path(out).write_text(json.dumps({"hlo": hlo_text, "cache": cache, "steps": steps}))


def test_the_kernel_profile_finds_every_weight_product_and_the_cache_in_the_compiled_loop(tmp_path):
    """bench/gpt_generate_profile.py reads generate's optimized HLO: the loop body's weight products do the
    step's weight FLOPs and read every weight, its attention products read each layer's keys and values once,
    and each layer writes its keys and values (a profile adds only times to these). The program is compiled in
    a child with XLA:CPU's fusion emitters on, as a user's is (the suite turns them off: tests/conftest.py)."""
    from bench import gpt_generate_profile

    flags = os.environ.get("XLA_FLAGS", "").replace(suite_compile.OLDER_EMITTERS, "")
    program = child_results(__file__, tmp_path, env={"XLA_FLAGS": flags})
    config, batch, hlo_text, steps = PROFILED, 3, program["hlo"], program["steps"]
    cache = gpt_generate_profile.CacheShape(*program["cache"])
    assert steps == 28 and cache == (3 * 2 * 32 * 8, 32, 8)  # rows x heads x slots x head width
    groups = {}
    for kernel in gpt_generate_profile.kernels(hlo_text, cache).values():
        groups.setdefault(kernel.group, []).append(kernel)
    weights, attention = gpt_generate.step_flops(_shapes(config), config, batch)
    assert sum(k.flops for k in groups["weights"]) == weights
    assert sum(k.flops for k in groups["attention"]) == attention
    param_bytes, cache_bytes = gpt_generate.step_bytes(_shapes(config), config, batch)
    assert sum(k.nbytes for k in groups["weights"]) >= param_bytes - 32 * 16 * 4  # wpe is a lookup, not a product
    assert cache_bytes <= sum(k.nbytes for k in groups["attention"]) < 1.2 * cache_bytes
    assert len(groups["cache in place"]) >= 2 * config.n_layer


if __name__ == "__main__":
    _compile_generate(sys.argv[1])
