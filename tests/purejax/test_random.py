"""purejax.random: keys derived from names are stable across runs and versions, distinct per name, and
independent of which other names exist."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from purejax import random as prandom


def key_data(key):
    return np.asarray(jax.random.key_data(key))


def test_name_to_int_is_the_31_bit_crc32_of_the_utf8_name():
    # Fixed values: changing them changes every model's initialisation, so it must be a deliberate decision.
    assert prandom.name_to_int("wte") == 1484033762
    assert prandom.name_to_int("blocks") == 1324193144
    assert prandom.name_to_int("ln_f") == 185595003
    assert prandom.name_to_int("proj") == 1376533648
    assert prandom.name_to_int("é") == 235179326  # UTF-8 bytes, not code points
    assert all(0 <= prandom.name_to_int(n) < 2**31 for n in ("", "a", "wte", "x" * 1000))


def test_fold_in_name_is_fold_in_of_the_crc_and_stable():
    key = jax.random.key(0)
    got = prandom.fold_in_name(key, "wte")
    np.testing.assert_array_equal(key_data(got), key_data(jax.random.fold_in(key, 1484033762)))
    # The threefry key itself, pinned: a jax upgrade that changed it would silently change every initialisation.
    np.testing.assert_array_equal(key_data(got), [3554071940, 2436748471])
    np.testing.assert_array_equal(
        key_data(prandom.fold_in_name(jax.random.key(42), "blocks")), [3083906591, 1861850163]
    )


def test_named_keys_are_distinct_and_differ_from_the_parent():
    key = jax.random.key(0)
    names = ("wte", "wpe", "blocks", "ln_f", "lm_head", "fc", "proj")
    keys = prandom.named_keys(key, *names)
    assert list(keys) == list(names)
    datas = {tuple(key_data(k)) for k in keys.values()} | {tuple(key_data(key))}
    assert len(datas) == len(names) + 1


def test_adding_a_name_changes_no_other_key():
    key = jax.random.key(7)
    before = prandom.named_keys(key, "wte", "blocks", "ln_f")
    after = prandom.named_keys(key, "wte", "wpe", "blocks", "ln_f", "lm_head")
    reordered = prandom.named_keys(key, "ln_f", "blocks", "wte")
    for name in before:
        np.testing.assert_array_equal(key_data(after[name]), key_data(before[name]))
        np.testing.assert_array_equal(key_data(reordered[name]), key_data(before[name]))


def test_named_keys_depend_on_the_parent_key():
    a = prandom.named_keys(jax.random.key(0), "w")["w"]
    b = prandom.named_keys(jax.random.key(1), "w")["w"]
    assert not np.array_equal(key_data(a), key_data(b))


def test_named_keys_refuses_repeated_names():
    with pytest.raises(ValueError, match=r"repeated names: \['fc', 'fc'\]"):
        prandom.named_keys(jax.random.key(0), "fc", "proj", "fc")


def test_named_keys_accepts_legacy_uint32_keys_and_works_under_jit_and_vmap():
    legacy = prandom.named_keys(jax.random.PRNGKey(3), "w")["w"]
    assert legacy.shape == (2,) and legacy.dtype == jnp.uint32
    typed = prandom.named_keys(jax.random.key(3), "w")["w"]
    np.testing.assert_array_equal(legacy, key_data(typed))

    jitted = jax.jit(lambda k: prandom.named_keys(k, "w")["w"])(jax.random.key(3))
    np.testing.assert_array_equal(key_data(jitted), key_data(typed))

    batch = jax.random.split(jax.random.key(3), 4)
    vmapped = jax.vmap(lambda k: prandom.fold_in_name(k, "w"))(batch)
    for i in range(4):
        np.testing.assert_array_equal(key_data(vmapped[i]), key_data(prandom.fold_in_name(batch[i], "w")))


def test_no_key_gives_no_keys():
    """Evaluation: a block's sublayers get None each, so its apply hands out keys the same way with or without one."""
    assert prandom.named_keys(None, "attn", "mlp") == {"attn": None, "mlp": None}
    with pytest.raises(ValueError, match="repeated"):
        prandom.named_keys(None, "attn", "attn")
