"""Settings checked before any work, bounded, and refused where they cannot apply (train/kit/rules.py):
a setting given where it has no effect names what it needs, Shampoo's start and a profile window must lie in the
run, Muon's Newton-Schulz steps are bounded, the compile cache's directory is checked before anything compiles,
and the fine-tune's rank and merge directory are checked against the base and the disk before training."""

import os
import re
from dataclasses import dataclass

import jax
import pytest

from models import gpt as gpt_model
from train import classify, flow, gpt
from train import finetune_models as models
from train.finetune_settings import FinetuneSettings
from train.kit import compile_cache, resume
from train.kit import rules as config_rules
from train.kit import settings as settings_lib
from train.kit.settings import ConfigError, When, setting


def refused(parse, argv: list[str], message: str) -> None:
    """`parse(argv)` exits with one line, `error: ...` holding `message`."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text and message in text, text


# ---------------------------------------------------------------- the rules, on a dataclass of their own


@dataclass(frozen=True)
class Settings:
    out_dir: str = setting("out", "where the run writes")
    init_from: str = setting("scratch", "where to start")
    mode: str = setting("plain", "plain or fancy")
    steps: int = setting(10, "steps in all", at_least=0)
    fancy_level: int = setting(1, "how fancy", applies=When("mode", "fancy"))
    fancy_start: int = setting(2, "the first fancy step", applies=When("mode", "fancy"), agrees=lambda s: _in_run(s))

    def __post_init__(self):
        settings_lib.check_ranges(self)


def _in_run(s: Settings) -> None:
    if s.fancy_start >= s.steps:
        raise ValueError(f"the run ends at steps={s.steps}")


def test_a_given_setting_that_has_no_effect_is_refused_whatever_its_value():
    for value in ("3", "1"):  # 1 is the default: given is given
        with pytest.raises(ConfigError, match=re.escape("--fancy_level applies only with --mode=fancy (it is plain)")):
            settings_lib.parse_args(Settings, [f"--fancy_level={value}"])
    assert settings_lib.parse_args(Settings, ["--mode=fancy", "--fancy_level=3"]).fancy_level == 3
    assert settings_lib.parse_args(Settings, ["--steps=1"]).steps == 1  # fancy_start does not apply: not checked


def test_a_setting_that_applies_must_agree_with_the_others():
    with pytest.raises(ConfigError, match=re.escape("fancy_start=2: the run ends at steps=2")):
        settings_lib.parse_args(Settings, ["--mode=fancy", "--steps=2"])


def test_without_the_typed_keys_a_setting_counts_as_given_when_it_differs_from_its_default():
    assert config_rules.broken(Settings(fancy_level=1)) is None
    assert config_rules.broken(Settings(fancy_level=3)) == "--fancy_level applies only with --mode=fancy (it is plain)"
    assert config_rules.broken(Settings(fancy_level=1), given={"fancy_level"}) is not None


def test_a_resume_checks_the_rules_once_the_checkpoints_settings_are_merged():
    """Before the merge, `mode` is the default, not the checkpoint's: the rules wait for `resume.settings`."""
    cfg = settings_lib.parse_args(Settings, ["--init_from=resume", "--fancy_level=3"])
    assert resume.settings(cfg, {"fancy_level"}, {"mode": "fancy"}, fixed=()).fancy_level == 3
    with pytest.raises(SystemExit, match=re.escape("--fancy_level applies only with --mode=fancy (it is plain)")):
        resume.settings(cfg, {"fancy_level"}, {"mode": "plain"}, fixed=())


# ---------------------------------------------------------------- train.gpt's optimizers, experts, pipeline, profile


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--muon_ns_steps=7"], "--muon_ns_steps applies only with --optimizer=muon (it is adamw)"),
        (["--muon_momentum=0.95"], "--muon_momentum applies only with --optimizer=muon (it is adamw)"),
        (["--optimizer=shampoo", "--muon_rms=0.3"], "--muon_rms applies only with --optimizer=muon (it is shampoo)"),
        (
            ["--optimizer=muon", "--shampoo_start=3"],
            "--shampoo_start applies only with --optimizer=shampoo (it is muon)",
        ),
        (["--shampoo_block_size=64"], "--shampoo_block_size applies only with --optimizer=shampoo (it is adamw)"),
        (["--expert_top_k=1"], "--expert_top_k applies only with --n_experts > 0 (it is 0)"),
        (["--pipeline_schedule=gpipe"], "--pipeline_schedule applies only with --pp > 1 (it is 1)"),
    ],
)
def test_gpt_refuses_a_setting_that_would_be_ignored(argv, message):
    refused(gpt.parse, argv, message)


def test_gpt_takes_the_same_settings_where_they_apply():
    assert gpt.parse(["--optimizer=muon", "--muon_ns_steps=7"]).muon_ns_steps == 7
    assert gpt.parse(["--n_experts=4", "--expert_top_k=1"]).expert_top_k == 1
    help_text = settings_lib.help_text(gpt.GPTSettings)
    assert "Newton-Schulz steps per update" in help_text and "only with --optimizer=muon" in help_text


def test_muon_newton_schulz_steps_are_bounded():
    """Each step is unrolled into the compiled update: a million of them compiled for more than 5 minutes."""
    refused(gpt.parse, ["--optimizer=muon", "--muon_ns_steps=1000000"], "muon_ns_steps=1000000: must be >= 1 and <= 50")
    assert gpt.parse(["--optimizer=muon", "--muon_ns_steps=50"]).muon_ns_steps == 50


