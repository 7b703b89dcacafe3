"""The errors the engine raises for what its caller got wrong: a setting or a request, not the program.

The batch layer (`python -m engine.run`) prints a UserError's message on one line, without a traceback,
and exits with its `exit_code`; the Python API raises them as they are.
"""
import difflib


class UserError(Exception):
    """A problem of the input or the settings, not of the program."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """A setting that cannot work; the message names the field."""


class RequestError(UserError, ValueError):
    """A request that can never run (empty, too long for max_model_len or for the whole pool, a token id
    outside the vocabulary, ...); the message names the field."""


def did_you_mean(name: str, known, form: str = "; did you mean {}?") -> str:
    """`form` filled with the name in `known` closest to `name` (a misspelt key or option), or "" when none
    is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return form.format(close[0]) if close else ""
