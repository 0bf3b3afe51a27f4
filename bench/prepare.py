"""Preparing a large corpus end to end: wall time, rate and peak memory of `python -m train.data` with a given
BPE, beside nanoGPT's way with tiktoken (the bench extra) on the same text and tokenizer.

    python -m bench.prepare --size_mb 1024

The corpus: the text files under this Python's prefixes (sources, docs, JSON, C headers; UTF-8 ones only,
sorted by path) joined, the whole repeated until it is --size_mb when they are fewer (the distinct megabytes
are printed). The tokenizer: a GPT-2-style BPE of --vocab_size tokens trained by `train_bpe` on the corpus's
first 4 MB, saved as tokenizer.json. The contenders, each a fresh process whose peak resident memory (its own
and its children's) is reported:

    train.data          python -m train.data --input corpus.txt --tokenizer tokenizer.json: the text streamed,
                        encoded by tiktoken given the whole tokens, exact (--encoder tiktoken, the default
                        where it is installed), on every core, written as it comes
    train.data, readable  the same with --encoder readable --workers N: the readable encoder over N processes
    tiktoken, nanoGPT   the same BPE as tiktoken ranks with GPT-2's pattern; the text read a megabyte piece at a
                        time (train.data's cuts), encode_ordinary_batch over 64 pieces at once on every core,
                        each piece's ids appended as uint16 to one file (nanoGPT's prepare.py, without HF datasets)

Both token files are compared id for id. docs/benchmarks.md has the table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from train.data import train_bpe
from train.data.corpus import text_files

TIKTOKEN = """
import os, sys, numpy as np
from bench.tokenize import tiktoken_encoding
from train.data.bpe_bulk import WORD_CUT, cut
from train.data.corpus import read_source
from train.data.tokenizers import load_tokenizer
corpus, tokenizer, out = sys.argv[1:4]
encoding = tiktoken_encoding(load_tokenizer(tokenizer))
pieces = list(cut((text for text, _ in read_source(corpus).chunks()), WORD_CUT))
with open(out, "wb") as f:
    for start in range(0, len(pieces), 64):
        for ids in encoding.encode_ordinary_batch(pieces[start : start + 64], num_threads=os.cpu_count()):
            np.asarray(ids, np.uint16).tofile(f)
"""
DATA = "import sys; from train.data.__main__ import main; main(sys.argv[1:])"
# The peak resident memory of this process (VmHWM: its own, from its exec on) and of its largest child.
PEAK = """
import re, resource
own = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
print("peak_kb", max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
"""


def build_corpus(path: Path, megabytes: int) -> float:
    """Write the corpus to `path`, a file at a time (so this process stays small: a child's peak memory counts
    what its parent held when it started); returns the distinct megabytes it was made of."""
    wanted, written = megabytes * 1_000_000, 0
    with path.open("w", encoding="utf-8") as out:
        for root in sorted({Path(sys.prefix), Path(sys.base_prefix)}):
            for file in text_files(root):
                try:
                    text = file.read_bytes().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                written += out.write(("\n\n" if written else "") + text[: wanted - written])
                if written >= wanted:
                    return written / 1e6
    distinct = written
    with path.open("a", encoding="utf-8") as out, path.open(encoding="utf-8") as again:
        while written < wanted:  # repeat the text from its start until the size is reached
            chunk = again.read(min(1 << 22, wanted - written))
            written += out.write(chunk)
    return distinct / 1e6


def timed(command: list[str]) -> tuple[float, float]:
    """(seconds, peak resident GB) of `command`, a Python program that prints `peak_kb N` last."""
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{command[:3]} failed:\n{result.stderr}")
    seconds = time.perf_counter() - start
    peak_kb = int(result.stdout.split("peak_kb")[-1])
    return seconds, peak_kb / 1e6


def token_ids(directory: Path) -> np.ndarray:
    """A prepared dataset's ids, train then val: the whole corpus's."""
    return np.concatenate([np.fromfile(directory / name, np.uint16) for name in ("train.bin", "val.bin")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size_mb", type=int, default=100)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        distinct = build_corpus(tmp / "corpus.txt", args.size_mb)
        size_bytes = (tmp / "corpus.txt").stat().st_size
        with (tmp / "corpus.txt").open(encoding="utf-8") as f:
            sample = f.read(4_000_000)
        (tmp / "tokenizer.json").write_text(json.dumps(train_bpe(sample, args.vocab_size).to_json()))
        data_args = ["--input", str(tmp / "corpus.txt"), "--tokenizer", str(tmp / "tokenizer.json")]
        ours = {
            name: timed([sys.executable, "-c", f"{DATA}\n{PEAK}", *data_args, "--out_dir", str(tmp / name), *more])
            for name, more in (
                ("train.data", ["--encoder", "tiktoken"]),
                ("train.data, readable", ["--encoder", "readable", "--workers", str(args.workers)]),
            )
        }
        peer_args = [str(tmp / "corpus.txt"), str(tmp / "tokenizer.json"), str(tmp / "tiktoken.bin")]
        theirs = timed([sys.executable, "-c", f"{TIKTOKEN}\n{PEAK}", *peer_args])
        want = np.fromfile(tmp / "tiktoken.bin", np.uint16)
        same = {name: np.array_equal(token_ids(tmp / name), want) for name in ours}
    megabytes = size_bytes / 1e6
    print(
        f"{megabytes:,.0f} MB of text ({distinct:,.0f} MB distinct), a BPE of {args.vocab_size}, {args.workers} workers"
    )
    print("| contender | s | MB/s | peak memory GB | same ids as tiktoken |")
    print("|---|---:|---:|---:|---|")
    for name, (seconds, peak) in {**ours, "tiktoken, nanoGPT": theirs}.items():
        agree = "yes" if same.get(name, True) else "NO"
        print(f"| {name} | {seconds:.0f} | {megabytes / seconds:.2f} | {peak:.2f} | {agree} |")


if __name__ == "__main__":
    main()
