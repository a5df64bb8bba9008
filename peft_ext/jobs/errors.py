"""How a job reports the methods that failed: :class:`JobFailed` and the one-line form of an error."""

from __future__ import annotations

__all__ = ["JobFailed", "one_line"]


def one_line(err: BaseException) -> str:
    """``err`` as one line for the user: its type and the first line of its message (the traceback is for
    ``--debug``)."""
    text = str(err).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


class JobFailed(RuntimeError):
    """Some methods of a job failed; the others finished and their results are on disk.

    Args:
        failures: One ``{"method", "label", "error"}`` per failed method (``error``: :func:`one_line`).
        out_dir: Where the results of the finished methods were written.
    """

    def __init__(self, failures: list[dict[str, str]], out_dir: str) -> None:
        self.failures = failures
        self.out_dir = out_dir
        lines = [f"method {f['label']} failed: {f['error']}" for f in failures]
        super().__init__("\n".join(lines))
