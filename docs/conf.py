"""Sphinx configuration of the pfa_numba docs site: the Markdown pages (MyST), the notebooks
(executed by MyST-NB) and the API reference from the docstrings (autodoc + napoleon)."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "pfa_numba"
author = "the pfa_numba authors"
copyright = "the pfa_numba authors, Apache-2.0"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
master_doc = "index"
html_theme = "alabaster"

# headings get GitHub-style anchors, so that links like page.md#a-heading resolve
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
# the notebooks run at every build (they are stored without outputs); an error fails it
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True

autodoc_member_order = "bysource"
autodoc_typehints = "none"
napoleon_numpy_docstring = True
napoleon_google_docstring = False
# the docstrings' own section titles, shown as titled sections
napoleon_custom_sections = ["Letters", "What it computes", "Layouts (``input_layout``)",
                            "Sparse modes: the band", "Rows with nothing to attend to",
                            "Differences from Ascend", "Errors"]
