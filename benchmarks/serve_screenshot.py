"""A screenshot of `aiayn serve`'s page, taken by headless Chromium (docs/serve.png).

    .venv/bin/python benchmarks/serve_screenshot.py RUN_DIR -o docs/serve.png \\
        --sentence "The Lord is my shepherd." --kind cross --layer 3 --head 1

Starts `aiayn serve RUN_DIR` on 127.0.0.1 (``serve_load.start_server``), opens the page in
Debian's Chromium through Selenium (apt-get install chromium chromium-driver), types the
sentence, waits for the translation and the heatmap, picks the map, and saves the page.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import server_options, start_server  # noqa: E402


def headless_chromium(width: int, height: int) -> webdriver.Chrome:
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        raise SystemExit("needs Chromium: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--hide-scrollbars", f"--window-size={width},{height}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("-o", "--output", default="docs/serve.png")
    parser.add_argument("--sentence", default="The Lord is my shepherd.")
    parser.add_argument("--weights", default="best")
    parser.add_argument("--kind", default="cross", choices=["cross", "encoder", "decoder_self"])
    parser.add_argument("--layer", type=int, default=1, help="counted from 1")
    parser.add_argument("--head", default="1", help="counted from 1, or 'mean'")
    parser.add_argument("--width", type=int, default=1000)
    args = parser.parse_args()

    process, url = start_server(server_options(args.run_dir, args.weights))
    driver = headless_chromium(args.width, 1000)
    try:
        driver.get(url + "/")
        wait = WebDriverWait(driver, 120)
        wait.until(lambda d: "parameters" in d.find_element(By.ID, "info").text)
        driver.find_element(By.ID, "source").clear()  # the page starts with its example in it
        driver.find_element(By.ID, "source").send_keys(args.sentence)
        driver.find_element(By.ID, "translate").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done")
                   or d.find_element(By.ID, "error").text)
        if driver.find_element(By.ID, "error").text:
            raise SystemExit(f"the page says: {driver.find_element(By.ID, 'error').text}")
        Select(driver.find_element(By.ID, "kind")).select_by_value(args.kind)
        Select(driver.find_element(By.ID, "layer")).select_by_value(str(args.layer - 1))
        head = "mean" if args.head == "mean" else str(int(args.head) - 1)
        Select(driver.find_element(By.ID, "head")).select_by_value(head)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(args.width, height + 20)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.output)
        print(f"translation: {driver.find_element(By.ID, 'translation').text}")
        print(f"wrote {args.output}")
    finally:
        driver.quit()
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
