"""What a fit check read from the hub for a model that is not in the local cache."""
from __future__ import annotations

from dataclasses import dataclass

from .shown import Shown

__all__ = ["HubRead"]


@dataclass(frozen=True, repr=False)
class HubRead(Shown):
    """The config and safetensors headers read over the network for one repo at one commit; int bytes."""

    repo_id: str
    revision: str  # the commit the hub resolved the asked revision to
    headers: int  # safetensors headers read
    bytes_read: int  # body bytes received: config, index and headers, never weights
    download_bytes: int  # what from_pretrained would download: the weight files' sizes
    cache_dir: str  # the hub cache the download would go to
    cache_free: int | None  # free bytes on the file system of cache_dir; None when unknown

    def __repr__(self) -> str:
        return (f"HubRead(repo_id={self.repo_id!r}, revision={self.revision[:12]!r}, headers={self.headers}, "
                f"bytes_read={self.bytes_read}, download_bytes={self.download_bytes})")
