"""The settings of `python -m train.finetune` (`--help` lists them; docs/lora.md has the table).

The names are train.gpt's where the meaning is the same, plus the `lora_*` ones; the text programs' shared
functions (`train.kit.text`: `open_data`, `estimate_loss`, `load_gpt2`) read the same fields of either.
The defaults differ where fine-tuning differs from pre-training: fewer steps, a short warmup, no weight decay
(the adapters start at a zero change; decaying them pulls towards the base, which LoRA's rank already limits),
and the byte tokenizer, whose ids mean the same on every text, so a base trained on one corpus reads another.
"""

from dataclasses import dataclass
from typing import Literal

from purejax import lora
from train.kit import settings as settings_lib
from train.kit.settings import inherited, setting
from train.kit.train_settings import TrainSettings


@dataclass(frozen=True)
class FinetuneSettings(TrainSettings):
    """Every setting of a LoRA fine-tune (`python -m train.finetune --help`); those every program has are
    `TrainSettings`. `init_from` names the base: a Hugging Face GPT-2 or Llama directory (or 'resume')."""

    # I/O (and adapters.msgpack)
    out_dir: str = inherited(TrainSettings, "out_dir", "out-finetune")
    init_from: str = inherited(TrainSettings, "init_from", "")
    eval_interval: int = setting(50, "estimate the train and val loss (and save) every this many steps", at_least=1)
    log_interval: int = setting(10, "a metrics row every this many steps", at_least=1)
    eval_iters: int = setting(20, "batches of each split per loss estimate", at_least=1)
    always_save_checkpoint: bool = setting(True, "save at every evaluation; false: only when the val loss improves")
    merge_into: str = setting(
        "", "at the end, also write base + adapters merged as a Hugging Face directory here (a new or empty one)"
    )
    # data
    dataset: str = setting("stdlib", "a prepared directory, a name under data/, or any text file or directory")
    tokenizer: Literal["char", "byte"] = setting(
        "byte",
        "one id per UTF-8 byte (the same ids on any text), or per character of this corpus (unless init_from "
        "has a tokenizer: then its own)",
    )
    batch_size: int = inherited(TrainSettings, "batch_size", 8)
    block_size: int = setting(64, "context length in tokens (the base's positions are cropped to it)", at_least=1)
    # LoRA (Hu et al. 2021)
    lora_rank: int = setting(
        8, "r: the rank of every adapter A @ B (at most the narrowest side of the matrices adapted)", at_least=1
    )
    lora_alpha: float = setting(16.0, "the adapters' output is scaled by lora_alpha / lora_rank", above=0)
    lora_targets: str = setting(
        "blocks.attn.qkv.w,blocks.mlp.*.w", "comma-separated param paths to adapt; `*` matches one dotted component"
    )
    base_dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "the frozen base's dtype in memory (the adapters and their optimizer state stay float32)"
    )
    dropout: float = setting(0.0, "the base model's dropout while training", at_least=0, below=1)
    layers: Literal["scan", "loop"] = setting("scan", "blocks as one lax.scan or a Python loop")
    # AdamW on the adapters, warmup + cosine schedule (train.gpt's)
    max_iters: int = setting(200, "optimizer steps in all", at_least=0)
    beta1: float = setting(0.9, "AdamW's first-moment decay", at_least=0, below=1)
    beta2: float = setting(0.99, "AdamW's second-moment decay", at_least=0, below=1)
    decay_lr: bool = setting(True, "warm up, then decay to min_lr; false: learning_rate throughout")
    warmup_iters: int = setting(10, "steps of linear warmup", at_least=0)
    lr_decay_iters: int = setting(200, "the step at which the cosine decay reaches min_lr", at_least=1)
    min_lr: float = setting(1e-4, "the learning rate at the end of the decay", at_least=0)
    # system
    dtype: Literal["float32", "bfloat16"] = setting("float32", "compute dtype of the forward and backward pass")
    seed: int = inherited(TrainSettings, "seed", 1337)
    # samples from the fine-tuned model at the end
    start: str = setting("\n", "the prompt of the samples")
    num_samples: int = setting(2, "samples drawn at the end (0: none)", at_least=0)
    max_new_tokens: int = setting(200, "tokens generated per sample", at_least=1)
    temperature: float = setting(0.8, "divides the logits; 0 takes the most likely token", at_least=0)
    top_k: int | None = setting(None, "sample among the k most likely tokens (none: all)", at_least=1)

    def __post_init__(self):
        settings_lib.check_ranges(self)
        if self.decay_lr:
            settings_lib.check_schedule(self)
        try:
            self.lora_config()
        except (TypeError, ValueError) as e:
            raise settings_lib.ConfigError(f"lora_targets={self.lora_targets!r}: {e}") from None

    def lora_config(self) -> lora.LoraConfig:
        """The adapters these settings describe."""
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return lora.LoraConfig(targets=targets, rank=self.lora_rank, alpha=self.lora_alpha)
