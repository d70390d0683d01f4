"""User-facing errors: one line that says what is wrong and how to fix it, never a traceback.

Library code raises `UserError`; every console script wraps its body in `cli_errors()`, which turns
it (and the few OS errors a user can cause, such as a full disk) into a one-line message and a
non-zero exit.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import click


class UserError(Exception):
    """A problem with the user's input or environment, reported as a single line."""


class ShardFormatError(UserError):
    """A packed folder does not follow the shard contract (see `pipeline.shards`)."""


@contextmanager
def cli_errors() -> Iterator[None]:
    """Turn expected failures into `click` errors: one line on stderr, exit status 1 (130 on ^C)."""
    try:
        yield
    except UserError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted: nothing was written to the output folder", err=True)
        sys.exit(130)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise click.ClickException(
                f"disk full while writing {exc.filename or 'output'}: free some space or choose "
                "another --out; nothing was left behind"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise click.ClickException(
                f"permission denied: {exc.filename}: choose a folder you can write to"
            ) from None
        raise
