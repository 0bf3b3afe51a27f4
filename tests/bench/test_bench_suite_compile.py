"""bench/suite_compile.py: each setting compiles the program in a process of its own, and the older emitters'
row runs only where jaxlib knows their flag (XLA aborts a process on a flag it does not know)."""

from bench import suite_compile


def test_every_setting_this_jaxlib_knows_compiles_in_its_own_process():
    seconds = suite_compile.measure(n_layer=1, repeats=1)
    assert list(seconds) == list(suite_compile.settings())
    assert ("+ older emitters" in seconds) == suite_compile.has_older_emitters()
    assert {"defaults", "most optimizations off"} <= set(seconds) and all(s > 0 for s in seconds.values())
