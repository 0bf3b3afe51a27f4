"""`python -m train.gpt` on several devices and processes computes what one device computes.

One chain of runs covers the whole path: a single-device run is the reference; a run on a 2 x 2 mesh (tensor
and data parallel, 4 simulated CPU devices in one process) trains the first 8 iterations; a run of 2
processes with 2 devices each, fully sharded over dp=4, resumes that checkpoint (saved from one mesh,
restored onto another) for 4 more. Both checkpoints must equal the single-device run's.

The unit tests below check `train.kit.devices.Devices` without a mesh, and the batch rows each process reads.
"""

import os

import jax
import numpy as np
import pytest

from purejax.parallel import launch
from tests.train.test_gpt import ROOT, TINY, corpus, final_state, finish, run_gpt  # noqa: F401 - corpus: a fixture
from train import data as data_lib
from train.gpt import GPTSettings
from train.kit.devices import Devices

COMMON = [
    *TINY,
    "--lr_decay_iters=12",
    "--warmup_iters=2",
    "--eval_interval=4",
    "--eval_iters=1",
    "--log_interval=4",
    "--batch_size=8",
    "--n_head=4",
]  # no dropout: sharded masks differ by design


def assert_same_state(got, want, what: str, atol: float = 2e-6) -> None:
    """Params and AdamW moments equal to float32 rounding (the sharded sums add in another order), within
    `atol` where a gradient is near zero (Adam scales its rounding up towards a step's size)."""
    assert int(got.step) == int(want.step), what
    for name in ("params", "opt_state"):
        flat_got, flat_want = (
            jax.tree_util.tree_leaves_with_path(getattr(got, name)),
            jax.tree.leaves(getattr(want, name)),
        )
        assert len(flat_got) == len(flat_want), what
        for (path, g), w in zip(flat_got, flat_want):
            np.testing.assert_allclose(
                g, w, rtol=2e-4, atol=atol, err_msg=f"{what}: {name}{jax.tree_util.keystr(path)}"
            )


@pytest.fixture(scope="module")
def even_corpus(corpus, tmp_path_factory):  # noqa: F811 - corpus: the imported fixture
    """The corpus with an even number of distinct characters. A run with tp=2 pads an odd vocabulary to a
    multiple of 2, which is another model (not comparable with one device's), and how many characters the
    pydoc topics hold depends on the Python version (an odd 95 on 3.12): one unused character evens it."""
    text = corpus.read_text()
    if len(set(text)) % 2:
        text += next(chr(i) for i in range(0xC0, 0x180) if chr(i) not in text)
    path = tmp_path_factory.mktemp("even-corpus") / "text.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_mesh_and_multi_process_runs_equal_the_single_device_run(tmp_path, even_corpus):
    data = f"--dataset={even_corpus}"
    # The reference: one device, 12 iterations, a checkpoint every 4.
    finish(run_gpt([*COMMON, data, "--out_dir=single", "--max_iters=12"], tmp_path))
    # A 2 x 2 mesh (Megatron tensor parallel inside data parallel), iterations 0..8.
    out = finish(run_gpt([*COMMON, data, "--out_dir=mesh", "--max_iters=8", "--dp=2", "--tp=2"], tmp_path))
    assert "2 x 2 mesh of 4 cpu devices in 1 process" in out, out
    assert_same_state(final_state(tmp_path / "mesh", 8), final_state(tmp_path / "single", 8), "2 x 2 mesh at iter 8")

    # Two processes of 2 devices each, fully sharded over dp=4, resume the mesh run's checkpoint: 8..12.
    args = [
        *COMMON,
        data,
        "--out_dir=mesh",
        "--max_iters=12",
        "--init_from=resume",
        "--dp=4",
        "--fsdp=true",
    ]
    results, outputs = launch_gpt(args, tmp_path, devices_per_process=2)
    assert "4 x 1 mesh (fsdp) of 4 cpu devices in 2 process(es)" in results[0].output, outputs
    assert "iter 12" in results[0].output and "iter 12" not in results[1].output, "only process 0 logs"
    assert_same_state(
        final_state(tmp_path / "mesh", 12), final_state(tmp_path / "single", 12), "2 processes at iter 12"
    )


