"""docs/parallelism.md's table of which parallel modes combine is the one `GPTSettings` enforces: every pair
of modes is built, and a "no" must be refused (before anything compiles) with an error naming a flag of each."""

import re
from pathlib import Path

import pytest

from train.gpt_settings import GPTSettings
from train.kit.settings import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"
MODES = {
    "dp": dict(dp=2),
    "tp": dict(tp=2),
    "fsdp": dict(dp=2, fsdp=True),
    "sp": dict(tp=2, sp=True),
    "cp": dict(cp=2),
    "pp": dict(pp=2),
    "moe": dict(n_experts=4),
    "ep": dict(dp=2, n_experts=4, ep=True),
}
FLAGS = {"dp": "dp", "tp": "tp", "fsdp": "fsdp", "sp": "sp", "cp": "cp", "pp": "pp", "moe": "n_experts", "ep": "ep"}
BASE = dict(n_layer=4, batch_size=8, block_size=16, dtype="float32")


def documented_table() -> dict[tuple[str, str], bool]:
    text = DOC.read_text().split("<!-- composition-table:")[1]
    rows = [line for line in text.splitlines()[1:] if line.startswith("|")]
    columns = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    table = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        mode = re.match(r"\*\*(\w+)\*\*", cells[0]).group(1)
        table.update({(mode, column): cell == "yes" for column, cell in zip(columns, cells[1:], strict=True)})
    return table


def test_the_table_covers_every_pair_of_modes_and_is_symmetric():
    table = documented_table()
    assert set(table) == {(a, b) for a in MODES for b in MODES}
    assert all(table[a, b] == table[b, a] for a, b in table)


@pytest.mark.parametrize("pair", sorted(documented_table().items()), ids=lambda item: "x".join(item[0]))
def test_train_config_accepts_exactly_the_documented_pairs(pair):
    (a, b), supported = pair
    settings = {**BASE, **MODES[a], **MODES[b]}
    if supported:
        GPTSettings(**settings)
        return
    with pytest.raises(ConfigError) as refused:
        GPTSettings(**settings)
    message = str(refused.value)
    assert f"--{FLAGS[a]}" in message or FLAGS[a] in message, message
    assert f"--{FLAGS[b]}" in message or FLAGS[b] in message, message
