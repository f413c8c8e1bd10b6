"""fedreid: federated person re-identification and retrieval."""

__version__ = "0.1.0"
