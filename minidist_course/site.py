"""``minidist site``: the course as a static website, built from the notebooks as committed.

Their outputs are already checked by nbval, so nothing is executed: the build stages the README,
the chapters and exercises (in the README's order), ``docs/`` and the glossary into one source
folder, then runs Sphinx with myst-nb (``nb_execution_mode = "off"``) and sphinx-book-theme. Why
Sphinx and not Jupyter Book 2 / mystmd: both render notebooks with MyST, but Sphinx is pure Python
(pip-installable, offline at build time: no Node packages fetched), has an offline search index,
and translates through gettext catalogs (``sphinx-intl``) that never contain the code cells — so a
translated page cannot show other code than the English one.

Offline at view time too: MathJax 3 comes from the ``sphinx-mathjax-offline`` wheel, copied into
the site; the theme's scripts and fonts are its own static files.

Two editions: English (every page) and Chinese (``zh_CN``: the entry path — README, glossary,
chapters 00–04 — from ``site/locales``), each page with a link to the other language. Layout::

    OUT/index.html          -> en/README.html
    OUT/en/...              the English site
    OUT/zh/...              the Chinese entry path

Design notes and the translation workflow: ``site/README.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ROOT", "SITE", "ENTRY_PATH", "pages", "stage", "build", "messages", "update_catalogs",
           "main"]

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
LANGUAGES = {"en": "en", "zh": "zh_CN"}
# the Chinese edition: the pages a newcomer reads first (docnames, without suffix)
ENTRY_PATH = ("README", "glossary", "course/00_why_distributed", "course/01_processes_and_ranks",
              "course/02_collectives", "course/03_ring_allreduce", "course/04_data_parallel")


def _readme_order(readme: str, folder: str) -> list[str]:
    """The notebooks of ``folder`` in the order the README names them (`` `04_data_parallel` ``)."""
    names = [p.stem for p in sorted((ROOT / folder).glob("*.ipynb"))]
    at = {n: readme.find(f"`{n}`") for n in names}
    return sorted(names, key=lambda n: (at[n] < 0, at[n], n))


def pages(lang: str = "en") -> list[str]:
    """The docnames of one edition, in the order of its table of contents."""
    readme = (ROOT / "README.md").read_text()
    everything = (["README", "glossary"] + [f"course/{n}" for n in _readme_order(readme, "course")]
                  + [f"exercises/{n}" for n in _readme_order(readme, "exercises")]
                  + [f"docs/{p.stem}" for p in sorted((ROOT / "docs").glob("*.md"))])
    return everything if lang == "en" else [p for p in everything if p in ENTRY_PATH]


def _toctree(docs: list[str], caption: str) -> str:
    return "\n```{toctree}\n:hidden:\n:caption: " + caption + "\n\n" + "\n".join(docs) + "\n```\n"


def stage(dest: Path, lang: str = "en") -> Path:
    """Copy one edition's sources into ``dest`` (replaced): README as the root document with the
    hidden tables of contents appended, the notebooks as committed, docs/, the glossary, conf.py,
    the catalogs and the templates. Returns ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    docs = pages(lang)
    for doc in docs:
        if doc in ("README", "glossary"):
            continue
        src = next(p for p in (ROOT / f"{doc}.ipynb", ROOT / f"{doc}.md") if p.exists())
        (dest / src.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / src.relative_to(ROOT))
    groups = [("Start", [d for d in docs if d == "glossary"]),
              ("Chapters", [d for d in docs if d.startswith("course/")]),
              ("Exercises", [d for d in docs if d.startswith("exercises/")]),
              ("Reference", [d for d in docs if d.startswith("docs/")])]
    readme = (ROOT / "README.md").read_text()
    (dest / "README.md").write_text(readme + "".join(_toctree(d, c) for c, d in groups if d))
    shutil.copy2(SITE / "glossary.md", dest / "glossary.md")
    for name in ("conf.py", "favicon.svg", "zh_terms.txt", "_templates", "locales"):
        src = SITE / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dest / name)
    (dest / "_pages.json").write_text(json.dumps({"lang": lang, "pages": docs}))
    return dest


def _sphinx(builder: str, src: Path, out: Path, lang: str, quiet: bool = True) -> None:
    cmd = [sys.executable, "-m", "sphinx", "-b", builder, "-W", "--keep-going", "-n",
           "-D", f"language={LANGUAGES[lang]}", str(src), str(out)] + (["-q"] if quiet else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"sphinx-build -b {builder} ({lang}) failed:\n{done.stderr[-6000:]}")


def build(out: Path, work: Path | None = None, langs=("en", "zh")) -> dict:
    """Build the site into ``out`` (replaced). ``work``: where the sources are staged (default
    ``out``'s sibling ``.site-src``). Returns ``{lang: seconds}``. Raises ``RuntimeError`` with
    Sphinx's warnings when a page has a broken cross-reference or a warning of any kind (``-W``)."""
    work = work or out.parent / ".site-src"
    if out.exists():
        shutil.rmtree(out)
    times = {}
    for lang in langs:
        t0 = time.perf_counter()
        src = stage(work / lang, lang)
        _sphinx("html", src, out / lang, lang)
        times[lang] = time.perf_counter() - t0
    (out / "index.html").write_text('<!doctype html><meta charset="utf-8"><title>minidist</title>'
                                    '<meta http-equiv="refresh" content="0; url=en/README.html">'
                                    '<a href="en/README.html">minidist</a>\n')
    return times


def messages(work: Path, lang: str = "zh") -> Path:
    """Extract the translatable messages of one edition (Sphinx's gettext builder) into
    ``work/gettext``; returns that folder (``.pot`` files, one per document)."""
    src = stage(work / f"{lang}-pot", lang)
    _sphinx("gettext", src, work / "gettext", "en")
    return work / "gettext"


def update_catalogs(work: Path) -> Path:
    """Bring ``site/locales/zh_CN`` up to date with the English sources (``sphinx-intl update``):
    new strings appear untranslated, changed ones fuzzy, for a translator to fill in."""
    pot = messages(work)
    subprocess.run([sys.executable, "-m", "sphinx_intl", "update", "-p", str(pot), "-l", "zh_CN",
                    "-d", str(SITE / "locales"), "-w", "0"], check=True, capture_output=True)
    return SITE / "locales" / "zh_CN" / "LC_MESSAGES"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minidist site", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/site", help="output folder (default build/site)")
    p.add_argument("--lang", choices=["en", "zh", "all"], default="all")
    p.add_argument("--update-catalogs", action="store_true",
                   help="update site/locales from the English sources instead of building")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    if a.update_catalogs:
        print(f"catalogs updated: {update_catalogs(out.parent / '.site-src')}")
        return 0
    times = build(out, langs=("en", "zh") if a.lang == "all" else (a.lang,))
    for lang, s in times.items():
        n = len(pages(lang))
        print(f"{lang}: {n} pages in {s:.1f} s -> {out / lang}")
    print(f"open {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

