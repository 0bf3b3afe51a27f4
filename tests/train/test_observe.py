"""Looking inside a run (`train.kit.observe`, `compile_cache`, `loggers`): the persistent compilation cache
counted across two runs, a profiler trace of the steps asked for, TensorBoard and W&B logs read back and
compared with metrics.jsonl, clear errors for a missing package or a malformed setting, before any compile."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

from tests.train.fresh_process import run_program
from train import flow, gpt
from train.kit import compile_cache, observe, resume
from train.kit import settings as settings_lib
from train.kit.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config=gpt_tiny", "--progress=false", "--peak_flops=1e11", "--eval_iters=1", "--log_interval=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(topics[k] for k in sorted(topics))[:20_000])
    return path


def rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def run_gpt(args: list[str], cwd: Path) -> str:
    """A fresh process (JAX opens its cache once per process), with none of the test session's cache settings."""
    return run_program("train.gpt", args, cwd, timeout=300)


def test_the_second_run_compiles_nothing_and_the_profile_holds_the_steps(tmp_path, corpus):
    """Counted, not timed: the first run compiles and writes every program to the cache, the second finds all of
    them there. The first run also traces iterations 1:2 (XProf's .xplane.pb and Perfetto's trace)."""
    args = [*TINY, f"--dataset={corpus}", "--max_iters=2", "--eval_interval=2", f"--compile_cache={tmp_path / 'jax'}"]
    first = run_gpt([*args, "--out_dir=a", "--profile=1:2"], tmp_path)
    second = run_gpt([*args, "--out_dir=b"], tmp_path)
    a, b = rows(tmp_path / "a")[-1], rows(tmp_path / "b")[-1]
    assert a["compile_cache"] == b["compile_cache"] == str(tmp_path / "jax")
    assert a["compiles"] > 0 and a["cache_misses"] > 0 and a["cache_hits"] < a["compiles"], first
    assert b["compiles"] == a["compiles"] and b["cache_hits"] == b["compiles"] and b["cache_misses"] == 0, second
    assert f"cache {tmp_path / 'jax'}: {b['cache_hits']} hits, 0 misses" in second

    (trace_dir,) = (tmp_path / "a" / "profile" / "plugins" / "profile").iterdir()
    assert list(trace_dir.glob("*.xplane.pb"))
    with gzip.open(trace_dir / "perfetto_trace.json.gz", "rt") as f:
        assert "train_step" in f.read()  # the jitted step ran inside the trace
    assert "profile of iterations 1:2" in first and not (tmp_path / "b" / "profile").exists()


def test_the_cache_settings():
    assert compile_cache.resolve("off") is None and compile_cache.resolve("") is None
    assert compile_cache.resolve("~/x") == Path("~/x").expanduser()
    assert compile_cache.default_directory().parts[-2:] == ("purejax", "jax")
    counts = compile_cache.Counts(compiles=3, compile_s=1.25, cache_hits=2, cache_misses=1)
    assert counts.summary(Path("/c")) == "compiled 3 programs in 1.2 s (cache /c: 2 hits, 1 misses)"
    assert counts.summary(None) == "compiled 3 programs in 1.2 s (cache off)"


def test_the_counter_counts_this_process_compilations():
    counter = compile_cache.Counter()
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()  # a program no other test compiles
    counts = counter.stop()
    assert counts.compiles >= 1 and counts.compile_s > 0
    before = counts.compiles
    jax.jit(lambda x: x * 5 - 2)(jax.numpy.arange(7.0)).block_until_ready()  # stopped: no longer counted
    assert counter.counts.compiles == before


@pytest.mark.parametrize(
    "spec, window", [("", None), ("3:5", (3, 5)), ("0:1", (0, 1)), ("5:5", None), ("5", None), ("a:b", None)]
)
def test_profile_windows(spec, window):
    if spec and window is None:
        with pytest.raises(ValueError, match="START:STOP"):
            observe.profile_window(spec)
    else:
        assert observe.profile_window(spec) == window


def test_a_malformed_profile_is_a_one_line_error_naming_the_key():
    with pytest.raises(SystemExit, match=r"profile='10': expected START:STOP"):
        gpt.parse(["--profile=10"])
    with pytest.raises(ConfigError, match="remat='everything'.*'dots_saveable'"):
        flow.FlowSettings(remat="everything")


