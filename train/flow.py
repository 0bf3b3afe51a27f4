"""Train a class-conditional DiT with rectified flow on images that need no download.

    python -m train.flow                                  # DiT on scikit-learn's 8x8 digits, a few CPU minutes
    python -m train.flow --config=flow_tiny --max_iters=50
    python -m train.flow --mask_ratio=0.5 --n_mixer=1     # MicroDiT: patch-mixer, then half the patches masked
    python -m train.flow --init_from=resume               # continue out_dir's newest checkpoint, bit for bit
    python -m train.flow --help                           # every setting, its default and range

Settings are the fields of `FlowSettings` (`--key=value`, presets in train/presets/flow_*.toml). The run
writes to out_dir `ckpt_*.msgpack`, `metrics.jsonl`, `loss.png`, and every `sample_interval` steps and at the
end a PNG grid of samples from the parameter average (`samples_<iter>.png`: one row per class). At the end it
samples `eval_per_class` images of each class at each guidance in `eval_guidance` and reports

- accuracy: the fraction that an independent classifier (an SVC trained on the real training digits,
  `train.sample_quality`) reads as the requested class; 10% is chance;
- fd: the pixel-space Fréchet distance of the samples to the real test images, and fd_floor, the same
  between the real training and test images (what a perfect generator would score, up to sample size).

Resume is exact: batches are a function of (seed, step), keys live in the checkpointed state, the learning
rate is a function of the step, so an interrupted and resumed run ends with the same parameters, bit for bit.
"""

from train.kit import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import functools
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import dit
from models import rectified_flow as rf
from purejax import optim
from purejax import tree as tree_lib
from purejax.precision import Policy, with_policy
from train import sample_quality
from train.data import images as images_lib
from train.flow_settings import FlowSettings
from train.kit import plots, resume, start
from train.kit.loop import Loop
from train.kit.metrics import format_seconds

PROGRAM = "train.flow"
MODEL_KEYS = ("dataset", "patch_size", "d_model", "n_layer", "n_head", "mlp_ratio", "n_mixer", "n_experts")


def make_optimizer(settings: FlowSettings) -> optim.GradientTransformation:
    """AdamW with nanoGPT's schedule: linear warmup, then cosine decay to min_lr."""
    lr = optim.schedules.warmup_cosine(
        settings.learning_rate, settings.warmup_iters, settings.lr_decay_iters, settings.min_lr
    )
    return optim.adamw(lr, weight_decay=settings.weight_decay)


def make_loss_fn(settings: FlowSettings, model_config: dit.DiTConfig, policy: Policy):
    """`(params, (x, y), key) -> (loss, aux)` for `optim.train_step`: the rectified-flow loss of DiT, or of
    MicroDiT's masked forward when mask_ratio > 0, run in the policy's compute dtype."""
    if settings.mask_ratio > 0:
        forward = functools.partial(dit.apply_masked, config=model_config, mask_ratio=settings.mask_ratio)
    else:
        forward = lambda p, z, t, y, key: dit.velocity(p, z, t, y, model_config)  # noqa: E731

    # The params and z (arguments 0 and 1) in the compute dtype; t stays float32: in bfloat16, time_scale * t
    # would move in steps of 4 above 512, so training would see another t than the target and the sampler use.
    predict = with_policy(forward, policy, cast=(0, 1))

    flow = settings.flow_config(model_config)

    def loss_fn(params, batch, key):
        x, y = batch
        return rf.loss(predict, params, x, y, flow, key=key)

    return loss_fn


