"""Running across machines on Flower (the ``[flower]`` extra).

* :mod:`fedreid.flower.app`: the ServerApp and ClientApp (thin wrappers of
  :mod:`fedreid.fl`'s server and client);
* :mod:`fedreid.flower.node`: a client machine's side (private state on disk);
* :mod:`fedreid.flower.codec`: records on the wire (no pickle);
* :mod:`fedreid.flower.security`: test CA and certificates, SuperNode keys;
* :mod:`fedreid.flower.launch`: starting SuperLink, SuperNodes and runs
  (``tools/flower_fed.py``);
* :mod:`fedreid.flower.search` / :mod:`fedreid.flower.search_codec`: federated
  search, each site answering from its own gallery store (query messages);
* :mod:`fedreid.flower.search_session`: a long-lived search session taking
  query after query on a Unix socket;
* :mod:`fedreid.flower.site_link`: direct site links, the session's queries
  sent to each site's long-lived process over HTTPS instead of as Flower
  messages (the same records and checks);
* ``project/pyproject.toml``: the Flower app that ``flwr run`` submits.
"""

from pathlib import Path

#: The Flower app directory ``flwr run`` is given (a pyproject.toml naming our components).
PROJECT_DIR = Path(__file__).resolve().parent / "project"
