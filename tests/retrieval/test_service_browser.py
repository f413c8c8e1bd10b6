"""The search page in a real headless Chromium: token, upload through the file input, ranked results, item view.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium``
package; the driver is started from ``/usr/bin/chromedriver`` (or the one on
PATH) through an explicit ``Service``, so selenium-manager never downloads
anything. Skipped, saying what is missing, when any of them is absent.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from test_service import HEIGHT, SITES, T0, TOKEN, build_store, person_image, save_tiny_model, write_png

from fedreid.inference.images import image_features
from fedreid.inference.model_io import load_model
from fedreid.retrieval import service as svc
from fedreid.retrieval.store import GalleryStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE_K = 12  # the page's default k
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name) or (name if Path(name).is_file() else None)
        if found:
            return found
    return None


def _browser_paths() -> tuple[str, str]:
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip(f"selenium is not installed ({INSTALL})")
    driver = _find("/usr/bin/chromedriver", "chromedriver")
    browser = _find("/usr/bin/chromium", "chromium", "chromium-browser")
    if driver is None or browser is None:
        missing = ", ".join(n for n, p in (("chromedriver", driver), ("chromium", browser)) if p is None)
        pytest.skip(f"{missing} not found ({INSTALL})")
    return driver, browser


@pytest.fixture(scope="module")
def chrome():
    driver_path, browser_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    loaded = load_model(save_tiny_model(root / "run"), "cpu")
    paths, rows = [], []
    for identity in range(10):
        for camera in range(2):
            p = write_png(root / "gallery" / f"{identity:04d}_c{camera + 1}.png", person_image(identity, camera, 0))
            paths.append(p)
            rows.append({"path": str(p), "camera": camera, "site": SITES[identity % 3],
                         "timestamp": T0 + 900 * len(rows), "identity": identity})
    build_store(root / "store", loaded, paths, rows)
    # the query: gallery item 6 (identity 3, camera 0) re-encoded as a JPEG with a little noise
    noisy = person_image(3, 0, 0).astype(np.int16) + np.random.default_rng(5).integers(-4, 5, (HEIGHT, HEIGHT // 2, 3))
    query = root / "query" / "query_person.jpg"
    query.parent.mkdir()
    assert cv2.imwrite(str(query), cv2.cvtColor(np.clip(noisy, 0, 255).astype(np.uint8), cv2.COLOR_RGB2BGR),
                       [cv2.IMWRITE_JPEG_QUALITY, 92])
    app = svc.create_app(root / "store", loaded, token=TOKEN)
    with svc.background_server(app) as url:
        yield {"url": url, "loaded": loaded, "store": root / "store", "query": query, "rows": rows}


def _wait(driver, condition, what: str, timeout: float = 20):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition, message=f"timed out waiting for {what}")


def test_page_searches_with_an_uploaded_image(chrome, served):
    from selenium.webdriver.common.by import By

    chrome.get(served["url"] + "/")
    assert chrome.title.startswith("Gallery search")
    chrome.find_element(By.ID, "token").send_keys("a-wrong-token-0123456789")
    chrome.find_element(By.ID, "connect").click()
    _wait(chrome, lambda d: "refused" in d.find_element(By.ID, "message").text, "the refused-token message")

    token = chrome.find_element(By.ID, "token")
    token.clear()
    token.send_keys(TOKEN)
    chrome.find_element(By.ID, "connect").click()
    _wait(chrome, lambda d: "Connected" in d.find_element(By.ID, "status").text, "the connected status")
    assert "20 items" in chrome.find_element(By.ID, "status").text

    chrome.find_element(By.ID, "file").send_keys(str(served["query"]))  # choosing a file starts the search
    _wait(chrome, lambda d: d.find_element(By.ID, "grid").get_attribute("data-ready") == str(PAGE_K),
          "the ranked results and their thumbnails")
    cards = chrome.find_elements(By.CSS_SELECTOR, "#grid .card")
    assert len(cards) == PAGE_K
    scores = [float(c.get_attribute("data-score")) for c in cards]
    assert scores == sorted(scores, reverse=True)
    assert [int(c.get_attribute("data-rank")) for c in cards] == list(range(1, PAGE_K + 1))

    feature = image_features(served["loaded"], [served["query"]]).features
    expected = GalleryStore.open(served["store"]).search(feature, PAGE_K)
    shown_ids = [int(c.get_attribute("data-id")) for c in cards]
    assert shown_ids == expected.ids[0].tolist()
    np.testing.assert_allclose(scores, expected.scores[0], atol=1e-5)
    top = served["rows"][shown_ids[0]]
    assert shown_ids[0] == 6 and top["identity"] == 3 and top["camera"] == 0
    assert f"{scores[0]:.3f}" in cards[0].text and "cam 0" in cards[0].text and "2024-05-01" in cards[0].text
    loaded = chrome.execute_script(
        "return [...document.querySelectorAll('#grid .card img')].map(i => i.complete && i.naturalWidth > 0)")
    assert all(loaded)
    assert "query_person.jpg" in chrome.find_element(By.ID, "results-title").text

    cards[0].find_element(By.TAG_NAME, "button").click()  # the item view: image and metadata
    dialog = chrome.find_element(By.ID, "item-dialog")
    _wait(chrome, lambda d: dialog.get_attribute("open") is not None, "the item dialog")
    meta = chrome.find_element(By.ID, "item-meta").text
    assert Path(top["path"]).name in meta and SITES[3 % 3] in meta
    assert chrome.execute_script("const i = document.getElementById('item-image'); return i.naturalHeight") == HEIGHT
    chrome.find_element(By.ID, "item-close").click()
    _wait(chrome, lambda d: dialog.get_attribute("open") is None, "the dialog to close")

    k = chrome.find_element(By.ID, "k")  # a filtered search from the form
    k.clear()
    k.send_keys("5")
    chrome.find_element(By.ID, "cameras").send_keys("1")
    chrome.find_element(By.ID, "search").click()
    _wait(chrome, lambda d: d.find_element(By.ID, "grid").get_attribute("data-ready") == "5", "the filtered results")
    cams = [served["rows"][int(c.get_attribute("data-id"))]["camera"]
            for c in chrome.find_elements(By.CSS_SELECTOR, "#grid .card")]
    assert cams == [1] * 5