def test_shampoo_must_start_preconditioning_within_the_run():
    message = "shampoo_start=10: Shampoo preconditions from step shampoo_start on, but the run ends at max_iters=10"
    refused(gpt.parse, ["--optimizer=shampoo", "--max_iters=10"], message)
    assert gpt.parse(["--optimizer=shampoo", "--max_iters=11"]).shampoo_start == 10
    assert gpt.parse(["--max_iters=5"]).max_iters == 5  # AdamW: shampoo_start does not apply


@pytest.mark.parametrize(
    "parse", [gpt.parse, lambda argv: settings_lib.command_line(flow.FlowSettings, argv, prog="f")]
)
def test_a_profile_window_must_end_within_the_run(parse):
    refused(parse, ["--max_iters=100", "--profile=95:101"], "profile='95:101': the run ends at max_iters=100")
    refused(parse, ["--max_iters=100", "--profile=200:210"], "before iteration STOP=210")
    assert parse(["--max_iters=100", "--profile=95:100"]).profile == "95:100"


def test_classify_refuses_a_profile_window_past_its_last_step_before_training(tmp_path, needs_sklearn):
    """train.classify counts epochs: its last step is known once the data is loaded, and checked there."""
    with pytest.raises(SystemExit, match=r"--profile=1:1000: the run ends at step 22 \(1 epochs of 22 steps\)"):
        classify.main(["--epochs=1", "--profile=1:1000", f"--out_dir={tmp_path}", "--progress=false"])
    assert not list(tmp_path.glob("ckpt_*"))


# ---------------------------------------------------------------- the compile cache's directory


@pytest.fixture
def jax_cache_config():
    """Restores JAX's cache directory after a test that enables one."""
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_a_home_that_cannot_be_expanded_is_an_error_when_the_settings_are_read():
    """pathlib raised `RuntimeError: Could not determine home directory` from inside the program."""
    refused(gpt.parse, ["--compile_cache=~purejax-no-such-user/cc"], "compile_cache='~purejax-no-such-user/cc': ")
    refused(gpt.parse, ["--compile_cache=~purejax-no-such-user/cc"], "'~purejax-no-such-user' names no home directory")


def test_a_named_cache_directory_that_cannot_be_written_is_an_error(tmp_path, jax_cache_config):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"^error: --compile_cache=.*file/cc: cannot write in .*file/cc \("):
        compile_cache.enable(str(tmp_path / "file" / "cc"))
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if not os.access(read_only, os.W_OK):  # root writes anywhere: the file above covers that case
        with pytest.raises(SystemExit, match=r"cannot write in .*read-only \(Permission denied\)"):
            compile_cache.enable(str(read_only))


def test_an_automatic_cache_directory_that_cannot_be_written_turns_the_cache_off_with_one_warning(
    tmp_path, monkeypatch, capsys, jax_cache_config
):
    """JAX itself printed a warning at every compilation it could not write (94 lines for a small run)."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.enable("auto") is None
    assert jax.config.jax_compilation_cache_dir is None
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the compile cache is off: "), lines


# ---------------------------------------------------------------- the fine-tune's rank and merge directory

BASE = gpt_model.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32, bias=True)


def test_a_lora_rank_above_the_narrowest_adapted_width_is_refused():
    """A rank of 100000 on a 64-wide base wrote a 716 MB adapter file; A @ B has rank at most min(d_in, d_out)."""
    base = models.Base(gpt_model.init(jax.random.key(0), BASE), BASE, "gpt2")
    with pytest.raises(SystemExit, match=re.escape("--lora_rank=33 exceeds the width of blocks.attn.qkv.w (32 x 96)")):
        models.check_settings(FinetuneSettings(lora_rank=33), base)
    models.check_settings(FinetuneSettings(lora_rank=32), base)
    with pytest.raises(SystemExit, match=re.escape("blocks.mlp.proj.w (128 x 32)")):  # the narrow side is d_out
        models.check_settings(FinetuneSettings(lora_rank=33, lora_targets="blocks.mlp.proj.w"), base)


def test_the_merge_directory_is_checked_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for directory, message in [
        (tmp_path / "file", "is a file"),
        (tmp_path / "model", "already holds config.json"),
        (tmp_path / "file" / "merged", "cannot be written (Not a directory)"),
    ]:
        with pytest.raises(SystemExit) as e:
            models.check_merge_into(str(directory))
        assert str(e.value).startswith(f"error: --merge_into='{directory}'") and message in str(e.value), e.value
    models.check_merge_into(str(tmp_path / "new" / "merged"))  # created now, so it is known to be writable
    assert (tmp_path / "new" / "merged").is_dir() and not any((tmp_path / "new" / "merged").iterdir())
    models.check_merge_into(str(tmp_path / "new" / "merged"))  # empty: as a run stopped before its end left it
    models.check_merge_into("")


def test_the_fine_tunes_table_says_when_each_setting_applies():
    rows = {name: meaning for name, *_, meaning in settings_lib.describe(FinetuneSettings)}
    assert "at most the narrowest side" in rows["lora_rank"] and "new or empty" in rows["merge_into"]
