"""Judging generated images without a downloaded Inception network: an independent classifier reads the class
of each sample, and a Fréchet distance compares the samples' pixel statistics with held-out real images.

    classifier = fit_classifier(data.train_images, data.train_labels)   # scikit-learn SVC, 99.4% on digits
    accuracy = class_accuracy(classifier, samples, requested_labels)    # read as the requested class?
    fd = frechet_distance(samples, data.test_images)                    # pixel-space FD; compare with
    floor = frechet_distance(data.train_images, data.test_images)       # real-train vs real-test

The Fréchet distance between Gaussians fitted to two sets (Heusel et al. 2017, "FID" when the features are
Inception's):  |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2).  The matrix square roots come
from symmetric eigendecompositions (numpy.linalg.eigh), which are exact for the positive semi-definite
covariances involved, so no scipy.linalg.sqrtm (and none of its complex round-off) is needed.
"""

import numpy as np
from jaxtyping import Float, Int


def _sqrt_psd(m: np.ndarray) -> np.ndarray:
    """The symmetric square root of a positive semi-definite matrix; tiny negative eigenvalues (round-off)
    are clipped to 0."""
    values, vectors = np.linalg.eigh((m + m.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def frechet_distance_gaussians(mu_a: np.ndarray, cov_a: np.ndarray, mu_b: np.ndarray, cov_b: np.ndarray) -> float:
    """|mu_a - mu_b|^2 + tr(cov_a + cov_b - 2 sqrt(sqrt(cov_a) cov_b sqrt(cov_a))), in float64."""
    root_a = _sqrt_psd(np.asarray(cov_a, np.float64))
    cross = _sqrt_psd(root_a @ np.asarray(cov_b, np.float64) @ root_a)
    diff = np.asarray(mu_a, np.float64) - np.asarray(mu_b, np.float64)
    return float(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2 * np.trace(cross))


def frechet_distance(a: Float[np.ndarray, " n_a *shape"], b: Float[np.ndarray, " n_b *shape"]) -> float:
    """The Fréchet distance between Gaussians fitted to two sets of images (each image flattened)."""
    a = np.asarray(a, np.float64).reshape(len(a), -1)
    b = np.asarray(b, np.float64).reshape(len(b), -1)
    if a.shape[1] != b.shape[1] or len(a) < 2 or len(b) < 2:
        raise ValueError(
            f"frechet_distance: need two sets of at least 2 images of one size, got {a.shape} and {b.shape}"
        )
    return frechet_distance_gaussians(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))


def fit_classifier(images: Float[np.ndarray, " n *shape"], labels: Int[np.ndarray, " n"]):
    """An RBF support-vector classifier on the flattened pixels (as scikit-learn's digits example): 99.4% on
    the 8x8 digits' fixed stratified test split. Independent of the generator: it never sees a generated
    image."""
    from sklearn.svm import SVC

    return SVC(gamma=0.25, C=10.0).fit(np.asarray(images).reshape(len(images), -1), np.asarray(labels))


def class_accuracy(classifier, images: Float[np.ndarray, " n *shape"], labels: Int[np.ndarray, " n"]) -> float:
    """The fraction of `images` the classifier reads as the class in `labels`."""
    predicted = classifier.predict(np.asarray(images).reshape(len(images), -1))
    return float(np.mean(predicted == np.asarray(labels)))


def evaluate(sample, data, per_class: int, guidances: tuple[float, ...]) -> dict[str, float]:
    """Classifier accuracy and pixel Fréchet distance of `per_class` samples of every class of `data` (an
    `images.ImageSplits`) at each guidance scale: `sample(labels, guidance) -> images in [0, 1]`. Also the
    classifier's accuracy on the real test images and `fd_floor`, real train against real test."""
    classifier = fit_classifier(data.train_images, data.train_labels)
    labels = np.repeat(np.arange(data.num_classes), per_class)
    out = {
        "classifier_test_accuracy": class_accuracy(classifier, data.test_images, data.test_labels),
        "fd_floor": frechet_distance(data.train_images, data.test_images),
    }
    for g in guidances:
        images = np.asarray(sample(labels, g))
        out[f"accuracy_g{g:g}"] = class_accuracy(classifier, images, labels)
        out[f"fd_g{g:g}"] = frechet_distance(images, data.test_images)
    return out
