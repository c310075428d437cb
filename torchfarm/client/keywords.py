"""The keywords of a public entry point that mirror torch's, taken as one typed value:
`**options: Unpack[SomeOptions]` (PEP 692), where SomeOptions is a TypedDict (total=False) that
names each keyword and its type, so that a type checker checks a caller's keywords as it did
those of a signature that spelled them out. At run time such a signature accepts any keyword;
`refuse_unknown` gives back the TypeError Python raised for one it does not name."""

from __future__ import annotations

from collections.abc import Callable, Mapping


def refuse_unknown(function: Callable, given: Mapping[str, object], known: Mapping) -> None:
    """TypeError, worded as Python's, for the first keyword in `given` that `known` (a
    TypedDict's __annotations__) does not name."""
    for name in given:
        if name not in known:
            raise TypeError(
                f"{function.__qualname__}() got an unexpected keyword argument {name!r}"
            )
