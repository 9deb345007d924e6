"""The playground page in headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven
by selenium): type a prompt, pick a decoder, watch the canvas stream, and find the final text equal
to the API's. Skipped, with the reason, where no browser is installed."""

from __future__ import annotations

import shutil

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client", "selenium"):
    pytest.importorskip(_m, reason=f"the playground test needs {_m}: pip install -e '.[test]'")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("no headless browser: install Debian's chromium and chromium-driver (apt-get install chromium "
                "chromium-driver) to run the playground test", allow_module_level=True)

import unmask  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

MODEL = "stories260K-sbd"


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-extensions"):
        opts.add_argument(flag)
    try:
        driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    except Exception as e:  # a broken browser install is an environment problem, not a failure of unmask
        pytest.skip(f"headless chromium did not start: {str(e).splitlines()[0]}")
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _side_by_side(browser, url: str, prompt: str, max_tokens: int, choose) -> dict:
    """Open the playground at ``url``, type ``prompt``, ``choose(browser)`` the options, run it side by side
    with AR and return what the panes show once both are done: text, ar_text, nfe, ar_nfe, spans (the main
    canvas's slots)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    choose(browser)
    n = browser.find_element(By.ID, "max_tokens")
    n.clear()
    n.send_keys(str(max_tokens))
    browser.find_element(By.ID, "compare").click()  # side by side with AR
    browser.find_element(By.ID, "run").click()
    done = "return [document.getElementById('pane-main').dataset.done, document.getElementById('pane-ar').dataset.done]"
    wait.until(lambda d: d.execute_script(done) == ["1", "1"])
    text = {p: browser.execute_script(f"return document.getElementById('text-{p}').textContent") for p in ("main", "ar")}
    nfe = {p: int(browser.find_element(By.ID, f"nfe-{p}").text) for p in ("main", "ar")}
    spans = browser.execute_script("return document.getElementById('canvas-main').children.length")
    return {"text": text["main"], "ar_text": text["ar"], "nfe": nfe["main"], "ar_nfe": nfe["ar"], "spans": spans}


def test_playground_streams_the_canvas_and_ends_with_the_api_text(browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    bundle = unmask.load(MODEL)
    prompt = "The little dog"
    # draft sizing off: with the AR pane running beside it, the sbd request's K would follow the load
    # (same text, other NFE); here the NFE shown must be unmask generate's
    with ServerThread(create_app(bundle, draft_sizes="off")) as s:
        got = _side_by_side(browser, s.url, prompt, 32,
                            lambda b: Select(b.find_element(By.ID, "decoder")).select_by_value("sbd"))
    assert got["text"] == unmask.generate(prompt, bundle, "sbd", max_new_tokens=32).texts[0]
    assert got["ar_text"] == unmask.generate(prompt, bundle, "ar", max_new_tokens=32).texts[0]
    assert got["nfe"] == unmask.generate(prompt, bundle, "sbd", max_new_tokens=32).stats.nfe_per_row[0]
    assert got["spans"] == 32  # the canvas shows every generated slot


def test_playground_runs_lookup_drafts_beside_plain_ar(browser):
    """Issue 51 on a plain causal model: pick the lookup draft source, compare with AR. Under a server whose
    default is lookup, the AR pane used to get lookup too (same NFE); it asks for plain AR now."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    bundle = unmask.load("stories260K")
    prompt = "Once upon a time, there was a cat. The cat was big. The cat was big. The cat was big."
    with ServerThread(create_app(bundle, defaults={"draft_source": "lookup"})) as s:
        got = _side_by_side(browser, s.url, prompt, 48,
                            lambda b: Select(b.find_element(By.ID, "draft_source")).select_by_visible_text("lookup"))
    want = unmask.generate(prompt, bundle, "ar", max_new_tokens=48)
    assert got["text"] == got["ar_text"] == want.texts[0]
    assert got["ar_nfe"] == want.stats.nfe == 48 and got["nfe"] < got["ar_nfe"]  # AR pane plain AR, main pane drafts
