"""The offline corpus of the TP lesson's tiny GPT: deterministic, printable, tokenised both ways."""

import string

import pytest
import torch

from minidist_course.text import CharTokenizer, load_corpus, stdlib_docstrings


def test_stdlib_corpus_is_deterministic_printable_text():
    a = stdlib_docstrings(max_chars=50_000)
    assert a == stdlib_docstrings(max_chars=50_000) and len(a) == 50_000
    assert set(a) <= set(string.printable) and "\r" not in a and "\t" not in a
    assert "Return" in a and a.count(" ") > 5_000, "it is English prose"


def test_dataset_batches_are_next_character_pairs():
    d = load_corpus(max_chars=20_000)
    assert d.tokenizer.decode(d.tokenizer.encode(d.text[:500])) == d.text[:500]
    assert len(d.train) + len(d.val) == len(d.text)
    x, y = d.batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = d.batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_unknown_character_and_short_split_are_clear_errors():
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("abd")
    d = load_corpus(max_chars=100)
    with pytest.raises(ValueError, match="fewer than block_size"):
        d.batch("val", 1, 64, torch.Generator())


def test_file_and_downloaded_corpus_options(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text("to be or not to be\n" * 20)
    d = load_corpus("file", path=str(src))
    assert d.tokenizer.vocab_size == len(set("to be or not to be\n"))
    cached = tmp_path / "cache" / "copy.txt"
    d2 = load_corpus("url", url=src.as_uri(), path=str(cached))   # file:// keeps the test offline
    assert cached.exists() and d2.text == d.text
    with pytest.raises(RuntimeError, match="needs no network"):
        load_corpus("url", url=(tmp_path / "missing.txt").as_uri(), path=str(tmp_path / "x.txt"))
