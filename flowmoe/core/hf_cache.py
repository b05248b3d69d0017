"""`--model org/name` from the local Hugging Face cache (issue 27, item 8), in huggingface_hub's
layout: `<cache>/models--org--name/snapshots/<commit>/`, the commit that `refs/main` names (or
`org/name@REVISION`: a branch or tag under refs/, or a commit). The cache is `$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. Nothing
is downloaded: a model not in the cache is one error line saying how to fetch it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flowmoe.core.errors import ConfigError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?")


def hub_cache() -> Path:
    """huggingface_hub's cache folder, found as it finds it ("" is unset)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model(source: str) -> str:
    """`source` itself when it is a path that exists or not a repo id (a preset, a typo for the
    loader to name); an `org/name[@revision]` not on disk as the cached snapshot's folder."""
    if Path(source).exists() or not REPO_ID.fullmatch(source):
        return source
    repo, _, revision = source.partition("@")
    if ".." in revision.split("/"):
        raise ConfigError(f"{source}: a revision is a branch, a tag or a commit, not a path")
    cache = hub_cache()
    folder = cache / f"models--{repo.replace('/', '--')}"
    fetch = f"`hf download {repo}` (needs internet) fetches it, or pass the checkpoint's folder"
    if not (folder / "snapshots").is_dir():
        raise ConfigError(f"{source}: no such folder, and not in the Hugging Face cache ({cache}); {fetch}")
    commit = _commit(folder, revision or "main")
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        where = f"revision {revision or 'main'} is not in the Hugging Face cache ({folder})"
        raise ConfigError(f"{source}: {where}; {fetch}")
    if not (snapshot / "config.json").exists():
        partial = f"the cached snapshot {snapshot} has no config.json (a partial download?)"
        raise ConfigError(f"{source}: {partial}; {fetch}")
    return str(snapshot)


def _commit(folder: Path, revision: str) -> str:
    """The commit a branch or tag names in refs/, or the revision itself (a commit hash)."""
    ref = folder / "refs" / revision
    if ref.is_file():
        with ref.open("rb") as f:
            text = f.read(100).decode("utf-8", errors="replace").strip()
        if re.fullmatch(r"[0-9a-f]{7,64}", text):
            return text
    return revision


def repo_id_of(folder: Path) -> str | None:
    """The org/name of a cached snapshot folder (`<cache>/models--org--name/snapshots/<commit>`),
    None for any other folder (the inverse of `resolve_model`)."""
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo[len("models--") :].replace("--", "/", 1)  # "models--gpt2": a repo without an org
