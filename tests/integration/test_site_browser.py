"""The course's website (``minidist site``), built offline and read in a real browser.

Builds both editions from the committed notebooks into a temporary folder (timed), serves them on
127.0.0.1 and opens every page in headless Chromium (Debian's, installed as
``test_browser_jupyterlab.py`` does): no console error, every image decoded, every math block
typeset by the site's own MathJax (no ``mjx-merror``), no resource loaded from another host.
Every internal link of every page resolves to a file of the site; a folded worked answer opens on
a click; the search page finds a term in both editions; the language switch leads to the same
page in the other edition. Then, without the browser: the Chinese pages show exactly the English
pages' code cells. Screenshots of two pages go to ``$MINIDIST_BROWSER_SHOTS`` (default
``/tmp/minidist-browser``).
"""

from __future__ import annotations

import functools
import http.server
import re
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from minidist_course import site
from test_browser_jupyterlab import (CHROMIUM, DRIVER, SCREENSHOT_DIR, _install_browser, _selenium,
                                     _which, _why_not)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "out"
    t0 = time.perf_counter()
    times = site.build(out)
    print(f"site built in {time.perf_counter() - t0:.1f} s: {times}")
    return out


@pytest.fixture(scope="module")
def browser(built, tmp_path_factory):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    _install_browser()
    webdriver = _selenium()
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(built)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    opts = webdriver.ChromeOptions()
    opts.binary_location = _which(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-dev-shm-usage", "--window-size=1300,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('profile')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    import shutil
    driver = webdriver.Chrome(options=opts,
                              service=webdriver.ChromeService(executable_path=shutil.which(DRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        driver.quit()
        server.shutdown()


def _html_pages(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*.html") if "_static" not in p.parts)


def _open(driver, url: str) -> None:
    driver.get(url)
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState")
                                    == "complete")
    if driver.execute_script("return document.querySelector('div.math, span.math') !== null"):
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(   # MathJax 3 typeset them
            "return document.querySelectorAll('span.math, div.math').length === "
            "document.querySelectorAll('span.math mjx-container, div.math mjx-container').length"))


def test_every_page_loads_clean(built, browser):
    driver, base = browser
    problems = []
    for page in _html_pages(built):
        rel = page.relative_to(built).as_posix()
        _open(driver, f"{base}/{rel}")
        errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        broken = driver.execute_script(
            "return [...document.images].filter(i => !i.complete || i.naturalWidth === 0)"
            ".map(i => i.src.slice(0, 80))")
        bad_math = driver.execute_script("return document.querySelectorAll('mjx-merror').length")
        foreign = driver.execute_script(
            "return performance.getEntriesByType('resource').map(r => r.name)"
            ".filter(n => !n.startsWith(location.origin) && !n.startsWith('data:'))")
        for what, found in (("console error", errors), ("broken image", broken),
                            ("math error", [bad_math] if bad_math else []),
                            ("resource from another host", foreign)):
            problems += [f"{rel}: {what}: {x}" for x in found]
    assert not problems, "\n".join(problems[:40])


def test_every_internal_link_resolves(built):
    missing = []
    for page in _html_pages(built):
        for href in re.findall(r'(?:href|src)="([^"]+)"', page.read_text()):
            url = urlparse(href)
            if url.scheme or href.startswith(("#", "mailto:")):
                continue
            target = (page.parent / unquote(url.path)).resolve()
            if url.path and not target.exists():
                missing.append(f"{page.relative_to(built)} -> {href}")
    assert not missing, "\n".join(missing[:40])


def test_a_folded_answer_opens_on_click(browser):
    driver, base = browser
    _open(driver, f"{base}/en/course/00_why_distributed.html")
    details = driver.find_elements("css selector", "details")
    assert details, "chapter 00 shows no folded answer"
    assert details[0].get_attribute("open") is None
    summary = details[0].find_element("css selector", "summary")
    driver.execute_script("arguments[0].scrollIntoView()", summary)
    summary.click()
    assert details[0].get_attribute("open") is not None
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(SCREENSHOT_DIR / "site-en-00-answer-open.png"))


@pytest.mark.parametrize("lang,term", [("en", "reduce-scatter"), ("zh", "数据并行")])
def test_search_finds_a_term(browser, lang, term):
    driver, base = browser
    _open(driver, f"{base}/{lang}/search.html?q={term}")
    from selenium.webdriver.support.ui import WebDriverWait
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(
        "return document.querySelectorAll('#search-results li, ul.search li').length") > 0)
    if lang == "zh":
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        _open(driver, f"{base}/zh/glossary.html")
        driver.save_screenshot(str(SCREENSHOT_DIR / "site-zh-glossary.png"))


def test_the_language_switch_leads_to_the_same_page(browser):
    driver, base = browser
    _open(driver, f"{base}/en/course/02_collectives.html")
    driver.find_element("id", "language-switch").click()
    assert driver.current_url.endswith("/zh/course/02_collectives.html"), driver.current_url
    driver.find_element("id", "language-switch").click()
    assert driver.current_url.endswith("/en/course/02_collectives.html"), driver.current_url


def _code_cells(page: Path) -> list[str]:
    html = page.read_text()
    cells = re.findall(r'<div class="cell_input[^"]*".*?<pre>(.*?)</pre>', html, re.S)
    return [re.sub(r"<[^>]+>", "", c) for c in cells]


def test_the_chinese_pages_show_the_english_code(built):
    for doc in site.ENTRY_PATH:
        en, zh = built / "en" / f"{doc}.html", built / "zh" / f"{doc}.html"
        assert zh.exists(), f"no Chinese page for {doc}"
        assert _code_cells(zh) == _code_cells(en), f"{doc}: the code cells differ"
        if doc.startswith("course/"):
            assert _code_cells(en), f"{doc}: no code cell found (the page layout changed?)"
