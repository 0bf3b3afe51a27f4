"""purejax.losses against optax and float64 numpy: cross-entropy with ignored and out-of-range labels, on
one device and in its vocab-parallel form, and the masked mean."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from purejax import losses, parallel

RNG = np.random.default_rng(0)
LOGITS = jnp.asarray(RNG.normal(size=(4, 6)) * 3, jnp.float32)
LABELS = jnp.asarray([0, 5, 2, 3])


def test_cross_entropy_matches_optax():
    want = optax.softmax_cross_entropy_with_integer_labels(LOGITS, LABELS)
    np.testing.assert_allclose(losses.cross_entropy(LOGITS, LABELS), want, rtol=1e-6)


def test_ignored_labels_give_zero_and_do_not_count_in_the_mean():
    labels = LABELS.at[1].set(-1)
    per_example = losses.cross_entropy(LOGITS, labels, ignore_index=-1)
    assert per_example[1] == 0
    full = optax.softmax_cross_entropy_with_integer_labels(LOGITS, LABELS)
    mean = losses.masked_mean(per_example, labels != -1)
    np.testing.assert_allclose(mean, (full[0] + full[2] + full[3]) / 3, rtol=1e-6)


def test_labels_outside_the_classes_give_nan_not_a_wrong_loss():
    for bad in (-1, 6, 100):
        per_example = losses.cross_entropy(LOGITS, LABELS.at[2].set(bad))
        assert np.isnan(per_example[2]) and np.isfinite(np.delete(np.asarray(per_example), 2)).all(), bad


def test_the_vocab_parallel_form_flags_out_of_range_labels_too():
    """On a one-device mesh the vocab-parallel path runs with the whole vocabulary as its shard."""
    mesh = parallel.make_mesh(1, 1)
    per_example = jax.jit(
        jax.shard_map(
            lambda lg, lb: losses.cross_entropy(lg, lb, axis_name=parallel.MODEL),
            mesh=mesh,
            in_specs=(P(None, parallel.MODEL), P()),
            out_specs=P(),
        )
    )

    np.testing.assert_allclose(per_example(LOGITS, LABELS), losses.cross_entropy(LOGITS, LABELS), rtol=1e-6)
    got = per_example(LOGITS, LABELS.at[1].set(6))
    assert np.isnan(got[1]) and np.isfinite(np.delete(np.asarray(got), 1)).all()
