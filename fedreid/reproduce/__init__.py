"""Reproducing the papers' tables: a registry of their rows and numbers, a resumable runner, result pages."""

from fedreid.reproduce.runner import ReproduceError, resolve_tables, run_table, write_page
from fedreid.reproduce.tables import TABLES, Cell, Row, Table, get_table

__all__ = ["TABLES", "Cell", "ReproduceError", "Row", "Table", "get_table", "resolve_tables", "run_table",
           "write_page"]
