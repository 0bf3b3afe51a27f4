"""Fine-tune an imported GPT-2 or Llama with LoRA (`purejax.lora`): only the adapters train, the base is frozen.

    python -m train.finetune --init_from=path/to/hf-gpt2-dir --lora_rank=8 --lora_alpha=16 \\
        --lora_targets=blocks.attn.qkv.w,blocks.mlp.*.w --dataset=my_text.txt
    python -m train.finetune --init_from=resume --out_dir=out-finetune   # continue, bit for bit
    python -m train.finetune --help                                    # every setting

The run evaluates the base before the first step (B = 0, so base + adapters is the base exactly), trains the
adapters on any text through the text programs' data path (`--dataset`; the text tokenized with the base's
own tokenizer when its directory holds one, tokenizer.json or GPT-2's vocab.json + merges.txt, else with
`--tokenizer`'s), evaluates every
eval_interval steps, and at the end writes the adapters alone (`adapters.msgpack`, `lora.load` reads it),
optionally the merged model as a Hugging Face directory (`--merge_into`), and samples from the result.

The training state holds the adapters and their optimizer state only, so checkpoints are small; the base is
read again from `init_from` (recorded in the checkpoint) when a run resumes. Resume is exact, as train.gpt's:
batches are a function of (seed, step), dropout keys live in the state, and the learning rate is a function
of the step. The base is an argument of the jitted step, not a constant baked into it.
"""

from train.kit import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from purejax import checkpoint, lora, optim
from purejax import tree as tree_lib
from purejax.precision import Policy, with_policy
from train import data as data_lib
from train import finetune_models as models
from train.finetune_settings import FinetuneSettings
from train.kit import resume, start, text
from train.kit import settings as settings_lib

__all__ = ["FinetuneSettings", "main", "parse"]
PROGRAM = "train.finetune"
# What the adapters and the batches were made for: a resumed run may not change these.
FIXED_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "dataset", "tokenizer", "block_size", "base_dtype")


def parse(argv: list[str]) -> FinetuneSettings:
    """The settings `main(argv)` runs with (before a resume merges the checkpoint's)."""
    return settings_lib.command_line(FinetuneSettings, argv, prog=PROGRAM, doc=__doc__)


def resolve_resume(run: start.Run) -> tuple[FinetuneSettings, dict]:
    """(settings, the checkpoint's config) for --init_from=resume: the saved settings, then today's overrides,
    except those that would change what the adapters or the batches are (`FIXED_KEYS`)."""
    saved = run.saved_config(parts=("train", "model", "lora"))
    recorded = {k: saved["train"][k] for k in FIXED_KEYS if k in saved["train"]}
    return run.resumed_settings(saved["train"], fixed=recorded), saved


def make_optimizer(settings: FinetuneSettings) -> optim.GradientTransformation:
    """AdamW on the adapters, driven by train.gpt's schedule (warmup, then cosine decay to min_lr) or a constant
    rate; weight decay on matrices only (nanoGPT's rule, counted per layer of the stacked blocks)."""
    if settings.decay_lr:
        lr = optim.schedules.warmup_cosine(
            settings.learning_rate, settings.warmup_iters, settings.lr_decay_iters, settings.min_lr
        )
    else:
        lr = settings.learning_rate
    decays = optim.ndim_at_least(2, stacked=("blocks",))
    return optim.adamw(lr, b1=settings.beta1, b2=settings.beta2, weight_decay=settings.weight_decay, mask=decays)


def check_base(model_config: Any, saved: dict | None, directory: str) -> None:
    """When resuming: the base read now must be the architecture the checkpoint's adapters were trained on
    (the run settings `dropout` and `layers` aside), or a one-line SystemExit naming what differs."""
    if saved is None:
        return
    run_only = ("dropout", "layers", "attention_impl", "remat")
    now = json.loads(
        json.dumps(dataclasses.asdict(model_config))
    )  # as the checkpoint's header stores it: lists, not tuples
    differ = [
        f"{k}: {saved['model'].get(k)!r} then, {v!r} now"
        for k, v in now.items()
        if k not in run_only and saved["model"].get(k) != v
    ]
    if differ:
        raise SystemExit(
            f"error: the base in {directory} is not the model the checkpoint's adapters were trained "
            f"on ({'; '.join(differ)})"
        )


