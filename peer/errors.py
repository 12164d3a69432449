"""Errors that the CLI turns into a clear message and exit code 2."""


class UsageError(Exception):
    """Bad input from the user (argument, file, data path): printed as-is, exit code 2."""
