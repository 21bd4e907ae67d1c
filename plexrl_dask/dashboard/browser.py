"""A headless Chromium that opens dashboard pages (for the browser tests and the benchmark).

Not used by the dashboard itself: it needs the ``selenium`` package (a test dependency) and a
Chromium with its driver (Debian: ``apt-get install chromium chromium-driver``). Pages are read
the way a user's browser gets them: through the Bokeh server's websocket. What a page shows is
read from its Bokeh document in the browser (the named data sources of
:mod:`plexrl_dask.dashboard.components`), so a test can compare it with the JSON routes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexrl_dask.errors import BrowserUnavailable, RequestTimeout

logger = logging.getLogger(__name__)

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
DRIVER_NAMES = ("chromedriver",)

#: JavaScript: the named columns of the named ColumnDataSource of the page's Bokeh document
#: (null until the document and the source exist).
_SOURCE_JS = """
const [name, columns] = arguments;
const docs = (window.Bokeh && window.Bokeh.documents) || [];
for (const doc of docs) {
  const model = doc.get_model_by_name(name);
  if (model == null) continue;
  const data = model.data;
  const get = (k) => (data instanceof Map ? data.get(k) : data[k]);
  const out = {};
  for (const c of columns) { const v = get(c); out[c] = v == null ? null : Array.from(v); }
  return out;
}
return null;
"""


def find_chromium() -> str | None:
    """The Chromium binary: ``$PLEXRL_CHROMIUM``, else the first of the usual names on PATH."""
    explicit = os.environ.get("PLEXRL_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def find_chromedriver() -> str | None:
    """The matching driver: ``$PLEXRL_CHROMEDRIVER``, else ``chromedriver`` on PATH."""
    explicit = os.environ.get("PLEXRL_CHROMEDRIVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((p for p in map(shutil.which, DRIVER_NAMES) if p), None)


def fetch_json(url: str, timeout: float = 30.0) -> Any:
    """GET ``url`` and parse it as JSON (bounded by ``timeout``)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Browser:
    """A headless Chromium under selenium, as a context manager.

    ``width``/``height``: the window (screenshots have that size).
    """

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 60.0) -> None:
        chromium, driver = find_chromium(), find_chromedriver()
        if chromium is None:
            raise BrowserUnavailable(
                "no Chromium binary found (apt-get install chromium, or set PLEXRL_CHROMIUM)"
            )
        if driver is None:
            raise BrowserUnavailable(
                f"Chromium is at {chromium} but chromedriver is not "
                "(apt-get install chromium-driver, or set PLEXRL_CHROMEDRIVER)"
            )
        try:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service
        except ImportError as e:
            raise BrowserUnavailable("selenium is not installed (pip install selenium)") from e
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in (
            "--headless=new",
            "--no-sandbox",  # CI runs as root in a container
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--disable-extensions",
            # a page left for another stays alive in the back/forward cache, its Bokeh
            # session connected and updating: leave pages for good
            "--disable-features=BackForwardCache",
            f"--window-size={width},{height}",
        ):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.timeout = float(timeout)
        self.driver = webdriver.Chrome(service=Service(driver), options=options)
        self.driver.set_page_load_timeout(self.timeout)
        self.driver.set_script_timeout(self.timeout)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.driver.quit()

    def open(self, url: str) -> None:
        self.driver.get(url)

    def source(self, name: str, columns: list[str]) -> dict[str, list] | None:
        """Columns of the page's data source ``name`` as the browser holds them (None until
        the page's document has it)."""
        return self.driver.execute_script(_SOURCE_JS, name, columns)

    def model_property(self, name: str, prop: str) -> Any:
        """Property ``prop`` of the page's model named ``name`` as the browser holds it (None
        until the page's document has it)."""
        return self.driver.execute_script(
            "const [name, prop] = arguments;"
            "for (const doc of (window.Bokeh && window.Bokeh.documents) || []) {"
            "  const m = doc.get_model_by_name(name); if (m != null) return m[prop]; }"
            "return null;",
            name,
            prop,
        )

    def hover_value(self, name: str, index: int) -> str | None:
        """What the page's tooltip formatter ``name`` (a ``CustomJSHover``) shows for row
        ``index`` of its source (None until the page's document has it)."""
        return self.driver.execute_script(
            "const [name, index] = arguments;"
            "for (const doc of (window.Bokeh && window.Bokeh.documents) || []) {"
            "  const m = doc.get_model_by_name(name);"
            "  if (m != null) return m.format(null, '', {index}); }"
            "return null;",
            name,
            index,
        )

    def wait_for(
        self, predicate: Callable[[], bool], what: str, timeout: float | None = None
    ) -> None:
        """Poll ``predicate`` until it holds; :class:`RequestTimeout` after ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not predicate():
            if time.monotonic() > deadline:
                raise RequestTimeout(f"the browser did not show {what} in time")
            time.sleep(0.2)

    def console_errors(self) -> list[dict[str, Any]]:
        """Console messages at error level since the last call."""
        return [e for e in self.driver.get_log("browser") if e.get("level") == "SEVERE"]

    def screenshot(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path
