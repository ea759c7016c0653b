"""One rule for option bounds: whole numbers from a minimum, amounts above 0, flags; errors name the option."""

from __future__ import annotations

import numbers
import operator
from typing import Any

from partitioner.errors import OptionError

__all__ = ["whole", "positive", "flag"]


def whole(value: Any, name: str, minimum: int = 1, optional: bool = False,
          error: type[Exception] = OptionError) -> int | None:
    """``value`` as an int (numpy's included, not a bool) at least ``minimum``; None passes where it is optional.

    ``error``: what the caller's users catch (an :class:`OptionError` naming the option, the CLI's
    usage error, ...); the rule and its message are the same for every caller.
    """
    if value is None and optional:
        return None
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise _refusal(error, f"{name} must be a whole number >= {minimum}, got {value!r}", name)
    return number


def positive(value: Any, name: str, unit: str, error: type[Exception] = OptionError) -> None:
    """Refuse an amount (bytes, seconds) that is not a number above 0; None passes (no limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise _refusal(error, f"{name} must be more than 0 {unit}, got {value!r}", name)


def flag(value: Any, name: str, optional: bool = False, error: type[Exception] = OptionError) -> None:
    """Refuse anything but True or False (or None where it is optional)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise _refusal(error, f"{name} takes True or False, got {value!r}", name)


def _refusal(error: type[Exception], message: str, name: str) -> Exception:
    """``error`` with ``message``: an OptionError also names the option it is about."""
    return OptionError(message, name) if error is OptionError else error(message)
