"""Train a GPT: nanoGPT's train.py, as pure functions, with exact resume and safe checkpoints.

    python -m purejax.train.gpt                                   # the default CPU preset on the built-in corpus
    python -m purejax.train.gpt --config=gpt_tiny --max_iters=50  # a preset from purejax/train/config/, then overrides
    python -m purejax.train.gpt --init_from=resume                # continue out_dir's newest checkpoint, bit for bit
    python -m purejax.train.gpt --init_from=path/to/hf-gpt2-dir    # fine-tune imported GPT-2 weights
    python -m purejax.train.gpt --dp=2 --tp=2                     # on a 2 x 2 device mesh (docs/parallelism.md)

Settings are the fields of `TrainConfig` below; `--key=value` sets one (unknown keys are rejected with the
list of valid ones). The run writes `out_dir/ckpt_*.msgpack`, `out_dir/metrics.jsonl` and, with matplotlib,
`out_dir/loss.png`. SIGTERM or SIGINT saves a checkpoint and exits; a second signal exits at once.

Resume is exact: batches are a function of (seed, step), dropout keys live in the checkpointed state, and
the learning rate is a function of the step, so an interrupted and resumed run produces the same
parameters as an uninterrupted one, bit for bit.

Several devices: `--dp` data-parallel groups of `--tp` tensor-parallel devices, `--fsdp` to split params and
optimizer state over the data groups too (purejax/train/parallel.py, docs/parallelism.md). `batch_size` is the global
batch, so a run computes the same thing on any mesh. Several processes (docs/multihost.md): every process
runs this program with `--coordinator`, `--num_processes` and its `--process_id` (or the PUREJAX_* variables
`python -m purejax.parallel.launch` sets); each reads only its rows of every batch, and only process 0 writes
logs, checkpoints and the progress bar. The device settings describe this launch: a resumed run takes them
from the command line, not from the checkpoint, so a run saved on one mesh continues on another.
"""

import dataclasses
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp

from purejax.models import gpt
from purejax import checkpoint, optim
from purejax.parallel import MeshAxes, distributed
from purejax.precision import Policy, with_policy
from purejax.train import config as config_lib
from purejax.train import data as data_lib
from purejax.train import run
from purejax.train.parallel import Devices


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run (nanoGPT's names). Model fields are copied into `gpt.GPTConfig`."""

    # I/O
    out_dir: str = "out-gpt"
    eval_interval: int = 250
    log_interval: int = 25
    eval_iters: int = 20
    eval_only: bool = False
    always_save_checkpoint: bool = True  # False: save only when the val loss improves
    init_from: str = "scratch"  # "scratch", "resume", or the path of a Hugging Face GPT-2 directory
    keep_checkpoints: int = 2
    # data
    dataset: str = "stdlib"  # a prepared directory, a name under data/, or any text file or directory
    tokenizer: Literal["char", "byte"] = "char"
    gradient_accumulation_steps: int = 1
    batch_size: int = 12  # per micro-batch
    block_size: int = 64
    # model
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    gelu: Literal["exact", "tanh"] = "exact"
    layers: Literal["scan", "loop"] = "scan"
    # AdamW, weight decay only on tensors with ndim >= 2, gradient clipping
    learning_rate: float = 1e-3
    max_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    # learning-rate schedule: linear warmup, cosine decay to min_lr (nanoGPT's get_lr)
    decay_lr: bool = True
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    min_lr: float = 1e-4
    # system
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    compile: bool = True  # False runs the step op by op, for debugging
    seed: int = 1337
    peak_flops: float = 0.0  # FLOP/s that MFU is a fraction of; 0 measures this machine's float32 matmul rate
    progress: bool = True
    # devices: a dp x tp mesh (dp * tp devices over all processes), optionally fully sharded
    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    # processes: "" / 0 / -1 read $PUREJAX_COORDINATOR, $PUREJAX_NUM_PROCESSES, $PUREJAX_PROCESS_ID (else one)
    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1

    def __post_init__(self):
        for name in ("eval_interval", "log_interval", "eval_iters", "batch_size", "block_size",
                     "gradient_accumulation_steps", "keep_checkpoints"):  # fmt: skip
            if getattr(self, name) < 1:
                raise config_lib.ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_iters < 0 or self.warmup_iters < 0:
            raise config_lib.ConfigError("max_iters and warmup_iters must be >= 0")
        if self.dp < 1 or self.tp < 1:
            raise config_lib.ConfigError(f"dp and tp must be at least 1, got dp={self.dp}, tp={self.tp}")

    def model_config(self, vocab_size: int) -> gpt.GPTConfig:
        """The model for a tokenizer of `vocab_size` tokens; under tensor parallelism the vocabulary is padded
        to a multiple of tp (its rows are split over the tp devices), as nanoGPT pads GPT-2's to 50304. The
        padding ids never occur in the data; their logits only learn to stay low."""
        vocab_size = -(-vocab_size // self.tp) * self.tp
        fields = {f.name for f in dataclasses.fields(gpt.GPTConfig)} - {"vocab_size"}
        try:
            return gpt.GPTConfig(vocab_size=vocab_size, **{k: getattr(self, k) for k in fields if hasattr(self, k)})
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None


MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "gelu")
DATA_KEYS = ("dataset", "tokenizer")
LAUNCH_KEYS = ("dp", "tp", "fsdp", "coordinator", "num_processes", "process_id")  # never taken from a checkpoint


def decays(path: str, leaf) -> bool:
    """nanoGPT's rule: weight decay on tensors with ndim >= 2 (matmul weights and embeddings), not on biases
    or LayerNorm scales. Counted per layer: a stacked block leaf has an extra leading layer axis."""
    return leaf.ndim - path.startswith("blocks.") >= 2


def make_optimizer(cfg: TrainConfig) -> optim.GradientTransformation:
    """AdamW with weight decay where `decays` says, driven by nanoGPT's warmup + cosine schedule (or a
    constant rate)."""
    if cfg.decay_lr:
        lr = optim.schedules.warmup_cosine(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr)
    else:
        lr = cfg.learning_rate
    return optim.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=decays)


def make_loss_fn(model: gpt.GPTConfig, policy: Policy, axes: MeshAxes = MeshAxes()):
    """`(params, batch, key) -> (loss, {})` for `optim.train_step`, run in the policy's compute dtype, on the
    devices of `axes` (the loss is then already the mean over all data shards)."""
    loss = with_policy(functools.partial(gpt.loss, config=model, axes=axes), policy)

    def loss_fn(params, batch, key):
        return loss(params, batch, key=key), {}

    return loss_fn


def estimate_loss(
    eval_loss, params, dataset, cfg: TrainConfig, iter_num: int, devices: Devices = Devices()
) -> dict[str, float]:
    """Mean loss over `eval_iters` batches of each split, without dropout; streams 1 and 2 of the batch
    sampler, so the estimate never changes the training batches."""
    out, rows = {}, devices.local_rows(cfg.batch_size)
    for stream, (name, split) in enumerate((("train_loss", dataset.train), ("val_loss", dataset.val)), start=1):
        total = 0.0
        for k in range(cfg.eval_iters):
            index = iter_num * cfg.eval_iters + k
            batch = data_lib.get_batch(split, cfg.batch_size, cfg.block_size, cfg.seed, index, stream, rows)
            total += float(eval_loss(params, *devices.put_batch(batch, cfg.batch_size)))
        out[name] = total / cfg.eval_iters
    return out