def get_batch(data: images_lib.ImageSplits, settings: FlowSettings, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of step `step`: indices drawn without replacement from a generator seeded by (seed, step),
    images scaled from [0, 1] to [-1, 1]. A function of the step alone, so a resumed run sees the same batches."""
    rng = np.random.default_rng([settings.seed, step])
    idx = rng.choice(len(data.train_images), size=min(settings.batch_size, len(data.train_images)), replace=False)
    return 2 * data.train_images[idx] - 1, data.train_labels[idx]


def new_state(settings: FlowSettings, model_config: dit.DiTConfig, ema: optim.ParamEMA) -> optim.TrainState:
    """The state before the first step: DiT's init, AdamW's state, the parameter average and the key."""
    key = jax.random.key(settings.seed)
    params = dit.init(jax.random.fold_in(key, 0), model_config)
    return optim.init_train_state(params, make_optimizer(settings), jax.random.fold_in(key, 1), ema=ema)


def make_sampler(model_config: dit.DiTConfig, n_steps: int):
    """`(params, seed, labels, guidance) -> images in [0, 1]`, jitted: one compilation per batch size (the key
    is made from the seed inside, so that making it compiles nothing of its own)."""
    sample = functools.partial(
        rf.sample,
        functools.partial(dit.velocity, config=model_config),
        n_steps=n_steps,
        shape=(model_config.input_size, model_config.input_size, model_config.in_channels),
        null_class=model_config.null_class,
    )

    def sample_images(params, seed, labels, guidance):
        images = sample(params, jax.random.key(seed), labels, guidance=guidance)
        return jnp.clip((images + 1) / 2, 0, 1)

    return jax.jit(sample_images)


def load_data(settings: FlowSettings, saved: dict | None) -> tuple[images_lib.ImageSplits, dit.DiTConfig, dict]:
    """(the images, the model for them, their fingerprint), checked against the checkpoint's when resuming."""
    try:
        if settings.guidances and importlib.util.find_spec("sklearn") is None:
            raise ModuleNotFoundError(
                "the final evaluation's classifier needs scikit-learn: pip install scikit-learn "
                "(or purejax[examples]), or skip it with --eval_guidance="
            )
        data = images_lib.load_images(settings.dataset)
        model_config = settings.model_config(data)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    fingerprint = resume.array_fingerprint(train_images=data.train_images, train_labels=data.train_labels)
    resume.check_data(saved, fingerprint, f"the {settings.dataset} training images")
    return data, model_config, fingerprint


def main(argv: list[str] | None = None) -> dict:
    with start.run(FlowSettings, argv, program=PROGRAM, doc=__doc__, default_preset="flow_digits") as run:
        settings, saved = run.settings, run.saved_config()
        if saved:
            settings = run.resumed_settings(saved["train"], fixed=MODEL_KEYS)
        data, model_config, fingerprint = load_data(settings, saved)
        ema = optim.param_ema(optim.ema_warmup(settings.ema_decay))  # a fixed 0.999 keeps 37% of the init at 1000
        if saved:
            state, resumed = resume.restore(run.manager, lambda: new_state(settings, model_config, ema))
        else:
            (state, _), resumed = run.devices.build_state(lambda: new_state(settings, model_config, ema)), None
        checkpoint_config = run.checkpoint_config(settings, model_config, fingerprint)
        return train(run, settings, model_config, data, start.StartingPoint(state, resumed, checkpoint_config), ema)


def train(
    run: start.Run,
    settings: FlowSettings,
    model_config: dit.DiTConfig,
    data: images_lib.ImageSplits,
    starting_point: start.StartingPoint,
    ema: optim.ParamEMA,
) -> dict:
    """The loop with what is particular to this program: batches from (seed, step), interval checkpoints and
    sample grids, and at the end samples of every class judged by `sample_quality.evaluate`."""
    state, resumed, checkpoint_config = starting_point
    loss_fn = make_loss_fn(settings, model_config, Policy(jnp.float32, settings.dtype, jnp.float32))
    train_step = functools.partial(
        optim.train_step,
        loss_fn=loss_fn,
        optimizer=make_optimizer(settings),
        max_grad_norm=settings.grad_clip or None,
        ema=ema,
    )
    step_fn = jax.jit(train_step, donate_argnums=0)
    sampler = make_sampler(model_config, settings.sample_steps)
    grid_labels = np.repeat(np.arange(data.num_classes), data.num_classes)  # one row per class

    def save(state: optim.TrainState, it: int, reason: str) -> Path:
        return run.manager.save(it, state, config=checkpoint_config, metadata={"reason": reason})

    def sample_grid(state: optim.TrainState, it: int) -> Path | None:
        images = np.asarray(sampler(ema.value(state.ema), settings.seed + 1, grid_labels, settings.sample_guidance))
        title = f"iter {it}, guidance {settings.sample_guidance:g}"
        return plots.save_grid(images, loop.out_dir / f"samples_{it:06d}.png", title)

    def due(state: optim.TrainState, it: int) -> None:  # after a step: never at the start
        if it != loop.start and it % settings.checkpoint_interval == 0:
            loop.save(state, it, "interval")
        if it != loop.start and it % settings.sample_interval == 0 and it < settings.max_iters:
            sample_grid(state, it)

    loop = run.loop(
        settings,
        save,
        start=int(state.step),
        total=settings.max_iters,
        log_interval=settings.log_interval,
        resumed=resumed is not None,
    )
    if resumed:
        loop.say(f"resumed from {run.manager.path(resumed.step)} at iter {resumed.step}")
    introduce(loop, settings, model_config, data, state)
    started = time.perf_counter()
    state = loop.run(state, lambda state, it: step_fn(state, get_batch(data, settings, it)), due)
    result = {"iter": int(state.step), "train_seconds": time.perf_counter() - started}
    samples = ""
    if settings.guidances:
        png = sample_grid(state, result["iter"])
        samples = f"; samples: {png}" if png else f"; sample grids skipped: {plots.NO_MATPLOTLIB}"
        result = judge_samples(loop, settings, data, sampler, ema.value(state.ema), result)
    loop.say(f"trained {result['iter']} iters in {format_seconds(result['train_seconds'])}{samples}")
    loop.plot(f"DiT {model_config.n_layer}x{model_config.d_model} rectified flow on {settings.dataset}")
    return result


def introduce(
    loop: Loop,
    settings: FlowSettings,
    model_config: dit.DiTConfig,
    data: images_lib.ImageSplits,
    state: optim.TrainState,
) -> None:
    """The lines that open the run: the model, the data."""
    masked = (
        f", MicroDiT mask ratio {settings.mask_ratio} after {model_config.n_mixer} mixer blocks"
        if settings.mask_ratio
        else ""
    )
    loop.say(
        f"model: DiT {model_config.n_layer}x{model_config.d_model}, patch {model_config.patch_size}, "
        f"{model_config.seq} tokens, {tree_lib.count(state.params) / 1e6:.2f}M params{masked}"
    )
    loop.say(
        f"data: {settings.dataset}, {len(data.train_images)} train / {len(data.test_images)} test images "
        f"{data.train_images.shape[1:]}, batch {settings.batch_size}"
    )


def judge_samples(
    loop: Loop,
    settings: FlowSettings,
    data: images_lib.ImageSplits,
    sampler: Callable,
    params: dict,
    result: dict[str, float],
) -> dict[str, float]:
    """`result` with the scores of `eval_per_class` samples of each class at each guidance of `eval_guidance`,
    read by an independent classifier and measured against the test digits (`sample_quality.evaluate`); the
    row written to metrics.jsonl and said."""
    judge = lambda labels, guidance: sampler(params, settings.seed + 12345, labels, guidance)  # noqa: E731
    result = {**result, **sample_quality.evaluate(judge, data, settings.eval_per_class, settings.guidances)}
    loop.write(**result)
    accuracies = ", ".join(f"{result[f'accuracy_g{g:g}']:.1%} at guidance {g:g}" for g in settings.guidances)
    distances = ", ".join(f"{result[f'fd_g{g:g}']:.3f} at guidance {g:g}" for g in settings.guidances)
    loop.say(
        f"classifier reads {accuracies} as the requested class "
        f"(it scores {result['classifier_test_accuracy']:.1%} on the real test digits)"
    )
    loop.say(f"pixel Frechet distance to the test digits: {distances}; real train vs test: {result['fd_floor']:.3f}")
    return result


if __name__ == "__main__":
    main()
