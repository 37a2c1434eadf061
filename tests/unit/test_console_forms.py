"""The console's form fields: a number that is not one is a clear 400, never a 500."""

from __future__ import annotations

import pytest
from starlette.datastructures import FormData

from effectledger_core.errors import InvalidRequest
from effectledger_ledger.console.forms import whole_number


@pytest.mark.parametrize("value,expected", [("1", 1), (" 42 ", 42), ("-3", -3),
                                            ("2147483647", 2**31 - 1)])
def test_a_whole_number_is_read(value: str, expected: int) -> None:
    assert whole_number(FormData([("epoch", value)]), "epoch") == expected


@pytest.mark.parametrize("value", ["", "x", "1.5", "\u00b2", "\u0661", "2147483648",
                                   "9" * 5000, "--1"])
def test_anything_else_is_refused_clearly(value: str) -> None:
    # "\u00b2" and "\u0661" are digits to str.isdigit() that int() refuses or reads.
    with pytest.raises(InvalidRequest, match="'epoch' must be a whole number"):
        whole_number(FormData([("epoch", value)]), "epoch")


def test_a_missing_field_is_refused_clearly() -> None:
    with pytest.raises(InvalidRequest):
        whole_number(FormData([]), "epoch")
