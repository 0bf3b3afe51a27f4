"""Training a byte-level BPE (GPT-2 style) on a corpus: count adjacent pairs, merge the most frequent, repeat.

1. Cut the text into words with GPT-2's pattern and count each distinct word (`bpe_split.split_words`).
2. The vocabulary starts as the special tokens, then the 256 byte characters of GPT-2's alphabet in code-point
   order (so every text can be encoded, whatever the corpus held).
3. Count every adjacent pair of tokens in the words, each occurrence weighted by its word's count.
4. Merge the most frequent pair into a new token, in every word that holds it, and update the counts of the
   pairs around it; repeat until the vocabulary has `vocab_size` tokens or no pair is left.

Ties: among pairs of equal count the one whose (left id, right id) is smallest wins. This is Hugging Face's
`BpeTrainer` rule, and with the same ids (special tokens first, then the alphabet in code-point order, then
merges in order) the merges are the same as its (tests/train/data/test_bpe_train.py compares them).

Only the words holding the merged pair are touched at each step (`where` indexes them), and the largest count
is kept in a heap whose stale entries are checked when they come out: after the first count, a pair's count
only falls, except the pairs that hold the newly merged token, which are pushed afresh.
"""

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable

from train.data.bpe import BPETokenizer
from train.data.bpe_split import bytes_to_unicode, split_words


def merge_pair(symbols: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """`symbols` with each occurrence of `pair`, left to right, replaced by `new_id`."""
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            merged.append(new_id)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def train_bpe(
    text: str | Iterable[str], vocab_size: int, special_tokens: tuple[str, ...] = ("<|endoftext|>",)
) -> BPETokenizer:
    """A GPT-2-style byte-level BPE of at most `vocab_size` tokens (fewer if the text runs out of pairs) learned
    from `text`, or from its pieces cut between words (`bpe_bulk.cut`: a corpus read as a stream), with
    `special_tokens` first (ids 0, 1...)."""
    alphabet = bytes_to_unicode()
    tokens = [*special_tokens, *sorted(alphabet.values())]
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"special_tokens {special_tokens!r} repeat a token or a byte character")
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(tokens)} special and byte tokens it must hold")
    id_of = {token: i for i, token in enumerate(tokens)}
    counts: Counter = Counter()
    for piece in [text] if isinstance(text, str) else text:
        counts.update(split_words(piece, "gpt2"))
    words = [[id_of[alphabet[byte]] for byte in word.encode("utf-8")] for word in counts]
    weights = list(counts.values())
    pair_counts: Counter = Counter()
    where = defaultdict(set)  # pair -> indices of the words that hold it (or held it once)
    for index, symbols in enumerate(words):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += weights[index]
            where[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    while len(id_of) < vocab_size and heap:
        negative_count, pair = heapq.heappop(heap)
        if -negative_count != pair_counts[pair]:  # stale: put it back with its count now
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], pair))
            continue
        new_token = tokens[pair[0]] + tokens[pair[1]]
        if new_token not in id_of:  # two merges can spell the same token ("a"+"bc", "ab"+"c"): one id
            id_of[new_token] = len(tokens)
            tokens.append(new_token)
        new_id = id_of[new_token]
        merges.append((tokens[pair[0]], tokens[pair[1]]))
        fresh = set()
        for index in where.pop(pair):
            merged = merge_pair(words[index], pair, new_id)
            for old in zip(words[index], words[index][1:]):
                pair_counts[old] -= weights[index]
            for new in zip(merged, merged[1:]):
                pair_counts[new] += weights[index]
                where[new].add(index)
                if new_id in new:
                    fresh.add(new)
            words[index] = merged
        for new in sorted(fresh):
            heapq.heappush(heap, (-pair_counts[new], new))
    specials = {token: id_of[token] for token in special_tokens}
    return BPETokenizer(vocab=id_of, merges=tuple(merges), special_tokens=specials, style="gpt2")
