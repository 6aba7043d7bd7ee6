"""``UserError``: bad input from the user (flags, paths, data rows, checkpoints).

It subclasses ``ValueError`` so callers can catch either. The CLI prints its message as one
line without a traceback (unless ``--debug``)."""


class UserError(ValueError):
    """A mistake the user can fix; the message says what is wrong and how to fix it."""


# What the CLI prints (after ``error: ``) when Ctrl-C stops a run or a command; the exit status is 130.
INTERRUPTED = "interrupted"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's status for a process stopped by Ctrl-C
