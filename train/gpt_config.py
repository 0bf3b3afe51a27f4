"""The settings of `python -m train.gpt` (nanoGPT's names), and what they make: the model's config, the
optimizer, the state before the first step (or GPT-2's imported weights). `python -m train.gpt --help`
lists the settings; docs/train-gpt.md has the same table."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import jax

from models import gpt, gpt_surgery
from purejax import optim
from purejax.nn import remat as remat_lib
from train import config as config_lib
from train.config import When, setting
from train.observe import RunSettings

SHAMPOO, MUON, MOE = When("optimizer", "shampoo"), When("optimizer", "muon"), When("n_experts", above=0)
"""When the optimizers' and the mixture of experts' own settings have an effect (`config_rules`)."""


def preconditions_in_the_run(cfg: "TrainConfig") -> None:
    """Shampoo runs its graft (Adam) alone before step `shampoo_start`: at or past max_iters, no step of the run
    would be preconditioned."""
    if 0 < cfg.max_iters <= cfg.shampoo_start:
        raise ValueError(
            f"Shampoo preconditions from step shampoo_start on, but the run ends at max_iters="
            f"{cfg.max_iters}: every step would be Adam's alone; set --shampoo_start below max_iters"
        )


@dataclass(frozen=True)
class TrainConfig(RunSettings):
    """Every setting of a run, nanoGPT's names (`python -m train.gpt --help` lists them); the compile
    cache, profiler and loggers are `RunSettings`, shared by every program. The model fields are copied into
    `gpt.GPTConfig`, which keeps nanoGPT's `n_embd` so that configs map 1:1."""

    # I/O
    out_dir: str = setting("out-gpt", "where checkpoints, metrics.jsonl, tokenizer.json and loss.png go")
    eval_interval: int = setting(250, "estimate the train and val loss (and save) every this many steps", at_least=1)
    log_interval: int = setting(25, "a metrics row (a line, without a progress bar) every this many steps", at_least=1)
    eval_iters: int = setting(20, "batches of each split per loss estimate", at_least=1)
    eval_only: bool = setting(False, "estimate the loss of the new or resumed model once, then exit")
    always_save_checkpoint: bool = setting(True, "save at every evaluation; false: only when the val loss improves")
    init_from: str = setting("scratch", "'scratch', 'resume' (out_dir's newest checkpoint) or a GPT-2 directory")
    keep_checkpoints: int = setting(2, "how many of the newest checkpoints to keep", at_least=1)
    # data
    dataset: str = setting("stdlib", "a prepared directory, a name under data/, or any text file or directory")
    tokenizer: Literal["char", "byte"] = setting("char", "raw text becomes one id per character, or per UTF-8 byte")
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", at_least=1)
    batch_size: int = setting(12, "sequences per micro-batch, over all devices", at_least=1)
    block_size: int = setting(64, "context length in tokens", at_least=1)
    # model
    n_layer: int = setting(4, "transformer blocks", at_least=1)
    n_head: int = setting(4, "attention heads per block", at_least=1)
    n_embd: int = setting(128, "model width (nanoGPT's name; d_model in purejax.nn)", at_least=1)
    dropout: float = setting(0.0, "dropout rate while training", at_least=0, below=1)
    bias: bool = setting(False, "biases in the linear layers and LayerNorms (GPT-2: true)")
    gelu: Literal["exact", "tanh"] = setting("exact", "GELU: exact (erf, nanoGPT) or tanh (GPT-2's approximation)")
    layers: Literal["auto", "scan", "loop"] = setting(
        "auto",
        "auto: a Python loop up to stack.AUTO_LOOP_DEPTH blocks without remat or fsdp (a faster step), else one "
        "lax.scan (compiles once); or always scan, or always loop",
    )
    remat: str = setting(
        "none",
        "recompute activations in the backward pass: 'none', 'block' or a "
        "jax.checkpoint_policies name (purejax/nn/remat.py)",
        check=remat_lib.check,
    )
    # mixture of experts (models/gpt_moe.py, docs/parallel-experts.md)
    n_experts: int = setting(0, "experts per block's MLP (0: a dense MLP; else >= 2)", at_least=0)
    expert_top_k: int = setting(2, "experts each token goes to (1 to n_experts)", applies=MOE, at_least=1)
    capacity_factor: float = setting(
        1.25,
        "tokens an expert takes, as a multiple of an even share (per device); the rest skip the layer (0: no limit)",
        applies=MOE,
        at_least=0,
    )
    moe_aux_weight: float = setting(
        0.01, "weight of the load-balancing loss (Switch Transformer)", applies=MOE, at_least=0
    )
    # AdamW, weight decay on matmul weights and embeddings only, gradient clipping
    learning_rate: float = setting(1e-3, "the peak learning rate, reached after the warmup", above=0)
    max_iters: int = setting(2000, "optimizer steps in all", at_least=0)
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay", at_least=0)
    beta1: float = setting(0.9, "AdamW's first-moment decay", at_least=0, below=1)
    beta2: float = setting(0.99, "AdamW's second-moment decay", at_least=0, below=1)
    grad_clip: float = setting(1.0, "clip the gradients to this global norm; 0 disables clipping", at_least=0)
    # the optimizer: AdamW, or Shampoo or Muon (docs/optim.md) with the same rate, betas, decay and schedule
    optimizer: Literal["adamw", "shampoo", "muon"] = setting(
        "adamw", "AdamW (nanoGPT's), Shampoo grafted onto Adam, or Muon on the blocks' matrices"
    )
    shampoo_block_size: int = setting(
        128, "Shampoo: the largest side of a preconditioned block", applies=SHAMPOO, at_least=1
    )
    shampoo_precondition_every: int = setting(
        10, "Shampoo: recompute the inverse roots every this many steps", applies=SHAMPOO, at_least=1
    )
    shampoo_start: int = setting(
        10,
        "Shampoo: steps of the graft alone (Adam) before preconditioning (below max_iters)",
        applies=SHAMPOO,
        agrees=preconditions_in_the_run,
        at_least=0,
    )
    muon_momentum: float = setting(
        0.95, "Muon: the momentum of the orthogonalised update", applies=MUON, at_least=0, below=1
    )
    muon_ns_steps: int = setting(
        5,
        "Muon: Newton-Schulz steps per update (5: Keller Jordan's and optax's; each is unrolled into the compiled "
        "step, so a bound keeps the compile short)",
        applies=MUON,
        at_least=1,
        at_most=50,
    )
    muon_rms: float = setting(
        0.2,
        "Muon: the update's RMS per unit of learning rate (0.2: AdamW's, so its rate and decay carry over; Liu "
        "et al. 2025)",
        applies=MUON,
        above=0,
    )
    # learning-rate schedule: linear warmup, cosine decay to min_lr (nanoGPT's get_lr)
    decay_lr: bool = setting(True, "warm up, then decay to min_lr; false: learning_rate throughout")
    warmup_iters: int = setting(100, "steps of linear warmup", at_least=0)
    lr_decay_iters: int = setting(2000, "the step at which the cosine decay reaches min_lr", at_least=1)
    min_lr: float = setting(1e-4, "the learning rate at the end of the decay", at_least=0)
    # system
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto",
        "compute dtype, params float32; auto: bfloat16 on a GPU or TPU, float32 on a CPU; float16 adds a "
        "dynamic loss scale",
    )
    compile: bool = setting(True, "jit the step; false runs it op by op, for debugging")
    seed: int = setting(1337, "the seed of the init, the batches and dropout", at_least=0, below=2**32)
    peak_flops: float = setting(
        0.0, "FLOP/s that MFU is a fraction of; 0: a known accelerator's bfloat16 peak, else no MFU", at_least=0
    )
    progress: bool = setting(True, "a progress bar on a terminal with tqdm; else a line every log_interval")
    max_bad_steps: int = setting(
        100, "stop after this many steps in a row with a non-finite loss or gradients (0: never)", at_least=0
    )
    # devices: pp stages of a dp x cp x tp mesh (pp * dp * cp * tp devices over all processes), optionally fully sharded
    dp: int = setting(1, "data-parallel groups (batch_size must divide by dp)", at_least=1)
    tp: int = setting(1, "tensor-parallel devices per group (n_head must divide by tp)", at_least=1)
    cp: int = setting(
        1,
        "context-parallel devices per group: the sequence split over them, attention as a ring "
        "(block_size must divide by 2 * cp; no dropout)",
        at_least=1,
    )
    fsdp: bool = setting(False, "also split params and optimizer state over the dp groups")
    ep: bool = setting(
        False,
        "expert parallelism: the experts split over the dp groups, tokens sent to them by "
        "all_to_all (n_experts must divide by dp)",
    )
    sp: bool = setting(
        False,
        "with tp > 1: Megatron sequence parallelism, LayerNorm and dropout on sequence "
        "shards over the tp devices (block_size must divide by tp)",
    )
    pp: int = setting(1, "pipeline stages: the blocks split over them in order (n_layer must divide by pp)", at_least=1)
    micro_batches: int = setting(
        1, "with pp > 1: micro-batches each batch is pipelined in (batch_size / dp must divide by it)", at_least=1
    )
    pipeline_schedule: Literal["gpipe", "1f1b"] = setting(
        "1f1b",
        "all forwards, then all backwards (gpipe), or one of each in turn (1f1b, less memory)",
        applies=When("pp", above=1),
    )
    # processes: "" / 0 / -1 take what the launcher set (srun, mpirun, purejax.parallel.launch), else one process
    coordinator: str = setting("", "host:port of process 0")
    num_processes: int = setting(0, "processes in the run (0: from the launcher, else 1)", at_least=0)
    process_id: int = setting(-1, "this process's index (-1: from the launcher)", at_least=-1)

    def __post_init__(self):
        config_lib.check_ranges(self)
        if self.decay_lr:
            config_lib.check_schedule(self)
        if self.optimizer != "adamw" and (self.tp > 1 or self.fsdp):
            raise config_lib.ConfigError(
                f"optimizer={self.optimizer} preconditions whole matrices, but under --tp or "
                "--fsdp a device updates slices of them: use --dp alone or adamw"
            )
        if self.cp > 1 and self.dropout > 0:
            raise config_lib.ConfigError(
                f"--cp={self.cp} runs attention as a ring, which cannot drop attention probabilities, but "
                f"--dropout={self.dropout}: use --dropout=0 or --cp=1"
            )
        if self.cp > 1 and self.block_size % (2 * self.cp):
            raise config_lib.ConfigError(
                f"--cp={self.cp} gives each device two chunks of the sequence (zig-zag order), so "
                f"block_size={self.block_size} must divide by 2 * cp = {2 * self.cp}"
            )
        if self.sp and (self.tp == 1 or self.block_size % self.tp or self.cp > 1 or self.pp > 1):
            raise config_lib.ConfigError(
                f"--sp splits the sequence over the --tp devices: it needs --tp > 1 and block_size divisible by tp "
                f"and no --cp or --pp, but tp={self.tp}, block_size={self.block_size}, cp={self.cp}, pp={self.pp}"
            )
        self._check_pipeline()
        self._check_experts()

    def _check_experts(self) -> None:
        """--n_experts and --ep: the modes a mixture of experts runs under (models/gpt_moe.py)."""
        if self.ep and (self.n_experts == 0 or self.dp == 1 or self.n_experts % self.dp or self.optimizer != "adamw"):
            raise config_lib.ConfigError(
                f"--ep splits the experts over the --dp groups: it needs n_experts > 0 "
                f"divisible by dp and adamw, but n_experts={self.n_experts}, dp={self.dp}, "
                f"optimizer={self.optimizer}"
            )
        if self.n_experts and (self.cp > 1 or self.sp or self.pp > 1):
            raise config_lib.ConfigError(
                f"--n_experts={self.n_experts} (mixture of experts) runs with --dp, --tp, "
                "--fsdp and --ep, not with --cp, --sp or --pp"
            )

    def _check_pipeline(self) -> None:
        """--pp and --micro_batches: what a pipeline needs, and the modes it does not combine with."""
        if self.pp == 1:
            if self.micro_batches > 1:
                raise config_lib.ConfigError(
                    f"--micro_batches={self.micro_batches} splits each batch between pipeline stages, but --pp=1; "
                    "use --pp > 1, or --gradient_accumulation_steps to split batches on one device"
                )
            return
        clash = [flag for flag, on in (("--fsdp", self.fsdp), (f"--cp={self.cp}", self.cp > 1)) if on]
        if clash or self.optimizer != "adamw":
            flags = ", ".join(clash or [f"--optimizer={self.optimizer}"])
            raise config_lib.ConfigError(
                f"--pp={self.pp} (pipeline parallelism) does not combine with {flags}: "
                "use --pp with --dp, --tp and adamw"
            )
        if self.n_layer % self.pp:
            raise config_lib.ConfigError(
                f"--pp={self.pp} stages of equal depth need n_layer={self.n_layer} to divide by {self.pp}"
            )
        if self.batch_size % self.dp or (self.batch_size // self.dp) % self.micro_batches:
            raise config_lib.ConfigError(
                f"batch_size={self.batch_size} over --dp={self.dp} is {self.batch_size / self.dp:g} rows per data "
                f"shard, which must split into --micro_batches={self.micro_batches}: make batch_size a multiple "
                f"of dp x micro_batches = {self.dp * self.micro_batches}"
            )

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


decays = optim.ndim_at_least(2, stacked=("blocks",))
"""nanoGPT's rule: weight decay on tensors with ndim >= 2 (matmul weights and embeddings), not on biases or
LayerNorm scales; counted per layer, so the stacked blocks' leading layer axis does not count."""


def make_optimizer(cfg: TrainConfig, data_axis: str | None = None) -> optim.GradientTransformation:
    """`cfg.optimizer` with weight decay where `decays` says, driven by nanoGPT's warmup + cosine schedule (or a
    constant rate): AdamW; Shampoo, its step size grafted from Adam's, each layer of the stacked blocks with
    its own statistics; or Muon on the blocks' matrices and AdamW on the rest (the embeddings, which are also
    the head, the biases and norms: Keller Jordan's split), its update scaled to AdamW's RMS (`muon_rms`).
    Inside the data-parallel step, `data_axis` shares Shampoo's inverse roots out over the data shards (each
    computes its share, one all-gather joins them) instead of every shard computing all of them."""
    if cfg.decay_lr:
        lr = optim.schedules.warmup_cosine(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters, cfg.min_lr)
    else:
        lr = cfg.learning_rate
    if cfg.optimizer == "shampoo":
        return optim.shampoo(
            lr,
            cfg.shampoo_block_size,
            b1=cfg.beta1,
            b2=cfg.beta2,
            stacked=("blocks",),
            precondition_every=cfg.shampoo_precondition_every,
            start_preconditioning_step=cfg.shampoo_start,
            axis_name=data_axis,
            weight_decay=cfg.weight_decay,
            mask=decays,
        )
    if cfg.optimizer == "muon":
        matrices = optim.matrix_leaves(stacked=("blocks",), exclude=("wte", "wpe"))
        return optim.muon(
            lr,
            ns_steps=cfg.muon_ns_steps,
            beta=cfg.muon_momentum,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=decays,
            adam_b1=cfg.beta1,
            adam_b2=cfg.beta2,
            adam_weight_decay=cfg.weight_decay,
            adam_weight_decay_mask=decays,
            matrices=matrices,
            consistent_rms=cfg.muon_rms,
        )
    return optim.adamw(lr, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=decays)


def new_state(cfg: TrainConfig, model: gpt.GPTConfig, params: dict | None = None, dtype: str = "") -> optim.TrainState:
    """The state before the first step: `params` (default: `gpt.init`), AdamW's state, the key, and the dynamic
    loss scale that float16 needs (for `dtype`, default the run's)."""
    key = jax.random.key(cfg.seed)
    params = gpt.init(jax.random.fold_in(key, 0), model) if params is None else params
    loss_scale = optim.dynamic_loss_scale() if (dtype or cfg.dtype) == "float16" else optim.NoLossScale()
    return optim.init_train_state(params, make_optimizer(cfg), jax.random.fold_in(key, 1), loss_scale=loss_scale)


def load_gpt2(cfg: TrainConfig) -> tuple[dict, gpt.GPTConfig]:
    """For --init_from=<dir>: GPT-2's params and config from a Hugging Face directory, cropped to block_size."""
    if not (Path(cfg.init_from) / "config.json").exists():
        raise SystemExit(
            f"error: --init_from={cfg.init_from!r} is not 'scratch', 'resume' or a Hugging Face "
            f"GPT-2 directory (no config.json there)"
        )
    from models import gpt_hf

    params, model = gpt_hf.load(Path(cfg.init_from))
    model = dataclasses.replace(model, dropout=cfg.dropout, layers=cfg.layers, remat=cfg.remat)
    return gpt_surgery.crop_block_size(params, model, min(cfg.block_size, model.block_size))
