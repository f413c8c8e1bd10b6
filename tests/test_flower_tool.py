"""tools/flower_fed.py without starting Flower: commands it would run, key material, refusals."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "flower_fed.py"


def tool(*args, cwd=None):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_certs_and_node_keys_are_made_once_and_private(tmp_path):
    done = tool("certs", "--out", tmp_path / "tls", "--host", "10.0.0.5", "--host", "server.lan")
    assert done.returncode == 0, done.stderr
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "server.lan" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert stat.S_IMODE(os.stat(tmp_path / "tls" / "server.key").st_mode) == 0o600
    again = tool("certs", "--out", tmp_path / "tls")
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert tool("node-key", "--out", tmp_path / "keys", "site1").returncode == 0
    assert (tmp_path / "keys" / "site1.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert stat.S_IMODE(os.stat(tmp_path / "keys" / "site1").st_mode) == 0o600
    assert "refusing to overwrite" in tool("node-key", "--out", tmp_path / "keys", "site1").stderr


def test_commands_it_would_run(tmp_path):
    (tmp_path / "tls").mkdir()
    for name in ("ca.crt", "server.pem", "server.key"):
        (tmp_path / "tls" / name).write_text("x")
    link = tool("superlink", "--tls", tmp_path / "tls", "--node-auth", "--print-only").stdout
    assert "--ssl-certfile" in link and "--enable-supernode-auth" in link
    assert "--disable-runtime-dependency-installation" in link and "--insecure" not in link
    (tmp_path / "k").write_text("x")
    node = tool("node", "--client", "market1501", "--superlink", "10.0.0.5:8000", "--ca", tmp_path / "tls/ca.crt",
                "--key", tmp_path / "k", "--prepared-root", "data", "--print-only", cwd=tmp_path).stdout
    assert "client='market1501'" in node and f"prepared-root='{tmp_path / 'data'}'" in node
    assert "--root-certificates" in node and "--auth-supernode-private-key" in node


@pytest.mark.parametrize("args, message", [
    (["superlink", "--print-only"], "--tls DIR"),
    (["superlink", "--insecure", "--node-auth", "--print-only"], "needs TLS"),
    (["local", "--config", "c.yaml", "--out", "r", "--node-auth"], "needs --tls"),
    (["node", "--client", "a", "--superlink", "h:1", "--print-only"], "--ca CA_FILE"),
    (["node", "--client", "a", "--superlink", "h:1", "--insecure", "--ca", "x", "--print-only"], "not both"),
    (["node", "--client", "a", "--superlink", "h:1", "--insecure", "--key", "nope", "--print-only"], "nope"),
    (["run", "--superlink", "h:1", "--insecure", "--out", "runs/x"], "--config is required"),
    (["run", "--superlink", "h:1", "--insecure", "--out", "runs/none", "--resume"], "nothing to resume"),
    (["run", "--superlink", "h:1", "--insecure", "--out", "r", "--config", "c.yaml", "oops"], "key.sub=value"),
])
def test_refusals_are_one_clear_line(tmp_path, args, message):
    done = tool(*args, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
