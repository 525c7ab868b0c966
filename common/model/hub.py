"""Models named by hub id (`org/name`), found in the local Hugging Face cache.

`huggingface_hub` reads `HF_HOME` / `HF_HUB_CACHE` for the cache and `HF_HUB_OFFLINE`; pdserve
never downloads at start-up: a snapshot that is not cached is a `ModelNotFound` whose one-line
message says where we looked and how to get the model.
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(ValueError):
    """The model a user named does not exist where pdserve looks; the message is one line."""


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "/", "~"))


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot directory of `repo_id` (revision `main`), or ModelNotFound."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    raise ModelNotFound(
        f"model {repo_id!r} is neither a local path nor in the Hugging Face cache "
        f"(looked in {hub_cache_dir()}, set by HF_HOME / HF_HUB_CACHE); get it with "
        f"`hf download {repo_id}` on a machine with network access, or pass --model a directory"
    )
