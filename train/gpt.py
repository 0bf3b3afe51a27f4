"""Train a GPT: nanoGPT's train.py, as pure functions, with exact resume and safe checkpoints.

    python -m train.gpt                                   # the default CPU preset on the built-in corpus
    python -m train.gpt --config=gpt_tiny --max_iters=50  # a preset from train/presets/, then overrides
    python -m train.gpt --init_from=resume                # continue out_dir's newest checkpoint, bit for bit
    python -m train.gpt --init_from=path/to/hf-gpt2-dir --dataset=my.txt   # fine-tune GPT-2, its own tokenizer
    python -m train.gpt --dp=2 --tp=2                     # on a 2 x 2 device mesh (docs/parallelism.md)

Settings are the fields of `GPTSettings` (train/gpt_settings.py; `--help` lists them); `--key=value`
sets one, checked against its type and range before anything compiles. The run writes `ckpt_*.msgpack`,
`metrics.jsonl` and `loss.png` (with matplotlib) to out_dir, in the loop every program shares
(train/kit/loop.py). SIGTERM or SIGINT saves a checkpoint and exits; a second signal exits at once.

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

from train.kit import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding

from models import gpt, gpt_flops, gpt_moe
from purejax import checkpoint, optim, parallel
from train import data as data_lib
from train.gpt_settings import GPTSettings
from train.gpt_steps import compile_step, decays, make_loss_fn, make_optimizer, model_specs, new_state
from train.kit import resume, start, text
from train.kit import settings as settings_lib
from train.kit.devices import Devices
from train.kit.peak_flops import peak_flops

__all__ = ["GPTSettings", "decays", "main", "make_loss_fn", "make_optimizer", "parse"]
PROGRAM, DEFAULT_PRESET = "train.gpt", "gpt_cpu"
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


def resolve_resume(run: start.Run) -> tuple[GPTSettings, dict]:
    """For --init_from=resume: (the settings, the checkpoint's config). The settings are the checkpoint's, then
    the overrides given now, except that an override contradicting the model or the data is an error (a
    checkpoint cannot be loaded into another architecture or continued on other data)."""
    saved = run.saved_config(parts=("train", "model"))
    missing = [
        f"{part}.{k}"
        for part, keys in (("model", MODEL_KEYS), ("train", DATA_KEYS))
        for k in keys
        if k not in saved[part]
    ]
    if missing:
        raise SystemExit(f"error: cannot resume from {run.manager.directory}: its config lacks {missing}")
    recorded = {**{k: saved["model"][k] for k in MODEL_KEYS}, **{k: saved["train"][k] for k in DATA_KEYS}}
    # Every other setting continues as saved unless given again now (e.g. --max_iters=4000 to train longer);
    # the devices are this launch's.
    return run.resumed_settings({**saved["train"], **recorded}, fixed=recorded, given=LAUNCH_KEYS), saved


def choose_model(
    settings: GPTSettings,
    vocab_size: int,
    devices: Devices,
    saved: dict | None,
    imported: gpt.GPTConfig | None,
) -> tuple[gpt.GPTConfig, Any]:
    """(the model's config, its param specs on the mesh): the checkpoint's, the imported one, or a new one for
    the tokenizer; checked against the tokenizer and the devices before anything compiles."""
    try:
        if saved is not None:  # how it trains is this run's, not what it is
            how = {"dropout": settings.dropout, "layers": settings.layers, "remat": settings.remat}
            model_config = gpt_moe.gpt_config({**saved["model"], **how})
        else:
            model_config = imported or settings.model_config(vocab_size)
        if vocab_size > model_config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} tokens, the model {model_config.vocab_size}")
        if model_config.vocab_size % settings.tp:  # padded for the tp the run started with
            raise ValueError(
                f"the model's vocabulary ({model_config.vocab_size} rows) cannot be split over "
                f"--tp={settings.tp}; use a tp that divides {model_config.vocab_size}"
            )
        param_specs = model_specs(model_config, devices)
        devices.local_rows(settings.batch_size)  # checks that the batch splits over dp
    except (settings_lib.ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    return model_config, param_specs


def resume_state(
    settings: GPTSettings, model_config: gpt.GPTConfig, saved: dict, run: start.Run, param_specs: Any
) -> tuple[optim.TrainState, Any, checkpoint.CheckpointInfo]:
    """(state, its specs, the checkpoint's info): the newest readable checkpoint, restored into the shapes that
    `new_state` would have (traced, never computed), each device reading its own shards. A run continued in
    float16 from float32 or bfloat16 gets a fresh dynamic loss scale (and drops it going back)."""
    saved_dtype, devices = saved["train"].get("dtype", settings.dtype), run.devices

    def place(template):
        def on_mesh(x, spec):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(devices.mesh, spec))

        return jax.tree.map(on_mesh, template, parallel.state_specs(template, param_specs))

    like = functools.partial(new_state, settings, model_config, dtype=saved_dtype)
    state, info = resume.restore(run.manager, like, place if devices.sharded else None)
    if (saved_dtype == "float16") != (settings.dtype == "float16"):
        state = state._replace(loss_scale=new_state(settings, model_config, state.params).loss_scale)
        print(f"dtype {saved_dtype} -> {settings.dtype}: the loss scale is now {type(state.loss_scale).__name__}")
    return state, parallel.state_specs(state, param_specs) if devices.sharded else None, info


def parse(argv: list[str]) -> GPTSettings:
    """The settings that `main(argv)` runs with (before a resume merges the checkpoint's); `--help` prints
    them all and exits, a bad one exits with a one-line error."""
    return settings_lib.command_line(GPTSettings, argv, prog=PROGRAM, doc=__doc__, default_preset=DEFAULT_PRESET)


def main(argv: list[str] | None = None) -> dict:
    with start.run(GPTSettings, argv, program=PROGRAM, doc=__doc__, default_preset=DEFAULT_PRESET, devices=True) as run:
        settings, saved, imported, tokenizer = run.settings, None, None, None
        if settings.init_from == "resume":
            settings, saved = resolve_resume(run)
            tokenizer = text.resumed_tokenizer(run.out_dir, saved)
        elif settings.init_from != "scratch":
            imported = text.load_gpt2(
                settings.init_from,
                settings.block_size,
                dropout=settings.dropout,
                layers=settings.layers,
                remat=settings.remat,
            )
            tokenizer = text.model_tokenizer(settings.init_from)  # the text is tokenized as GPT-2's was
        data, fingerprint = text.open_data(settings, run.devices, saved, tokenizer)
        if imported and tokenizer is None:
            text.check_untokenized_import(settings.init_from, data.tokenizer, imported[1])
        vocab_size = data.tokenizer.vocab_size
        model_config, param_specs = choose_model(settings, vocab_size, run.devices, saved, imported and imported[1])
        if run.main:
            data.tokenizer.save(run.out_dir / "tokenizer.json")  # so out_dir alone is enough to sample from

        # ------------------------------------------------ state: fresh, imported, or resumed
        if saved is None:
            make_state = functools.partial(new_state, settings, model_config)  # compiled once, built in place
            (state, state_specs), resumed = (
                run.devices.build_state(make_state, param_specs, imported and imported[0]),
                None,
            )
        else:
            state, state_specs, resumed = resume_state(settings, model_config, saved, run, param_specs)
        compiled = compile_step(settings, model_config, run.devices, state_specs, param_specs)
        checkpoint_config = run.checkpoint_config(settings, model_config, fingerprint)
        starting_point = start.StartingPoint(state, resumed, checkpoint_config)
        return train(run, settings, model_config, data, starting_point, compiled)


def train(
    run: start.Run,
    settings: GPTSettings,
    model_config: gpt.GPTConfig,
    data: data_lib.Dataset,
    starting_point: start.StartingPoint,
    compiled: tuple,
) -> dict:
    """The loop (`train.kit.loop`) with what is particular to a GPT: batches drawn from (seed, step) and
    prefetched, tokens/s and MFU, and an evaluation every eval_interval steps and at the end, each followed
    by a checkpoint (always, or when the val loss improved)."""
    state, resumed, checkpoint_config = starting_point
    (step_fn, eval_loss), first, devices = compiled, int(state.step), run.devices
    global_batch = settings.batch_size * settings.gradient_accumulation_steps
    rows = devices.local_rows(global_batch)  # this process reads only these rows of every batch
    batches = data_lib.batches(data.train, global_batch, settings.block_size, settings.seed, first, rows=rows)
    batches = data_lib.prefetch(batches, put=lambda batch: devices.put_batch(batch, global_batch))
    tokens_per_iter, (peak, peak_source) = global_batch * settings.block_size, peak_flops(settings.peak_flops)
    estimates = text.LossEstimates(eval_loss, data, settings, devices, resumed, first)

    def save(state, it, reason):  # on every process: gathering the state is a collective
        meta = {"best_val_loss": estimates.best, "reason": reason}
        if estimates.at == it:
            meta["val_loss"] = estimates.last["val_loss"]
        return run.manager.save(it, state, config=checkpoint_config, metadata=meta)

    def evaluate_when_due(state, it):
        if not (settings.eval_only or estimates.due(it)):
            return
        improved = estimates.estimate(state.params, it)
        loop.write(iter=it, **estimates.last)
        loop.say(estimates.line(it))
        if it > 0 and (improved or settings.always_save_checkpoint) and not settings.eval_only:
            loop.save(state, it, "eval")

    def rates(seconds_per_iter: float) -> dict[str, float]:
        tokens = {"tokens_per_s": tokens_per_iter / seconds_per_iter}
        return {**tokens, "mfu": gpt_flops.estimate_mfu(model_config, tokens["tokens_per_s"], peak)} if peak else tokens

    total = first if settings.eval_only else settings.max_iters
    loop = run.loop(
        settings,
        save,
        start=first,
        total=total,
        log_interval=settings.log_interval,
        resumed=resumed is not None,
        rates=rates,
    )
    loop.say(f"model: {gpt_flops.num_params(state.params) / 1e6:.2f}M non-embedding params, {model_config}")
    loop.say(
        f"data: {len(data.train):,} train / {len(data.val):,} val tokens, vocab {model_config.vocab_size}; "
        f"{tokens_per_iter:,} tokens per iter; {peak_source}"
    )
    loop.say(f"dtype: {settings.dtype} compute, float32 params, on {jax.default_backend()}")
    if devices.sharded:
        loop.say(describe_devices(settings, devices))
    if resumed:
        loop.say(f"resumed from {run.manager.path(resumed.step)} at iter {resumed.step}")
    state = loop.run(state, lambda state, it: step_fn(state, next(batches)), evaluate_when_due, not settings.eval_only)
    loop.plot(f"GPT {model_config.n_layer}x{model_config.n_embd} on {settings.dataset}")
    return {"iter": int(state.step), **estimates.last, "best_val_loss": estimates.best}


def describe_devices(settings: GPTSettings, devices: Devices) -> str:
    """The mesh a sharded run trains on, as its start-up line says it."""
    cp = f", sequences split over cp={devices.cp}" if devices.cp > 1 else ""
    cp += ", sequence parallel over tp (sp)" if devices.sp else ""
    pp = f", {devices.pp} pipeline stages ({settings.pipeline_schedule}, {settings.micro_batches} micro-batches)"
    mesh = f"{devices.dp} x {devices.tp} mesh{' (fsdp)' if devices.fsdp else ''}{cp}{pp if devices.pp > 1 else ''}"
    return (
        f"devices: {mesh} of {jax.device_count()} {jax.devices()[0].platform} devices in "
        f"{jax.process_count()} process(es)"
    )


if __name__ == "__main__":
    main()
