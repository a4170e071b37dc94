"""Execute a notebook headless in a real kernel (nbclient), save the executed copy, print its reports.

Usage: python scripts/run_notebook.py notebooks/quickstart.ipynb [--timeout 600]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def run(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run every cell in a fresh python3 kernel started from this interpreter's environment."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def reports(nb: nbformat.NotebookNode) -> list[str]:
    """The text/plain of every output, in order: the memory reports the notebook produced."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out.get("text", ""))
            elif "data" in out and "text/plain" in out["data"]:
                texts.append(out["data"]["text/plain"])
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    nb = run(args.notebook, args.timeout)
    executed = args.notebook.with_suffix(".executed.ipynb")
    nbformat.write(nb, executed)
    for text in reports(nb):
        print(text.rstrip())
        print()
    print(f"ran {args.notebook} in {time.perf_counter() - started:.1f} s; executed copy: {executed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
