"""Multi-process runs for real: 2 processes on localhost (CPU, gloo collectives), each simulating 2 devices,
against 1 process with 4, against the same training on one device in this process (tests
purejax/parallel/distributed.py and purejax/parallel/launch.py).

The launches are few and shared by module fixtures (each costs seconds); the child program is
multiprocess_child.py beside this file. Argument errors are checked in this process, which never joins a
multi-process run: `initialize` raises before reaching JAX, or JAX refuses before connecting.
"""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import mlp
from purejax import tree
from purejax.parallel import distributed, launch

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("multiprocess_child.py")
STEPS, GLOBAL_BATCH, D_IN, N_CLASSES = 6, 8, 16, 4
ENV_NAMES = (
    distributed.ENV_COORDINATOR,
    distributed.ENV_NUM_PROCESSES,
    distributed.ENV_PROCESS_ID,
    distributed.JAX_ENV_COORDINATOR,
    distributed.ENV_INIT_TIMEOUT,
    distributed.ENV_HEARTBEAT_TIMEOUT,
    distributed.ENV_SHUTDOWN_TIMEOUT,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """STEPS global batches of a learnable task: labels are the argmax of a fixed linear map of x."""
    path = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, GLOBAL_BATCH, D_IN)).astype(np.float32)
    np.save(path / "x.npy", x)
    np.save(path / "labels.npy", np.argmax(x @ rng.normal(size=(D_IN, N_CLASSES)), axis=-1).astype(np.int32))
    return path


