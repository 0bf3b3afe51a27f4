"""Fine-tune an imported GPT-2 or Llama with LoRA (`purejax.lora`): only the adapters train, the base is frozen.

    python -m train.finetune --init_from=path/to/hf-gpt2-dir --lora_rank=8 --lora_alpha=16 \\
        --lora_targets=blocks.attn.qkv.w,blocks.mlp.*.w --dataset=my_text.txt
    python -m train.finetune --init_from=resume --out_dir=out-finetune   # continue, bit for bit
    python -m train.finetune --help                                    # every setting

The run evaluates the base before the first step (B = 0, so base + adapters is the base exactly), trains the
adapters on any text through train.gpt's data path (`--dataset`, `--tokenizer`), evaluates every
eval_interval steps, and at the end writes the adapters alone (`adapters.msgpack`, `lora.load` reads it),
optionally the merged model as a Hugging Face directory (`--merge_into`), and samples from the result.

The training state holds the adapters and their optimizer state only, so checkpoints are small; the base is
read again from `init_from` (recorded in the checkpoint) when a run resumes. Resume is exact, as train.gpt's:
batches are a function of (seed, step), dropout keys live in the state, and the learning rate is a function
of the step. The base is an argument of the jitted step, not a constant baked into it.
"""

from train import signals

if __name__ == "__main__":  # first, before the heavy imports: a signal while JAX loads gets one line
    signals.exit_at_once_while_starting()

import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from purejax import checkpoint, lora, optim
from purejax import tree as tree_lib
from purejax.precision import Policy, with_policy
from train import config as config_lib
from train import data as data_lib
from train import finetune_models as models
from train import gpt as gpt_program
from train import resume, run
from train.finetune_config import FinetuneConfig
from train.gpt_config import make_optimizer
from train.loop import Loop
from train.parallel import Devices

__all__ = ["FinetuneConfig", "main", "parse"]
PROGRAM = "train.finetune"
# What the adapters and the batches were made for: a resumed run may not change these.
FIXED_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "dataset", "tokenizer", "block_size", "base_dtype")


def parse(argv: list[str]) -> FinetuneConfig:
    """The settings `main(argv)` runs with (before a resume merges the checkpoint's)."""
    return config_lib.command_line(FinetuneConfig, argv, prog="train.finetune", doc=__doc__)


def resolve_resume(cfg: FinetuneConfig, argv: list[str], manager: checkpoint.CheckpointManager):
    """(settings, the checkpoint's config) for --init_from=resume: the saved settings, then today's overrides,
    except those that would change what the adapters or the batches are (`FIXED_KEYS`)."""
    saved = resume.saved_config(manager, PROGRAM, parts=("train", "model", "lora"))
    recorded = {k: saved["train"][k] for k in FIXED_KEYS if k in saved["train"]}
    return resume.settings(cfg, config_lib.explicit_keys(argv), saved["train"], fixed=recorded), saved


def check_base(model: Any, saved: dict | None, directory: str) -> None:
    """When resuming: the base read now must be the architecture the checkpoint's adapters were trained on
    (the run settings `dropout` and `layers` aside), or a one-line SystemExit naming what differs."""
    if saved is None:
        return
    run_only = ("dropout", "layers", "attention_impl", "remat")
    now = json.loads(json.dumps(dataclasses.asdict(model)))  # as the checkpoint's header stores it: lists, not tuples
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


def new_state(cfg: FinetuneConfig, base: dict, config: lora.LoraConfig) -> optim.TrainState:
    """The state before the first step: fresh adapters (B = 0) and AdamW's state for them alone (jitted by
    `main`: one compilation rather than an op-by-op run of every draw)."""
    key = jax.random.key(cfg.seed)
    adapters = lora.init(jax.random.fold_in(key, 0), base, config)
    return optim.init_train_state(adapters, make_optimizer(cfg.train_config()), jax.random.fold_in(key, 1))


