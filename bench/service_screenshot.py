"""Screenshot of the search page with results: docs/img/search-page.png.

Builds a synthetic Market-style gallery (fedreid.data.synthetic: drawn
people, six cameras), a small untrained resnet18 (the ranking shows what the
page looks like, not a trained model's accuracy), a gallery store of it, serves
it on 127.0.0.1 (fedreid.retrieval.service.background_server), and drives
Debian's headless Chromium with Selenium: token, query upload, results,
screenshot. Nothing is downloaded (Service(/usr/bin/chromedriver)).

  python bench/service_screenshot.py                      # writes docs/img/search-page.png
  python bench/service_screenshot.py --out /tmp/page.png --dialog   # with an item opened

Needs: apt-get install -y chromium chromium-driver; pip install selenium.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedreid.config import ModelConfig, to_dict
from fedreid.data.synthetic import RELEASE_DIRS, generate_world
from fedreid.inference.images import image_features, parse_market_name
from fedreid.inference.model_io import load_model
from fedreid.models.reid import create_reid_model, shared_state
from fedreid.retrieval import service as svc
from fedreid.retrieval.gallery_rows import GALLERY_ROOTS_KEY, gallery_roots
from fedreid.retrieval.store import GalleryStore

TOKEN = "screenshot-token-0123456789"
SITES = {0: "north gate", 1: "north gate", 2: "plaza", 3: "plaza", 4: "station", 5: "station"}
T0 = 1_714_550_400.0  # 2024-05-01 08:00 UTC


def build(root: Path, id_scale: float, seed: int) -> tuple[Path, Path, object]:
    """A synthetic Market gallery, an untrained resnet18 run and a Flat store; returns (store, query folder, model)."""
    generate_world(root / "raw", datasets=["market1501"], height=128, width=64, id_scale=id_scale, min_ids=12,
                   seed=seed)
    release = root / "raw" / RELEASE_DIRS["market1501"]
    gallery = [p for p in sorted((release / "bounding_box_test").glob("*.jpg")) if parse_market_name(p)[0] > 0]
    run = root / "run"
    run.mkdir()
    torch.manual_seed(seed)
    model = create_reid_model("resnet18", 0, bottleneck_dim=128, seed=seed)
    cfg = ModelConfig(backbone="resnet18", bottleneck_dim=128, height=128, width=64)
    torch.save({"format": "fedreid.model", "model": to_dict(cfg), "mode": "fedpav", "round": 0,
                "state": shared_state(model)}, run / "model_final.pt")
    loaded = load_model(run, "cpu")
    feats = image_features(loaded, gallery, batch_size=64)
    rng = np.random.default_rng(seed)
    rows = []
    for p in gallery:
        pid, cam = parse_market_name(p)
        rows.append({"path": str(p), "camera": cam, "site": SITES.get(cam, "depot"), "identity": pid,
                     "timestamp": float(T0 + int(rng.integers(0, 10 * 3600)))})
    GalleryStore.create(root / "store", feats.features, rows, factory="Flat", model_fingerprint=loaded.fingerprint,
                        meta={"model_fingerprint": loaded.fingerprint, "model": str(run),
                              GALLERY_ROOTS_KEY: gallery_roots([str(Path(r["path"]).resolve()) for r in rows])})
    return root / "store", release / "query", loaded


def screenshot(url: str, query: Path, out: Path, k: int, dialog: bool, width: int, height: int) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    try:
        driver.get(url + "/")
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        driver.find_element(By.ID, "connect").click()
        WebDriverWait(driver, 20).until(lambda d: "Connected" in d.find_element(By.ID, "status").text)
        box = driver.find_element(By.ID, "k")
        box.clear()
        box.send_keys(str(k))
        driver.find_element(By.ID, "file").send_keys(str(query))
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.ID, "grid").get_attribute("data-ready") == str(k))
        if dialog:
            driver.find_elements(By.CSS_SELECTOR, "#grid .card button")[0].click()
            WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "item-dialog").get_attribute("open"))
        driver.execute_script("document.activeElement && document.activeElement.blur()")
        time.sleep(0.3)  # let the thumbnails paint
        out.parent.mkdir(parents=True, exist_ok=True)
        png = driver.get_screenshot_as_png()
    finally:
        driver.quit()
    from PIL import Image

    # 256 colours: a third of the bytes of the full-colour PNG, no visible loss for a screenshot
    shot = Image.open(io.BytesIO(png)).convert("RGB")
    shot.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/img/search-page.png")
    parser.add_argument("--id-scale", type=float, default=0.15, help="synthetic identities (fraction of Market's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--query", type=int, default=3, help="which query image (sorted index)")
    parser.add_argument("--k", type=int, default=12)
    parser.add_argument("--dialog", action="store_true", help="open the top result's item view")
    parser.add_argument("--size", default="1280x1040", help="window WIDTHxHEIGHT")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    width, height = (int(v) for v in args.size.lower().split("x"))
    with tempfile.TemporaryDirectory(prefix="fedreid-shot-") as tmp:
        store, queries, loaded = build(Path(tmp), args.id_scale, args.seed)
        query_files = sorted(p for p in queries.glob("*.jpg") if parse_market_name(p)[0] > 0)
        query = query_files[args.query % len(query_files)]
        named = Path(tmp) / f"query_{query.name}"
        shutil.copy(query, named)
        app = svc.create_app(store, loaded, token=TOKEN)
        with svc.background_server(app) as url:
            screenshot(url, named, Path(args.out), args.k, args.dialog, width, height)
    print(f"wrote {args.out} (query {query.name}, a store of {app.state.service.store.ntotal} items)")


if __name__ == "__main__":
    main()
