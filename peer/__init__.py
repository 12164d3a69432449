"""hivepipe: the node (CLI, volunteer worker, server host, swarm launcher, dashboard); the shared floor is core/."""


def version() -> str:
    """The installed package's version (pyproject.toml), as `peer --version` prints it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("hivepipe")
    except PackageNotFoundError:
        return "unknown (not installed)"
