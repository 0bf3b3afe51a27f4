"""bench/gpt_train.py without timing anything: what MFU is measured against (an accelerator's peak from
purejax.train.run's table, tested in tests/purejax/train/test_gpu_defaults.py), the GPT-2 124M case it runs on a
GPU (built as shapes only, nothing trained), and the Haiku peer's copy of the weights against purejax's own step
(with the bench extra's dm-haiku)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import gpt_train
from purejax.models import gpt


def test_mfu_is_against_the_accelerator_peak_or_the_best_measured_rate():
    rates = [1e11, 3e11, 2e11]
    assert gpt_train.mfu_peak("gpu", "NVIDIA H100 80GB HBM3", rates)[0] == 989e12
    assert gpt_train.mfu_peak("gpu", "NVIDIA L40S", rates)[0] == 3e11  # an unknown chip: measured
    peak, what = gpt_train.mfu_peak("cpu", "cpu", rates)
    assert peak == 3e11 and "100, 300, 200 GFLOP/s" in what


def test_gpt2_case_is_gpt2_small_and_its_step_traces_in_bfloat16():
    """The gpt2 case is GPT-2 124M (block 1024, GPT-2's vocabulary padded to 50304); its purejax loss traces in
    bfloat16 to a float32 scalar. Shapes only (jax.eval_shape): nothing is computed."""
    case = gpt_train.CASES["gpt2"]
    config = case.model
    assert (config.n_layer, config.n_head, config.n_embd, config.block_size, config.vocab_size) == (
        12, 12, 768, 1024, 50304
    )  # fmt: skip
    params = jax.eval_shape(lambda key: gpt.init(key, config), jax.random.key(0))
    total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    assert 123e6 < total < 125e6, total  # no biases: 124.3M with the position embeddings
    loss_fn = gpt_train.train_gpt.make_loss_fn(config, gpt_train.Policy(jnp.float32, "bfloat16", jnp.float32))
    batch = (jax.ShapeDtypeStruct((case.batch, config.block_size), jnp.int32),) * 2
    loss, _ = jax.eval_shape(loss_fn, params, batch, None)
    assert loss.shape == () and loss.dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_haiku_peer_starts_from_purejax_weights_and_takes_the_same_step(dtype):
    """The Haiku GPT holds exactly purejax's initial weights and reports purejax's loss before and after one
    AdamW step (what the bench checks before timing, here at a tiny size)."""
    pytest.importorskip("haiku", reason="dm-haiku is in the bench extra (pip install purejax[bench])")
    config = gpt_train._config(2, 2, 32, 16)
    weights = jax.tree.map(np.asarray, gpt.init(jax.random.key(0), config))
    data = np.random.default_rng(0).integers(0, config.vocab_size, (4, config.block_size + 1), dtype=np.int32)
    x, y = data[:, :-1], data[:, 1:]
    ours, theirs = (make(weights, config, x, y, dtype=dtype) for make in (gpt_train.make_purejax, gpt_train.make_haiku))
    rtol = 1e-6 if dtype == "float32" else 1e-2
    for _ in range(2):
        np.testing.assert_allclose(float(theirs()), float(ours()), rtol=rtol)