def start_state(
    cfg: FinetuneConfig, base: dict, config: lora.LoraConfig, manager: checkpoint.CheckpointManager, saved: dict | None
) -> tuple[optim.TrainState, checkpoint.CheckpointInfo | None]:
    """(state, the checkpoint's info): fresh adapters, or the newest checkpoint restored into their shapes. A
    target that selects nothing (or a vector) is a one-line error naming the matrices there are."""
    try:
        if saved is None:
            return jax.jit(new_state, static_argnums=(0, 2))(cfg, base, config), None
        return resume.restore(manager, lambda: new_state(cfg, base, config))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def compile_step(cfg: FinetuneConfig, model: Any, config: lora.LoraConfig):
    """(the step `(state, batch, base) -> (state, metrics)`, the loss `(base, adapters, x, y) -> loss`), both
    jitted with the base as an argument; the loss is the model's own `loss` on the merged params."""
    loss = with_policy(models.model_loss(model), Policy(jnp.float32, cfg.dtype, jnp.float32))
    optimizer = make_optimizer(cfg.train_config())

    def step(state: optim.TrainState, batch: Any, base: dict):
        frozen = lora.frozen(loss, base, config)

        def loss_fn(adapters, batch, key):
            return frozen(adapters, batch, key=key), {}

        return optim.train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer, max_grad_norm=cfg.grad_clip or None)

    def evaluate(base: dict, adapters: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        return lora.frozen(loss, base, config)(adapters, (x, y))

    return jax.jit(step, donate_argnums=0), jax.jit(evaluate)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    with signals.StopSignal() as stop:
        cfg = parse(argv)
        out_dir = run.prepare_out_dir(cfg.out_dir)
        manager = checkpoint.CheckpointManager(out_dir, keep_last=cfg.keep_checkpoints)
        saved, base_dir = None, cfg.init_from
        if cfg.init_from == "resume":
            cfg, saved = resolve_resume(cfg, argv, manager)
            base_dir = saved.get("base", "")
        if not base_dir or base_dir == "resume":
            raise SystemExit("error: give the model to fine-tune: --init_from=<Hugging Face GPT-2 or Llama directory>")
        base = models.load(base_dir, cfg)
        model = base.config
        check_base(model, saved, base_dir)
        models.check_settings(cfg, base)  # the rank against the base's widths, --merge_into: before any work
        dataset, fingerprint = gpt_program.open_data(cfg.train_config(), Devices(), saved)
        if dataset.tokenizer.vocab_size > model.vocab_size:
            raise SystemExit(
                f"error: the {cfg.tokenizer} tokenizer has {dataset.tokenizer.vocab_size} ids, but the "
                f"base model only {model.vocab_size}"
            )
        dataset.tokenizer.save(out_dir / "tokenizer.json")
        config = cfg.lora_config()
        state, info = start_state(cfg, base.params, config, manager, saved)
        run_config = {
            "program": PROGRAM,
            "train": dataclasses.asdict(cfg),
            "model": dataclasses.asdict(model),
            "lora": dataclasses.asdict(config),
            "base": str(base_dir),
            "data": fingerprint,
        }
        compiled = compile_step(cfg, model, config)
        state, result = train(cfg, base, config, dataset, state, compiled, manager, run_config, info, stop)
        return {**result, **finish(cfg, state.params, base, config, base_dir, dataset.tokenizer)}


def train(
    cfg: FinetuneConfig,
    base: models.Base,
    config: lora.LoraConfig,
    dataset: data_lib.Dataset,
    state: optim.TrainState,
    compiled: tuple,
    manager: checkpoint.CheckpointManager,
    run_config: dict,
    resumed: checkpoint.CheckpointInfo | None,
    stop: signals.StopSignal,
) -> tuple[optim.TrainState, dict]:
    """(the final state, the losses): the shared loop with the evaluations. Iteration 0 is the base's own loss
    (B = 0), recorded as `base_val_loss`; then every eval_interval steps and at the end, each followed by a
    checkpoint of the state (the adapters and their optimizer state)."""
    (step_fn, evaluate), start = compiled, int(state.step)
    eval_loss, train_cfg = functools.partial(evaluate, base.params), cfg.train_config()
    meta = dict(resumed.metadata) if resumed else {}
    best, base_val = meta.get("best_val_loss", math.inf), meta.get("base_val_loss")
    evaluated_at = start if resumed and meta.get("reason") in ("eval", "end") else None
    batches = data_lib.prefetch(data_lib.batches(dataset.train, cfg.batch_size, cfg.block_size, cfg.seed, start))
    last: dict[str, float] = {}

    def save(state, it, reason):
        info = {"best_val_loss": best, "base_val_loss": base_val, "reason": reason}
        return manager.save(it, state, config=run_config, metadata=info)

    def evaluate_when_due(state, it):
        nonlocal best, base_val, evaluated_at, last
        if it % cfg.eval_interval and it != cfg.max_iters or it == evaluated_at:
            return
        last, evaluated_at = gpt_program.estimate_loss(eval_loss, state.params, dataset, train_cfg, it), it
        base_val = last["val_loss"] if it == 0 else base_val
        loop.write(iter=it, **last)
        loop.say(
            f"iter {it}: train loss {last['train_loss']:.4f}, val loss {last['val_loss']:.4f}"
            + (" (the base)" if it == 0 else f" (the base: {base_val:.4f})")
        )
        improved, best = last["val_loss"] < best, min(best, last["val_loss"])
        if it > 0 and (improved or cfg.always_save_checkpoint):
            loop.save(state, it, "eval")

    loop = Loop(
        manager.directory,
        stop,
        save,
        start=start,
        total=cfg.max_iters,
        log_interval=cfg.log_interval,
        progress=cfg.progress,
        max_bad_steps=cfg.max_bad_steps,
        resumed=resumed is not None,
        rates=lambda seconds: {"tokens_per_s": cfg.batch_size * cfg.block_size / seconds},
    )
    trainable, frozen = tree_lib.count(state.params), tree_lib.count(base.params)
    loop.say(
        f"LoRA {config}: {trainable:,} trainable params ({trainable / frozen:.2%} of the base's {frozen:,}, "
        f"{cfg.base_dtype}); optimizer state {tree_lib.nbytes(state.opt_state) / 1e6:.2f} MB"
    )
    if resumed:
        loop.say(f"resumed from {manager.path(resumed.step)} at iter {resumed.step}")
    state = loop.run(state, lambda state, it: step_fn(state, next(batches), base.params), evaluate_when_due)
    loop.plot(f"LoRA r={config.rank} on {base.family}, {cfg.dataset}")
    return state, {"iter": int(state.step), **last, "base_val_loss": base_val, "best_val_loss": best}


def finish(
    cfg: FinetuneConfig,
    adapters: dict,
    base: models.Base,
    config: lora.LoraConfig,
    base_dir: str,
    tokenizer: data_lib.Tokenizer,
) -> dict:
    """After training: the adapters alone in out_dir/adapters.msgpack, the merged model as a Hugging Face
    directory if asked (`merge_into`, at the base's full context), and samples from base + adapters."""
    try:
        path = lora.save(Path(cfg.out_dir) / "adapters.msgpack", adapters, config)
    except checkpoint.CheckpointWriteError as e:  # a full disk: one line; the checkpoints stay as they were
        raise SystemExit(f"error: {e}") from None
    print(f"adapters: {path} ({path.stat().st_size / 1e3:.1f} KB)")
    if cfg.merge_into:
        full, full_model = models.read(base_dir)
        models.save(lora.merge(full, adapters, config), full_model, cfg.merge_into)
        print(f"merged model: {cfg.merge_into}")
    samples = sample(cfg, lora.merge(base.params, adapters, config), base.config, tokenizer) if cfg.num_samples else []
    for text in samples:
        print(text, "-" * 40, sep="\n")
    return {"adapters": str(path), "samples": samples}


def sample(cfg: FinetuneConfig, params: dict, model: Any, tokenizer: data_lib.Tokenizer) -> list[str]:
    """`num_samples` continuations of `start` from the merged params (the family's `generate`)."""
    try:
        ids = np.asarray(tokenizer.encode(cfg.start), np.int32)
    except ValueError as e:
        raise SystemExit(f"error: --start cannot be encoded with the {cfg.tokenizer} tokenizer: {e}") from None
    if len(ids) == 0:
        raise SystemExit("error: --start is empty; give at least one character to sample from")
    prompt = jnp.asarray(np.tile(ids, (cfg.num_samples, 1)))
    out = models.generate(
        params,
        model,
        prompt,
        vocab_size=tokenizer.vocab_size,
        key=jax.random.key(cfg.seed),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
    )
    return [tokenizer.decode(row) for row in np.asarray(out)]


if __name__ == "__main__":
    main()
