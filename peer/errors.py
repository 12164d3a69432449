"""Errors that the CLI turns into a clear message and exit code 2."""


class UsageError(Exception):
    """Bad input from the user (argument, file, data path): printed as-is, exit code 2."""


class NetworkError(Exception):
    """The network refused what the user asked for (an address that cannot be bound, initial peers
    that do not answer, a server nobody can dial back): printed as-is, exit code 2."""
