"""bench/compile_threads.py: every compilation it times is XLA compiling a program anew (no cache hit), one
for "one", two for each of "two in a row" and "two side by side"."""

from jax import monitoring

from bench import compile_threads
from train.kit.compile_cache import BACKEND_COMPILE


def test_each_way_compiles_new_programs_every_time():
    compiled = []

    def listen(event, seconds, **kwargs):
        if event == BACKEND_COMPILE:
            compiled.append(str(kwargs.get("fun_name")))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        results = compile_threads.measure(n_layer=1, repeats=1)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    steps = [name for name in compiled if "loss" in name]  # besides, the key's small programs op by op
    assert len(steps) == 5, compiled
    assert list(results) == ["one", "two in a row", "two side by side"]
    assert all(wall > 0 and cpu > 0 for wall, cpu in results.values())
