"""Starting under the launchers clusters use, and dying with ours (tests purejax/parallel/cluster.py and the paths
of purejax/parallel/distributed.py that use it).

`srun` and `mpirun` are not installed here; what a program sees of them is the environment they give each
process, so the end-to-end tests start 2 local processes with exactly those variables (and no PUREJAX_*) and
require one 2-process run: JAX's own detection finds the coordinator from them, as on a cluster. The ports are
chosen free, through the job ids JAX derives them from.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from purejax.parallel import cluster, distributed
from tests.purejax.parallel.test_distributed import CHILD, ENV_NAMES, data_dir, reference  # noqa: F401 - fixtures
from tests.train.test_gpt import TINY, corpus  # noqa: F401 - corpus: a fixture

ROOT = Path(__file__).resolve().parents[3]
JAX_PORTS = 61440  # JAX's cluster detection picks its coordinator port in [61440, 65535] from the job id
LAUNCHERS = ("SLURM_", "OMPI_", "PMIX_", cluster.ENV_LAUNCHER_PIPE, *ENV_NAMES)


def free_jax_port() -> int:
    """A port in JAX's range that is free now."""
    for port in random.sample(range(JAX_PORTS, 65536), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {JAX_PORTS}..65535")


def srun_env(port: int, n: int) -> Callable[[int], dict[str, str]]:
    """What `srun --ntasks=n` on one node sets for task i, with a job id whose derived port is `port`."""
    job_id = 7 * 4096 + port - JAX_PORTS  # JAX: SLURM_JOB_ID % 4096 + 61440
    common = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": str(n),
        "SLURM_STEP_NUM_TASKS": str(n),
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
    }
    return lambda i: {**common, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}


