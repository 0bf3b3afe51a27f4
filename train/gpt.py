"""Train a GPT: nanoGPT's train.py, as pure functions, with exact resume and safe checkpoints.

    python -m train.gpt                                   # the default CPU preset on the built-in corpus
    python -m train.gpt --config=gpt_tiny --max_iters=50  # a preset from train/config/, then overrides
    python -m train.gpt --init_from=resume                # continue out_dir's newest checkpoint, bit for bit
    python -m train.gpt --init_from=path/to/hf-gpt2-dir    # fine-tune imported GPT-2 weights
    python -m train.gpt --dp=2 --tp=2                     # on a 2 x 2 device mesh (docs/parallelism.md)

Settings are the fields of `TrainConfig` (train/gpt_config.py; `--help` lists them); `--key=value`
sets one, checked against its type and range before anything compiles. The run writes `ckpt_*.msgpack`,
`metrics.jsonl` and `loss.png` (with matplotlib) to out_dir, in the loop every program shares
(train/loop.py). SIGTERM or SIGINT saves a checkpoint and exits; a second signal exits at once.

Resume is exact: batches are a function of (seed, step), dropout keys live in the checkpointed state, and
the learning rate is a function of the step, so an interrupted and resumed run produces the same
parameters as an uninterrupted one, bit for bit.

Several devices: `--dp` data-parallel groups of `--tp` tensor-parallel devices, `--fsdp` to split params and
optimizer state over the data groups too (docs/parallelism.md), `--cp` and `--pp` to split every sequence or the
layers over devices (docs/parallel-context.md, docs/parallel-pipeline.md); `batch_size` is the global batch, so without
dropout every mesh computes the same thing (dropout masks depend on the data shard). Several processes
(docs/multihost.md), started by `srun`, `mpirun` or `python -m purejax.parallel.launch`, each read only their rows
of every batch; process 0 alone writes logs and checkpoints. A resumed run takes the device settings from this
command line, not from the checkpoint, so a run saved on one mesh continues on another.
"""

from train import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import dataclasses
import functools
import math
import sys
from typing import Any

import jax
from jax.sharding import NamedSharding

from models import gpt
from purejax import checkpoint, optim, parallel
from purejax.parallel import distributed
from purejax.precision import resolve_compute_dtype
from train import config as config_lib
from train import data as data_lib
from train import observe, resume, run
from train.gpt_config import TrainConfig, decays, load_gpt2, make_optimizer, new_state
from train.gpt_steps import compile_step, make_loss_fn, model_specs
from train.loop import Loop
from train.parallel import Devices, start_devices

__all__ = ["TrainConfig", "decays", "main", "make_loss_fn", "make_optimizer", "parse"]
PROGRAM = "train.gpt"
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "gelu")
DATA_KEYS = ("dataset", "tokenizer")
LAUNCH_KEYS = (
    "dp",
    "tp",
    "cp",
    "pp",
    "micro_batches",
    "pipeline_schedule",
    "fsdp",
    "sp",
    "coordinator",
    "num_processes",
    "process_id",
)  # never from a checkpoint: a run continues on another mesh


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


def resolve_resume(
    cfg: TrainConfig, argv: list[str], manager: checkpoint.CheckpointManager
) -> tuple[TrainConfig, dict]:
    """For --init_from=resume: (the settings, the checkpoint's config). The settings are the checkpoint's, then
    the overrides given now, except that an override contradicting the model or the data is an error (a
    checkpoint cannot be loaded into another architecture or continued on other data)."""
    saved = resume.saved_config(manager, PROGRAM, parts=("train", "model"))
    missing = [
        f"{part}.{k}"
        for part, keys in (("model", MODEL_KEYS), ("train", DATA_KEYS))
        for k in keys
        if k not in saved[part]
    ]
    if missing:
        raise SystemExit(f"error: cannot resume from {manager.directory}: its config lacks {missing}")
    recorded = {**{k: saved["model"][k] for k in MODEL_KEYS}, **{k: saved["train"][k] for k in DATA_KEYS}}
    # Every other setting continues as saved unless given again now (e.g. --max_iters=4000 to train longer);
    # the devices are this launch's.
    given = {*config_lib.explicit_keys(argv), *LAUNCH_KEYS}
    return resume.settings(cfg, given, {**saved["train"], **recorded}, fixed=recorded), saved


