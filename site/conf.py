"""Sphinx configuration of the course's website (staged and run by ``minidist site``)."""

import json
from pathlib import Path

from minidist_course.site import ENTRY_PATH

_here = Path(__file__).parent
_pages = json.loads((_here / "_pages.json").read_text())

project = "minidist"
author = "the minidist authors"
root_doc = "README"
extensions = ["myst_nb", "sphinx-mathjax-offline"]   # MathJax 3 as static files: no CDN
nb_execution_mode = "off"            # the committed outputs, already checked by nbval
nb_output_stderr = "show"
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type"]
if _pages["lang"] != "en":   # the Chinese edition links to English-only pages: they are elsewhere
    suppress_warnings.append("myst.xref_missing")
exclude_patterns = ["_build", "locales", "_templates", "**/.ipynb_checkpoints"]
locale_dirs = ["locales/"]
gettext_compact = False              # one catalog per document
gettext_uuid = False
gettext_location = False
html_theme = "sphinx_book_theme"
html_title = "minidist"
html_favicon = "favicon.svg"
html_static_path = []
templates_path = ["_templates"]
html_sidebars = {"**": ["navbar-logo.html", "language-switch.html", "search-button-field.html",
                        "sbt-sidebar-nav.html"]}
html_theme_options = {"show_navbar_depth": 1, "use_download_button": False,
                      "use_fullscreen_button": False}
html_context = {"edition": _pages["lang"], "zh_pages": list(ENTRY_PATH)}
html_extra_path = []
html_copy_source = False
html_show_sourcelink = False

# The Chinese search index: jieba cuts the text into words; the glossary's terms (site/zh_terms.txt)
# are added to its dictionary so that "数据并行" is one searchable word, not only "数据" and "并行".
html_search_options = {"dict": str(_here / "zh_terms.txt")} if _pages["lang"] != "en" else {}
html_context["default_mode"] = "light"   # the theme logs an error when no mode is set


def setup(app):
    # Sphinx 9.0's Chinese search names its JavaScript stemmer "ChineseStemmer" but ships the
    # English one (EnglishStemmer), so every page's search script fails: name the shipped one.
    from sphinx.search import languages
    from sphinx.search.zh import SearchChinese

    class _SearchChinese(SearchChinese):
        language_name = "English"

    languages["zh"] = _SearchChinese
