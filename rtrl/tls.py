"""TLS for the stack's listeners: one pair of settings, the same checks, for every server.

Each service's settings class mixes in TLSListener (so the variables are
``RTRL_<SERVICE>_TLS_CERT_FILE`` and ``..._TLS_KEY_FILE``); with both set the listener
speaks TLS only. The embedded stack listens on loopback and leaves them unset.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, model_validator


class TLSListener(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    tls_cert_file: Path | None = None
    """PEM certificate chain: when set (with tls_key_file), the listener speaks TLS only."""

    tls_key_file: Path | None = None
    """PEM private key of tls_cert_file."""

    @model_validator(mode="after")
    def _tls_files(self) -> TLSListener:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("set both tls_cert_file and tls_key_file, or neither")
        for path in (self.tls_cert_file, self.tls_key_file):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        return self

    def http_context(self) -> ssl.SSLContext | None:
        """For rtrl.http_limits.serve_http; None: plain HTTP."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return server_context(self.tls_cert_file, self.tls_key_file)

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        """For a gRPC server's add_secure_port; None: plaintext."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key_file.read_bytes(), self.tls_cert_file.read_bytes())]
        )


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """What an HTTPS listener serves with: this certificate, TLS 1.2 at least."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def client_credentials(ca_file: Path | None) -> grpc.ChannelCredentials | None:
    """What a gRPC client trusts a TLS server with (None: the server speaks plaintext)."""
    return None if ca_file is None else grpc.ssl_channel_credentials(Path(ca_file).read_bytes())
