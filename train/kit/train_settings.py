"""The settings every training program that runs the shared loop has, each declared once with its help and
range: where the run writes, where it starts from, the batch, the optimizer's common knobs, the seed, and how
the loop reports and gives up. A program's settings extend `TrainSettings`, adding their own and giving some
of these the program's own default (`settings.inherited`):

    @dataclass(frozen=True)
    class FlowSettings(TrainSettings):
        out_dir: str = inherited(TrainSettings, "out_dir", "out-flow")
        d_model: int = setting(128, "model width", at_least=1)

How a run is watched (the compile cache, the profiler, TensorBoard, W&B) is `observe.RunSettings`, which
these extend in turn; `--help` lists those last.
"""

from dataclasses import dataclass
from typing import Any

from train.kit.observe import RunSettings
from train.kit.settings import setting


@dataclass(frozen=True)
class TrainSettings(RunSettings):
    """The common settings of `train.gpt`, `train.classify`, `train.flow` and `train.finetune`."""

    out_dir: str = setting("out", "where the checkpoints, metrics.jsonl, loss.png and the program's other files go")
    init_from: str = setting(
        "scratch",
        "'scratch', 'resume' (out_dir's newest checkpoint), or a Hugging Face model directory (train.gpt: GPT-2's "
        "weights; train.finetune: the base)",
    )
    keep_checkpoints: int = setting(2, "how many of the newest checkpoints to keep", at_least=1)
    batch_size: int = setting(
        64, "examples per step (per micro-batch with gradient accumulation), over all devices", at_least=1
    )
    learning_rate: float = setting(1e-3, "the peak learning rate, reached after the warmup", above=0)
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay", at_least=0)
    grad_clip: float = setting(1.0, "clip the gradients to this global norm; 0 disables clipping", at_least=0)
    seed: int = setting(
        0, "the seed of the init, the batches and every random draw of training", at_least=0, below=2**32
    )
    progress: bool = setting(True, "a progress bar on a terminal with tqdm; else a line every log interval")
    max_bad_steps: int = setting(
        100, "stop after this many steps in a row with a non-finite loss or gradients (0: never)", at_least=0
    )

    def on_this_machine(self) -> Any:
        """These settings with what depends on the machine made concrete, once its devices are up (train.gpt's
        `dtype="auto"`); the same settings where nothing does."""
        return self
