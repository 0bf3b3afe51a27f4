"""Fixtures of the training-program tests."""

import pytest


@pytest.fixture
def needs_sklearn():
    """Skip where scikit-learn is missing: its wheel ships the 8x8 digits these tests train on (and the SVC that
    judges samples). It comes with the examples extra; the newest-JAX environment may lack it."""
    pytest.importorskip("sklearn", reason="the 8x8 digits ship with scikit-learn: pip install scikit-learn")