def launch_gpt(args: list[str], cwd, devices_per_process: int) -> tuple[list[launch.ProcessResult], str]:
    """`python -m train.gpt *args` as 2 processes on this host (purejax.parallel.launch): their results,
    and their outputs as one text, once both exited 0."""
    cache = {k: v for k, v in os.environ.items() if k.startswith("JAX_COMPILATION_CACHE")}  # never the user's
    env = {"PUREJAX_HEARTBEAT_TIMEOUT": "20", "PYTHONPATH": str(ROOT), **cache}
    results = launch.launch(
        ["-m", "train.gpt", *args], 2, timeout=300, devices_per_process=devices_per_process, cwd=cwd, env=env
    )
    outputs = "\n".join(f"--- process {r.process_id}: {r.returncode}\n{r.output}" for r in results)
    assert [r.returncode for r in results] == [0, 0], outputs
    return results, outputs


def test_devices_on_one_device_is_the_plain_program():
    devices = Devices()
    assert not devices.sharded and devices.local_rows(8) is None
    assert devices.axes.data is None and devices.axes.model is None
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(devices.put_batch(x, 2), x)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(dp=1, fsdp=True), "needs dp > 1"),
        (dict(dp=3, num_processes=2), "cannot be shared evenly by 2 processes"),
        (dict(dp=0), "dp must be a positive int"),
        (dict(pp=3, num_processes=2), r"pp x dp x cp x tp = 3 devices cannot be shared evenly by 2"),
        (dict(pp=0), "pp must be a positive int"),
    ],
)
def test_impossible_device_settings_are_rejected(settings, message):
    with pytest.raises(ValueError, match=message):
        Devices(**settings)


def test_the_vocabulary_is_padded_to_a_multiple_of_tp():
    assert GPTSettings().model_config(108).vocab_size == 108
    assert GPTSettings(tp=8, n_head=8).model_config(108).vocab_size == 112


def test_a_process_reads_only_its_rows_of_the_same_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    whole = data_lib.get_batch(tokens, 8, 16, seed=3, step=5)
    for rows in (range(0, 4), range(4, 8), range(2, 3)):
        part = data_lib.get_batch(tokens, 8, 16, seed=3, step=5, rows=rows)
        np.testing.assert_array_equal(part[0], whole[0][rows.start : rows.stop])
        np.testing.assert_array_equal(part[1], whole[1][rows.start : rows.stop])
    with pytest.raises(ValueError, match="contiguous range within 0..8"):
        data_lib.get_batch(tokens, 8, 16, seed=3, step=5, rows=range(4, 12))


def test_the_module_docstring_names_only_what_exists():
    """train/kit/devices.py's usage example once called `Devices.from_settings`, which never existed."""
    import re

    from train.kit import devices as devices_lib

    names = set(re.findall(r"\b[Dd]evices\.(\w+)", devices_lib.__doc__))
    assert names and all(hasattr(Devices, name) for name in names), names


def test_shampoo_shares_its_roots_over_the_data_shards_and_equals_one_device(tmp_path, even_corpus):
    """`--optimizer=shampoo --dp=2`: the inverse roots are split between the two data shards (one all-gather
    joins them, tests/purejax/optim/test_shampoo.py counts it) and the run equals the single-device one."""
    shampoo = ["--optimizer=shampoo", "--shampoo_block_size=16", "--shampoo_start=2", "--shampoo_precondition_every=3"]
    common = [*COMMON, *shampoo, f"--dataset={even_corpus}", "--max_iters=8"]
    finish(run_gpt([*common, "--out_dir=single"], tmp_path))
    out = finish(run_gpt([*common, "--out_dir=dp", "--dp=2"], tmp_path))
    assert "2 x 1 mesh of 2 cpu devices in 1 process" in out, out
    # The gradient sum over two shards rounds differently from one device's, and the inverse fourth roots of
    # the statistics amplify that rounding: the params agree to about 4e-6 (measured), where AdamW's agree to
    # float32 rounding (the test above); 2e-5 is a fiftieth of one step (Adam-sized, learning rate 1e-3).
    got, want = final_state(tmp_path / "dp", 8).params, final_state(tmp_path / "single", 8).params
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5, err_msg=f"shampoo, dp=2: {jax.tree_util.keystr(path)}")
