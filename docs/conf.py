"""Sphinx configuration for the kombu-sqlinbox docs (plain alabaster, no extra theme)."""

from __future__ import annotations

from kombu_sqlinbox import __version__

project = "kombu-sqlinbox"
author = "kombu-sqlinbox contributors"
copyright = "kombu-sqlinbox contributors"
release = __version__  # one place for the version

extensions: list[str] = []
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {
    "description": "Celery task queues in tables of your own SQL database",
}
pygments_style = "sphinx"