def mpirun_env(port: int, n: int, version: int = 4) -> Callable[[int], dict[str, str]]:
    """What Open MPI's `mpirun -np n` sets for rank i; version 4 names the launcher's address, 5 does not."""
    job_id = (port - JAX_PORTS) * 4096  # JAX: (job id // 4096) % 4096 + 61440
    common = {"OMPI_COMM_WORLD_SIZE": str(n), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)}
    if version == 4:
        common["OMPI_MCA_orte_hnp_uri"] = f"{job_id}.0;tcp://127.0.0.1:{free_jax_port()}"
    return lambda i: {**common, "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i)}


def clean_environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHERS)}
    return {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def start_as(
    launcher_env: Callable[[int], dict[str, str]],
    args: list[str],
    n: int,
    out: Path,
    timeout: float,
    cwd: Path | None = None,
) -> list[tuple[int, str]]:
    """`python *args` as n processes with the launcher's variables; (exit status, output) of each."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        with open(out / f"{i}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    env={**clean_environ(), **launcher_env(i)},
                    cwd=cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [(proc.returncode, (out / f"{i}.log").read_text()) for i, proc in enumerate(procs)]


# ---------------------------------------------------------------- reading the environment


def test_detect_reads_what_srun_and_mpirun_set():
    assert cluster.detect({}) is None
    slurm = srun_env(61500, 4)(3)
    assert cluster.detect(slurm) == cluster.Launch("Slurm (srun)", 4, 3)
    # Without the step's node list (what JAX's detection needs too) it is no srun task: one process.
    assert cluster.detect({k: v for k, v in slurm.items() if k != "SLURM_STEP_NODELIST"}) is None
    assert cluster.detect(mpirun_env(61500, 2)(1)) == cluster.Launch("Open MPI (mpirun)", 2, 1, jax_detects=True)
    assert cluster.detect(mpirun_env(61500, 2, version=5)(1)).jax_detects is False
    assert cluster.detect({**slurm, **mpirun_env(61500, 2)(0)}).launcher == "Open MPI (mpirun)"  # JAX's order
    with pytest.raises(ValueError, match=r"\$SLURM_NTASKS is 'four', which is not an int"):
        cluster.detect({**slurm, "SLURM_NTASKS": "four"})


@pytest.fixture
def bare_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith(LAUNCHERS)]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_launched_process_count(bare_env):
    assert distributed.launched_process_count() == 1
    for name, value in srun_env(61500, 4)(0).items():
        bare_env.setenv(name, value)
    assert distributed.launched_process_count() == 4
    bare_env.setenv(distributed.ENV_NUM_PROCESSES, "2")  # given explicitly: it wins
    assert distributed.launched_process_count() == 2


def test_one_srun_task_or_auto_detect_false_is_a_single_process(bare_env):
    for name, value in srun_env(61500, 1)(0).items():
        bare_env.setenv(name, value)
    distributed.initialize()  # srun --ntasks=1: nothing to join
    bare_env.setenv("SLURM_NTASKS", "2")
    distributed.initialize(auto_detect=False)  # the launcher is ignored on request
    import jax

    assert not jax.distributed.is_initialized()


def test_open_mpi_5_needs_the_coordinator_and_says_so(bare_env):
    for name, value in mpirun_env(61500, 2, version=5)(1).items():
        bare_env.setenv(name, value)
    with pytest.raises(ValueError, match=r"process 1 of 2 started by Open MPI \(mpirun\).*give \$PUREJAX_COORDINATOR"):
        distributed.initialize()


def test_errors_say_which_task_of_which_launch(bare_env):
    import jax

    for name, value in srun_env(61500, 2)(1).items():
        bare_env.setenv(name, value)
    jax.devices()  # JAX has started: too late to join, and JAX says so before connecting anywhere
    with pytest.raises(RuntimeError, match=r"process 1 of 2 started by Slurm \(srun\).*must be called before") as e:
        distributed.initialize()
    assert "Call purejax.parallel.initialize() first" in str(e.value)


def test_settings_go_to_jax_with_a_20_s_heartbeat(bare_env):
    """What reaches jax.distributed.initialize: under srun nothing but the timeouts (JAX detects the rest);
    otherwise the settings given; the heartbeat 20 s unless set (JAX's own default is 100 s)."""
    import jax

    calls = []
    bare_env.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    distributed.initialize("127.0.0.1:1", 2, 1)
    bare_env.setenv(distributed.ENV_HEARTBEAT_TIMEOUT, "7")
    distributed.initialize("127.0.0.1:1", 2, 1, initialization_timeout=9)
    bare_env.delenv(distributed.ENV_HEARTBEAT_TIMEOUT)
    for name, value in srun_env(61500, 2)(1).items():
        bare_env.setenv(name, value)
    distributed.initialize()
    given = {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 1}
    detected = dict.fromkeys(given)
    assert calls == [
        {**given, "heartbeat_timeout_seconds": 20},
        {**given, "heartbeat_timeout_seconds": 7, "initialization_timeout": 9},
        {**detected, "heartbeat_timeout_seconds": 20},
    ]


# ---------------------------------------------------------------- 2 processes under srun and mpirun


@pytest.fixture(scope="module")
def launched(data_dir, corpus, tmp_path_factory) -> dict:  # noqa: F811 - data_dir, corpus: fixtures
    """train.gpt as 2 srun tasks, and the MLP child as 2 Open MPI ranks, side by side."""
    tmp = tmp_path_factory.mktemp("launched")
    gpt = [
        "-m",
        "train.gpt",
        *TINY,
        f"--dataset={corpus}",
        "--out_dir=run",
        "--dp=2",
        "--max_iters=2",
        "--eval_interval=2",
        "--eval_iters=1",
        "--log_interval=1",
    ]
    mlp = [str(CHILD), "train", str(data_dir), str(tmp / "mlp")]
    with ThreadPoolExecutor(2) as pool:
        slurm = pool.submit(start_as, srun_env(free_jax_port(), 2), gpt, 2, tmp / "srun", 300, cwd=tmp)
        ranks = mpirun_env(free_jax_port(), 2)
        two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # as the child expects
        mpi = pool.submit(start_as, lambda i: {**ranks(i), **two_devices}, mlp, 2, tmp / "mpirun", 120)
        return {"srun": slurm.result(), "mpirun": mpi.result(), "dir": tmp}


def test_train_gpt_runs_as_one_job_under_srun(launched):
    (code0, out0), (code1, out1) = launched["srun"]
    assert (code0, code1) == (0, 0), f"--- task 0\n{out0}\n--- task 1\n{out1}"
    assert "2 x 1 mesh of 2 cpu devices in 2 process(es)" in out0, out0
    assert "iter 2" in out0 and "iter 2" not in out1, "only process 0 logs"
    assert (launched["dir"] / "run" / "ckpt_00000002.msgpack").exists()


def test_mpirun_ranks_train_like_one_device(launched, reference):  # noqa: F811 - reference: a fixture
    outputs = launched["mpirun"]
    results = []
    for code, out in outputs:
        assert code == 0, out
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    assert [r["process"] for r in results] == [0, 1] and [r["rows"] for r in results] == [[0, 4], [4, 8]]
    for r in results:
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)


# ---------------------------------------------------------------- dying with purejax.parallel.launch


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that is gone to reap it counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_killing_the_launcher_ends_its_processes_and_theirs():
    """SIGKILL cannot be passed on, so the launcher's processes learn of it from the pipe they watch; each
    takes its own child (a `sleep`) with it. Before, they slept on for the full 600 s."""
    program = (
        "from purejax.parallel import distributed; distributed.initialize()\n"
        "import os, subprocess\n"
        "child = subprocess.Popen(['sleep', '600'])\n"
        "print('pids', os.getpid(), child.pid, flush=True)\n"
        "child.wait()"
    )
    env = {**clean_environ(), distributed.ENV_INIT_TIMEOUT: "60"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "purejax.parallel.launch", "--num_processes=2", "--", "-c", program],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids = []
    try:
        while len(pids) < 4:
            line = launcher.stdout.readline()
            assert line, "the launcher ended before its processes started"
            if "] pids " in line:
                pids += [int(p) for p in line.split()[-2:]]
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "still running 20 s after the launcher was killed"


def test_die_with_launcher_ignores_a_variable_without_its_pipe(monkeypatch):
    """A grandchild inherits the variable but not the descriptor: nothing to watch, nothing happens."""
    read_end, write_end = os.pipe()
    try:
        monkeypatch.setenv(cluster.ENV_LAUNCHER_PIPE, f"{read_end}:{os.fstat(read_end).st_ino + 1}")  # another pipe
        cluster.die_with_launcher()
        monkeypatch.setenv(cluster.ENV_LAUNCHER_PIPE, "not-a-pipe")
        cluster.die_with_launcher()
        assert not cluster._watching.is_set()
    finally:
        os.close(read_end)
        os.close(write_end)
