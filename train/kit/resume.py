"""`--init_from=resume` for every training program: the checkpoint's settings with the overrides given now,
the state restored into a template that `jax.eval_shape` describes (no random init computed and thrown away),
and a fingerprint of the data it was trained on, checked against the data found now.

    saved = resume.saved_config(manager, program="train.flow")
    settings = resume.settings(settings, settings_lib.explicit_keys(argv), saved["train"], fixed=MODEL_KEYS)
    resume.check_data(saved, resume.array_fingerprint(images=data.train_images), "the digits")
    state, info = resume.restore(manager, lambda: optim.init_train_state(dit.init(key, model), ...))

Every way this can fail (no checkpoint, one written by another program or without settings, data that
differ, a state of another shape) is a one-line `SystemExit` naming the file and what differs.
"""

import dataclasses
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from purejax import checkpoint
from purejax import tree as tree_lib
from train.kit import settings as settings_lib
from train.kit.observe import RunSettings

PyTree = Any


def saved_config(manager: checkpoint.CheckpointManager, program: str, parts: Iterable[str] = ("train",)) -> dict:
    """The `config` stored in the newest readable checkpoint of `manager`, checked to come from `program`
    and to hold each of `parts` (e.g. "train", the settings, and "model") as a dict."""
    step = manager.latest_step()
    if step is None:
        raise SystemExit(f"error: --init_from=resume, but {str(manager.directory)!r} has no readable checkpoint")
    path = manager.path(step)
    config = checkpoint.read_metadata(path).config
    missing = [p for p in parts if not (isinstance(config, dict) and isinstance(config.get(p), dict))]
    if missing:
        held = sorted(config) if isinstance(config, dict) else type(config).__name__
        raise SystemExit(
            f"error: cannot resume from {path}: its config ({held}) lacks the {missing} settings that "
            f"{program} writes; resume a {program} out_dir, or start a new run"
        )
    if config.get("program", program) != program:
        raise SystemExit(f"error: cannot resume from {path}: it was written by {config['program']}, not {program}")
    return config


def settings(current: Any, given: Iterable[str], saved: dict[str, Any], fixed: Iterable[str]) -> Any:
    """The resumed run's settings: `saved` (the checkpoint's), then those of `current` named in `given` (the
    overrides given now, e.g. a longer --max_iters). An override of a key in `fixed` (the model, the data,
    what a step means) that differs from the checkpoint is refused, naming every such key: a checkpoint cannot
    continue as another architecture or on other data. Saved keys this version no longer has are dropped;
    keys it has that the checkpoint lacks take their defaults. How the run is watched (`observe.RunSettings`:
    the compile cache, a profile, the loggers) is this launch's, never the checkpoint's."""
    names = {f.name for f in dataclasses.fields(current)}
    given = {*given, *(f.name for f in dataclasses.fields(RunSettings))} & names
    conflicts = [
        f"{k}: checkpoint has {saved[k]!r}, override says {getattr(current, k)!r}"
        for k in fixed
        if k in given and k in saved and saved[k] != getattr(current, k)
    ]
    if conflicts:
        listed = "\n  ".join(conflicts)
        raise SystemExit(f"error: the overrides conflict with the checkpoint being resumed:\n  {listed}")
    values = {**saved, **{k: getattr(current, k) for k in given}, "init_from": "resume", "out_dir": current.out_dir}
    try:
        return settings_lib.build(type(current), {k: v for k, v in values.items() if k in names})
    except settings_lib.ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def restore(
    manager: checkpoint.CheckpointManager, new_state: Callable[[], PyTree], place: Callable | None = None
) -> checkpoint.Restored:
    """The newest checkpoint (the one `saved_config` read the settings from), restored into the shapes and
    dtypes of `new_state()`, which is only traced (`jax.eval_shape`): nothing is initialised. `place(template)`
    may add shardings to the template (`jax.ShapeDtypeStruct(..., sharding=...)`), so each device reads only
    its slice. A damaged newest checkpoint is an error, not a silent fall-back to an older one whose settings
    would differ from those already read."""
    template = jax.eval_shape(new_state)
    if place is not None:
        template = place(template)
    step = manager.latest_step()
    try:
        restored = None if step is None else manager.restore(like=template, step=step)
    except tree_lib.TreeMismatchError as e:
        raise SystemExit(f"error: cannot resume from {manager.directory}: {e}") from None
    except checkpoint.CheckpointError as e:
        hint = f"to continue from an older checkpoint, move {manager.path(step).name} out of the directory"
        raise SystemExit(f"error: cannot resume from {manager.directory}: {e}\n({hint})") from None
    if restored is None:
        raise SystemExit(f"error: --init_from=resume, but {str(manager.directory)!r} has no checkpoint")
    return restored


def check_data(saved: dict | None, current: dict, what: str, say: Callable[[str], None] = print) -> None:
    """Refuse (SystemExit) to resume on data whose fingerprint differs from the one the checkpoint's config
    recorded (`saved["data"]`), naming every part that differs; `what` names the data in the message. A
    checkpoint that recorded none (written before fingerprints) gets a warning through `say`. Nothing to
    check when not resuming (`saved` None)."""
    recorded = None if saved is None else saved.get("data")
    if recorded is None:
        if saved is not None:
            say(f"warning: the checkpoint records no fingerprint of its data, so {what} is not checked")
        return
    differences = [
        f"{k}: the checkpoint was trained on {_describe(recorded.get(k))}, {what} has {_describe(current.get(k))}"
        for k in sorted(recorded.keys() | current.keys())
        if recorded.get(k) != current.get(k)
    ]
    if differences:
        raise SystemExit(
            f"error: {what} is not the data the checkpoint was trained on:\n  "
            + "\n  ".join(differences)
            + "\nresume on the same data (prepared from the same text by the same Python version), or start a new "
            "run in another --out_dir"
        )


def _describe(part: Any) -> str:
    if isinstance(part, dict):
        return ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in part.items())
    return "nothing" if part is None else str(part)


def array_fingerprint(**arrays: np.ndarray) -> dict[str, dict[str, Any]]:
    """Each array's shape, dtype and the CRC-32 of its bytes."""

    def one(a: np.ndarray) -> dict[str, str]:
        crc = zlib.crc32(np.ascontiguousarray(a).data)
        return {"shape": "x".join(map(str, a.shape)), "dtype": str(a.dtype), "crc32": f"{crc:08x}"}

    return {name: one(a) for name, a in arrays.items()}
