"""Type and range checks for what a script passes: a wrong type is a TypeError naming the
parameter, a bad value a ValueError, before anything reaches the engine."""
import math
import numbers

_INT64_MAX = 2**63 - 1


def integer(name, value, minimum=None, maximum=_INT64_MAX):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value


def number(name, value, minimum=None, positive=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def string(name, value):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    return value


def path(name, value):
    import os
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return string(name, value)


def strings(name, values):
    if isinstance(values, str) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of strings, got {type(values).__name__}")
    out = list(values)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"{name} must hold strings, got {type(v).__name__}")
    return out


def not_implemented(what, **arguments):
    """Keras arguments meshtune does not implement: refused by name, never silently ignored."""
    for name, value in arguments.items():
        if value is not None:
            raise NotImplementedError(f"{what}: {name}= is not implemented by meshtune")
