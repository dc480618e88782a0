"""The page of `aiayn serve` (aiayn/serving/static) in a real headless Chromium, against
a real server process: translations, n-best, next pieces and attention maps drawn.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'aiayn[serve]'")
from serve_helpers import (  # noqa: E402
    attention_by_hand,
    http_json,
    serve_process,
)

from aiayn.inference.translator import Translator  # noqa: E402


def chromium_driver():
    """A headless Chromium through Selenium, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (browser and driver_path):
        pytest.skip("Chromium is missing: apt-get install chromium chromium-driver "
                    "(`make test` installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options,
                            service=webdriver.ChromeService(executable_path=driver_path))


def expected_colour(value: float) -> np.ndarray:
    """The page's colour scale (app.js, colour): white to (8, 48, 107), square root."""
    t = np.sqrt(np.clip(value, 0, 1))
    return np.round(np.array([255, 255, 255]) + (np.array([8, 48, 107]) - 255) * t)


READ_CELLS = """
const canvas = document.getElementById("heatmap");
const d = canvas.dataset, cell = Number(d.cell);
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
const out = [];
for (let r = 0; r < Number(d.rows); r++) {
  const row = [];
  for (let c = 0; c < Number(d.cols); c++) {
    const x = Math.floor(Number(d.left) + c * cell + cell / 2);
    const y = Math.floor(Number(d.top) + r * cell + cell / 2);
    const i = 4 * (y * canvas.width + x);
    row.push([pixels.data[i], pixels.data[i + 1], pixels.data[i + 2]]);
  }
  out.push(row);
}
return {cells: out, kind: d.kind, width: canvas.width, height: canvas.height};
"""


def test_the_page_translates_and_draws_the_attention_in_chromium(server, translator, run_dir):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    sentence = "red sun moon tree"
    driver = chromium_driver()
    try:
        driver.get(server + "/")
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: "parameters" in d.find_element(By.ID, "info").text)
        # On load the page translated its placeholder: no blank section before a click.
        placeholder = driver.find_element(By.ID, "source").get_attribute("placeholder")
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done")
                   or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        assert driver.find_element(By.ID, "source").get_attribute("value") == placeholder
        assert not driver.find_element(By.ID, "to-choice").is_displayed()  # one direction
        assert driver.find_element(By.ID, "translation").text == \
            translator.translate([placeholder], translator.resolve(beam=4))[0]
        assert driver.find_element(By.ID, "next-target").text != ""
        assert driver.find_elements(By.CSS_SELECTOR, "#layer option") and \
            driver.find_elements(By.CSS_SELECTOR, "#head option")
        assert driver.find_element(By.ID, "heatmap").get_attribute("data-kind") == "cross"
        if os.environ.get("AIAYN_PAGE_SCREENSHOT"):  # to look at the page by eye
            driver.save_screenshot(os.environ["AIAYN_PAGE_SCREENSHOT"])
        driver.find_element(By.ID, "source").clear()
        driver.find_element(By.ID, "source").send_keys(sentence)
        driver.find_element(By.ID, "translate").click()
        # (the click sets the status to "translating…" before it returns)
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done")
                   or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        translation = translator.translate([sentence], translator.resolve(beam=4))[0]
        assert driver.find_element(By.ID, "translation").text == translation
        items = driver.find_elements(By.CSS_SELECTOR, "ol#nbest > li")
        want = translator.translate_nbest([sentence], translator.resolve(beam=4, nbest=4))[0]
        assert all(li.is_displayed() for li in items)
        shown = [(li.find_element(By.CLASS_NAME, "text").text,
                  float(li.find_element(By.CLASS_NAME, "score").text)) for li in items]
        assert [t for t, _ in shown] == [t for t, _ in want] and len(want) > 1
        assert np.allclose([s for _, s in shown], [s for _, s in want], atol=1e-4)

        # The next piece at step 0, temperature 1; then the temperature slider at its
        # coldest end redraws the bars of that distribution.
        def shown_pieces():
            return [(li.find_element(By.CLASS_NAME, "piece").text,
                     li.find_element(By.CLASS_NAME, "probability").text)
                    for li in driver.find_elements(By.CSS_SELECTOR, "ol#next-pieces > li")]

        for temperature in (1.0, 0.05):
            if temperature != 1.0:
                driver.find_element(By.ID, "temperature").send_keys(Keys.HOME)
            wait.until(lambda d, t=temperature: d.find_element(
                By.ID, "next-pieces").get_attribute("data-temperature") == f"{t:g}")
            want = http_json(server + "/next", {"text": sentence, "target": translation,
                                                "step": 0, "temperature": temperature})
            assert shown_pieces() == [(p, f"{q:.3f}") for p, q in want["pieces"]]
        assert float(shown_pieces()[0][1]) > 0.99  # cold: the likeliest piece takes it all

        att = translator.attention(sentence, translator.resolve(beam=4))
        for kind, rows, cols in (("cross", att.tgt_tokens, att.src_tokens),
                                 ("decoder_self", att.tgt_tokens, att.tgt_tokens)):
            Select(driver.find_element(By.ID, "kind")).select_by_value(kind)
            Select(driver.find_element(By.ID, "layer")).select_by_value("0")
            Select(driver.find_element(By.ID, "head")).select_by_value("1")
            drawn = driver.execute_script(READ_CELLS)
            cells = np.array(drawn["cells"], dtype=float)
            assert drawn["kind"] == kind and cells.shape == (len(rows), len(cols), 3)
            # Rows are queries, columns keys: each cell has the colour of its weight.
            want = np.stack([[expected_colour(v) for v in row] for row in att.maps[kind][0][1]])
            assert np.abs(cells - want).max() <= 2
            assert len({tuple(c) for c in cells.reshape(-1, 3)}) > 2  # not a blank canvas
        assert np.all(cells[np.triu_indices(len(rows), 1)] == 255)  # causal: white above

        # The step slider: at its left end, the first step checkpoint's cross-attention
        # over the same translation, another picture than the served model's.
        Select(driver.find_element(By.ID, "kind")).select_by_value("cross")
        Select(driver.find_element(By.ID, "head")).select_by_value("1")
        served = np.array(driver.execute_script(READ_CELLS)["cells"], dtype=float)
        slider = driver.find_element(By.ID, "step")
        assert slider.is_displayed() and slider.get_attribute("max") == "4"
        slider.send_keys(Keys.HOME)
        wait.until(lambda d: d.find_element(By.ID, "heatmap").get_attribute("data-step") == "100"
                   or d.find_element(By.ID, "error").text)
        assert driver.find_element(By.ID, "error").text == ""
        assert driver.find_element(By.ID, "step-label").text == "step 100"
        early = attention_by_hand(run_dir, translator, sentence, 100, beam=4)
        assert early.tgt_tokens == att.tgt_tokens
        drawn = np.array(driver.execute_script(READ_CELLS)["cells"], dtype=float)
        want = np.stack([[expected_colour(v) for v in row] for row in early.maps["cross"][0][1]])
        assert np.abs(drawn - want).max() <= 2
        assert np.abs(drawn - served).max() > 20  # the picture changed

        # Typing the start of the translation: once typing pauses, the page shows the
        # model's completion of it, and the confidence of the translation shown.
        want = translator.translate([sentence], translator.resolve(beam=4), prefixes=["blue"])[0]
        assert want.startswith("blue") and want != translation
        driver.find_element(By.ID, "prefix").send_keys("blue")
        wait.until(lambda d: d.find_element(By.ID, "translation").text == want
                   and d.find_element(By.ID, "status").text.startswith("done"))
        best = translator.translate_scored([sentence], translator.resolve(beam=4),
                                           prefixes=["blue"])[0][0]
        assert driver.find_element(By.ID, "confidence").text.startswith(
            f"score {best.score:.3f}: log-probability {best.log_prob:.2f} over "
            f"{len(best.pieces)} pieces; the least likely")
    finally:
        driver.quit()


