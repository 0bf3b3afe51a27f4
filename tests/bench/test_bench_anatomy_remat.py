"""bench/gpt_anatomy.py's remat section at the tiny config, timed with one sample (the figures are not read): the
setup it builds by label (with biases or without), that every rematerialisation choice starts from the same first
loss as the plain scan, and that the scratch memory it reports falls as the choice saves less (the whole block
recomputed keeps less than the plain scan). The test venv has no flax: the section uses purejax alone."""

import re

import pytest

from bench import gpt_anatomy
from bench.gpt_anatomy_steps import Setup


def test_setup_by_label_has_biases_only_when_the_label_says_so():
    assert not Setup.make("tiny").case.model.bias
    assert Setup.make("tiny-bias").case.model.bias
    assert Setup.make("tiny-bias").case.model.n_layer == Setup.make("tiny").case.model.n_layer


def test_every_config_the_cli_names_builds():
    assert {"tiny", "tiny-bias", "small-b16", "small-b16-bias"} <= set(gpt_anatomy.CONFIGS)
    with pytest.raises(SystemExit):
        gpt_anatomy.main(["--configs", "huge", "--sections", "remat"])


def test_remat_section_reports_one_loss_and_less_scratch_for_less_saved(capsys):
    gpt_anatomy.section_remat(Setup.make("tiny"), repeats=1)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"[\d.]+", cells[3]):
            rows[cells[0]] = (float(cells[3]), cells[4])
    names = ["default (auto)", "scan"] + [f"{layers}, {r}" for layers in ("scan", "loop") for r in gpt_anatomy.REMATS]
    assert list(rows) == names
    assert len({loss for _, loss in rows.values()}) == 1, rows  # rematerialisation does not change the numbers
    scratch = {name: mib for name, (mib, _) in rows.items()}
    assert scratch["scan, block"] < scratch["scan, dots_saveable"] < scratch["scan"], scratch
