"""The website's Chinese edition stays in step with the English sources (``minidist site``).

The translations live in gettext catalogs (``site/locales/zh_CN``), one per page of the entry path
(``minidist_course.site.ENTRY_PATH``). The test extracts the English messages of those pages as
they are now (Sphinx's gettext builder, a few seconds) and fails, naming the page and the first
strings, when one has no translation (new), only a fuzzy one (changed since it was translated),
or when a catalog still holds strings the page no longer has. Code cells are never messages, so a
Chinese page cannot show other code; tests/integration/test_site_browser.py compares the built
pages' code cells as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

babel_pofile = pytest.importorskip("babel.messages.pofile")
site = pytest.importorskip("minidist_course.site")
pytest.importorskip("myst_nb")


def _catalog(path: Path):
    with open(path, "rb") as f:
        return babel_pofile.read_po(f)


def test_every_entry_page_is_translated_and_current(tmp_path):
    pot_dir = site.messages(tmp_path)
    po_dir = site.SITE / "locales" / "zh_CN" / "LC_MESSAGES"
    problems = []
    for doc in site.ENTRY_PATH:
        pot, po = pot_dir / f"{doc}.pot", po_dir / f"{doc}.po"
        assert pot.exists(), f"{doc}: no messages extracted (is it still in the README's order?)"
        if not po.exists():
            problems.append(f"{doc}: no catalog {po.relative_to(site.ROOT)}")
            continue
        want = {m.id for m in _catalog(pot) if m.id}
        have = {m.id: m for m in _catalog(po) if m.id}
        untranslated = sorted(i for i in want if i not in have or not have[i].string)
        fuzzy = sorted(i for i in want if i in have and have[i].string and have[i].fuzzy)
        stale = sorted(set(have) - want)
        for what, ids in (("untranslated", untranslated), ("out of date (fuzzy)", fuzzy),
                          ("no longer in the page", stale)):
            if ids:
                problems.append(f"{doc}: {len(ids)} {what}, e.g. {ids[0][:100]!r}")
    assert not problems, ("the Chinese edition is behind the English pages; run `minidist site "
                          "--update-catalogs` and translate:\n" + "\n".join(problems))


def test_the_entry_path_follows_the_readme():
    assert site.pages("zh") == list(site.ENTRY_PATH)
    en = site.pages("en")
    assert en[:2] == ["README", "glossary"] and len(en) > len(site.ENTRY_PATH)
    assert all(p in en for p in site.ENTRY_PATH)
