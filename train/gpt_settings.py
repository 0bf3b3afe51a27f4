"""The settings of `python -m train.gpt` (nanoGPT's names) and the model's config they make;
`python -m train.gpt --help` lists them, docs/train-gpt.md has the same table. The optimizer and the state
they make are train/gpt_steps.py's."""

import dataclasses
from dataclasses import dataclass
from typing import Literal

import jax

from models import gpt, gpt_moe
from purejax.nn import remat as remat_lib
from purejax.precision import resolve_compute_dtype
from train.kit import settings as settings_lib
from train.kit.settings import When, inherited, setting
from train.kit.train_settings import TrainSettings

SHAMPOO, MUON, MOE = When("optimizer", "shampoo"), When("optimizer", "muon"), When("n_experts", above=0)
"""When the optimizers' and the mixture of experts' own settings have an effect (`train.kit.rules`)."""


def preconditions_in_the_run(settings: "GPTSettings") -> None:
    """Shampoo runs its graft (Adam) alone before step `shampoo_start`: at or past max_iters, no step of the run
    would be preconditioned."""
    if 0 < settings.max_iters <= settings.shampoo_start:
        raise ValueError(
            f"Shampoo preconditions from step shampoo_start on, but the run ends at max_iters="
            f"{settings.max_iters}: every step would be Adam's alone; set --shampoo_start below max_iters"
        )


