"""Helpers for stand-ins of optional GPU libraries (Transformer Engine, flash-attn) in CPU tests: a callable
with a library function's exact parameter list, so a call with a keyword or an argument count that the
real function would reject fails here too."""

import inspect


def with_signature(impl, required, optional=()):
    """`impl(**kwargs)` behind a keyword parameter list: unknown or missing keywords fail like the real call."""

    def call(**kwargs):
        unknown, missing = set(kwargs) - set(required) - set(optional), set(required) - set(kwargs)
        assert not unknown and not missing, f"unknown {sorted(unknown)}, missing {sorted(missing)}"
        return impl(**kwargs)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    call.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in required] + [inspect.Parameter(n, kind, default=None) for n in optional]
    )
    return call


def positional(impl, names):
    """`impl(**dict(zip(names, args)))` for a pybind function that takes exactly `len(names)` positional args."""

    def call(*args, **kwargs):
        assert not kwargs, f"pybind function called with keywords {sorted(kwargs)}"
        assert len(args) == len(names), f"takes {len(names)} positional arguments ({names}), got {len(args)}"
        return impl(**dict(zip(names, args)))

    return call
