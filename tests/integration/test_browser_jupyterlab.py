"""The course in JupyterLab, in a real browser (issue 14).

nbval runs the notebooks on a kernel, but a learner runs them in JupyterLab. This test starts
JupyterLab on 127.0.0.1 (token auth on) in a temporary copy of the course, opens
``01_processes_and_ranks.ipynb`` in headless Chromium driven by Selenium, runs all cells from the
Run menu, waits for the kernel to go idle, and checks that no cell shows an error and that the
per-rank output of ``minidist.run`` (``[rank N] ...``) appears in the page. It saves a screenshot.
It then runs a cell whose ranks deadlock (a short ``minidist.run`` timeout), checks that the timeout
message appears in that cell, shuts the kernel down and checks that no process of the job is left.

Set-up: Debian's ``chromium`` and ``chromium-driver`` are installed with apt-get when missing (so a
fresh machine passes; needs root), Selenium comes from the ``test`` extra (installed with pip here
if missing). Skipped, with the reason, when neither the browser nor root + apt-get is available.
Nothing is fetched at run time by the browser or Selenium: the driver path is given explicitly.

Notes on JupyterLab 4: it skips rendering off-screen cells (windowing), so the test turns
windowing off in a fresh settings directory and reads text with ``textContent``; the first-open
"official Jupyter news" notification is switched off there and dismissed if it appears anyway.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COURSE = ROOT / "course"
NOTEBOOK = "01_processes_and_ranks.ipynb"
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = "chromedriver"
SCREENSHOT_DIR = Path(os.environ.get("MINIDIST_BROWSER_SHOTS", "/tmp/minidist-browser"))

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(900)]

DEADLOCK_CELL = '''\
import os, torch, minidist
from minidist.comm import p2p
print("kernel pid", os.getpid())

def blocking_ring(rank, world_size):
    x = torch.ones(4)                       # on gloo a blocking send waits for its recv
    p2p.send(x, (rank + 1) % world_size)    # every rank sends first: nobody receives
    p2p.recv(torch.empty_like(x), (rank - 1) % world_size)

minidist.run(blocking_ring, 2, timeout=5)
'''


def _which(names) -> str | None:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the browser test installs Debian's chromium: Linux only"
    if _which(CHROMIUM) and shutil.which(DRIVER):
        return None
    if os.geteuid() != 0:
        return "chromium/chromedriver are not installed and installing them needs root"
    if not shutil.which("apt-get"):
        return "chromium/chromedriver are not installed and apt-get is not available"
    return None


def _has_cjk_font() -> bool:
    if not shutil.which("fc-list"):   # fontconfig comes with chromium
        return False
    r = subprocess.run(["fc-list", ":lang=zh"], capture_output=True, text=True)
    return r.returncode == 0 and bool(r.stdout.strip())


def _install_browser() -> None:
    """apt-get install Debian's chromium and chromium-driver (update the lists only if needed)."""
    if _which(CHROMIUM) and shutil.which(DRIVER) and _has_cjk_font():
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-q",
           "--no-install-recommends", "chromium", "chromium-driver",
           "fonts-wqy-microhei"]   # CJK glyphs: the site's Chinese pages are read in screenshots
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=300", "update", "-q"], env=env,
                       capture_output=True, text=True, timeout=300)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"apt-get install chromium failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def _selenium():
    try:
        import selenium  # noqa: F401
    except ImportError:  # the test extra lists it; a venv made without it gets it here
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "selenium>=4.10"], check=True,
                       timeout=300)
    from selenium import webdriver
    return webdriver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``marker`` (the server and everything it started)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in env and state != "Z":
            pids.append(int(entry))
    return sorted(pids)