@dataclass(frozen=True)
class GPTSettings(TrainSettings):
    """Every setting of a run, nanoGPT's names (`python -m train.gpt --help` lists them); those every program
    has are `TrainSettings`. The model fields are copied into `gpt.GPTConfig`, which keeps nanoGPT's `n_embd`
    so that configs map 1:1."""

    # I/O (and tokenizer.json, so that out_dir alone is enough to sample from)
    out_dir: str = inherited(TrainSettings, "out_dir", "out-gpt")
    eval_interval: int = setting(250, "estimate the train and val loss (and save) every this many steps", at_least=1)
    log_interval: int = setting(25, "a metrics row (a line, without a progress bar) every this many steps", at_least=1)
    eval_iters: int = setting(20, "batches of each split per loss estimate", at_least=1)
    eval_only: bool = setting(False, "estimate the loss of the new or resumed model once, then exit")
    always_save_checkpoint: bool = setting(True, "save at every evaluation; false: only when the val loss improves")
    # data
    dataset: str = setting("stdlib", "a prepared directory, a name under data/, or any text file or directory")
    tokenizer: Literal["char", "byte"] = setting(
        "char", "raw text becomes one id per character, or per UTF-8 byte (unless init_from has a tokenizer)"
    )
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step", at_least=1)
    batch_size: int = inherited(TrainSettings, "batch_size", 12)
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
    max_iters: int = setting(2000, "optimizer steps in all", at_least=0)
    weight_decay: float = inherited(TrainSettings, "weight_decay", 0.1)
    beta1: float = setting(0.9, "AdamW's first-moment decay", at_least=0, below=1)
    beta2: float = setting(0.99, "AdamW's second-moment decay", at_least=0, below=1)
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
    seed: int = inherited(TrainSettings, "seed", 1337)
    peak_flops: float = setting(
        0.0, "FLOP/s that MFU is a fraction of; 0: a known accelerator's bfloat16 peak, else no MFU", at_least=0
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
        settings_lib.check_ranges(self)
        if self.decay_lr:
            settings_lib.check_schedule(self)
        if self.optimizer != "adamw" and (self.tp > 1 or self.fsdp):
            raise settings_lib.ConfigError(
                f"optimizer={self.optimizer} preconditions whole matrices, but under --tp or "
                "--fsdp a device updates slices of them: use --dp alone or adamw"
            )
        if self.cp > 1 and self.dropout > 0:
            raise settings_lib.ConfigError(
                f"--cp={self.cp} runs attention as a ring, which cannot drop attention probabilities, but "
                f"--dropout={self.dropout}: use --dropout=0 or --cp=1"
            )
        if self.cp > 1 and self.block_size % (2 * self.cp):
            raise settings_lib.ConfigError(
                f"--cp={self.cp} gives each device two chunks of the sequence (zig-zag order), so "
                f"block_size={self.block_size} must divide by 2 * cp = {2 * self.cp}"
            )
        if self.sp and (self.tp == 1 or self.block_size % self.tp or self.cp > 1 or self.pp > 1):
            raise settings_lib.ConfigError(
                f"--sp splits the sequence over the --tp devices: it needs --tp > 1 and block_size divisible by tp "
                f"and no --cp or --pp, but tp={self.tp}, block_size={self.block_size}, cp={self.cp}, pp={self.pp}"
            )
        self._check_pipeline()
        self._check_experts()

    def _check_experts(self) -> None:
        """--n_experts and --ep: the modes a mixture of experts runs under (models/gpt_moe.py)."""
        if self.ep and (self.n_experts == 0 or self.dp == 1 or self.n_experts % self.dp or self.optimizer != "adamw"):
            raise settings_lib.ConfigError(
                f"--ep splits the experts over the --dp groups: it needs n_experts > 0 "
                f"divisible by dp and adamw, but n_experts={self.n_experts}, dp={self.dp}, "
                f"optimizer={self.optimizer}"
            )
        if self.n_experts and (self.cp > 1 or self.sp or self.pp > 1):
            raise settings_lib.ConfigError(
                f"--n_experts={self.n_experts} (mixture of experts) runs with --dp, --tp, "
                "--fsdp and --ep, not with --cp, --sp or --pp"
            )

    def _check_pipeline(self) -> None:
        """--pp and --micro_batches: what a pipeline needs, and the modes it does not combine with."""
        if self.pp == 1:
            if self.micro_batches > 1:
                raise settings_lib.ConfigError(
                    f"--micro_batches={self.micro_batches} splits each batch between pipeline stages, but --pp=1; "
                    "use --pp > 1, or --gradient_accumulation_steps to split batches on one device"
                )
            return
        clash = [flag for flag, on in (("--fsdp", self.fsdp), (f"--cp={self.cp}", self.cp > 1)) if on]
        if clash or self.optimizer != "adamw":
            flags = ", ".join(clash or [f"--optimizer={self.optimizer}"])
            raise settings_lib.ConfigError(
                f"--pp={self.pp} (pipeline parallelism) does not combine with {flags}: "
                "use --pp with --dp, --tp and adamw"
            )
        if self.n_layer % self.pp:
            raise settings_lib.ConfigError(
                f"--pp={self.pp} stages of equal depth need n_layer={self.n_layer} to divide by {self.pp}"
            )
        if self.batch_size % self.dp or (self.batch_size // self.dp) % self.micro_batches:
            raise settings_lib.ConfigError(
                f"batch_size={self.batch_size} over --dp={self.dp} is {self.batch_size / self.dp:g} rows per data "
                f"shard, which must split into --micro_batches={self.micro_batches}: make batch_size a multiple "
                f"of dp x micro_batches = {self.dp * self.micro_batches}"
            )

    def model_config(self, vocab_size: int) -> gpt.GPTConfig:
        """The model for a tokenizer of `vocab_size` tokens; under tensor parallelism the vocabulary is padded
        to a multiple of tp (its rows are split over the tp devices), as nanoGPT pads GPT-2's to 50304. The
        padding ids never occur in the data; their logits only learn to stay low."""
        vocab_size = -(-vocab_size // self.tp) * self.tp
        fields = {f.name for f in dataclasses.fields(gpt_moe.MoEConfig)} - {"vocab_size"}
        try:
            return gpt_moe.gpt_config(
                {"vocab_size": vocab_size, **{k: getattr(self, k) for k in fields if hasattr(self, k)}}
            )
        except ValueError as e:
            raise settings_lib.ConfigError(str(e)) from None

    def on_this_machine(self) -> "GPTSettings":
        """`dtype="auto"` made concrete for the backend the devices run on (bfloat16 on a GPU or TPU)."""
        return dataclasses.replace(self, dtype=resolve_compute_dtype(self.dtype, jax.default_backend()))