def resolve_resume(cfg: TrainConfig, given: set[str], manager: checkpoint.CheckpointManager) -> tuple[TrainConfig, gpt.GPTConfig]:
    """For --init_from=resume: the settings come from the checkpoint, then the overrides given now, except
    that an override contradicting the model or the data is an error (a checkpoint cannot be loaded into a
    different architecture or continued on other data)."""
    step = manager.latest_step()
    if step is None:
        raise SystemExit(f"error: --init_from=resume, but {cfg.out_dir!r} has no readable checkpoint")
    saved = checkpoint.read_metadata(manager.path(step)).config
    missing = [f"{part}.{k}" for part, keys in (("model", MODEL_KEYS), ("train", DATA_KEYS)) for k in keys
               if k not in (saved.get(part) or {})]  # fmt: skip
    if missing:
        raise SystemExit(f"error: {manager.path(step)} is not a train.gpt checkpoint: its config lacks {missing}")
    recorded = {**{k: saved["model"][k] for k in MODEL_KEYS}, **{k: saved["train"][k] for k in DATA_KEYS}}
    # Every other setting continues as saved unless given again now (e.g. --max_iters=4000 to train longer);
    # the devices are this launch's.
    try:
        settings = config_lib.resume_settings(cfg, {**saved["train"], **recorded}, {*given, *LAUNCH_KEYS}, fixed=recorded)
    except config_lib.ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    cfg = config_lib.build(TrainConfig, {k: v for k, v in settings.items() if k in TrainConfig.__dataclass_fields__})
    model = gpt.GPTConfig(**{**saved["model"], "dropout": cfg.dropout, "layers": cfg.layers})
    if model.vocab_size % cfg.tp:  # the vocabulary was padded for the tp it was saved with, not this one
        raise SystemExit(f"error: the checkpoint's vocabulary ({model.vocab_size} rows) cannot be split over "
                         f"--tp={cfg.tp}; resume with a tp that divides {model.vocab_size}")  # fmt: skip
    return cfg, model


