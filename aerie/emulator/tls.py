"""HTTPS for the emulator: the server's TLS context (``--tls-cert`` / ``--tls-key``), and a throwaway self-signed
certificate for tests and benchmarks that exercise a client's certificate checks against it."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context for --tls-cert/--tls-key (the library's secure defaults: TLS 1.2+)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def write_self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """Write ``cert.pem`` + ``key.pem`` (EC P-256) for 127.0.0.1/localhost into ``folder``, valid one day and made
    now (nothing is reused between runs); returns (cert, key). A client trusts it only when told to (its CA
    bundle is the certificate itself). Needs the ``openssl`` command."""
    if shutil.which("openssl") is None:
        raise FileNotFoundError("openssl is not installed: it makes the self-signed test certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
