"""The GPT's pipeline stage (models/gpt_pipeline.py) on the test process's one device: a single stage embeds,
runs every block, and applies the tied head and the loss, so the runner's loss and gradients are `gpt.loss`'s.
Several stages, dropout and the training step: tests/purejax/parallel/test_pipeline.py (8 simulated devices)."""

import jax
import numpy as np

from models import gpt, gpt_pipeline
from purejax import parallel
from purejax import tree as tree_lib
from purejax.parallel import pipeline, pipeline_schedules

CONFIG = gpt.GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)


def test_one_stage_is_gpt_loss_and_its_gradients():
    params = gpt.init(jax.random.key(0), CONFIG)
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, CONFIG.vocab_size)
    batch = (tokens[:, :-1], tokens[:, 1:].at[0, :3].set(-1))  # some ignored targets
    mesh = jax.make_mesh((1,), (pipeline.PIPE,), devices=jax.devices()[:1])
    fn = gpt_pipeline.sharded_loss_and_grads(mesh, CONFIG, pipeline_schedules.one_f_one_b(1, 2))
    loss, grads = fn(parallel.shard(params, pipeline.param_specs(params), mesh), batch)
    ref_loss, ref_grads = jax.value_and_grad(gpt.loss)(params, batch, CONFIG)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    flat, ref_flat = tree_lib.flatten(grads), tree_lib.flatten(ref_grads)
    assert flat.keys() == ref_flat.keys()
    for path, want in ref_flat.items():
        np.testing.assert_allclose(flat[path], want, rtol=1e-4, atol=1e-6, err_msg=path)
