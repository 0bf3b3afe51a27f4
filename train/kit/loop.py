"""The loop every training program runs, so that a program says only what is particular to it.

    loop = Loop(out_dir, stop, save, start=int(state.step), total=settings.max_iters, log_interval=50,
                progress=settings.progress, max_bad_steps=settings.max_bad_steps, resumed=resumed)
    loop = run.loop(settings, save, start=..., total=..., log_interval=..., resumed=...)  # the same, in a program
    state = loop.run(state, step, due=evaluate_when_due)
    loop.plot("GPT on stdlib")                           # loss.png, or a line saying why not

A program gives it three functions:

- `step(state, it) -> (state, metrics)`: the training step on iteration `it`'s batch (`optim.train_step`);
- `save(state, it, reason, **metadata) -> path`: one checkpoint. The loop saves on a stop signal (reason
  "signal") and after the last step ("end", unless the last save was at that iteration already);
- `due(state, it)`: what is due at iteration `it` (an evaluation, samples, an interval checkpoint through
  `loop.save`), called before each step and once after the last; its time is left out of the step timing.

Around them the loop keeps, alike for every program:

- timing: the first step, compilation included, is reported on its own line; then every `log_interval`
  steps a row goes to `metrics.jsonl` (`metrics.MetricsLog`: strict JSON, null for a non-finite number) with the
  loss, learning rate, gradient norm, loss scale, the number of steps skipped since the last row, ms/iter,
  the step's own scalar metrics (e.g. accuracy) and the program's `rates(seconds_per_step)` (tokens/s, MFU).
  The time is that of the steps that ran: the loop waits for the state at each row (JAX dispatches steps
  ahead of the device), and a row whose window holds only the first step has no timing. A resumed run
  first drops the rows that the interrupted one logged after its checkpoint, so no iteration appears twice;
- the display: a tqdm bar on a terminal, else the same row as a plain line (`metrics.live_bar`);
- stop signals (`signals.StopSignal`): a request saves a checkpoint after the step in flight and exits
  with 0; `agree(requested, it)`, asked after every step, lets the processes of a multi-process run stop at
  the same step (`Devices.stop_agreement`);
- divergence: `optim.train_step` skips a step whose gradients are not finite (params unchanged; a float16
  loss scale backs off). After `WARN_AFTER` such steps in a row, or steps with a non-finite loss, a warning;
  after `max_bad_steps` (0: never) the run stops with an error and exit status 1, without saving over the
  last good checkpoint, and so does a run that skipped every one of its steps, however few. Checked at log
  intervals and at the end from every step's metrics (no extra wait per step);
- an `observe.Observer` when the program passes one (`observer=`): a profiler trace around the steps that
  `--profile` names, and every row of metrics.jsonl also to TensorBoard or W&B.
"""

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from purejax import checkpoint
from train.kit import plots, signals
from train.kit.metrics import MetricsLog, live_bar
from train.kit.observe import Observer

WARN_AFTER = 10  # consecutive bad steps before a warning
STEP_METRICS = {"loss": "loss", "learning_rate": "lr", "grad_norm": "grad_norm", "loss_scale": "loss_scale"}

PyTree = Any


