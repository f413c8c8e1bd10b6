"""The service's access log: request lines without item ids (an erasure must not live on in the log)."""

import logging
import urllib.request

import pytest

from fedreid.retrieval.access_log import RedactItemIds, log_config, redact_item_ids


def access_record(path: str) -> logging.LogRecord:
    # uvicorn's access record: (client address, method, path with query, HTTP version, status)
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", 200), None)


@pytest.mark.parametrize("path, logged", [
    ("/items/person-0042", "/items/{item_id}"),
    ("/items/42/image", "/items/{item_id}/image"),
    ("/items/42?fields=site", "/items/{item_id}?fields=site"),
    ("/items", "/items"),
    ("/search", "/search"),
    ("/web/items/42", "/web/items/42"),  # not an item route
])
def test_item_ids_are_left_out_of_access_records(path, logged):
    assert redact_item_ids(path) == logged  # the rule other log lines naming a request path use too
    record = access_record(path)
    assert RedactItemIds().filter(record) is True  # the line is kept
    assert record.getMessage() == f'127.0.0.1:5000 - "GET {logged} HTTP/1.1" 200'


def test_a_served_request_is_logged_without_its_item_id(capsys):
    pytest.importorskip("uvicorn")
    from fastapi import FastAPI

    from fedreid.retrieval.service import background_server

    app = FastAPI()

    @app.delete("/items/{item_id}")
    def erase(item_id: str) -> dict:
        return {"removed": item_id}

    with background_server(app, log_level="info") as url:
        request = urllib.request.Request(f"{url}/items/person-0042", method="DELETE")
        with urllib.request.urlopen(request) as reply:
            assert reply.status == 200
    logged = capsys.readouterr()
    assert '"DELETE /items/{item_id} HTTP/1.1" 200' in logged.out
    assert "person-0042" not in logged.out + logged.err


def test_the_configuration_is_uvicorns_own_with_the_filter_on_its_access_handler():
    from uvicorn.config import LOGGING_CONFIG

    config = log_config()
    assert config["handlers"]["access"]["filters"] == ["item_ids"]
    assert config["formatters"] == LOGGING_CONFIG["formatters"] and "filters" not in LOGGING_CONFIG["handlers"]["access"]
