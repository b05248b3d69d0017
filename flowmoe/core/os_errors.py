"""An OSError as a few words for an error line (the caller names the path)."""

from __future__ import annotations

import errno

OS_REASONS = {
    errno.ENOENT: "no such file",
    errno.EISDIR: "is a directory, not a file",
    errno.ELOOP: "a symlink loop",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a file is in the way of a folder",
    errno.EEXIST: "a file is in the way of a folder",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on the disk",
    errno.ENAMETOOLONG: "file name too long",
}


def os_reason(exc: OSError) -> str:
    """An OSError as a few words for an error line (the path is the caller's to name)."""
    return OS_REASONS.get(exc.errno or 0, exc.strerror or str(exc))
