"""train.kit.compile_log: every compilation listed with its function, argument shapes and seconds; a function
compiled again says which arguments changed; JAX's logging is left as it was found."""

import logging

import jax
import jax.numpy as jnp
import pytest

from train.kit import compile_log


def test_each_compilation_is_listed_with_its_shapes_and_why_it_compiled_again():
    programs = compile_log.ProgramLog()
    try:

        def scale_rows(x, y):  # a name no other test compiles
            return x * y[:, None]

        step = jax.jit(scale_rows)
        step(jnp.ones((3, 2)), jnp.ones(3, jnp.int32)).block_until_ready()
        step(jnp.ones((3, 2)), jnp.ones(3, jnp.int32)).block_until_ready()  # cached: not compiled again
        step(jnp.ones((5, 2)), jnp.ones(5, jnp.int32)).block_until_ready()
    finally:
        listed = [p for p in programs.stop() if p.name == "scale_rows"]
    assert [p.shapes for p in listed] == [("f32[3,2]", "i32[3]"), ("f32[5,2]", "i32[5]")]
    assert listed[0].differs == () and listed[1].differs == ("arg 0: f32[5,2]", "arg 1: i32[5]")
    assert all(p.seconds > 0 for p in listed)
    assert str(listed[1]).startswith("scale_rows") and "again for arg 0: f32[5,2]" in str(listed[1])


def test_other_jax_records_reach_the_root_logger_and_the_settings_come_back(caplog):
    before = jax.config.jax_log_compiles, logging.getLogger("jax").propagate
    programs = compile_log.ProgramLog()
    try:
        with caplog.at_level(logging.WARNING):
            logging.getLogger("jax._src.example").warning("something JAX wants said")
            jax.jit(lambda x: x - 7)(jnp.arange(4.0)).block_until_ready()
    finally:
        programs.stop()
    said = [r.getMessage() for r in caplog.records]
    assert "something JAX wants said" in said
    assert not any(m.startswith(("Compiling", "Finished")) for m in said), said  # the chatter stays off
    assert (jax.config.jax_log_compiles, logging.getLogger("jax").propagate) == before


@pytest.mark.parametrize("name, plain", [("jit(train_step)", "train_step"), ("multiply", "multiply")])
def test_names_drop_jits_wrapper(name, plain):
    assert compile_log._plain(name) == plain
