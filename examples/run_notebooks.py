"""Executes the example notebooks with nbclient and fails on any error or on stale outputs.

Every ``examples/*.ipynb`` and ``docs/tutorials/*.ipynb`` (or the notebooks given on the
command line) is first checked for committed outputs and execution counts (committed notebooks
carry none), then executed in a fresh kernel whose working directory is the notebook's
folder. The executed outputs are never written back. The kernel runs the interpreter that runs
this script (a kernelspec written at runtime into a temporary directory), so it imports the
jaxops installed in that environment.

Usage (from any directory)::

    python examples/run_notebooks.py                 # check and execute every notebook
    python examples/run_notebooks.py kernels.ipynb   # only these
    python examples/run_notebooks.py --strip         # remove outputs in place (for authors)
    python examples/run_notebooks.py --check         # only check for committed outputs

Exit status 1 names each notebook that failed and the error of its failing cell.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

EXAMPLES = Path(__file__).resolve().parent
#: The folders whose notebooks run by default: the examples and the tutorials.
FOLDERS = (EXAMPLES, EXAMPLES.parent / "docs" / "tutorials")
KERNEL = "python3"
TIMEOUT_S = 300
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of IPython tracebacks


def stale_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """What a committed notebook must not carry: outputs and execution counts."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i} has {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i} has execution_count {cell.execution_count}")
    return problems


def strip_outputs(path: Path) -> bool:
    """Removes outputs and execution counts in place; returns whether the file changed."""
    nb = nbformat.read(path, as_version=4)
    if not stale_outputs(nb):
        return False
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(nb, path)
    return True


def kernel_specs(spec_root: Path) -> KernelSpecManager:
    """A python3 kernelspec, written under `spec_root`, that runs this very interpreter."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(spec_root / KERNEL)
    specs = KernelSpecManager(kernel_dirs=[str(spec_root)])
    argv = specs.get_kernel_spec(KERNEL).argv
    if argv[0] != sys.executable:
        raise RuntimeError(f"kernelspec runs {argv[0]}, not {sys.executable}")
    return specs


def execute(path: Path, specs: KernelSpecManager) -> str | None:
    """Runs a notebook in a fresh kernel (cwd = its folder); returns the error, None if fine."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        km=KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs),
        timeout=TIMEOUT_S,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        return ANSI.sub("", str(e))
    return None


def notebooks(names: Sequence[str]) -> list[Path]:
    """The notebooks to run: the given paths (or names inside examples/), else all of them."""
    if not names:
        return [path for folder in FOLDERS for path in sorted(folder.glob("*.ipynb"))]
    paths = []
    for name in names:
        path = Path(name)
        if not path.exists() and (EXAMPLES / name).exists():
            path = EXAMPLES / name
        if not path.exists():
            raise SystemExit(f"run_notebooks: no such notebook: {name}")
        paths.append(path.resolve())
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "notebooks", nargs="*", help="notebooks (default: examples/ and docs/tutorials/ *.ipynb)"
    )
    parser.add_argument(
        "--strip", action="store_true", help="remove outputs and execution counts in place"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check for committed outputs, execute nothing (the docs build executes them)",
    )
    args = parser.parse_args(argv)
    paths = notebooks(args.notebooks)
    if not paths:
        print("run_notebooks: no notebooks found", file=sys.stderr)
        return 1

    if args.strip:
        for path in paths:
            print(f"{path.name}: {'stripped' if strip_outputs(path) else 'clean'}")
        return 0

    if args.check:
        stale = {p.name: stale_outputs(nbformat.read(p, as_version=4)) for p in paths}
        for name, problems in stale.items():
            status = "FAIL" if problems else "ok  "
            print(f"{status}  {name}: {'; '.join(problems) or 'no outputs'}")
        if any(stale.values()):
            print("run_notebooks: committed outputs (run with --strip)", file=sys.stderr)
            return 1
        return 0

    failures = []
    with tempfile.TemporaryDirectory(prefix="jaxops-kernels-") as tmp:
        specs = kernel_specs(Path(tmp))
        for path in paths:
            stale = stale_outputs(nbformat.read(path, as_version=4))
            if stale:
                why = "; ".join(stale) + " (run with --strip)"
                failures.append((path, f"stale outputs: {why}"))
                print(f"FAIL  {path.name}: stale outputs: {why}", flush=True)
                continue
            start = time.perf_counter()
            error = execute(path, specs)
            took = time.perf_counter() - start
            print(f"{'FAIL' if error else 'ok  '}  {path.name:28s} {took:6.1f} s", flush=True)
            if error:
                failures.append((path, error))

    for path, error in failures:
        print(f"\n=== {path.name} failed ===\n{error}", file=sys.stderr)
    if failures:
        names = ", ".join(p.name for p, _ in failures)
        print(f"\nrun_notebooks: {len(failures)} of {len(paths)} failed: {names}", file=sys.stderr)
        return 1
    print(f"run_notebooks: all {len(paths)} notebooks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
