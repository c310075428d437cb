"""The keywords of a public entry point that mirror torch's, taken as one typed value:
`**options: Unpack[SomeOptions]` (PEP 692), where SomeOptions is a TypedDict (total=False) that
names each keyword and its type, so that a type checker checks a caller's keywords as it did
those of a signature that spelled them out. At run time such a signature accepts any keyword;
`chosen` gives back the TypeError Python raised for one it does not name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

Options = TypeVar("Options", bound=Mapping[str, Any])


def chosen(function: Callable, given: Mapping[str, object], defaults: Options) -> Options:
    """`defaults` (every keyword's, so they name them all) with `given` over them; TypeError,
    worded as Python's, for the first keyword in `given` that `defaults` does not name."""
    for name in given:
        if name not in defaults:
            raise TypeError(
                f"{function.__qualname__}() got an unexpected keyword argument {name!r}"
            )
    return cast(Options, {**defaults, **given})
