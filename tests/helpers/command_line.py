"""Command lines of the processes the tests start, apart from ``tests/sitecustomize.py``: a Python whose own
``sitecustomize`` comes first (Debian's and Ubuntu's, in /usr/lib/python3.x) hides ours from the pytest process."""


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(program, args) of a command line ``[-u] <program> <args>`` (what follows ``python``)."""
    while argv and argv[0] == "-u":  # unbuffered output, which the tests' environment sets anyway
        argv = argv[1:]
    split = 2 if argv[:1] == ["-m"] else 1
    return argv[:split], argv[split:]
