"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class InputError(Exception):
    """A user's input (params, data, model folder) is wrong; the message names it and what was expected."""


class NotYetSupported(InputError):
    """An option whose code has not landed yet: refused up front instead of silently ignored."""

    def __init__(self, what: str, where: str):
        super().__init__(f"{what} is not supported yet (it comes with {where}); remove it from the params")
