"""The testing guide names every fixture there is, and none that is not."""

from __future__ import annotations

import re

import celery_ext.testing

from .support import DOCS


def test_the_testing_guide_documents_every_fixture_and_no_other() -> None:
    documented = set(re.findall(r"^``(sqlinbox\w*)``$", (DOCS / "testing.rst").read_text(),
                                re.MULTILINE))
    defined = {name for name, value in vars(celery_ext.testing).items()
               if name.startswith("sqlinbox") and "fixture" in type(value).__name__.lower()}
    assert "sqlinbox_clock" in defined
    # the app fixture a project overrides is named in the text, not listed
    assert documented == defined - {"sqlinbox_service_app"}
