#!/usr/bin/env bash
# Check the package on every Python that pyproject's requires-python admits, without torch:
# for each version, a venv in .venvs/pyXY (made once) with the package installed (editable, no
# torch), then: import every module, ruff's undefined-name check (F821/F822/F823) for that
# version, and the torch-free tests. A missing interpreter is an error: an admitted version
# that is not checked is not admitted.
# Usage: scripts/test_pythons.sh "3.10 3.11 3.12 3.13" "tests/a.py tests/b.py"
set -euo pipefail
cd "$(dirname "$0")/.."
versions=${1:-"3.10 3.11 3.12 3.13"}
tests=${2:-tests/reliability/test_reliability_ii_torchfree.py}
# The package's dependencies without torch, plus the test tools.
deps="ipython>=8 ipywidgets>=8 matplotlib psutil nvidia-ml-py pytest ruff"

find_python() {  # pyenv's newest X.Y first, then pythonX.Y on PATH
    local found
    found=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -V | tail -1 || true)
    [ -n "$found" ] || found=$(command -v "python$1" || true)
    [ -n "$found" ] || { echo "python$1 not found (pyenv install $1, or narrow requires-python)" >&2; return 1; }
    echo "$found"
}

for v in $versions; do
    tag=py${v/./}
    venv=.venvs/$tag
    python=$(find_python "$v")
    if [ ! -f "$venv/.ready" ] || [ pyproject.toml -nt "$venv/.ready" ]; then
        rm -rf "$venv"
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --disable-pip-version-check $deps
        "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
        touch "$venv/.ready"
    fi
    echo "== Python $v ($("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'), no torch)"
    "$venv/bin/python" - <<'PY'
import importlib, pkgutil, sys
import oom_magic
names = [m.name for m in pkgutil.walk_packages(oom_magic.__path__, "oom_magic.")
         if m.name != "oom_magic.__main__"]  # runs the command line: checked by tests/fit/test_cli.py
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules, "importing oom_magic imported torch"
print(f"imported {len(names) + 1} modules")
PY
    "$venv/bin/ruff" check --no-cache --quiet --select F821,F822,F823 --target-version "$tag" oom_magic tests
    echo "ruff F821/F822/F823 ($tag): clean"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider $tests
done
