"""Text datasets for language models: a corpus in, token files out, batches drawn reproducibly.

    python -m train.data                          # the built-in corpus into data/stdlib/
    python -m train.data --input poems/ --tokenizer byte --out_dir data/poems

The pieces, in the order data flows through them (one file each):

- `corpus`: read a text file or directory, or build the default corpus from Python's own documentation
  and source (no download);
- `tokenizers`: character-level and byte-level tokenizers, saved as JSON;
- `bpe` (with `bpe_split`, `bpe_files`, `bpe_train`, `bpe_bulk`): byte-pair encoding that agrees with GPT-2's,
  Llama's and Hugging Face's files id for id, a trainer, and a corpus encoded in pieces over processes;
- `prepare`: tokenize and write `train.bin`/`val.bin` (uint16, or uint32 past 65,536 ids; 90/10 split),
  `tokenizer.json`, `meta.json`, the text streaming through (with `progress`, a progress line);
- `dataset`: `ensure_dataset` (find or prepare what a training run names) and `open_dataset`;
- `batches`: `get_batch` from (seed, step), and `prefetch` to the device.

See docs/data.md.
"""

from train.data.batches import batches, get_batch, prefetch
from train.data.bpe import BPETokenizer
from train.data.bpe_train import train_bpe
from train.data.corpus import SEPARATOR, STDLIB_MODULES, TEXT_EXTENSIONS, Source, read_source, stdlib_corpus
from train.data.dataset import Dataset, ensure_dataset, fingerprint, open_dataset
from train.data.prepare import prepare, source_sha256, split_point
from train.data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, load_tokenizer, make_tokenizer

__all__ = [
    "SEPARATOR",
    "BPETokenizer",
    "STDLIB_MODULES",
    "TEXT_EXTENSIONS",
    "ByteTokenizer",
    "CharTokenizer",
    "Dataset",
    "Source",
    "Tokenizer",
    "batches",
    "ensure_dataset",
    "fingerprint",
    "get_batch",
    "load_tokenizer",
    "make_tokenizer",
    "open_dataset",
    "prefetch",
    "prepare",
    "read_source",
    "source_sha256",
    "split_point",
    "stdlib_corpus",
    "train_bpe",
]