def open_data(cfg: TrainConfig, devices: Devices, saved: dict | None) -> tuple[data_lib.Dataset, dict]:
    """The dataset (prepared by process 0 if needed) and its fingerprint, which must be the checkpoint's when
    resuming: the same tokenizer and token files, or a clear error before anything is overwritten."""
    try:
        if distributed.is_main():  # prepares the dataset if needed; the other processes wait, then open it
            data_lib.ensure_dataset(cfg.dataset, tokenizer=cfg.tokenizer)
        devices.barrier("dataset ready")
        dataset = data_lib.open_dataset(data_lib.ensure_dataset(cfg.dataset, tokenizer=cfg.tokenizer, log=None))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: dataset {cfg.dataset!r}: {e}") from None
    shortest = min(len(dataset.train), len(dataset.val))
    if cfg.block_size >= shortest:
        raise SystemExit(
            f"error: block_size={cfg.block_size} needs more than {cfg.block_size} tokens per split, "
            f"but the {'train' if len(dataset.train) == shortest else 'val'} split has {shortest}"
        )
    fingerprint = data_lib.fingerprint(dataset)
    say = print if distributed.is_main() else lambda line: None
    resume.check_data(saved, fingerprint, f"dataset {cfg.dataset!r} ({dataset.path})", say)
    return dataset, fingerprint


def choose_model(
    cfg: TrainConfig, vocab_size: int, devices: Devices, saved: dict | None, imported: gpt.GPTConfig | None
) -> tuple[gpt.GPTConfig, Any]:
    """(the model, its param specs on the mesh): the checkpoint's, the imported one, or a new one for the
    tokenizer; checked against the tokenizer and the devices before anything compiles."""
    try:
        if saved is not None:
            how = {"dropout": cfg.dropout, "layers": cfg.layers, "remat": cfg.remat}  # how it trains, not what it is
            model = gpt.GPTConfig(**{**saved["model"], **how})
        else:
            model = imported or cfg.model_config(vocab_size)
        if vocab_size > model.vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} tokens, the model {model.vocab_size}")
        if model.vocab_size % cfg.tp:  # padded for the tp the run started with
            raise ValueError(
                f"the model's vocabulary ({model.vocab_size} rows) cannot be split over --tp={cfg.tp}; "
                f"use a tp that divides {model.vocab_size}"
            )
        param_specs = model_specs(model, devices)
        devices.local_rows(cfg.batch_size)  # checks that the batch splits over dp
    except (config_lib.ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    return model, param_specs


def resume_state(
    cfg: TrainConfig,
    model: gpt.GPTConfig,
    saved: dict,
    manager: checkpoint.CheckpointManager,
    devices: Devices,
    param_specs: Any,
) -> tuple[optim.TrainState, Any, checkpoint.CheckpointInfo]:
    """(state, its specs, the checkpoint's info): the newest readable checkpoint, restored into the shapes that
    `new_state` would have (traced, never computed), each device reading its own shards. A run continued in
    float16 from float32 or bfloat16 gets a fresh dynamic loss scale (and drops it going back)."""
    saved_dtype = saved["train"].get("dtype", cfg.dtype)

    def place(template):
        def on_mesh(x, spec):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(devices.mesh, spec))

        return jax.tree.map(on_mesh, template, parallel.state_specs(template, param_specs))

    like = functools.partial(new_state, cfg, model, dtype=saved_dtype)
    state, info = resume.restore(manager, like, place if devices.sharded else None)
    if (saved_dtype == "float16") != (cfg.dtype == "float16"):
        state = state._replace(loss_scale=new_state(cfg, model, state.params).loss_scale)
        print(f"dtype {saved_dtype} -> {cfg.dtype}: the loss scale is now {type(state.loss_scale).__name__}")
    return state, parallel.state_specs(state, param_specs) if devices.sharded else None, info


def parse(argv: list[str]) -> TrainConfig:
    """The settings that `main(argv)` runs with (before a resume merges the checkpoint's); `--help` prints
    them all and exits, a bad one exits with a one-line error."""
    return config_lib.command_line(TrainConfig, argv, prog="train.gpt", doc=__doc__, default_preset="gpt_cpu")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    with signals.StopSignal() as stop, observe.Observer() as observer:  # a signal while starting up: no traceback
        cfg = parse(argv)
        devices = start_devices(cfg)
        cfg = dataclasses.replace(cfg, dtype=resolve_compute_dtype(cfg.dtype, jax.default_backend()))  # "auto"

        # ------------------------------------------------ everything that can fail does so before compiling
        out_dir = run.prepare_out_dir(cfg.out_dir)
        manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
        observer.start(cfg, out_dir, config=dataclasses.asdict(cfg), main=distributed.is_main())  # cache, loggers
        saved = imported = None
        if cfg.init_from == "resume":
            cfg, saved = resolve_resume(cfg, argv, manager)
        elif cfg.init_from != "scratch":
            imported = load_gpt2(cfg)
        dataset, fingerprint = open_data(cfg, devices, saved)
        model, param_specs = choose_model(cfg, dataset.tokenizer.vocab_size, devices, saved, imported and imported[1])
        if distributed.is_main():
            dataset.tokenizer.save(out_dir / "tokenizer.json")  # so out_dir alone is enough to sample from

        # ------------------------------------------------ state: fresh, imported, or resumed
        info = None
        if saved is None:
            state, state_specs = devices.place(new_state(cfg, model, imported and imported[0]), param_specs)
        else:
            state, state_specs, info = resume_state(cfg, model, saved, manager, devices, param_specs)
        step_fn, eval_loss = compile_step(cfg, model, devices, state_specs, param_specs)
        config = {
            "program": PROGRAM,
            "train": dataclasses.asdict(cfg),
            "model": dataclasses.asdict(model),
            "data": fingerprint,
        }
        return train(cfg, model, dataset, devices, state, (step_fn, eval_loss), manager, config, info, stop, observer)


