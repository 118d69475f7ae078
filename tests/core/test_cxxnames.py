"""The one rule for matching a declared C++ name to a demangled one (``cubinstore._core.cxxnames``)."""

from __future__ import annotations

import pytest

from cubinstore.internals import names_entry, normalize_name


@pytest.mark.parametrize("demangled", [
    "mylib::scale<256, float>",  # c++filt
    "mylib::scale<(int)256, float>",  # cu++filt casts integer template arguments
    "mylib::scale<256u, float>",
    "mylib::scale<(unsigned int)256u, float>",
])
def test_every_demangler_spelling_names_one_function(demangled: str) -> None:
    assert names_entry("mylib::scale<256, float>", demangled)
    assert normalize_name(demangled) == "mylib::scale<256,float>"


def test_a_different_argument_is_a_different_function() -> None:
    assert not names_entry("mylib::scale<256, float>", "mylib::scale<(int)128, float>")
    assert not names_entry("mylib::scale<256, float>", "mylib::scale<(int)256, double>")