class Loop:
    """The shared loop of `train`'s programs; see the module docstring. Only the main process of a
    multi-process run (`main=True`) writes metrics.jsonl and prints; every process saves (a collective)."""

    def __init__(
        self,
        out_dir: str | Path,
        stop: signals.StopSignal,
        save: Callable[..., Path],
        *,
        start: int,
        total: int,
        log_interval: int,
        progress: bool,
        max_bad_steps: int,
        resumed: bool = False,
        main: bool = True,
        rates: Callable[[float], dict[str, float]] = lambda seconds_per_step: {},
        agree: Callable[[bool, int], bool] = lambda requested, it: requested,
        observer: Observer | None = None,
    ):
        self.out_dir, self.stop, self._save = Path(out_dir), stop, save
        self.start, self.total, self.log_interval, self.progress = start, total, log_interval, progress
        self.max_bad_steps, self.main, self.rates, self.agree = max_bad_steps, main, rates, agree
        self.observer = observer or Observer()  # one that was never started watches nothing
        self.log = MetricsLog(self.out_dir / "metrics.jsonl") if main else None
        self.saved_at = start if resumed else None  # the resumed checkpoint is this iteration's
        self.bar = None
        self._pending: list[dict[str, Any]] = []  # the metrics of the steps since the last log row
        self._window_start, self._window_steps, self._compiled = time.perf_counter(), 0, False
        self._bad, self._good, self._warned = 0, 0, False
        if resumed and self.log is not None:
            self.log.drop_after(start)  # rows a killed run logged after its checkpoint: this run logs them again

    def say(self, line: str) -> None:
        """Print a line (above the bar when there is one); only on the main process."""
        if self.bar is not None:
            self.bar.write(line)
        elif self.main:
            print(line, flush=True)

    def write(self, **row: Any) -> None:
        """Append a row to metrics.jsonl and send it to the observer's loggers (main process only)."""
        if self.log is not None:
            self.log.write(**row)
            self.observer.log(row)

    def save(self, state: PyTree, it: int, reason: str, **metadata: Any) -> Path:
        """The program's `save(state, it, reason, **metadata)`, noted so that the end does not save twice."""
        try:
            path = self._save(state, it, reason, **metadata)
        except checkpoint.CheckpointWriteError as e:  # a full disk: one line naming the file and the last good one
            raise SystemExit(f"error: {e}") from None
        self.saved_at = it
        self.say(f"saved {path} ({reason})")
        return path

    def run(
        self, state: PyTree, step: Callable, due: Callable[[PyTree, int], None] | None = None, save_at_end: bool = True
    ) -> PyTree:
        """Train from `start` to `total`; returns the final state (saved unless `save_at_end` is False)."""
        self.bar = live_bar(self.total, self.start, self.progress) if self.main else None
        self.stop.training()
        it = self.start
        try:
            while True:
                if due is not None:
                    began = time.perf_counter()
                    due(state, it)
                    self._window_start += time.perf_counter() - began  # evaluations are not step time
                if it >= self.total:
                    break
                self.observer.before_step(it, state)
                state, metrics = step(state, it)
                it += 1
                self.observer.after_step(it, state)
                self._after_step(it, metrics, state)
                if self.agree(self.stop.requested, it):
                    self.save(state, it, "signal")
                    self.stop.finishing()  # a late signal now says everything is saved
                    raise SystemExit(0)
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
        self._check_the_last_steps(it)
        if save_at_end and self.saved_at != it:
            self.save(state, it, "end")
        self.stop.finishing()
        return state

    def _after_step(self, it: int, metrics: dict[str, Any], state: PyTree) -> None:
        self._pending.append(metrics)
        self._window_steps += 1
        if self.bar is not None:
            self.bar.update(1)
        if not self._compiled:  # keep compilation out of the first window's timing
            jax.block_until_ready((state, metrics))
            self.say(f"compiled and ran the first step in {time.perf_counter() - self._window_start:.1f} s")
            self._compiled, self._window_start, self._window_steps = True, time.perf_counter(), 0
        if it % self.log_interval == 0:
            jax.block_until_ready(state)  # time the steps that ran, not the ones dispatched
            self._log_row(it)

    def _log_row(self, it: int) -> None:
        """One row of metrics.jsonl and of the display from the steps since the last, and the divergence check."""
        # Waits for the last step: the one wait per log interval. Scalars become Python numbers and bools.
        pending = jax.device_get(self._pending)
        pending = jax.tree.map(lambda x: x.item() if getattr(x, "shape", None) == () else x, pending)
        self._pending = []
        steps, seconds = self._window_steps, time.perf_counter() - self._window_start
        self._window_start, self._window_steps = time.perf_counter(), 0
        last = pending[-1]
        row = {"iter": it, **{name: last[key] for key, name in STEP_METRICS.items() if key in last}}
        row["skipped"] = sum(bool(m["skipped"]) for m in pending)
        row.update({k: v for k, v in last.items() if k not in STEP_METRICS and k != "skipped" and _is_scalar(v)})
        if steps:  # none when the only step since the last row was the first (its time is on its own line)
            row["ms_per_iter"] = seconds / steps * 1e3
            row.update(self.rates(seconds / steps))
        self.write(**row)
        shown = ", ".join(_show(k, v) for k, v in row.items() if k not in ("iter", "grad_norm", "loss_scale"))
        if self.bar is not None:
            self.bar.set_postfix_str(shown)
        else:
            self.say(f"iter {it}: {shown}")
        self._check_health(it, pending, float(last.get("loss_scale", 1.0)))

    def _check_health(self, it: int, pending: list[dict[str, Any]], loss_scale: float) -> None:
        for m in pending:
            bad = bool(m["skipped"]) or not math.isfinite(float(m["loss"]))
            self._bad = self._bad + 1 if bad else 0
            self._good += not bad
        if self._bad == 0:
            self._warned = False
            return
        what = (
            f"the last {self._bad} steps (to iter {it}) had a non-finite loss or gradients and were skipped "
            f"(loss scale {loss_scale:g})"
        )
        if 0 < self.max_bad_steps <= self._bad:
            self._fail(f"{what}: the run diverged")
        if self._bad >= WARN_AFTER and not self._warned:
            self._warned = True
            limit = f"the run stops at {self.max_bad_steps}" if self.max_bad_steps else "max_bad_steps=0: never stops"
            self.say(f"warning: {what}; {limit}")

    def _check_the_last_steps(self, it: int) -> None:
        """The health check over the steps since the last row; a run that trained and skipped every step (a
        float16 run diverged from its first step, say) has failed, however few steps it had."""
        if self._pending:
            pending = jax.device_get(self._pending)
            self._pending = []
            self._check_health(it, pending, float(pending[-1].get("loss_scale", 1.0)))
        if it > self.start and self._good == 0:
            self._fail(f"every one of the {it - self.start} steps of this run had a non-finite loss or gradients")

    def _fail(self, what: str) -> None:
        newest = "nothing saved yet" if self.saved_at is None else f"the newest checkpoint is iter {self.saved_at}"
        raise SystemExit(
            f"error: {what}. Stopped without saving ({newest}); lower --learning_rate, clip gradients, or train "
            "in bfloat16 or float32"
        )

    def plot(self, title: str) -> Path | None:
        """loss.png from metrics.jsonl, or a line saying why it was skipped (main process only)."""
        if self.log is None:
            return None
        png = plots.plot_losses(self.log, self.out_dir / "loss.png", title=title)
        self.say(f"loss curve: {png}" if png else f"loss.png skipped: {plots.NO_MATPLOTLIB}")
        return png


def _is_scalar(value: Any) -> bool:
    return getattr(value, "shape", None) == () or isinstance(value, (int, float))


def _show(key: str, value: Any) -> str:
    """One value of a log row for people: `loss 2.3456`, `lr 1.00e-03`, `mfu 3.1%`, `12,345 tokens/s`."""
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return f"{key} {value}"
    if key == "mfu":
        return f"mfu {value:.1%}"
    if key.endswith("_per_s"):
        return f"{value:,.0f} {key.removesuffix('_per_s')}/s"
    if key == "ms_per_iter":
        return f"{value:.1f} ms/iter"
    if key == "lr":
        return f"lr {value:.2e}"
    if isinstance(value, float):
        return f"{key} {value:.4f}"
    return f"{key} {value}"
