"""``dafka console`` in a real browser: Debian's headless Chromium driven by selenium
and chromium-driver (``make chromium`` installs them), over a real mesh: a tower, a
store process, producers and a consumer group (50 published, 20 committed: lag 30)."""

from __future__ import annotations

import shutil
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from dafka.config import NodeConfig
from dafka.console.server import Console
from dafka.nodes.consumer import Consumer
from dafka.nodes.producer import Producer
from tests.conftest import start_store_process, wait_until

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        CHROMIUM is None or DRIVER is None,
        reason="Debian's chromium and chromium-driver are not installed (`make chromium` installs them)",
    ),
]

TOPIC = "orders<script>window.pwned=1</script>"
GROUP = "billing"


@pytest.fixture
def browser() -> Any:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER or ""), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def text_of(driver: Any, css: str) -> str:
    """The text of the elements matching ``css`` (a row: its cells, space-separated), read
    in one script run: the page redraws itself, so element handles go stale."""
    script = """return Array.from(document.querySelectorAll(arguments[0])).map((e) =>
        e.cells ? Array.from(e.cells).map((c) => c.textContent).join(" ") : e.textContent).join(" ")"""
    return str(driver.execute_script(script, css))


def test_landing_and_topic_pages_in_chromium(cfg: NodeConfig, tmp_path: Path, browser: Any) -> None:
    db = tmp_path / "db"
    store = start_store_process(cfg, db)
    producer = Producer(TOPIC, cfg)
    try:
        wait_until(lambda: len(producer.peers))
        for i in range(50):
            producer.publish(b'{"order": %d}' % i)
        assert producer.flush(20)
        with Consumer(TOPIC, cfg, group=GROUP, offset_reset="earliest") as member:
            polled = [member.poll(10) for _ in range(20)]
            assert [r.offset for r in polled if r] == list(range(20))
            assert member.commit() == {(TOPIC, producer.address): 20}
            with Console(cfg, db=str(db), interval=0.3) as console:
                browser.get(console.url)
                head = producer.address[:8]
                wait_until(lambda: f"{head}:49" in text_of(browser, "#topics td"), timeout=15)
                assert TOPIC in text_of(browser, "#topics td")  # the name, as text
                wait_until(lambda: f"{GROUP} 1 30" in text_of(browser, "#groups tr"), timeout=15)
                # The mesh picture: the store linked to the topic's producers, the topic to the group.
                links = browser.execute_script(
                    'return Array.from(document.querySelectorAll("svg.mesh line")).map((e) => e.dataset.link)'
                )
                assert any(link.startswith("store:") and link.endswith("topic:" + TOPIC) for link in links), links
                assert f"topic:{TOPIC} -- group:{GROUP}" in links
                # Live: more records show up without a reload (the marker survives).
                browser.execute_script("window.marker = 7;")
                for i in range(50, 60):
                    producer.publish(b'{"order": %d}' % i)
                assert producer.flush(20)
                wait_until(lambda: f"{head}:59" in text_of(browser, "#topics td"), timeout=15)
                wait_until(lambda: f"{GROUP} 1 40" in text_of(browser, "#groups tr"), timeout=15)
                assert browser.execute_script("return window.marker") == 7
                assert browser.execute_script("return window.pwned") is None
                # The topic page: the latest records' contents decoded.
                browser.get(console.url + "topics/" + urllib.parse.quote(TOPIC, safe=""))
                wait_until(lambda: '"order": 59' in text_of(browser, "#record-list pre"), timeout=15)
                assert '"order": 40' in text_of(browser, "#record-list pre")
                # Its charts: records/s, and the lag of the group consuming it.
                charts = "return document.querySelectorAll('#rate-chart .uplot, #topic-lag-chart .uplot').length"
                wait_until(lambda: browser.execute_script(charts) == 2, timeout=15)
                assert GROUP in text_of(browser, "#topic-lag-chart")
                assert TOPIC in browser.find_element(By.ID, "title").text
                assert browser.execute_script("return window.pwned") is None
    finally:
        producer.close(0)
        store.terminate()
        store.wait(10)


HOSTILE_VALUES = [
    b'<img src=x onerror="window.pwned=3">',
    b"<script>window.pwned=4</script>",
    b'{"html": "</pre><svg onload=\\"window.pwned=5\\">"}',
    bytes(range(256)),
]


def test_record_browser_over_the_mesh_in_chromium_shows_hostile_values_as_text(
    cfg: NodeConfig, tmp_path: Path, browser: Any
) -> None:
    """A console attached to the tower only (no --db) reads the records over the mesh;
    HTML and script in the topic name and in the values are shown as text, never run."""
    store = start_store_process(cfg, tmp_path / "db")
    producer = Producer(TOPIC, cfg)
    try:
        wait_until(lambda: len(producer.peers))
        for i in range(30):
            producer.publish(b"plain %d" % i)
        for value in HOSTILE_VALUES:
            producer.publish(value)
        assert producer.flush(20)
        with Console(cfg, interval=0.3) as console:
            browser.get(console.url + "topics/" + urllib.parse.quote(TOPIC, safe=""))
            wait_until(lambda: "window.pwned=4" in text_of(browser, "#record-list pre"), timeout=20)
            shown = text_of(browser, "#record-list pre")
            assert '<img src=x onerror="window.pwned=3">' in shown
            assert "<script>window.pwned=4</script>" in shown
            assert "svg onload" in shown and "00 01 02 03" in shown  # JSON as text, binary as hex
            assert "read over the mesh" in text_of(browser, "#record-note")
            # Nothing of the values became markup.
            count = "return document.querySelectorAll('#record-list img, #record-list script, #record-list svg').length"
            assert browser.execute_script(count) == 0
            assert browser.execute_script("return window.pwned") is None
            # Jump to an offset.
            browser.find_element(By.ID, "offset").send_keys("3")
            browser.find_element(By.ID, "go").click()
            wait_until(lambda: text_of(browser, "#record-list td").startswith("3 "), timeout=15)
            assert "plain 3" in text_of(browser, "#record-list pre")
            assert browser.find_element(By.ID, "time").get_attribute("disabled") is not None  # no timestamps on the mesh
            assert browser.execute_script("return window.pwned") is None
    finally:
        producer.close(0)
        store.terminate()
        store.wait(10)
