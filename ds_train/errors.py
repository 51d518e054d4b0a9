"""The one exception type for user mistakes.

A `UserError` is printed as one line (no traceback unless `--debug`) and exits non-zero. Everything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: config, hostfile, data, checkpoint or command line."""

    exit_code = 2