def train(
    cfg: TrainConfig,
    model: gpt.GPTConfig,
    dataset: data_lib.Dataset,
    devices: Devices,
    state: optim.TrainState,
    compiled: tuple,
    manager: checkpoint.CheckpointManager,
    config: dict,
    resumed: Any,
    stop: signals.StopSignal,
    observer: observe.Observer,
) -> dict:
    """The loop (`train.loop`) with what is particular to a GPT: batches drawn from (seed, step) and
    prefetched, tokens/s and MFU, and an evaluation every eval_interval steps and at the end, each followed
    by a checkpoint (always, or when the val loss improved)."""
    (step_fn, eval_loss), start = compiled, int(state.step)
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    rows = devices.local_rows(global_batch)  # this process reads only these rows of every batch
    batches = data_lib.batches(dataset.train, global_batch, cfg.block_size, cfg.seed, start, rows=rows)
    batches = data_lib.prefetch(batches, put=lambda batch: devices.put_batch(batch, global_batch))
    tokens_per_iter, (peak, peak_source) = global_batch * cfg.block_size, run.peak_flops(cfg.peak_flops)
    best = resumed.metadata.get("best_val_loss", math.inf) if resumed else math.inf
    # An "eval" or "end" checkpoint was saved right after evaluating its iteration; a "signal" one was not.
    evaluated_at = start if resumed and resumed.metadata.get("reason") in ("eval", "end") else None
    last: dict[str, float] = {}

    def save(state, it, reason):  # on every process: gathering the state is a collective
        meta = {"best_val_loss": best, "reason": reason}
        if evaluated_at == it:
            meta["val_loss"] = last["val_loss"]
        return manager.save(it, state, config=config, metadata=meta)

    def evaluate_when_due(state, it):
        nonlocal best, evaluated_at, last
        if not cfg.eval_only and (it % cfg.eval_interval and it != cfg.max_iters or it == evaluated_at):
            return
        last, evaluated_at = estimate_loss(eval_loss, state.params, dataset, cfg, it, devices), it
        loop.write(iter=it, **last)
        loop.say(f"iter {it}: train loss {last['train_loss']:.4f}, val loss {last['val_loss']:.4f}")
        improved, best = last["val_loss"] < best, min(best, last["val_loss"])
        if it > 0 and (improved or cfg.always_save_checkpoint) and not cfg.eval_only:
            loop.save(state, it, "eval")

    def rates(seconds_per_iter: float) -> dict[str, float]:
        tokens = {"tokens_per_s": tokens_per_iter / seconds_per_iter}
        return {**tokens, "mfu": gpt.estimate_mfu(model, tokens["tokens_per_s"], peak)} if peak else tokens

    loop = Loop(
        manager.directory,
        stop,
        save,
        start=start,
        total=start if cfg.eval_only else cfg.max_iters,
        log_interval=cfg.log_interval,
        progress=cfg.progress,
        max_bad_steps=cfg.max_bad_steps,
        resumed=resumed is not None,
        main=distributed.is_main(),
        rates=rates,
        agree=devices.stop_agreement(),
        observer=observer,
    )
    loop.say(f"model: {gpt.num_params(state.params) / 1e6:.2f}M non-embedding params, {model}")
    loop.say(
        f"data: {len(dataset.train):,} train / {len(dataset.val):,} val tokens, vocab {model.vocab_size}; "
        f"{tokens_per_iter:,} tokens per iter; {peak_source}"
    )
    loop.say(f"dtype: {cfg.dtype} compute, float32 params, on {jax.default_backend()}")
    if devices.sharded:
        cp = f", sequences split over cp={devices.cp}" if devices.cp > 1 else ""
        cp += ", sequence parallel over tp (sp)" if devices.sp else ""
        pp = f", {devices.pp} pipeline stages ({cfg.pipeline_schedule}, {cfg.micro_batches} micro-batches)"
        mesh = f"{devices.dp} x {devices.tp} mesh{' (fsdp)' if devices.fsdp else ''}{cp}{pp if devices.pp > 1 else ''}"
        loop.say(
            f"devices: {mesh} of {jax.device_count()} {jax.devices()[0].platform} devices in "
            f"{jax.process_count()} process(es)"
        )
    if resumed:
        loop.say(f"resumed from {manager.path(resumed.step)} at iter {resumed.step}")
    state = loop.run(state, lambda state, it: step_fn(state, next(batches)), evaluate_when_due, not cfg.eval_only)
    loop.plot(f"GPT {model.n_layer}x{model.n_embd} on {cfg.dataset}")
    return {"iter": int(state.step), **last, "best_val_loss": best}


if __name__ == "__main__":
    main()