def test_the_page_of_a_model_of_two_languages_offers_them(tagged_run_dir):
    """A menu of the target languages, the first chosen; choosing the other translates
    again into it. (A model of one direction has no menu: the test above.)"""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    translator = Translator.from_pretrained(tagged_run_dir)
    sentence = "green blue black"
    want = {to: translator.toward(to).translate([sentence])[0] for to in ("xx", "yy")}
    assert want["xx"] != want["yy"]
    driver = chromium_driver()
    with serve_process(tagged_run_dir) as served:
        server = served.url
        try:
            driver.get(server + "/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done")
                       or d.find_element(By.ID, "error").text)
            assert driver.find_element(By.ID, "error").text == ""
            menu = Select(driver.find_element(By.ID, "to"))
            assert driver.find_element(By.ID, "to-choice").is_displayed()
            assert [o.get_attribute("value") for o in menu.options] == ["xx", "yy"]
            assert menu.first_selected_option.get_attribute("value") == "xx"
            placeholder = driver.find_element(By.ID, "source").get_attribute("placeholder")
            assert driver.find_element(By.ID, "translation").text == \
                translator.toward("xx").translate([placeholder])[0]
            driver.find_element(By.ID, "source").clear()
            driver.find_element(By.ID, "source").send_keys(sentence)
            driver.find_element(By.ID, "translate").click()
            wait.until(lambda d: d.find_element(By.ID, "translation").text == want["xx"]
                       and d.find_element(By.ID, "status").text.startswith("done"))
            menu.select_by_value("yy")  # translates again, into yy
            wait.until(lambda d: d.find_element(By.ID, "translation").text == want["yy"]
                       and d.find_element(By.ID, "status").text.startswith("done"))
            assert driver.find_element(By.ID, "error").text == ""
            # the attention was asked for in the same direction: its source starts with yy's tag
            assert driver.execute_script("return state.attention.src_tokens[0]") == "<2yy>"
        finally:
            driver.quit()