def new_state(settings: FinetuneSettings, base: dict, lora_config: lora.LoraConfig) -> optim.TrainState:
    """The state before the first step: fresh adapters (B = 0) and AdamW's state for them alone (jitted by
    `main`: one compilation rather than an op-by-op run of every draw)."""
    key = jax.random.key(settings.seed)
    adapters = lora.init(jax.random.fold_in(key, 0), base, lora_config)
    return optim.init_train_state(adapters, make_optimizer(settings), jax.random.fold_in(key, 1))


def start_state(
    settings: FinetuneSettings,
    base: dict,
    lora_config: lora.LoraConfig,
    manager: checkpoint.CheckpointManager,
    saved: dict | None,
) -> tuple[optim.TrainState, checkpoint.CheckpointInfo | None]:
    """(state, the checkpoint's info): fresh adapters, or the newest checkpoint restored into their shapes. A
    target that selects nothing (or a vector) is a one-line error naming the matrices there are."""
    try:
        if saved is None:
            return jax.jit(new_state, static_argnums=(0, 2))(settings, base, lora_config), None
        return resume.restore(manager, lambda: new_state(settings, base, lora_config))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def compile_step(settings: FinetuneSettings, model_config: Any, lora_config: lora.LoraConfig):
    """(the step `(state, batch, base) -> (state, metrics)`, the loss `(base, adapters, x, y) -> loss`), both
    jitted with the base as an argument; the loss is the model's own `loss` on the merged params."""
    loss = with_policy(models.model_loss(model_config), Policy(jnp.float32, settings.dtype, jnp.float32))
    optimizer = make_optimizer(settings)

    def step(state: optim.TrainState, batch: Any, base: dict):
        frozen = lora.frozen(loss, base, lora_config)

        def loss_fn(adapters, batch, key):
            return frozen(adapters, batch, key=key), {}

        return optim.train_step(
            state, batch, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=settings.grad_clip or None
        )

    def evaluate(base: dict, adapters: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return lora.frozen(loss, base, lora_config)(adapters, (x, y))

    return jax.jit(step, donate_argnums=0), jax.jit(evaluate)


def main(argv: list[str] | None = None) -> dict:
    with start.run(FinetuneSettings, argv, program=PROGRAM, doc=__doc__) as run:
        settings, saved, base_dir = run.settings, None, run.settings.init_from
        if settings.init_from == "resume":
            settings, saved = resolve_resume(run)
            base_dir = saved.get("base", "")
        if not base_dir or base_dir == "resume":
            raise SystemExit("error: give the model to fine-tune: --init_from=<Hugging Face GPT-2 or Llama directory>")
        base = models.load(base_dir, settings)
        model_config = base.model_config
        check_base(model_config, saved, base_dir)
        models.check_settings(settings, base)  # the rank against the base's widths, --merge_into: before any work
        # the base's own tokenizer when its directory holds one (as it was trained), else --tokenizer's
        tokenizer = text.resumed_tokenizer(run.out_dir, saved) if saved else text.model_tokenizer(base_dir)
        data, fingerprint = text.open_data(settings, run.devices, saved, tokenizer)
        if data.tokenizer.vocab_size > model_config.vocab_size:
            raise SystemExit(
                f"error: the {data.tokenizer.kind} tokenizer has {data.tokenizer.vocab_size} ids, but the "
                f"base model only {model_config.vocab_size}"
            )
        data.tokenizer.save(run.out_dir / "tokenizer.json")
        lora_config = settings.lora_config()
        state, resumed = start_state(settings, base.params, lora_config, run.manager, saved)
        lora_part = {"lora": dataclasses.asdict(lora_config), "base": str(base_dir)}
        checkpoint_config = run.checkpoint_config(settings, model_config, fingerprint, **lora_part)
        compiled = compile_step(settings, model_config, lora_config)
        starting_point = start.StartingPoint(state, resumed, checkpoint_config)
        return train(run, settings, base, data, starting_point, lora_config, compiled, base_dir)


def train(
    run: start.Run,
    settings: FinetuneSettings,
    base: models.Base,
    data: data_lib.Dataset,
    starting_point: start.StartingPoint,
    lora_config: lora.LoraConfig,
    compiled: tuple,
    base_dir: str,
) -> dict:
    """The shared loop with the evaluations, then `finish`. Iteration 0 is the base's own loss (B = 0),
    recorded as `base_val_loss`; then every eval_interval steps and at the end, each followed by a checkpoint
    of the state (the adapters and their optimizer state)."""
    state, resumed, checkpoint_config = starting_point
    step_fn, evaluate = compiled
    first, eval_loss = int(state.step), functools.partial(evaluate, base.params)
    estimates = text.LossEstimates(eval_loss, data, settings, run.devices, resumed, first)
    base_val = resumed.metadata.get("base_val_loss") if resumed else None
    batches = data_lib.batches(data.train, settings.batch_size, settings.block_size, settings.seed, first)
    batches = data_lib.prefetch(batches)

    def save(state, it, reason):
        info = {"best_val_loss": estimates.best, "base_val_loss": base_val, "reason": reason}
        return run.manager.save(it, state, config=checkpoint_config, metadata=info)

    def evaluate_when_due(state, it):
        nonlocal base_val
        if not estimates.due(it):
            return
        improved = estimates.estimate(state.params, it)
        base_val = estimates.last["val_loss"] if it == 0 else base_val
        loop.write(iter=it, **estimates.last)
        loop.say(estimates.line(it) + (" (the base)" if it == 0 else f" (the base: {base_val:.4f})"))
        if it > 0 and (improved or settings.always_save_checkpoint):
            loop.save(state, it, "eval")

    def rates(seconds_per_iter: float) -> dict[str, float]:
        return {"tokens_per_s": settings.batch_size * settings.block_size / seconds_per_iter}

    total, resumed_run = settings.max_iters, resumed is not None
    loop = run.loop(
        settings, save, start=first, total=total, log_interval=settings.log_interval, resumed=resumed_run, rates=rates
    )
    trainable, frozen = tree_lib.count(state.params), tree_lib.count(base.params)
    loop.say(
        f"LoRA {lora_config}: {trainable:,} trainable params ({trainable / frozen:.2%} of the base's {frozen:,}, "
        f"{settings.base_dtype}); optimizer state {tree_lib.nbytes(state.opt_state) / 1e6:.2f} MB"
    )
    if resumed:
        loop.say(f"resumed from {run.manager.path(resumed.step)} at iter {resumed.step}")
    state = loop.run(state, lambda state, it: step_fn(state, next(batches), base.params), evaluate_when_due)
    loop.plot(f"LoRA r={lora_config.rank} on {base.family}, {settings.dataset}")
    result = {"iter": int(state.step), **estimates.last, "base_val_loss": base_val, "best_val_loss": estimates.best}
    return {**result, **finish(settings, state.params, base, lora_config, base_dir, data.tokenizer)}


def finish(
    settings: FinetuneSettings,
    adapters: dict,
    base: models.Base,
    lora_config: lora.LoraConfig,
    base_dir: str,
    tokenizer: data_lib.Tokenizer,
) -> dict:
    """After training: the adapters alone in out_dir/adapters.msgpack, the merged model as a Hugging Face
    directory if asked (`merge_into`, at the base's full context), and samples from base + adapters."""
    try:
        path = lora.save(Path(settings.out_dir) / "adapters.msgpack", adapters, lora_config)
    except checkpoint.CheckpointWriteError as e:  # a full disk: one line; the checkpoints stay as they were
        raise SystemExit(f"error: {e}") from None
    print(f"adapters: {path} ({path.stat().st_size / 1e3:.1f} KB)")
    if settings.merge_into:
        full, full_model = models.read(base_dir)
        models.save(lora.merge(full, adapters, lora_config), full_model, settings.merge_into)
        print(f"merged model: {settings.merge_into}")
    samples = (
        sample(settings, lora.merge(base.params, adapters, lora_config), base.model_config, tokenizer)
        if settings.num_samples
        else []
    )
    for sampled in samples:
        print(sampled, "-" * 40, sep="\n")
    return {"adapters": str(path), "samples": samples}


def sample(settings: FinetuneSettings, params: dict, model_config: Any, tokenizer: data_lib.Tokenizer) -> list[str]:
    """`num_samples` continuations of `start` from the merged params (the family's `generate`)."""
    try:
        ids = np.asarray(tokenizer.encode(settings.start), np.int32)
    except ValueError as e:
        raise SystemExit(f"error: --start cannot be encoded with the {tokenizer.kind} tokenizer: {e}") from None
    if len(ids) == 0:
        raise SystemExit("error: --start is empty; give at least one character to sample from")
    prompt = jnp.asarray(np.tile(ids, (settings.num_samples, 1)))
    out = models.generate(
        params,
        model_config,
        prompt,
        vocab_size=tokenizer.vocab_size,
        key=jax.random.key(settings.seed),
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
    )
    return [tokenizer.decode(row) for row in np.asarray(out)]


if __name__ == "__main__":
    main()
