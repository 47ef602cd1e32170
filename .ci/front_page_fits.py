r"""Does the documentation's front page fit one screen at a given viewport size?

Renders it in Chromium (Qt WebEngine), saves a screenshot, and checks that the front page's
first screen (everything up to the line that starts "Next") ends inside the viewport.

Not part of CI (Qt WebEngine is about 300 MB); run it after changing the README's top:

    python3 -m venv /tmp/qt && /tmp/qt/bin/pip install PyQt6 PyQt6-WebEngine
    .venv/bin/sphinx-build -q -D nb_execution_mode=off -b html docs /tmp/docs_html
    QT_QPA_PLATFORM=offscreen QTWEBENGINE_CHROMIUM_FLAGS="--no-sandbox --disable-gpu" \
        /tmp/qt/bin/python .ci/front_page_fits.py /tmp/docs_html/index.html --size 1400x900

Prints each block's top and bottom in CSS pixels; exits 1 when the "Next" line ends below the
viewport (or is missing), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from PyQt6.QtCore import QSize, QTimer, QUrl
from PyQt6.QtWebEngineWidgets import QWebEngineView
from PyQt6.QtWidgets import QApplication

# The top-level blocks of the page's article with their vertical extent, measured in the page.
_MEASURE = """
(() => {
  const blocks = [];
  for (const e of document.querySelectorAll('article section#jaxops > *')) {
    const b = e.getBoundingClientRect();
    blocks.push([e.tagName, Math.round(b.top), Math.round(b.bottom),
                 (e.innerText || '').slice(0, 50).replace(/\\n/g, ' ')]);
  }
  return JSON.stringify({viewport: [window.innerWidth, window.innerHeight], blocks: blocks});
})()
"""


def main() -> int:
    """Render, measure, report; the exit status says whether the first screen fits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=pathlib.Path, help="the built index.html")
    parser.add_argument("--size", default="1400x900", help="viewport WIDTHxHEIGHT (1400x900)")
    parser.add_argument("--screenshot", type=pathlib.Path, default=pathlib.Path("front_page.png"))
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))

    app = QApplication(sys.argv[:1])
    view = QWebEngineView()
    view.resize(QSize(width, height))
    view.show()
    measured: dict = {}

    def done(result: str) -> None:
        measured.update(json.loads(result))
        view.grab().save(str(args.screenshot))
        app.quit()

    # The theme lays the page out after load (fonts, its scripts): measure a moment later.
    view.loadFinished.connect(
        lambda ok: QTimer.singleShot(1500, lambda: view.page().runJavaScript(_MEASURE, done))
    )
    view.load(QUrl.fromLocalFile(str(args.page.resolve())))
    QTimer.singleShot(60_000, app.quit)
    app.exec()
    if not measured:
        print(f"front_page_fits: {args.page} did not render within 60 s", file=sys.stderr)
        return 1

    vw, vh = measured["viewport"]
    print(f"viewport {vw} x {vh}, screenshot {args.screenshot}")
    bottom = None
    for tag, top, end, text in measured["blocks"]:
        print(f"{tag:8} {top:5} {end:5}  {text}")
        if bottom is None and text.startswith("Next"):
            bottom = end
    if bottom is None:
        print("front_page_fits: no block starting 'Next' on the page", file=sys.stderr)
        return 1
    fits = bottom <= vh
    print(f"the first screen ends at {bottom} px: {'fits' if fits else 'does NOT fit'}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