def test_help_lists_the_shared_settings_after_the_programs_own():
    names = [row[0] for row in settings_lib.describe(gpt.GPTSettings)]
    assert names[0] == "out_dir" and names[-7:] == [
        "compile_cache",
        "log_compiles",
        "profile",
        "tensorboard",
        "wandb_log",
        "wandb_project",
        "wandb_run_name",
    ]


def test_how_a_run_is_watched_is_never_taken_from_the_checkpoint():
    cfg = flow.FlowSettings(init_from="resume")
    saved = {"tensorboard": True, "profile": "1:2", "max_iters": 7, "compile_cache": "/elsewhere"}
    resumed = resume.settings(cfg, given=set(), saved=saved, fixed=())
    assert (resumed.tensorboard, resumed.profile, resumed.compile_cache) == (False, "", "auto")
    assert resumed.max_iters == 7  # everything else continues as saved


def count_compiles(fn):
    """(fn's result or the SystemExit it raised, the number of XLA compilations while it ran)."""
    counter = compile_cache.Counter()
    try:
        result = fn()
    except SystemExit as e:
        result = e
    return result, counter.stop().compiles


@pytest.mark.parametrize("setting, package", [("tensorboard", "tensorboard"), ("wandb_log", "wandb")])
def test_a_missing_logger_package_fails_before_anything_compiles(setting, package, tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    args = [*TINY, f"--dataset={corpus}", f"--out_dir={tmp_path / 'out'}", f"--{setting}=true"]
    error, compiles = count_compiles(lambda: gpt.main(args))
    assert isinstance(error, SystemExit) and f"pip install {package}" in str(error) and f"--{setting}" in str(error)
    assert compiles == 0


def wandb_records(run_file: Path) -> list:
    """The records of a .wandb file: leveldb's log format (32 KiB blocks of records, each a 4-byte checksum, a
    2-byte length, a 1-byte type: full, first, middle, last) after a 7-byte header, holding wandb's protos."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B", run_file
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a record header: the block is padded
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def tensorboard_scalars(directory: Path) -> dict[int, dict]:
    """{step: {tag: value}} of the event files in `directory`, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events, scalars = EventAccumulator(str(directory)).Reload(), {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            scalars.setdefault(event.step, {})[tag] = event.value
    return scalars


def wandb_history(out_dir: Path, project: str, name: str) -> dict[int, dict]:
    """{step: {key: value}} of the one offline W&B run under `out_dir`, checking its project and name."""
    (run_file,) = (out_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or i.nested_key[0]): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        if record.WhichOneof("record_type") == "run":
            assert (record.run.project, record.run.display_name) == (project, name)
    return history


def test_tensorboard_and_wandb_hold_the_rows_of_metrics_jsonl(tmp_path, corpus, monkeypatch):
    """One run with both loggers (each where its package is installed); every number of every row of
    metrics.jsonl, training and evaluation, read back at its iteration."""
    installed = {p: importlib.util.find_spec(p) is not None for p in ("tensorboard", "wandb")}
    if not any(installed.values()):
        pytest.skip("the loggers need tensorboard or wandb: pip install tensorboard wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for where in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in the home directory
        monkeypatch.setenv(where, str(tmp_path / where.lower()))
    out = tmp_path / "out"
    gpt.main(
        [
            *TINY,
            f"--dataset={corpus}",
            f"--out_dir={out}",
            "--max_iters=3",
            "--eval_interval=2",
            f"--tensorboard={installed['tensorboard']}",
            f"--wandb_log={installed['wandb']}",
            "--wandb_project=tests",
            "--wandb_run_name=tiny",
        ]
    )
    logged = [r for r in rows(out) if "iter" in r]
    assert {r["iter"] for r in logged} == {0, 1, 2, 3} and any("val_loss" in r for r in logged)
    assert "cache_hits" in logged[-1]  # the compile counts too, at the last iteration
    read_back = {
        "tensorboard": lambda: tensorboard_scalars(out / "tensorboard"),
        "wandb": lambda: wandb_history(out, "tests", "tiny"),
    }
    for package, read in read_back.items():
        if not installed[package]:
            continue
        steps = read()
        for row in logged:
            for key, value in row.items():
                if key != "iter" and isinstance(value, (int, float)):  # TensorBoard: float32, W&B: float64
                    assert steps[row["iter"]][key] == pytest.approx(value, rel=1e-6), (package, row["iter"], key)
