"""Errors that the CLI turns into a clear message and exit code 2."""


class UsageError(Exception):
    """Bad input from the user (argument, file, data path): printed as-is, exit code 2."""


class NetworkError(Exception):
    """The network refused what the user asked for (an address that cannot be bound, initial peers
    that do not answer, a server nobody can dial back): printed as-is, exit code 2."""


def check_identity_path(path: str | None) -> None:
    """`--identity-path`: a file, or a path whose folder exists (a new identity is written there);
    UsageError naming what is wrong, before anything is started or written."""
    import os

    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"--identity-path {path}: a folder, not an identity file")
    if os.path.exists(path):
        return
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise UsageError(f"--identity-path {path}: folder {folder} does not exist (a new identity is written there)")