def _settings(user_settings: Path) -> None:
    """Fresh JupyterLab settings: render every cell, no news/update notifications."""
    nb = user_settings / "@jupyterlab" / "notebook-extension"
    nb.mkdir(parents=True)
    (nb / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    ap = user_settings / "@jupyterlab" / "apputils-extension"
    ap.mkdir(parents=True)
    (ap / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = _why_not()
    if reason:
        print(f"SKIP test_browser_jupyterlab: {reason}")
        pytest.skip(reason)
    t0 = time.monotonic()
    _install_browser()
    webdriver = _selenium()
    t_install = time.monotonic() - t0
    tmp = tmp_path_factory.mktemp("lab")
    work = tmp / "course"
    shutil.copytree(COURSE, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(DEADLOCK_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, work / "deadlock.ipynb")
    _settings(tmp / "settings")
    token, port, marker = secrets.token_hex(16), _free_port(), f"MINIDIST_LAB_{secrets.token_hex(6)}"
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "rt"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), PYTHONPATH=str(ROOT),
               **{marker: "1"})
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
           "--ServerApp.port_retries=0", "--ServerApp.terminals_enabled=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp / "lab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{port}"
    driver = None
    try:
        _wait_http(f"{base}/api/status?token={token}", server, tmp / "lab.log")
        t_lab = time.monotonic() - t0 - t_install
        opts = webdriver.ChromeOptions()
        opts.binary_location = _which(CHROMIUM)
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", "--window-size=1400,1000",
                     f"--user-data-dir={tmp / 'chromium-profile'}"):
            opts.add_argument(flag)
        service = webdriver.ChromeService(executable_path=shutil.which(DRIVER))
        driver = webdriver.Chrome(options=opts, service=service)
        driver.set_page_load_timeout(120)
        print(f"browser set-up {t_install:.1f} s, JupyterLab up {t_lab:.1f} s")
        yield {"driver": driver, "base": base, "token": token, "server": server,
               "marker": marker, "tmp": tmp, "work": work}
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()


