"""Key material for a Flower deployment: a test CA with a server certificate, and SuperNode keys.

For tests and trials on your own machines. In production use certificates
from your organisation's CA; the files here have the same layout.

* :func:`make_tls_files`: ``ca.crt`` (self-signed CA), ``server.pem`` (the
  SuperLink's certificate for the given host names and IP addresses, signed
  by the CA) and ``server.key``. The SuperLink takes all three, SuperNodes
  and ``flwr`` take ``ca.crt``.
* :func:`make_node_key`: a SuperNode's key pair on NIST P-384 in OpenSSH
  format (what ``flower-supernode --auth-supernode-private-key`` and
  ``flwr supernode register`` read): ``<name>`` (private) and ``<name>.pub``.

Existing files are never overwritten; private keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Sequence


def write_new_file(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to a new file ``path`` atomically (mode 0600 when ``private``); an existing one is refused.

    The bytes go to a temporary file beside ``path`` created with its final
    mode (0600 for a private key, so no other user can open it while the key
    is being written), then hard-linked to ``path``: the link fails if a file
    appeared there meanwhile, so nothing is ever overwritten (``os.replace``
    would). Where the file system has no hard links, a rename after a second
    check stands in.
    """
    refusal = f"{path} exists; refusing to overwrite key material (remove it or choose another folder)"
    if path.exists() or path.is_symlink():
        raise FileExistsError(refusal)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # os.open applies the umask to 0o666 as a plain file gets; 0o600 is owner-only whatever the umask.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise FileExistsError(refusal) from None
        except OSError:  # no hard links here (some network and FAT file systems)
            if path.exists() or path.is_symlink():
                raise FileExistsError(refusal) from None
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def make_tls_files(out_dir: str | Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                   *, days: int = 365) -> dict[str, Path]:
    """A CA and a server certificate valid for ``hosts`` (names or IP addresses) under ``out_dir``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("make_tls_files: at least one host name or IP address is needed")
    out = Path(out_dir)
    paths = {"ca": out / "ca.crt", "cert": out / "server.pem", "key": out / "server.key"}
    clash = [str(p) for p in paths.values() if p.exists()]
    if clash:
        raise FileExistsError(f"{', '.join(clash)} exist; refusing to overwrite key material")
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedreid test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    write_new_file(paths["ca"], ca_cert.public_bytes(pem))
    write_new_file(paths["cert"], server_cert.public_bytes(pem))
    write_new_file(paths["key"], server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()), private=True)
    return paths


def make_node_key(out_dir: str | Path, name: str) -> dict[str, Path]:
    """A SuperNode key pair ``<out_dir>/<name>`` and ``<out_dir>/<name>.pub`` (P-384, OpenSSH format)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"make_node_key: {name!r} is not a plain file name")
    out = Path(out_dir)
    private, public = out / name, out / f"{name}.pub"
    key = ec.generate_private_key(ec.SECP384R1())
    ssh = serialization.Encoding.OpenSSH
    if public.exists():
        raise FileExistsError(f"{public} exists; refusing to overwrite key material")
    write_new_file(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()), private=True)
    write_new_file(public, key.public_key().public_bytes(ssh, serialization.PublicFormat.OpenSSH) + b"\n")
    return {"private": private, "public": public}


__all__ = ["make_tls_files", "make_node_key"]
