"""Check a built docs site (``python scripts/check_site.py SITE``): each notebook's page shows
at least as many figures as the notebook, as stored, draws (the site executes the notebooks
again at each build, so a figure lost to a non-inline backend shows here). Exit 1 on a miss."""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def figures(notebook):
    """How many image outputs ``notebook`` holds as stored."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum("image/png" in out.get("data", {}) for cell in cells
               for out in cell.get("outputs", []))


def main(site):
    missed = []
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = pathlib.Path(site) / "notebooks" / f"{notebook.stem}.html"
        shown = page.read_text().count("<img ") if page.exists() else -1
        if shown < figures(notebook):
            missed.append(f"{page}: {shown} images, the notebook draws {figures(notebook)}")
    print("\n".join(missed) or "every notebook page shows its figures")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