def _wait_http(url: str, server, logfile: Path, timeout: float = 120) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited with {server.returncode}:\n{logfile.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {timeout} s:\n{logfile.read_text()[-3000:]}")


# --- page helpers -----------------------------------------------------------------------------

# the notebook in the tab that is shown (hidden tabs carry lm-mod-hidden)
_CURRENT = "document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook')"


def _js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def _wait(cond, timeout: float, what: str, driver=None, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    if driver is not None:
        _shot(driver, "timeout")
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _shot(driver, name: str) -> Path:
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOT_DIR / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def _dismiss_popups(driver) -> None:
    """Answer the first-open 'official Jupyter news' notification with 'No', if it is shown."""
    _js(driver, """
        for (const b of document.querySelectorAll('.jp-toast-button, .Toastify__toast button,'
                                                  + ' .jp-Dialog-button')) {
            const t = (b.textContent || '').trim();
            if (t === 'No' || t === 'Dismiss') b.click();
        }""")


def _open(lab, name: str) -> None:
    d = lab["driver"]
    d.get(f"{lab['base']}/lab/tree/{name}?reset&token={lab['token']}")  # reset: only this tab
    _wait(lambda: _js(d, f"const nb = {_CURRENT}; return nb !== null && "
                         "nb.querySelectorAll('.jp-Cell').length > 0"), 120, f"{name} to open", d)
    try:
        _wait(lambda: _kernel_idle(d), 240, "the kernel to start", d)
    except pytest.fail.Exception as e:   # what the server said: the kernel's own start-up errors are there
        log = (lab["tmp"] / "lab.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{e}\nkernels (REST): {_kernels(lab)}\nlab.log (end):\n{log}") from e
    _dismiss_popups(d)


def _kernels(lab) -> str:
    """The server's own list of kernels and their states (``/api/kernels``), for a failure."""
    import urllib.request
    try:
        with urllib.request.urlopen(f"{lab['base']}/api/kernels?token={lab['token']}", timeout=10) as r:
            return r.read().decode()[:1000]
    except OSError as e:
        return f"(not read: {e})"


def _kernel_idle(driver) -> bool:
    """The kernel status in the status bar reads Idle, and no cell prompt shows [*]."""
    return bool(_js(driver, """
        const bar = document.querySelector('.jp-StatusBar-Widget, #jp-main-statusbar');
        const status = bar ? bar.textContent : '';
        const nb = %s;
        const busy = nb === null || [...nb.querySelectorAll('.jp-InputArea-prompt')]
                     .some(p => (p.textContent || '').includes('*'));
        return status.includes('Idle') && !busy;""" % _CURRENT))


def _menu(driver, top: str, item: str) -> None:
    """Click menu ``top`` in the menu bar, then its entry ``item`` (real clicks, as a learner)."""
    from selenium.webdriver.common.by import By
    bar = [e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")
           if e.text.strip() == top]
    assert bar, f"menu {top!r} not in the menu bar"
    bar[0].click()
    deadline = time.monotonic() + 10
    labels = []
    while time.monotonic() < deadline:
        entries = driver.find_elements(By.CSS_SELECTOR, ".lm-Menu-item")
        labels = [(e, e.text.strip().split("\n")[0]) for e in entries if e.is_displayed()]
        hit = [e for e, label in labels if label == item]
        if hit:
            hit[0].click()
            return
        time.sleep(0.3)
    raise AssertionError(f"menu item {top} > {item} not found; shown: {[lb for _, lb in labels]}")


def _cells(driver) -> list[dict]:
    """Every code cell of the current notebook: prompt and output text (textContent)."""
    return _js(driver, """
        const nb = %s;
        if (nb === null) return [];
        return [...nb.querySelectorAll('.jp-CodeCell')].map(c => ({
            prompt: (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
            out: [...c.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent).join('\\n'),
            err: [...c.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
                 .map(o => o.textContent).join('\\n'),
        }));""" % _CURRENT)


def _run_all_and_wait(lab, timeout: float) -> list[dict]:
    d = lab["driver"]
    _menu(d, "Run", "Run All Cells")
    # wait until every code cell has an execution count and the kernel is idle again
    _wait(lambda: any("*" in c["prompt"] for c in _cells(d)) or _all_numbered(d), 30,
          "Run All to start", d)
    _wait(lambda: _kernel_idle(d) and _all_numbered(d), timeout, "every cell to finish", d, poll=1)
    return _cells(d)


def _all_numbered(driver) -> bool:
    cells = _cells(driver)
    return bool(cells) and all(re.search(r"\[\d+\]", c["prompt"]) for c in cells)


def _kernel_ids(lab) -> list[str]:
    import urllib.request
    with urllib.request.urlopen(f"{lab['base']}/api/kernels?token={lab['token']}", timeout=10) as r:
        return [k["id"] for k in json.load(r)]


# --- the tests --------------------------------------------------------------------------------

def test_chapter_01_runs_in_jupyterlab(lab):
    import urllib.error
    import urllib.request
    with pytest.raises(urllib.error.HTTPError) as denied:  # token auth is on
        urllib.request.urlopen(f"{lab['base']}/api/kernels", timeout=10)
    assert denied.value.code == 403
    d = lab["driver"]
    t0 = time.monotonic()
    _open(lab, NOTEBOOK)
    cells = _run_all_and_wait(lab, timeout=420)
    took = time.monotonic() - t0
    shot = _shot(d, "ch01_after_run_all")
    print(f"ch01 ran in JupyterLab in {took:.1f} s; screenshot {shot}")
    errors = [(i, c["err"][-800:]) for i, c in enumerate(cells)
              if "Traceback" in c["err"] or "Error" in c["err"]]
    assert not errors, f"cells show errors: {errors}"
    text = "\n".join(c["out"] for c in cells)
    for r in range(4):
        assert f"[rank {r}] hello from rank {r} of 4" in text, text[:3000]
    assert "✓ four ranks ran and returned their results in rank order" in text
    assert "minidist.run timed out after" in text  # ch01's own deadlock demo, caught in the cell
    # the last code cell (torchrun) ran too
    assert "RESULT rank 1 of 2" in text


def test_deadlocked_cell_reports_the_timeout_and_leaves_no_process(lab):
    d = lab["driver"]
    _open(lab, "deadlock.ipynb")
    before = set(_kernel_ids(lab))
    assert before, "no kernel was started for the notebook"
    cells = _run_all_and_wait(lab, timeout=180)
    shot = _shot(d, "deadlock_cell")
    out = cells[0]["out"]
    print(f"screenshot {shot}")
    assert "RankTimeoutError" in out and "timed out after 5 s" in out, out[-3000:]
    assert re.search(r"rank 0: .*send to rank 1", out) and "(waiting)" in out, out[-3000:]
    # shut every kernel down from the Kernel menu, then nothing of the job may be left
    _menu(d, "Kernel", "Shut Down All Kernels…")
    time.sleep(1)
    _js(d, """for (const b of document.querySelectorAll('.jp-Dialog-button.jp-mod-accept'))
                  b.click();""")
    _wait(lambda: not _kernel_ids(lab), 60, "the kernels to shut down", d)
    server = lab["server"].pid
    _wait(lambda: _marked_pids(lab["marker"]) == [server], 30,
          "every process of the job except the server to exit")
    assert _marked_pids(lab["marker"]) == [server]
