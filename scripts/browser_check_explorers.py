"""Real-browser check of notebook 04's explorers: JupyterLab + headless Chromium, a control changed, a redraw seen.

What it does:

1. makes sure the smoke run of notebooks 00, 02 and 03 exists (runs it otherwise: about 2 minutes), and writes
   a copy of ``notebooks/04_query_estimation_error.ipynb`` with the smoke profile's parameters injected by
   papermill (``prepare_only``: nothing is executed) into a fresh folder;
2. starts JupyterLab on 127.0.0.1 with a random token, serving that folder;
3. opens the notebook in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by selenium
   through ``/usr/bin/chromedriver``; fresh profile, no GPU, no background networking), runs every cell, and
   waits for the attention explorer's widget;
4. picks another head in its ``head`` dropdown and waits until the explorer's caption names the new head and
   its figure is redrawn (a new image);
5. saves a screenshot (``--screenshot``, default ``runs/smoke/browser_check_explorers.png``) and stops
   JupyterLab. The exit status is 0 only if every step passed.

Run it (about 2-3 minutes, most of it the notebook itself)::

    apt-get install chromium chromium-driver      # once; and selenium: pip install "selenium>=4.20"
    KVSHOT_CACHE=... python scripts/browser_check_explorers.py
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = "04_query_estimation_error.ipynb"
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
)


def log(msg: str) -> None:
    print(f"[browser-check] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_notebook(folder: Path) -> Path:
    """The smoke run's inputs, and notebook 04 with the smoke parameters injected (not executed)."""
    sys.path.insert(0, str(REPO))
    import papermill

    from kvshot_lib import runner

    results = REPO / "runs" / "smoke" / "results"
    if (
        not (REPO / "runs" / "smoke" / "drafters").is_dir()
        or not (results / "acceptance_by_step.csv").is_file()
    ):
        log("no smoke run of notebooks 02 and 03 yet: running 00, 02, 03 under the smoke profile")
        runner.run_profile("smoke", only=["00", "02", "03"])
    [(nb, params)] = runner.plan_run(runner.load_profile("smoke"), only=["04"])
    params.update(profile="smoke", run_dir=str(REPO / "runs" / "smoke"), figure_dir=str(folder / "figures"))
    out = folder / NOTEBOOK
    papermill.execute_notebook(str(nb), str(out), parameters=params, prepare_only=True, kernel_name="python3")
    return out


def start_lab(folder: Path, port: int, token: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("KVSHOT_STATIC_EXPLORERS", None)
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        f"--ServerApp.token={token}", f"--ServerApp.root_dir={folder}", "--LabApp.expose_app_in_browser=True",
        "--allow-root",  # containers often run as root; JupyterLab refuses root without it
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=open(folder / "jupyterlab.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"JupyterLab did not start on port {port}; see {folder / 'jupyterlab.log'}")


def browser(profile_dir: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile_dir}"):
        opts.add_argument(flag)
    return webdriver.Chrome(
        service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=opts
    )


def wait_for(driver, script: str, timeout: float, what: str, *args):
    """Poll a JavaScript function body (``arguments[i]`` = ``args[i]``) until it returns something truthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = driver.execute_script(script, *args)
        if value:
            return value
        time.sleep(1.0)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


CAPTION_JS = """
const html = [...document.querySelectorAll('.jp-OutputArea .widget-html-content')].map(e => e.innerText);
return html.find(t => t.includes('anchor t=') && t.includes(arguments[0] || '')) || null;
"""
IMAGE_JS = """
const box = [...document.querySelectorAll('.jp-OutputArea .widget-output')]
  .find(o => o.closest('.widget-vbox') && o.closest('.widget-vbox').innerText.includes('anchor t='));
const img = box && box.querySelector('img');
const src = img ? img.src.slice(-200) : null;
return src && src !== arguments[0] ? src : null;
"""
HEAD_SELECT_JS = """
const boxes = [...document.querySelectorAll('.jp-OutputArea .widget-dropdown')];
const head = boxes.find(b => (b.querySelector('label') || {}).innerText === 'head');
return head ? head.querySelector('select') : null;
"""


def check(timeout: float, screenshot: Path) -> float:
    from selenium.webdriver.support.ui import Select

    t0 = time.time()
    folder = Path(tempfile.mkdtemp(prefix="kvshot-browser-check-"))
    lab = None
    driver = None
    try:
        prepare_notebook(folder)
        port, token = free_port(), secrets.token_hex(16)
        lab = start_lab(folder, port, token)
        log(f"JupyterLab on 127.0.0.1:{port}")
        driver = browser(folder / "chromium-profile")
        driver.get(f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK}?token={token}")
        wait_for(
            driver,
            "return window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell');",
            120,
            "the notebook",
        )
        wait_for(
            driver,
            "return !!document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-KernelStatus');",
            60,
            "a kernel",
        )
        time.sleep(3)
        driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
        log("running every cell")
        caption = wait_for(driver, CAPTION_JS, timeout, "the attention explorer's widget", "")
        first_image = wait_for(driver, IMAGE_JS, 60, "the explorer's first figure", None)
        log(f"explorer shown: {caption.splitlines()[0]}")
        select = Select(wait_for(driver, HEAD_SELECT_JS, 30, "the head dropdown"))
        current = select.first_selected_option.get_attribute("value")
        choice = next(o for o in select.options if o.get_attribute("value") != current)
        new_head = choice.text
        select.select_by_visible_text(new_head)
        log(f"head {current!r} -> {new_head!r}")
        wait_for(driver, CAPTION_JS, 60, f"the caption to name head {new_head}", f"head {new_head} ")
        wait_for(driver, IMAGE_JS, 60, "the redrawn figure", first_image)
        log("the explorer redrew after the control changed")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        driver.execute_script(
            "const el = [...document.querySelectorAll('.widget-vbox')].find(v => v.innerText.includes('anchor t='));"
            "el && el.scrollIntoView();"
        )
        time.sleep(1)
        driver.save_screenshot(str(screenshot))
        log(f"screenshot: {screenshot}")
        return time.time() - t0
    finally:
        if driver is not None:
            driver.quit()
        if lab is not None:
            os.killpg(lab.pid, 15)
            lab.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds to wait for the notebook to reach the explorer"
    )
    p.add_argument("--screenshot", type=Path, default=REPO / "runs" / "smoke" / "browser_check_explorers.png")
    args = p.parse_args(argv)
    try:
        seconds = check(args.timeout, args.screenshot)
    except Exception as e:  # noqa: BLE001 - a failed check is a message and a non-zero exit, whatever broke
        print(f"[browser-check] FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log(f"passed in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
