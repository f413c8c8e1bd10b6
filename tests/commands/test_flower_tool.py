"""tools/flower_fed.py without starting Flower: commands it would run, key material, refusals."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # typer, imported by flwr's CLI parsers
def test_client_resources_reach_the_simulation_backend(tmp_path, monkeypatch, capsys):
    """--client-gpus/--client-cpus -> LocalDeployment -> `flwr run --federation-config` -> Ray's backend config.

    Nothing starts: the deployment is replaced once the tool has built it, and
    Flower's own parsers turn the command's text into the backend config.
    """
    import types

    from fl_helpers import tiny_config, write_world
    from flwr.common.config import parse_config_args
    from flwr.simulation.app import _run_simulation_settings
    from flwr.supercore.utils import simulation_config_from_json
    from tool_loader import cli_error, load_tool

    from fedreid.config import dump_config
    from fedreid.flower import launch

    class Started(Exception):
        pass

    seen = {}

    class Recording(launch.LocalDeployment):
        def start(self):
            seen["deployment"] = self
            raise Started()

    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # Ray itself is not needed to build it
    monkeypatch.setattr(launch, "LocalDeployment", Recording)
    (tmp_path / "run.yaml").write_text(dump_config(tiny_config(write_world(tmp_path / "prepared"))))
    flower_fed = load_tool("flower_fed", "flower_fed_tool")
    with pytest.raises(Started):
        flower_fed.main(["simulate", "--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"),
                         "--client-gpus", "0.25", "--client-cpus", "3"])
    args = seen["deployment"].cli.run_args("config='x'")
    federation = args[args.index("--federation-config") + 1]
    flat = {k.replace("-", "_"): v for k, v in parse_config_args([federation]).items()}
    supernodes, backend, backend_config, _, _ = _run_simulation_settings(simulation_config_from_json(flat))
    assert supernodes == 2 and backend == "ray"
    assert backend_config["client_resources"] == {"num_cpus": 3, "num_gpus": 0.25}
    without = launch.LocalDeployment(tmp_path / "w", ["a"], simulation=True).cli.run_args("x")
    assert without[without.index("--federation-config") + 1] == "num-supernodes=1"  # Flower's defaults
    for option, value, message in (("--client-gpus", "-1", "a share of a GPU >= 0"),
                                   ("--client-cpus", "0", "a whole number of CPUs >= 1")):
        err = cli_error(flower_fed, ["simulate", "--config", "c.yaml", "--out", str(tmp_path / "r2"), option, value],
                        capsys)
        assert message in err and not (tmp_path / "r2").exists()  # refused before anything is made
