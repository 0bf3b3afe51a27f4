"""Train a class-conditional DiT with rectified flow on images that need no download.

    python -m purejax.train.flow                                  # DiT on scikit-learn's 8x8 digits, a few CPU minutes
    python -m purejax.train.flow --config=flow_tiny --max_iters=50
    python -m purejax.train.flow --mask_ratio=0.5 --n_mixer=1     # MicroDiT: patch-mixer, then half the patches masked
    python -m purejax.train.flow --init_from=resume               # continue out_dir's newest checkpoint, bit for bit

Settings are the fields of `TrainConfig` (`--key=value`, presets in purejax/train/config/flow_*.toml). The run
writes `out_dir/ckpt_*.msgpack`, `metrics.jsonl`, `loss.png`, and every `sample_interval` steps and at the end
(unless `eval_guidance` is empty) a PNG grid of samples from the parameter average (`samples_<iter>.png`: one
row per class). At the end it samples
`eval_per_class` images of each class at each guidance in `eval_guidance` and reports

- accuracy: the fraction that an independent classifier (an SVC trained on the real training digits,
  `train.sample_quality`) reads as the requested class; 10% is chance;
- fd: the pixel-space Fréchet distance of the samples to the real test images, and fd_floor, the same
  between the real training and test images (what a perfect generator would score, up to sample size).

Resume is exact: batches are a function of (seed, step), keys live in the checkpointed state, the learning
rate is a function of the step, so an interrupted and resumed run ends with the same parameters, bit for bit.
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

from purejax.models import dit
from purejax.models import rectified_flow as rf
from purejax import checkpoint, optim
from purejax import tree as tree_lib
from purejax.precision import Policy
from purejax.train import config as config_lib
from purejax.train import run, sample_quality
from purejax.train.data import images as images_lib


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run. Model fields go to `dit.DiTConfig`, flow fields to `rf.FlowConfig`."""

    # I/O
    out_dir: str = "out-flow"
    init_from: Literal["scratch", "resume"] = "scratch"
    log_interval: int = 50
    checkpoint_interval: int = 500
    keep_checkpoints: int = 2
    sample_interval: int = 1000  # a PNG grid every so many steps (and at the end)
    # data
    dataset: Literal["digits", "mnist"] = "digits"
    batch_size: int = 128
    # model (DiT); mask_ratio > 0 with n_mixer > 0 is MicroDiT's deferred masking
    patch_size: int = 2
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    mlp_ratio: float = 4.0
    n_mixer: int = 0
    mask_ratio: float = 0.0
    n_experts: int = 0
    layers: Literal["scan", "loop"] = "scan"  # "loop" runs faster on CPU at this depth, "scan" compiles flat in depth
    # rectified flow
    time_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    shift: float = 1.0
    label_dropout: float = 0.1
    # AdamW with linear warmup and cosine decay, gradient clipping, parameter average
    learning_rate: float = 1e-3
    max_iters: int = 3000
    warmup_iters: int = 100
    lr_decay_iters: int = 3000
    min_lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0 disables clipping
    ema_decay: float = 0.999  # reached after a warmup (optim.ema_warmup): early averages follow the params
    # sampling and evaluation
    sample_steps: int = 32
    sample_guidance: float = 1.5
    eval_per_class: int = 100
    eval_guidance: str = "1,2"  # guidance scales evaluated at the end; "" skips the end's samples and evaluation
    # system
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        for name in ("log_interval", "checkpoint_interval", "keep_checkpoints", "sample_interval", "batch_size",
                     "sample_steps", "eval_per_class"):  # fmt: skip
            if getattr(self, name) < 1:
                raise config_lib.ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_iters < 0 or self.warmup_iters < 0:
            raise config_lib.ConfigError("max_iters and warmup_iters must be >= 0")
        if not 0.0 <= self.mask_ratio < 1.0:
            raise config_lib.ConfigError(f"mask_ratio must be in [0, 1), got {self.mask_ratio}")
        self.guidances  # noqa: B018 - parses eval_guidance, so a typo fails here

    @property
    def guidances(self) -> tuple[float, ...]:
        try:
            return tuple(float(g) for g in self.eval_guidance.split(",") if g.strip())
        except ValueError:
            raise config_lib.ConfigError(f"eval_guidance={self.eval_guidance!r}: expected numbers separated by commas") from None

    def model_config(self, data: images_lib.ImageSplits) -> dit.DiTConfig:
        _, size, _, channels = data.train_images.shape
        try:
            return dit.DiTConfig(input_size=size, in_channels=channels, n_classes=data.num_classes, learn_sigma=False,
                                 time_scale=1000.0, patch_size=self.patch_size, d_model=self.d_model,
                                 n_layer=self.n_layer, n_head=self.n_head, mlp_ratio=self.mlp_ratio,
                                 n_mixer=self.n_mixer, n_experts=self.n_experts, layers=self.layers)  # fmt: skip
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None

    def flow_config(self, model: dit.DiTConfig) -> rf.FlowConfig:
        return rf.FlowConfig(time_sampling=self.time_sampling, shift=self.shift, label_dropout=self.label_dropout,
                             null_class=model.null_class)  # fmt: skip


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

    def predict(params, z, t, y, key):
        # The params and z in the compute dtype; t stays float32: in bfloat16, time_scale * t would move in
        # steps of 4 above 512, so training would see another t than the target and the sampler use.
        params, z = policy.cast_to_compute((params, z))
        return policy.cast_to_output(forward(params, z, t, y, key=key))

    flow = cfg.flow_config(model)

    def loss_fn(params, batch, key):
        x, y = batch
        return rf.loss(predict, params, x, y, key, flow)

    return loss_fn


