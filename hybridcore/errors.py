"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""

# Every character str.splitlines() breaks on: a message holding one (a YAML key, a parser's detail) is
# escaped rather than split, so an InputError is one line whatever text it quotes.
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def one_line(text: str) -> str:
    """`text` with every line break escaped (`\\n`), so that it prints as exactly one line."""
    for ch in _LINE_BREAKS:
        if ch in text:
            text = text.replace(ch, ch.encode("unicode_escape").decode("ascii"))
    return text


def say(text: str) -> None:
    """Print one line to stderr on a line of its own, even while a progress bar is being drawn there."""
    import sys

    from tqdm import tqdm
    tqdm.write(one_line(text), file=sys.stderr)


class InputError(Exception):
    """A user's input (params, data, model folder) is wrong; the message names it, what was found and what
    was expected, on one line."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(str(message)))


class TrainingFault(RuntimeError):
    """A stage stopped on a fault it detected itself (NaN/inf values, a checkpoint that could not be written).
    The message says what happened, where, and what was kept; the CLI prints it as one line, exit code 1."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(str(message)))


SHARDING_ISSUE = "the 3D sharding issue (#8)"  # where what a layout cannot do yet is tracked


class NotYetSupported(InputError):
    """An option whose code has not landed yet: refused up front instead of silently ignored."""

    def __init__(self, what: str, where: str):
        self.what, self.where = what, where
        super().__init__(f"{what} is not supported yet (it comes with {where}); remove it from the params")

    def __reduce__(self):  # Prefect and multiprocessing pickle exceptions; rebuild from both arguments
        return type(self), (self.what, self.where)
