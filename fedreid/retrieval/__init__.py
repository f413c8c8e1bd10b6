"""Retrieval at scale: an updatable gallery store (FAISS index by factory string + SQLite metadata)."""

from fedreid.retrieval.gallery_rows import GalleryMetadataError, parse_time
from fedreid.retrieval.store import GalleryStore, GalleryStoreError

__all__ = ["GalleryMetadataError", "GalleryStore", "GalleryStoreError", "parse_time"]