def get_batch(data: images_lib.ImageSplits, cfg: TrainConfig, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of step `step`: indices drawn without replacement from a generator seeded by (seed, step),
    images scaled from [0, 1] to [-1, 1]. A function of the step alone, so a resumed run sees the same batches."""
    rng = np.random.default_rng([cfg.seed, step])
    idx = rng.choice(len(data.train_images), size=min(cfg.batch_size, len(data.train_images)), replace=False)
    return 2 * data.train_images[idx] - 1, data.train_labels[idx]


def make_sampler(model: dit.DiTConfig, n_steps: int):
    """`(params, key, labels, guidance) -> images in [0, 1]`, jitted: one compilation per batch size."""
    sample = functools.partial(rf.sample, functools.partial(dit.velocity, config=model), n_steps=n_steps,
                               shape=(model.input_size, model.input_size, model.in_channels), null_class=model.null_class)  # fmt: skip
    return jax.jit(lambda params, key, y, guidance: jnp.clip((sample(params, key, y, guidance=guidance) + 1) / 2, 0, 1))


def save_grid(images: np.ndarray, path: Path, title: str) -> Path | None:
    """Images (rows * cols, h, w, 1), row-major, as one PNG grid; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    images = np.pad(images[..., 0], ((0, 0), (1, 1), (1, 1)))  # a blank pixel around each image
    n, h, w = images.shape
    rows = cols = int(np.sqrt(n))
    grid = images[: rows * cols].reshape(rows, cols, h, w).transpose(0, 2, 1, 3).reshape(rows * h, cols * w)
    fig, ax = plt.subplots(figsize=(4, 4.2))
    ax.imshow(grid, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=8)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def evaluate(sampler, params, data: images_lib.ImageSplits, cfg: TrainConfig) -> dict[str, float]:
    """Classifier accuracy and pixel Fréchet distance of eval_per_class samples per class, per guidance."""
    classifier = sample_quality.fit_classifier(data.train_images, data.train_labels)
    labels = jnp.repeat(jnp.arange(data.num_classes), cfg.eval_per_class)
    out = {"classifier_test_accuracy": sample_quality.class_accuracy(classifier, data.test_images, data.test_labels),
           "fd_floor": sample_quality.frechet_distance(data.train_images, data.test_images)}  # fmt: skip
    for g in cfg.guidances:
        images = np.asarray(sampler(params, jax.random.key(cfg.seed + 12345), labels, g))
        out["accuracy_g%g" % g] = sample_quality.class_accuracy(classifier, images, np.asarray(labels))
        out["fd_g%g" % g] = sample_quality.frechet_distance(images, data.test_images)
    return out


def resolve_resume(cfg: TrainConfig, given: set[str], manager: checkpoint.CheckpointManager) -> TrainConfig:
    """For --init_from=resume: the checkpoint's settings, then the overrides given now; an override that
    contradicts the model or the data is an error."""
    step = manager.latest_step()
    if step is None:
        raise SystemExit(f"error: --init_from=resume, but {cfg.out_dir!r} has no readable checkpoint")
    saved = checkpoint.read_metadata(manager.path(step)).config["train"]
    try:
        settings = config_lib.resume_settings(cfg, saved, given, fixed=MODEL_KEYS)
    except config_lib.ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    return config_lib.build(TrainConfig, settings)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = config_lib.parse_args(TrainConfig, argv, default_preset="flow_digits")
    except config_lib.ConfigError as e:
        raise SystemExit(f"error: {e}") from None

    # ------------------------------------------------ everything that can fail does so before compiling
    out_dir = run.prepare_out_dir(cfg.out_dir)
    manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
    if cfg.init_from == "resume":
        cfg = resolve_resume(cfg, config_lib.explicit_keys(argv), manager)
    try:
        data = images_lib.load_images(cfg.dataset)
        model = cfg.model_config(data)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    policy = Policy(jnp.float32, cfg.dtype, jnp.float32)

    # ------------------------------------------------ state: fresh or resumed
    key = jax.random.key(cfg.seed)
    params = jax.jit(dit.init, static_argnames="config")(jax.random.fold_in(key, 0), model)
    optimizer = make_optimizer(cfg)
    ema = optim.param_ema(optim.ema_warmup(cfg.ema_decay))  # a fixed 0.999 would keep 37% of the init at 1000 steps
    state = optim.init_train_state(params, optimizer, jax.random.fold_in(key, 1), ema=ema)
    if cfg.init_from == "resume":
        state, info = manager.restore(like=state)
        print(f"resumed from {manager.path(info.step)} at iter {info.step}")
    iter_num = int(state.step)
    step_fn = jax.jit(functools.partial(optim.train_step, loss_fn=make_loss_fn(cfg, model, policy), optimizer=optimizer,
                                        max_grad_norm=cfg.grad_clip or None, ema=ema), donate_argnums=0)  # fmt: skip
    sampler = make_sampler(model, cfg.sample_steps)
    grid_labels = jnp.repeat(jnp.arange(data.num_classes), data.num_classes)  # one row per class

    log = run.MetricsLog(out_dir / "metrics.jsonl")
    print(f"model: DiT {model.n_layer}x{model.d_model}, patch {model.patch_size}, {model.seq} tokens, "
          f"{tree_lib.count(state.params) / 1e6:.2f}M params"
          + (f", MicroDiT mask ratio {cfg.mask_ratio} after {model.n_mixer} mixer blocks" if cfg.mask_ratio else ""))
    print(f"data: {cfg.dataset}, {len(data.train_images)} train / {len(data.test_images)} test images "
          f"{data.train_images.shape[1:]}, batch {cfg.batch_size}")  # fmt: skip

    def save(reason: str):
        path = manager.save(iter_num, state, config={"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(model)},
                            metadata={"reason": reason})  # fmt: skip
        bar.write(f"saved {path} ({reason})")

    def sample_png() -> Path | None:
        images = np.asarray(sampler(ema.value(state.ema), jax.random.key(cfg.seed + 1), grid_labels, cfg.sample_guidance))
        return save_grid(images, out_dir / f"samples_{iter_num:06d}.png",
                         f"iter {iter_num}, guidance {cfg.sample_guidance:g}")  # fmt: skip

    bar = run.progress(cfg.max_iters, initial=iter_num, enabled=cfg.progress)
    start = time.perf_counter()
    window_start, window_iters, compiled = start, 0, False
    with run.StopSignal() as stop:
        while iter_num < cfg.max_iters:
            state, metrics = step_fn(state, get_batch(data, cfg, iter_num))
            iter_num += 1
            window_iters += 1
            bar.update(1)
            if not compiled:  # keep compilation out of the first window's timing
                jax.block_until_ready(metrics["loss"])
                bar.write(f"compiled and ran the first step in {time.perf_counter() - window_start:.1f} s")
                compiled, window_start, window_iters = True, time.perf_counter(), 0
            if iter_num % cfg.log_interval == 0 and window_iters:
                loss = float(metrics["loss"])
                dt = (time.perf_counter() - window_start) / window_iters
                log.write(iter=iter_num, loss=loss, lr=metrics["learning_rate"], grad_norm=metrics["grad_norm"],
                          ms_per_iter=dt * 1e3)  # fmt: skip
                bar.set_postfix_str(f"loss {loss:.4f} {dt * 1e3:.0f} ms/iter")
                if not cfg.progress:
                    print(f"iter {iter_num}: loss {loss:.4f}, {dt * 1e3:.1f} ms/iter", flush=True)
                window_start, window_iters = time.perf_counter(), 0
            if iter_num % cfg.checkpoint_interval == 0:
                save("interval")
            if iter_num % cfg.sample_interval == 0 and iter_num < cfg.max_iters:
                sample_png()
            if stop.requested:
                save("signal")
                bar.close()
                raise SystemExit(0)
    bar.close()
    train_seconds = time.perf_counter() - start
    if not manager.steps() or manager.steps()[-1] != iter_num:
        save("end")
    result, png = {"iter": iter_num, "train_seconds": train_seconds}, None
    if cfg.guidances:
        png = sample_png()
        result.update(evaluate(sampler, ema.value(state.ema), data, cfg))
        log.write(**result)
        accuracies = ", ".join(f"{result['accuracy_g%g' % g]:.1%} at guidance {g:g}" for g in cfg.guidances)
        distances = ", ".join(f"{result['fd_g%g' % g]:.3f} at guidance {g:g}" for g in cfg.guidances)
        print(f"classifier reads {accuracies} as the requested class "
              f"(it scores {result['classifier_test_accuracy']:.1%} on the real test digits)")
        print(f"pixel Frechet distance to the test digits: {distances}; real train vs test: {result['fd_floor']:.3f}")
    print(f"trained {iter_num} iters in {run.format_seconds(train_seconds)}" + (f"; samples: {png}" if png else ""))
    run.plot_losses(log, out_dir / "loss.png", title=f"DiT {model.n_layer}x{model.d_model} rectified flow on {cfg.dataset}")
    return result


if __name__ == "__main__":
    main()
