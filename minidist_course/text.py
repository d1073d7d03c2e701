"""A real text corpus that ships offline: the docstrings of Python's standard library.

Every Python installation carries a few megabytes of English prose about programming in its
docstrings, so a character-level language model can train on real text with no download. The
corpus is deterministic for a given Python version: modules in a fixed order, their public
classes and functions sorted by name, whitespace normalised, characters outside printable ASCII
dropped. :func:`download_text` fetches any plain-text URL (e.g. Tiny Shakespeare) as an option.

Used by the tensor-parallel lesson's tiny GPT (``minidist.models.gpt``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import string
import urllib.request
from dataclasses import dataclass

import torch

__all__ = ["STDLIB_MODULES", "stdlib_docstrings", "download_text", "CharTokenizer", "CharDataset",
           "load_corpus"]

STDLIB_MODULES = (
    "abc", "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools", "gettext",
    "heapq", "hashlib", "inspect", "io", "itertools", "json", "logging", "math", "operator",
    "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "socket", "statistics",
    "string", "struct", "subprocess", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)
_ALLOWED = set(string.printable) - set("\r\x0b\x0c\t")


def _clean(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return "".join(c for c in "\n".join(lines) if c in _ALLOWED).strip()


def stdlib_docstrings(modules=STDLIB_MODULES, max_chars: int | None = None) -> str:
    """The docstrings of ``modules`` and of their public classes, functions and methods, joined.

    Deterministic: fixed module order, members sorted by name, duplicates (inherited or aliased
    docstrings) kept once. A module that fails to import raises (the corpus would differ silently).
    """
    seen, parts = set(), []

    def add(obj):
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            parts.append(_clean(doc))

    for name in modules:
        mod = importlib.import_module(name)  # all are in every CPython: a failure is a real error
        add(mod)
        for attr in sorted(vars(mod)):
            obj = vars(mod)[attr]
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                add(obj)
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_") and inspect.isfunction(vars(obj)[meth]):
                        add(vars(obj)[meth])
        if max_chars is not None and sum(map(len, parts)) >= max_chars:
            break
    text = "\n\n".join(p for p in parts if p)
    return text[:max_chars] if max_chars is not None else text


def download_text(url: str, path: str) -> str:
    """Download ``url`` to ``path`` once (optional: everything else works offline) and read it."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            urllib.request.urlretrieve(url, path)
        except OSError as e:
            raise RuntimeError(f"download_text: could not fetch {url} ({e}); use "
                               "load_corpus('stdlib'), which needs no network") from e
    with open(path, encoding="utf-8") as f:
        return f.read()


class CharTokenizer:
    """Characters <-> ids; the vocabulary is the sorted set of characters of the training text."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"CharTokenizer.encode: characters not in the vocabulary: {unknown[:10]}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class CharDataset:
    """Token ids split 90/10 into train/validation; :meth:`batch` draws random windows."""

    text: str
    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor

    def batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator):
        """``(x, y)`` of shape ``[batch_size, block_size]``; y is x shifted by one character."""
        data = self.train if split == "train" else self.val
        if len(data) <= block_size:
            raise ValueError(f"CharDataset.batch: the {split} split has {len(data)} tokens, "
                             f"fewer than block_size + 1 = {block_size + 1}")
        starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
        x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
        return x, y


def load_corpus(source: str = "stdlib", max_chars: int | None = 200_000, path: str | None = None,
                url: str | None = None) -> CharDataset:
    """A character-level dataset: ``"stdlib"`` (offline, default), ``"file"`` (``path``) or
    ``"url"`` (downloaded to ``path`` once)."""
    if source == "stdlib":
        text = stdlib_docstrings(max_chars=max_chars)
    elif source == "file":
        if path is None:
            raise ValueError("load_corpus: source='file' needs path= (the text file to read)")
        with open(path, encoding="utf-8") as f:
            text = f.read()[:max_chars]
    elif source == "url":
        if url is None or path is None:
            raise ValueError("load_corpus: source='url' needs url= and path= (where to keep it)")
        text = download_text(url, path)[:max_chars]
    else:
        raise ValueError(f"load_corpus: source must be 'stdlib', 'file' or 'url', got {source!r}")
    tok = CharTokenizer(text)
    ids = tok.encode(text)
    n = int(0.9 * len(ids))
    return CharDataset(text, tok, ids[:n], ids[n:])
