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
    check_new_file_folder("--identity-path", path, "a new identity is written there")


def check_new_file_folder(flag: str, path: str, why: str) -> None:
    """The folder of `path`, a file this command will write (`why` says what): it exists and this
    user can write there; UsageError naming the flag, the path and the folder otherwise, before
    anything is started or written."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist ({why})")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {folder} is not writable ({why})")