def run_child(mode: str, data_dir: Path, out_dir: Path, num_processes: int, devices: int, timeout: float = 120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return launch.launch(
        [str(CHILD), mode, str(data_dir), str(out_dir)],
        num_processes,
        timeout=timeout,
        devices_per_process=devices,
        env=env,
    )


def result_of(process: launch.ProcessResult) -> dict:
    assert process.returncode == 0, f"process {process.process_id} exited {process.returncode}:\n{process.output}"
    line = next(line for line in process.output.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory) -> dict:
    """The same training, as 2 processes x 2 devices and as 1 process x 4 devices, launched side by side."""
    with ThreadPoolExecutor(2) as pool:
        two = pool.submit(run_child, "train", data_dir, tmp_path_factory.mktemp("two"), 2, devices=2)
        one = pool.submit(run_child, "train", data_dir, tmp_path_factory.mktemp("one"), 1, devices=4)
        return {"two": two.result(), "one": one.result()}


@pytest.fixture(scope="module")
def two_processes(runs) -> tuple[list[launch.ProcessResult], list[dict]]:
    return runs["two"], [result_of(p) for p in runs["two"]]


@pytest.fixture(scope="module")
def one_process(runs) -> dict:
    return result_of(runs["one"][0])


@pytest.fixture(scope="module")
def reference(data_dir) -> dict:
    """The same training on this process's one device: no mesh, no shard_map, no collective."""
    config, optimizer = mlp.MLPConfig(d_in=D_IN, hidden=(32,), n_classes=N_CLASSES), optax.adam(5e-2)
    x, labels = np.load(data_dir / "x.npy"), np.load(data_dir / "labels.npy")

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(mlp.loss)(params, batch, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = mlp.init(jax.random.key(0), config)
    opt_state, losses = optimizer.init(params), []
    for i in range(STEPS):
        params, opt_state, value = step(params, opt_state, (x[i], labels[i]))
        losses.append(float(value))
    return {"losses": losses, "params": {k: np.asarray(v).ravel() for k, v in tree.flatten(params).items()}}


# ---------------------------------------------------------------- 2 processes x 2 devices == 1 process x 4


def test_one_process_on_four_devices_trains_like_one_device(one_process, reference):
    np.testing.assert_allclose(one_process["losses"], reference["losses"], rtol=1e-5)
    assert one_process["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        np.testing.assert_allclose(one_process["params"][name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_two_processes_train_exactly_like_one(two_processes, one_process):
    _, results = two_processes
    assert [r["devices"] for r in results] == [[2, 4], [2, 4]] and one_process["devices"] == [4, 4]
    assert [r["rows"] for r in results] == [[0, 4], [4, 8]] and one_process["rows"] == [0, 8]
    # On purejax.parallel's (data, model) meshes: tp within a process splits the rows; tp across processes
    # (dp=1) replicates them, so both processes load all 8.
    expected = [
        {"dp=4,tp=1": [0, 4], "dp=2,tp=2": [0, 4], "dp=1,tp=4": [0, 8]},
        {"dp=4,tp=1": [4, 8], "dp=2,tp=2": [4, 8], "dp=1,tp=4": [0, 8]},
    ]
    assert [r["rows_on_meshes"] for r in results] == expected
    assert set(map(tuple, one_process["rows_on_meshes"].values())) == {(0, 8)}
    for r in results:
        np.testing.assert_allclose(r["losses"], one_process["losses"], rtol=1e-6)
        assert r["params"].keys() == one_process["params"].keys()
        for name, value in one_process["params"].items():
            np.testing.assert_allclose(r["params"][name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert one_process["losses"][-1] < one_process["losses"][0] - 0.1  # it trained


def test_every_process_runs_the_same_collectives(two_processes):
    _, results = two_processes
    # One all-reduce of the loss (pmean) and one of the gradients (psum from the transpose), in one order.
    assert results[0]["collectives"] == results[1]["collectives"] and results[0]["collectives"]
    assert set(results[0]["collectives"]) == {"all-reduce"}
    assert all(r["cpu_collectives"] == "gloo" for r in results)  # JAX's default on CPU, nothing to select


def test_only_process_0_logs(two_processes):
    processes, _ = two_processes
    assert processes[0].output.count("log: step") == STEPS
    assert "log: step" not in processes[1].output


def test_only_process_0_writes_the_checkpoint_and_every_process_reads_it(two_processes, data_dir):
    _, results = two_processes
    # Each process saved to "ckpt.msgpack" in its own working directory: only process 0's exists.
    assert [r["checkpoint"]["files_here"] for r in results] == [["ckpt.msgpack"], []]
    x = np.load(data_dir / "x.npy")
    for r in results:
        saved = r["checkpoint"]
        assert saved["step"] == STEPS and saved["same_params"] and saved["same_shards"], saved
        # the batch held by both processes, gathered into the file: equal to the data file's last batch
        np.testing.assert_array_equal(np.asarray(saved["x"], np.float32), x[-1])


def test_errors_name_the_process_and_what_to_do(two_processes):
    _, results = two_processes
    for r in results:
        rejoin, interleaved, wrong_rows, indivisible = r["errors"]
        assert "already initialised as process" in rejoin and "num_processes" in rejoin
        p = r["process"]
        assert f"process {p} holds the non-contiguous row blocks" in interleaved
        assert "jax.devices() in order" in interleaved
        rows = "0..4" if p == 0 else "4..8"
        assert "leaf ['x'] has 8 rows" in wrong_rows and f"process {p} of 2 owns rows {rows} (4 rows)" in wrong_rows
        assert "a global batch of shape (6, 16) does not fit the sharding" in indivisible


# ---------------------------------------------------------------- a dead peer, and the launcher's timeout


def test_a_killed_peer_makes_the_survivor_exit_with_an_error(data_dir, tmp_path):
    """One process SIGKILLs itself mid-run, process 1 in one run and process 0 (which hosts JAX's
    coordination service) in another; the two runs go side by side to save time. The survivor must not
    hang: the coordination service notices the missing heartbeats (3 s here; at once when the service
    itself died) and ends it, or its next collective fails first. The launcher's 60 s timeout is only the
    last resort, so a survivor still running then fails the test."""
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(
            lambda victim: run_child(f"die:{victim}", data_dir, tmp_path / str(victim), 2, devices=2, timeout=60),
            [1, 0],
        )
    for victim, processes in zip([1, 0], runs):
        dead, survivor = processes[victim], processes[1 - victim]
        assert dead.returncode == -signal.SIGKILL, dead.output
        assert not survivor.timed_out, survivor.output
        assert survivor.returncode != 0, survivor.output
        assert "log: step 2" in processes[0].output and "RESULT" not in survivor.output
        clear = ("Connection closed by peer", "Connection reset by peer", "heartbeat", "another task died")
        assert any(words in survivor.output for words in clear), survivor.output


def test_launch_kills_every_process_at_its_timeout():
    results = launch.launch(["-c", "import time; time.sleep(600)"], 2, timeout=1)
    assert [r.timed_out for r in results] == [True, True]
    assert launch.exit_status(results) == launch.TIMED_OUT


def test_when_one_process_fails_the_others_are_killed_after_the_grace_and_its_status_is_reported():
    """Process 1 fails at once (as one that never reaches initialize would); process 0 would wait for it
    for minutes. The launcher kills process 0 after the grace and reports process 1's status."""
    fail = "import os, sys, time\nif os.environ['PUREJAX_PROCESS_ID'] == '1': sys.exit(3)\ntime.sleep(600)"
    start = time.monotonic()
    results = launch.launch(["-c", fail], 2, timeout=120, failure_grace=1)
    assert time.monotonic() - start < 30
    assert [r.returncode for r in results] == [-signal.SIGKILL, 3] and not any(r.timed_out for r in results)
    assert launch.exit_status(results) == 3  # the first failure in time, not process 0's kill


def _start_launcher(program: str) -> tuple[subprocess.Popen, list[int]]:
    """`python -m purejax.parallel.launch` of 2 processes running `program`, which prints "pid N" first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "purejax.parallel.launch", "--num_processes=2", "--", "-c", program],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]  # "[i] pid N"
    return launcher, pids


def test_terminating_the_launcher_passes_the_signal_on_so_programs_can_save():
    graceful = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('saving', flush=True), sys.exit(0)))\n"
        "print('pid', os.getpid(), flush=True)\n"
        "time.sleep(600)"
    )
    launcher, _ = _start_launcher(graceful)
    launcher.terminate()
    assert launcher.wait(timeout=30) == 0
    assert launcher.stdout.read().count("saving") == 2


def test_terminating_the_launcher_twice_kills_every_process():
    stubborn = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('pid', os.getpid(), flush=True)\n"
        "time.sleep(600)"
    )
    launcher, pids = _start_launcher(stubborn)
    launcher.terminate()
    time.sleep(1)
    assert launcher.poll() is None  # the processes ignore the first signal, so the launcher keeps waiting
    launcher.terminate()
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (killed and reaped by the launcher)


def test_launch_command_line_sets_each_process_environment(capsys):
    show = "import os; print('id', *(os.environ[k] for k in ('PUREJAX_PROCESS_ID', 'PUREJAX_NUM_PROCESSES')))"
    assert launch.main(["--num_processes=2", "--timeout=60", "--", "-c", show]) == 0
    out = capsys.readouterr().out
    assert "[0] id 0 2" in out and "[1] id 1 2" in out
    fail = "import os, sys; sys.exit(3 if os.environ['PUREJAX_PROCESS_ID'] == '1' else 0)"
    assert launch.main(["--num_processes=2", "--timeout=60", "--", "-c", fail]) == 3


def test_exit_status():
    result = lambda code: launch.ProcessResult(0, code, "")  # noqa: E731
    assert launch.exit_status([result(0), result(0)]) == 0
    assert launch.exit_status([result(0), result(-signal.SIGKILL), result(1)]) == 128 + signal.SIGKILL
    assert launch.exit_status([result(1), result(None)]) == launch.TIMED_OUT


def test_launch_rejects_no_program():
    with pytest.raises(SystemExit):
        launch.main(["--num_processes=2"])
    with pytest.raises(ValueError, match="num_processes must be at least 1"):
        launch.launch(["-c", "pass"], 0, timeout=10)


# ---------------------------------------------------------------- initialize: settings and their errors


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_initialize_is_a_no_op_for_one_process(clean_env):
    distributed.initialize()
    distributed.initialize(num_processes=1)
    distributed.initialize("127.0.0.1:1", 1, 0)
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "1")
    distributed.initialize()
    assert not jax.distributed.is_initialized()
    assert distributed.process_index() == 0 and distributed.process_count() == 1 and distributed.is_main()


@pytest.mark.parametrize(
    "args, env, missing",
    [
        ({"coordinator_address": "127.0.0.1:1"}, {}, ["num_processes (or $PUREJAX_NUM_PROCESSES)", "process_id"]),
        ({"num_processes": 2}, {}, ["coordinator_address (or $PUREJAX_COORDINATOR)", "process_id"]),
        ({}, {"PUREJAX_PROCESS_ID": "1", "PUREJAX_NUM_PROCESSES": "2"}, ["coordinator_address"]),
        ({}, {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "PUREJAX_NUM_PROCESSES": "2"}, ["process_id"]),
    ],
)
def test_initialize_rejects_partial_settings(clean_env, args, env, missing):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match="a multi-process run needs") as e:
        distributed.initialize(**args)
    assert all(m in str(e.value) for m in missing), e.value


def test_initialize_rejects_bad_values(clean_env):
    with pytest.raises(ValueError, match=r"process_id must be in 0..1 for num_processes=2, got 2"):
        distributed.initialize("127.0.0.1:1", 2, 2)
    with pytest.raises(ValueError, match="process_id is 1 but num_processes is 1"):
        distributed.initialize(num_processes=1, process_id=1)
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match=r"\$PUREJAX_NUM_PROCESSES is 'two', which is not an int"):
        distributed.initialize()
    clean_env.delenv(distributed.ENV_NUM_PROCESSES)
    clean_env.setenv(distributed.ENV_HEARTBEAT_TIMEOUT, "3s")
    with pytest.raises(ValueError, match=r"\$PUREJAX_HEARTBEAT_TIMEOUT is '3s', which is not an int"):
        distributed.initialize()


def test_initialize_after_jax_started_says_to_call_it_first(clean_env):
    jax.devices()  # the backend is up now
    with pytest.raises(RuntimeError, match="must be called before") as e:
        distributed.initialize("127.0.0.1:1", 2, 0, heartbeat_timeout_seconds=3)
    assert "process 0 of 2" in str(e.value) and "Call purejax.parallel.initialize() first" in str(e.value)
    assert not jax.distributed.is_initialized()


# ---------------------------------------------------------------- rows and the global batch, one process


def test_one_process_owns_every_row_and_global_batch_places_them():
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
    assert distributed.local_rows(sharding, (6, 3)) == range(0, 6)
    x = np.arange(18, dtype=np.float32).reshape(6, 3)
    batch = distributed.global_batch({"x": x, "y": np.arange(6)}, sharding, 6)
    assert batch["x"].sharding == sharding and batch["x"].shape == (6, 3)
    np.testing.assert_array_equal(np.asarray(batch["x"]), x)
    np.testing.assert_array_equal(np.asarray(batch["y"]), np.arange(6))


def test_global_batch_names_the_leaf_and_the_rows_owned():
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))
    owned = r"leaf \['y'\] has 5 rows \(shape \(5,\)\), but process 0 of 1 owns rows 0..6"
    with pytest.raises(ValueError, match=owned):
        distributed.global_batch({"x": np.zeros((6, 3)), "y": np.zeros(5)}, sharding, 6)
    with pytest.raises(ValueError, match=r"leaf \[1\] is a scalar"):
        distributed.global_batch((jnp.zeros(6), 1.0), sharding, 6)
    with pytest.raises(ValueError, match=r"global_shape is \(\), a scalar has no rows"):
        distributed.local_rows(sharding, ())
