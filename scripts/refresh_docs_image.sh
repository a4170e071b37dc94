#!/bin/sh
# Refresh the README's docs/img/quickstart-widget.png from the browser test's latest screenshot.
# The test (tests/ui/test_jupyterlab.py) writes under test-output/ui/ only; copying its picture
# over the tracked image is this deliberate step, run by hand when the widget's look changes.
set -eu
cd "$(dirname "$0")/.."
shot=test-output/ui/quickstart-widget.png
[ -f "$shot" ] || { echo "no $shot: run 'python -m pytest tests/ui/test_jupyterlab.py' first" >&2; exit 1; }
cp "$shot" docs/img/quickstart-widget.png
echo "docs/img/quickstart-widget.png refreshed from $shot"
