"""Write a real Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`) with megatron-core's own builder
(`megatron_hdp.megatron.datasets.sources.write_indexed_dataset`).

Inputs: a seeded synthetic corpus (the demo's and the tests'), text files or JSONL, or token files.

    python -m megatron_hdp.harness.build_dataset --out data/corpus --synthetic lognormal --num-docs 2000 --vocab 512
    python -m megatron_hdp.harness.build_dataset --out data/byted --synthetic byted --num-docs 5000 --max-length 65536
    python -m megatron_hdp.harness.build_dataset --out data/text --text notes.txt README.md
    python -m megatron_hdp.harness.build_dataset --out data/web --jsonl pages.jsonl
    python -m megatron_hdp.harness.build_dataset --out data/tok --tokens ids.txt doc.npy

Text is tokenized byte-level (token = UTF-8 byte, vocabulary 256): enough for demos and tests, not a
real tokenizer — for real data use Megatron's `tools/preprocess_data.py`, whose output this project
reads unchanged. A text file is one document; a JSONL line's "text" field is one document; a token
`.npy` file is one document, and each line of whitespace-separated integers in any other file is one.

The synthetic corpus has a long-tailed length distribution: `lognormal` (median --median-length, plus 1%
of documents of max_length/4..max_length; the demo's) or ByteScale's `byted` / `github` mixes
(`megatron_hdp.plan.lengths`, documents longer than --max-length cut to it, as a context limit would);
and learnable content: document d counts up from a random token in a
random stride of 1-3 (mod the vocabulary), so a model must read its context to predict the stride.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from megatron_hdp.megatron.datasets.sources import indexed_dataset_exists, write_indexed_dataset
from megatron_hdp.plan.lengths import SYNTHETIC as SYNTHETIC_MIXES
from megatron_hdp.plan.lengths import synthetic_lengths as mix_lengths

BYTE_VOCAB = 256
DISTRIBUTIONS = ("lognormal", *SYNTHETIC_MIXES)


def synthetic_lengths(
    num_docs: int, *, seed: int, distribution: str = "lognormal", median: int = 256, sigma: float = 1.2,
    long_fraction: float = 0.01, max_length: int = 16384,
) -> np.ndarray:
    """Raw token counts of a long-tailed corpus, every count in [2, max_length].

    `lognormal`: lognormal around `median`, plus `long_fraction` of documents drawn uniformly from
    [max_length / 4, max_length]. `byted` / `github`: ByteScale's published mixes, cut at `max_length`.
    """
    if num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if distribution in SYNTHETIC_MIXES:
        lengths = mix_lengths(distribution, num_sequences=num_docs, seed=seed)
    elif distribution == "lognormal":
        rng = np.random.default_rng(seed)
        lengths = rng.lognormal(np.log(median), sigma, num_docs)
        long = rng.random(num_docs) < long_fraction
        lengths[long] = rng.uniform(max_length / 4, max_length, int(long.sum()))
    else:
        raise ValueError(f"unknown distribution {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")
    return np.clip(lengths.astype(np.int64), 2, max_length)


def synthetic_documents(lengths: np.ndarray, *, vocab_size: int, seed: int) -> Iterator[np.ndarray]:
    """Counting documents (random start, stride 1-3, mod vocab_size) of the given raw lengths."""
    rng = np.random.default_rng((seed, 1))
    starts = rng.integers(0, vocab_size, lengths.size)
    strides = rng.integers(1, 4, lengths.size)
    for length, start, stride in zip(lengths, starts, strides):
        yield (start + stride * np.arange(length, dtype=np.int64)) % vocab_size


def text_documents(paths: Sequence[str | Path]) -> Iterator[np.ndarray]:
    """One byte-level document per text file."""
    for path in paths:
        yield np.frombuffer(Path(path).read_bytes(), dtype=np.uint8).astype(np.int64)


def jsonl_documents(paths: Sequence[str | Path], *, key: str = "text") -> Iterator[np.ndarray]:
    """One byte-level document per JSONL line (its `key` field)."""
    for path in paths:
        with open(path, encoding="utf-8") as stream:
            for number, line in enumerate(stream, 1):
                if line.strip():
                    try:
                        text = json.loads(line)[key]
                    except (json.JSONDecodeError, KeyError) as error:
                        raise ValueError(f"{path}:{number}: not a JSON object with a {key!r} field ({error})") from None
                    yield np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def token_documents(paths: Sequence[str | Path]) -> Iterator[np.ndarray]:
    """Documents of token ids: a `.npy` file is one, every non-empty line of another file is one."""
    for path in paths:
        if str(path).endswith(".npy"):
            yield np.load(path).astype(np.int64).reshape(-1)
            continue
        with open(path, encoding="utf-8") as stream:
            for line in stream:
                if line.strip():
                    yield np.array(line.split(), dtype=np.int64)


def build_demo_dataset(
    directory: str | Path, *, num_docs: int = 512, vocab_size: int = 256, seed: int = 1234, max_length: int = 2048
) -> str:
    """Write the demo's synthetic corpus under `directory` (skipped when already there); return its prefix."""
    prefix = str(Path(directory) / f"hdp_demo_{num_docs}docs_v{vocab_size}_s{seed}_max{max_length}")
    if indexed_dataset_exists(prefix):
        return prefix
    lengths = synthetic_lengths(num_docs, seed=seed, median=max(2, max_length // 16), max_length=max_length)
    write_indexed_dataset(prefix, synthetic_documents(lengths, vocab_size=vocab_size, seed=seed), vocab_size=vocab_size)
    return prefix


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output prefix: writes OUT.bin and OUT.idx")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", choices=DISTRIBUTIONS, help="a seeded long-tailed synthetic corpus")
    source.add_argument("--text", nargs="+", metavar="FILE", help="text files, one document each (byte-level)")
    source.add_argument("--jsonl", nargs="+", metavar="FILE", help="JSONL files, one document per line's 'text'")
    source.add_argument("--tokens", nargs="+", metavar="FILE", help=".npy files or lines of integer token ids")
    parser.add_argument("--num-docs", type=int, default=10000, help="synthetic: documents")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (synthetic default 32000; text 256)")
    parser.add_argument("--median-length", type=int, default=256, help="synthetic lognormal: median raw length")
    parser.add_argument("--max-length", type=int, default=16384, help="synthetic: longest raw document")
    parser.add_argument("--seed", type=int, default=1234, help="synthetic: random seed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.synthetic:
        vocab = args.vocab or 32000
        lengths = synthetic_lengths(args.num_docs, seed=args.seed, distribution=args.synthetic,
                                    median=args.median_length, max_length=args.max_length)
        documents = synthetic_documents(lengths, vocab_size=vocab, seed=args.seed)
    elif args.tokens:
        if args.vocab is None:
            parser.error("--tokens needs --vocab (the tokenizer's vocabulary size)")
        vocab, documents = args.vocab, token_documents(args.tokens)
    else:
        vocab = args.vocab or BYTE_VOCAB
        documents = text_documents(args.text) if args.text else jsonl_documents(args.jsonl)
    num_docs, num_tokens = write_indexed_dataset(args.out, documents, vocab_size=vocab)
    print(f"{args.out}.bin/.idx: {num_docs} documents, {num_tokens} tokens, vocabulary {vocab}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