def start_devices(cfg: TrainConfig) -> Devices:
    """Join the multi-process run if there is one and make the dp x tp devices; before any other JAX call."""
    num_processes = cfg.num_processes or int(os.environ.get(distributed.ENV_NUM_PROCESSES, "").strip() or 1)
    try:
        devices = Devices(dp=cfg.dp, tp=cfg.tp, fsdp=cfg.fsdp, num_processes=num_processes)
        devices.start(coordinator_address=cfg.coordinator or None, num_processes=cfg.num_processes or None,
                      process_id=None if cfg.process_id < 0 else cfg.process_id)  # fmt: skip
        if devices.sharded:
            devices.mesh  # noqa: B018 - builds the mesh now, so a wrong device count fails before any work
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return devices


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = config_lib.parse_args(TrainConfig, argv, default_preset="gpt_cpu")
    except config_lib.ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    devices = start_devices(cfg)
    main_process = distributed.is_main()  # only process 0 prints, logs and draws the progress bar
    say = print if main_process else lambda *args, **kwargs: None

    # ------------------------------------------------ everything that can fail does so before compiling
    out_dir = run.prepare_out_dir(cfg.out_dir)
    manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
    hf_dir, resumed_model = None, None
    if cfg.init_from == "resume":
        cfg, resumed_model = resolve_resume(cfg, config_lib.explicit_keys(argv), manager)
    elif cfg.init_from != "scratch":
        hf_dir = Path(cfg.init_from)
        if not (hf_dir / "config.json").exists():
            raise SystemExit(f"error: --init_from={cfg.init_from!r} is not 'scratch', 'resume' or a Hugging Face "
                             f"GPT-2 directory (no config.json there)")
    try:
        if main_process:  # prepares the dataset if needed; the other processes wait, then open it
            data_lib.ensure_dataset(cfg.dataset, tokenizer=cfg.tokenizer)
        devices.barrier("dataset ready")
        dataset = data_lib.open_dataset(data_lib.ensure_dataset(cfg.dataset, tokenizer=cfg.tokenizer, log=None))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: dataset {cfg.dataset!r}: {e}") from None
    shortest = min(len(dataset.train), len(dataset.val))
    if cfg.block_size >= shortest:
        raise SystemExit(f"error: block_size={cfg.block_size} needs more than {cfg.block_size} tokens per split, "
                         f"but the {'train' if len(dataset.train) == shortest else 'val'} split has {shortest}")
    try:
        model = resumed_model or cfg.model_config(dataset.tokenizer.vocab_size)
        param_specs = gpt.param_specs(model, devices.axes, devices.mesh.shape) if devices.sharded else None
        devices.local_rows(cfg.batch_size)  # checks that the batch splits over dp
    except (config_lib.ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    policy = Policy(jnp.float32, cfg.dtype, jnp.float32)
    if main_process:
        dataset.tokenizer.save(out_dir / "tokenizer.json")  # so out_dir alone is enough to sample from

    # ------------------------------------------------ state: fresh, imported, or resumed
    key = jax.random.key(cfg.seed)
    if hf_dir is not None:
        from purejax.models import gpt_hf

        params, model = gpt_hf.load(hf_dir)
        model = dataclasses.replace(model, dropout=cfg.dropout, layers=cfg.layers)
        if dataset.tokenizer.vocab_size > model.vocab_size:
            raise SystemExit(f"error: the tokenizer has {dataset.tokenizer.vocab_size} tokens, the model {model.vocab_size}")
        params, model = gpt.crop_block_size(params, model, min(cfg.block_size, model.block_size))
    else:
        params = gpt.init(jax.random.fold_in(key, 0), model)  # resume: the template the checkpoint fills
    optimizer = make_optimizer(cfg)
    loss_scale = optim.dynamic_loss_scale() if cfg.dtype == "float16" else optim.NoLossScale()
    state = optim.init_train_state(params, optimizer, jax.random.fold_in(key, 1), loss_scale=loss_scale)
    state, state_specs = devices.place(state, param_specs)  # on the mesh, each device its shards
    best_val_loss, evaluated_at, saved_at = math.inf, None, None
    if cfg.init_from == "resume":
        state, info = manager.restore(like=state)  # placed like the template: a checkpoint from any mesh fits
        best_val_loss, saved_at = info.metadata.get("best_val_loss", math.inf), info.step
        # An "eval" or "end" checkpoint was saved right after evaluating its iteration; a "signal" or
        # interval one was not, so a due evaluation at that iteration still runs.
        evaluated_at = info.step if info.metadata.get("reason") in ("eval", "end") else None
        say(f"resumed from {manager.path(info.step)} at iter {info.step}")
    iter_num = int(state.step)

    step_kwargs = dict(loss_fn=make_loss_fn(model, policy, devices.axes), optimizer=optimizer,
                       max_grad_norm=cfg.grad_clip or None, micro_batches=cfg.gradient_accumulation_steps)  # fmt: skip
    if not cfg.compile and devices.sharded:
        raise SystemExit("error: --compile=False (op by op, for debugging) runs on one device; drop --dp/--tp/--fsdp")
    step_fn = devices.train_step(state_specs, **step_kwargs) if cfg.compile else functools.partial(optim.train_step, **step_kwargs)
    eval_loss = devices.evaluate(
        lambda p, batch, axes: with_policy(functools.partial(gpt.loss, config=model, axes=axes), policy)(p, batch), param_specs
    )

    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    peak = cfg.peak_flops or run.measure_matmul_flops()
    log = run.MetricsLog(out_dir / "metrics.jsonl") if main_process else None
    say(f"model: {gpt.num_params(state.params) / 1e6:.2f}M non-embedding params, {model}")
    say(f"data: {len(dataset.train):,} train / {len(dataset.val):,} val tokens, vocab {model.vocab_size}; "
        f"{tokens_per_iter:,} tokens per iter; MFU against {peak / 1e9:.0f} GFLOP/s")  # fmt: skip
    if devices.sharded:
        say(f"devices: {devices.dp} x {devices.tp} mesh{' (fsdp)' if devices.fsdp else ''} of "
            f"{jax.device_count()} {jax.devices()[0].platform} devices in {jax.process_count()} process(es)")  # fmt: skip

    def write(**metrics):
        if log is not None:
            log.write(**metrics)

    def save(reason: str, val_loss: float | None = None):  # on every process: gathering the state is a collective
        nonlocal saved_at
        saved_at = iter_num
        meta = {"best_val_loss": best_val_loss, "reason": reason}
        if val_loss is not None:
            meta["val_loss"] = val_loss
        path = manager.save(iter_num, state, config={"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(model)},
                            metadata=meta)  # fmt: skip
        bar.write(f"saved {path} ({reason})")

    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    rows = devices.local_rows(global_batch)  # this process reads only these rows of every batch
    train_batches = data_lib.prefetch(
        data_lib.batches(dataset.train, global_batch, cfg.block_size, cfg.seed, iter_num, rows=rows),
        put=lambda batch: devices.put_batch(batch, global_batch),
    )
    bar = run.progress(cfg.max_iters, initial=iter_num, enabled=cfg.progress, quiet=not main_process)
    last_eval: dict[str, float] = {}
    window_start, window_iters, compiled = time.perf_counter(), 0, False
    with run.StopSignal() as stop:
        while True:
            due = iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters
            if due and iter_num != evaluated_at:
                last_eval = estimate_loss(eval_loss, state.params, dataset, cfg, iter_num, devices)
                write(iter=iter_num, **last_eval)
                bar.write(f"iter {iter_num}: train loss {last_eval['train_loss']:.4f}, val loss {last_eval['val_loss']:.4f}")
                improved = last_eval["val_loss"] < best_val_loss
                best_val_loss = min(best_val_loss, last_eval["val_loss"])
                if iter_num > 0 and (improved or cfg.always_save_checkpoint) and not cfg.eval_only:
                    save("eval", last_eval["val_loss"])
                window_start, window_iters = time.perf_counter(), 0
            if cfg.eval_only or iter_num >= cfg.max_iters:
                break
            state, metrics = step_fn(state, next(train_batches))
            iter_num += 1
            window_iters += 1
            bar.update(1)
            if not compiled:  # keep compilation out of the first window's timing
                jax.block_until_ready(metrics["loss"])
                bar.write(f"compiled and ran the first step in {time.perf_counter() - window_start:.1f} s")
                compiled, window_start, window_iters = True, time.perf_counter(), 0
            if iter_num % cfg.log_interval == 0 and window_iters:
                loss = float(metrics["loss"])  # blocks: log only every log_interval steps
                dt = (time.perf_counter() - window_start) / window_iters
                tokens_per_s = tokens_per_iter / dt
                mfu = gpt.estimate_mfu(model, tokens_per_s, peak)
                write(iter=iter_num, loss=loss, lr=metrics.get("learning_rate", cfg.learning_rate),
                      grad_norm=metrics["grad_norm"], skipped=bool(metrics["skipped"]),
                      ms_per_iter=dt * 1e3, tokens_per_s=tokens_per_s, mfu=mfu)  # fmt: skip
                bar.set_postfix_str(f"loss {loss:.4f} lr {float(metrics.get('learning_rate', 0)):.2e} "
                                    f"{tokens_per_s:,.0f} tok/s mfu {mfu:.1%}")  # fmt: skip
                if not cfg.progress:
                    say(f"iter {iter_num}: loss {loss:.4f}, {dt * 1e3:.1f} ms/iter, mfu {mfu:.1%}", flush=True)
                window_start, window_iters = time.perf_counter(), 0
            if devices.stop_requested(stop.requested, iter_num % cfg.log_interval == 0):
                save("signal")
                bar.close()
                raise SystemExit(0)
    bar.close()
    if not cfg.eval_only and saved_at != iter_num:  # decided alike on every process, not from a directory listing
        save("end", last_eval.get("val_loss"))
    png = run.plot_losses(log, out_dir / "loss.png", title=f"GPT {model.n_layer}x{model.n_embd} on {cfg.dataset}") if log else None
    if png:
        say(f"loss curve: {png}")
    return {"iter": iter_num, **last_eval, "best_val_loss": best_val_loss}


if __name__ == "__main__":
    main()
