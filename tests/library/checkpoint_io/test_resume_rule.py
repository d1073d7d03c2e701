"""The resume and retire rules on listings (minidist.resume_rule) against what checkpoint_io does
with real folders: generations copied from one real save, corrupted by a flipped byte, or cut
short (no manifest), on listings hypothesis draws."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minidist import checkpoint_io as ck
from minidist.resume_rule import choose_generation, generations_to_retire

STATUS = st.sampled_from(["verified", "corrupt", "unfinished"])
LISTINGS = st.dictionaries(st.integers(1, 30), STATUS, max_size=7)


def _tree(listing: dict) -> str:
    """A checkpoint location holding ``listing``'s generations."""
    template = tempfile.mkdtemp()
    ck.save_generation(template, {"m.pt": {"model": {"w": torch.arange(4.0)}}}, where="t",
                       kind="t")
    good = ck.newest(template)
    root = tempfile.mkdtemp()
    for n, status in listing.items():
        folder = os.path.join(root, f"gen-{n:06d}")
        if status == "unfinished":
            os.makedirs(folder)
            continue
        shutil.copytree(good, folder)
        if status == "corrupt":
            with open(os.path.join(folder, "m.pt"), "r+b") as f:
                byte = f.read(1)
                f.seek(0)
                f.write(bytes([byte[0] ^ 0xFF]))
    shutil.rmtree(template)
    return root


def _number(folder: str) -> int:
    return int(os.path.basename(folder).split("-")[1])


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(LISTINGS, st.booleans())
def test_open_generation_picks_what_the_rule_picks(listing, fallback):
    root = _tree(listing)
    try:
        try:
            want = choose_generation([(n, s != "unfinished") for n, s in listing.items()],
                                     fallback=fallback,
                                     verifies=lambda n: listing[n] == "verified")
        except (FileNotFoundError, ValueError) as e:
            with pytest.raises(type(e)):
                ck.open_generation(root, "t", "t", fallback=fallback)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            folder, _ = ck.open_generation(root, "t", "t", fallback=fallback)
        assert _number(folder) == want
    finally:
        shutil.rmtree(root)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(LISTINGS, st.integers(1, 4))
def test_a_save_retires_what_the_rule_retires(listing, keep):
    new = max(listing, default=0) + 1
    listing = {**listing, new: "verified"}
    root = _tree(listing)
    try:
        ck._retire(root, os.path.join(root, f"gen-{new:06d}"), keep)
        left = sorted(n for n, _, _ in ck.generations(root))
        removed = generations_to_retire([(n, s != "unfinished") for n, s in listing.items()], new,
                                        keep, lambda n: listing[n] == "verified")
        assert left == sorted(set(listing) - set(removed))
        assert new in left
        good_left = [n for n in left if listing[n] == "verified"]
        assert len(good_left) == min(keep, sum(s == "verified" for s in listing.values()))
    finally:
        shutil.rmtree(root)


def test_the_rules_on_named_listings():
    assert choose_generation([(3, True), (1, True), (4, False)]) == 3
    assert choose_generation([(1, True), (2, True)], fallback=True, verifies=lambda n: n == 1) == 1
    with pytest.raises(ValueError, match="every complete generation is corrupt"):
        choose_generation([(1, True)], fallback=True, verifies=lambda n: False)
    with pytest.raises(FileNotFoundError, match="no complete generation 2"):
        choose_generation([(1, True), (2, False)], generation=2)
    assert generations_to_retire([(1, True), (2, True), (3, True)], 3, 2) == [1]
    assert generations_to_retire([(1, True), (2, True), (3, True)], 3, 2,
                                 verifies=lambda n: n != 2) == []
