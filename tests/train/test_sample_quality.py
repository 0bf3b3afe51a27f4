"""train.sample_quality: the Fréchet distance against the closed form for Gaussians and against scipy's
sqrtm, and the independent digit classifier's accuracy on real test digits."""

import numpy as np
import pytest

from train import sample_quality as q


def random_rotation(d, rng):
    return np.linalg.qr(rng.normal(size=(d, d)))[0]


def test_commuting_covariances_give_the_closed_form():
    """S_a = Q diag(a) Q^T and S_b = Q diag(b) Q^T commute: FD = |mu_a - mu_b|^2 + sum (sqrt(a) - sqrt(b))^2."""
    rng = np.random.default_rng(0)
    rot = random_rotation(6, rng)
    a, b = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 6)
    mu_a, mu_b = rng.normal(size=6), rng.normal(size=6)
    got = q.frechet_distance_gaussians(mu_a, rot @ np.diag(a) @ rot.T, mu_b, rot @ np.diag(b) @ rot.T)
    want = np.sum((mu_a - mu_b) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    np.testing.assert_allclose(got, want, rtol=1e-10)


def test_general_covariances_match_scipy_sqrtm():
    scipy_linalg = pytest.importorskip("scipy.linalg")
    rng = np.random.default_rng(1)
    m1, m2 = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    s1, s2 = m1 @ m1.T, m2 @ m2.T + np.eye(5)
    want = np.trace(s1 + s2 - 2 * scipy_linalg.sqrtm(s1 @ s2).real)
    np.testing.assert_allclose(q.frechet_distance_gaussians(np.zeros(5), s1, np.zeros(5), s2), want, rtol=1e-8)


def test_frechet_distance_of_samples():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(4000, 2, 2))
    assert q.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)  # a set against itself
    shifted = q.frechet_distance(a, a + 1.0)  # the same covariance, means 1 apart in each of 4 pixels
    assert shifted == pytest.approx(4.0, rel=1e-6)
    # (images of two sizes are refused by the shape annotation, "n_a *shape" against "n_b *shape", first)
    with pytest.raises(ValueError, match="two sets of at least 2 images of one size"):
        q.frechet_distance(a, rng.normal(size=(1, 2, 2)))  # one image has no covariance


@pytest.mark.usefixtures("needs_sklearn")
def test_classifier_reads_real_digits():
    from train.data.images import load_digits

    data = load_digits()
    classifier = q.fit_classifier(data.train_images, data.train_labels)
    assert q.class_accuracy(classifier, data.test_images, data.test_labels) > 0.98  # recorded: 99.4%
    flipped = data.test_images[:, ::-1]  # upside-down digits are mostly not what they were
    assert q.class_accuracy(classifier, flipped, data.test_labels) < 0.5
