"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import gpp_deepspeed

MODULES = sorted(m.name for m in pkgutil.walk_packages(gpp_deepspeed.__path__, "gpp_deepspeed."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_of_module_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} fail; run python -m doctest -v on it"
