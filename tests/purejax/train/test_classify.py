"""train.classify: a short run on the 8x8 digits really learns, an interrupted and resumed run (stopped in the
middle of an epoch) ends bit for bit where an uninterrupted one does, the augmentation and the confusion
matrix against plain numpy, and bad settings fail before anything compiles."""

import jax
import numpy as np
import pytest

from purejax import checkpoint
from purejax.train import classify, run
from purejax.train.data import images as images_lib

# MobileNetV1 at width 0.25 (the quickest MobileNet to compile), 44 steps of 32 per epoch, 3 epochs, no augmentation;
# BatchNorm momentum raised so that eval-mode statistics keep up with so short a run.
FAST = ["--progress=false", "--version=v1", "--width=0.25", "--num_downsamples=2", "--batch_size=32", "--epochs=3",
        "--dropout=0", "--augment=false", "--learning_rate=1e-2", "--warmup_steps=10", "--bn_momentum=0.3"]  # fmt: skip
LEARNED = 0.75  # test accuracy after those 132 steps; measured 83.0% here (chance: 10%)


def leaves(out_dir, step):
    tree, _ = checkpoint.restore(checkpoint.CheckpointManager(out_dir).path(step))
    return [np.asarray(jax.random.key_data(x)) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)
            for x in jax.tree.leaves(tree)]  # fmt: skip


class StopAfter(run.StopSignal):
    """A StopSignal whose stop request arrives after `steps` training steps, as a SIGTERM mid-epoch would."""

    steps = 8
    checked = 0

    @property
    def requested(self):  # the program checks once after every step
        StopAfter.checked += 1
        return StopAfter.checked >= StopAfter.steps

    @requested.setter
    def requested(self, value):
        pass


def test_short_run_learns_and_resume_mid_epoch_is_bit_exact(tmp_path, monkeypatch, capsys):
    straight = classify.main([*FAST, f"--out_dir={tmp_path / 'straight'}"])
    assert straight["step"] == 132 and straight["test_accuracy"] > LEARNED, straight
    assert straight["confusion"].sum() == 359
    assert (tmp_path / "straight" / "metrics.jsonl").exists()

    monkeypatch.setattr(run, "StopSignal", StopAfter)
    with pytest.raises(SystemExit):
        classify.main([*FAST, f"--out_dir={tmp_path / 'stopped'}"])
    monkeypatch.undo()
    stopped_at = checkpoint.CheckpointManager(tmp_path / "stopped").latest_step()
    assert stopped_at == StopAfter.steps
    resumed = classify.main([f"--out_dir={tmp_path / 'stopped'}", "--init_from=resume"])
    assert "resumed from" in capsys.readouterr().out
    for a, b in zip(leaves(tmp_path / "straight", 132), leaves(tmp_path / "stopped", 132), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed["test_accuracy"] == straight["test_accuracy"]
    # what the run is cannot change on resume (before anything compiles): each conflict is named
    with pytest.raises(SystemExit, match=r"(?s)width: checkpoint has .* override says 0.5.*batch_size: .*epochs: "):
        classify.main([f"--out_dir={tmp_path / 'stopped'}", "--init_from=resume", "--width=0.5", "--batch_size=7",
                       "--epochs=99"])  # fmt: skip


def test_random_shift_is_a_crop_of_the_zero_padded_image():
    x = np.random.default_rng(0).uniform(size=(5, 6, 7, 2)).astype(np.float32)
    shifted = classify.random_shift(x, 2, np.random.default_rng(1))
    dy, dx = np.random.default_rng(1).integers(0, 5, size=(2, 5))
    for i in range(5):
        expected = np.pad(x[i], ((2, 2), (2, 2), (0, 0)))[dy[i] : dy[i] + 6, dx[i] : dx[i] + 7]
        np.testing.assert_array_equal(shifted[i], expected)


def test_epoch_batches_are_a_function_of_seed_and_epoch():
    data = images_lib.load_digits()
    cfg = classify.ClassifyConfig(batch_size=100)
    x1, y1 = classify.epoch_batches(data, cfg, 3)
    x2, y2 = classify.epoch_batches(data, cfg, 3)
    assert x1.shape == (14, 100, 8, 8, 1) and y1.shape == (14, 100)
    np.testing.assert_array_equal(x1, x2)
    assert not np.array_equal(classify.epoch_batches(data, cfg, 4)[1], y1)
    assert len(np.unique(y1)) == 10


def test_confusion_matrix_and_per_class_accuracy():
    counts = classify.confusion_matrix(np.array([0, 0, 1, 2, 2, 2]), np.array([0, 1, 1, 2, 2, 0]), 3)
    np.testing.assert_array_equal(counts, [[1, 1, 0], [0, 1, 0], [1, 0, 2]])
    text = classify.format_confusion(counts)
    assert "50.0%" in text and "100.0%" in text and "66.7%" in text


def test_bad_settings_fail_before_compiling(tmp_path):
    with pytest.raises(SystemExit, match="no readable checkpoint"):
        classify.main([f"--out_dir={tmp_path}", "--init_from=resume"])
    with pytest.raises(SystemExit, match="exceeds the 1438 training images"):
        classify.main([f"--out_dir={tmp_path}", "--batch_size=5000"])
    with pytest.raises(SystemExit, match="unknown config key"):
        classify.main(["--widht=0.5"])
    with pytest.raises(SystemExit, match="width must be positive"):
        classify.main([f"--out_dir={tmp_path}", "--width=0"])
