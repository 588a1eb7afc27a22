"""The dashboard in a real browser: headless Chromium opens /dashboard on a server under
load, and the block map it drew (read back pixel by pixel from its canvas) counts what
/debug/kv counts; screenshots land in the test's tmp dir.

Needs Chromium (Debian: `apt-get install -y chromium`); skipped where there is none, as on
CI, which does not install it. Run it with: python -m pytest -m browser"""

from __future__ import annotations

import threading
from collections import Counter

import httpx
import pytest

from dashboard_events import fresh_prompt, report_counts, stream_until
from headless_chromium import HeadlessChromium, find_chromium

CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install -y chromium); CI does not install it"),
]

# The page's colours for blocks that no single request owns (its legend shows them).
FIXED = {(0xE9, 0xED, 0xF2): "free", (0x9F, 0xB3, 0xC8): "cached", (0x2B, 0x2F, 0x36): "shared"}

# Each drawn cell's centre pixel, the legend's counts, the table rows, and the event drawn.
_READ_PAGE = """(() => {
  const canvas = document.getElementById("block-map");
  const cell = +canvas.dataset.cell, columns = +canvas.dataset.columns, blocks = +canvas.dataset.blocks;
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  const centre = Math.floor((cell - 1) / 2), cells = [];
  for (let i = 0; i < blocks; i++) {
    const x = (i % columns) * cell + centre, y = Math.floor(i / columns) * cell + centre;
    const at = (y * canvas.width + x) * 4;
    cells.push([pixels[at], pixels[at + 1], pixels[at + 2], pixels[at + 3]]);
  }
  const legend = {};
  for (const name of ["free", "cached", "shared", "owned"]) {
    legend[name] = +document.getElementById("count-" + name).textContent;
  }
  return {cells, legend, event: window.kvserveDashboard.last, frames: window.kvserveDashboard.frames,
          running_rows: document.querySelectorAll("#running tr[data-request]").length,
          timeline_steps: +document.getElementById("timeline").dataset.steps,
          throughput_points: +document.getElementById("throughput").dataset.points};
})()"""


def _drawn_counts(cells: list[list[int]]) -> dict[str, int]:
    """(free, cached, used, shared) from the pixels: any other opaque colour is an owner's."""
    assert all(alpha == 255 for *_, alpha in cells), "a block was not drawn"
    kinds = Counter(FIXED.get(tuple(rgb), "owned") for *rgb, _ in cells)
    return {"free": kinds["free"], "cached": kinds["cached"], "used": kinds["shared"] + kinds["owned"],
            "shared": kinds["shared"]}


def _debug_kv(server) -> dict:
    return httpx.get(f"{server.base_url}/debug/kv").json()


def test_dashboard_draws_the_block_map_debug_kv_counts(server, tmp_path):
    browser = HeadlessChromium(CHROMIUM, str(tmp_path / "profile"))
    stop = threading.Event()
    prompts = [(fresh_prompt(37), 2), (fresh_prompt(21), 1), (fresh_prompt(50), 1)]
    threads = [threading.Thread(target=stream_until, args=(server.base_url, prompt, n, stop)) for prompt, n in prompts]
    try:
        for thread in threads:
            thread.start()
        browser.open(f"{server.base_url}/dashboard")
        # Under load: a frame with all four samples running and past their first decode.
        browser.wait_for("(() => { const e = window.kvserveDashboard.last; return e && e.num_running === 4 &&"
                         " e.running.every((r) => r.output_tokens >= 2); })()", timeout=120)
        busy = browser.evaluate(_READ_PAGE)
        browser.screenshot(str(tmp_path / "dashboard-under-load.png"))
        event = busy["event"]
        total = event["kv"]["blocks"]["total"]
        assert len(busy["cells"]) == total
        drawn = _drawn_counts(busy["cells"])
        # What it drew is what the snapshot it drew says (taken at one moment on the server),
        # and what its legend says.
        assert drawn == report_counts(event["kv"])
        assert drawn["used"] >= 4 and drawn["shared"] == 37 // 16  # the n=2 prompt's full blocks
        assert busy["legend"] == {"free": drawn["free"], "cached": drawn["cached"], "shared": drawn["shared"],
                                  "owned": drawn["used"] - drawn["shared"]}
        assert busy["running_rows"] == 4
        assert busy["timeline_steps"] > 0 and busy["throughput_points"] > 0

        stop.set()
        for thread in threads:
            thread.join()
        # At rest nothing changes: what it draws equals /debug/kv exactly.
        browser.wait_for(f"(() => {{ const e = window.kvserveDashboard.last; return e.time > {event['time']} &&"
                         " e.num_running === 0 && e.kv.blocks.used === 0; })()", timeout=60)
        rest = browser.evaluate(_READ_PAGE)
        browser.screenshot(str(tmp_path / "dashboard-at-rest.png"))
        assert _drawn_counts(rest["cells"]) == report_counts(_debug_kv(server))
        assert rest["running_rows"] == 0
    finally:
        stop.set()
        browser.close()
        for thread in threads:
            thread.join()
    for name in ("dashboard-under-load.png", "dashboard-at-rest.png"):
        image = (tmp_path / name).read_bytes()
        assert image.startswith(b"\x89PNG") and len(image) > 10_000, name
