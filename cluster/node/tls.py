"""TLS contexts for the HTTP API: the node's server side, and what clients and peers trust.

A node with ``tls_cert_file`` and ``tls_key_file`` serves HTTPS only, TLS 1.2 or newer. A node
checks its peers' certificates against ``tls_ca_file`` when set, else against the system's
store plus its own ``tls_cert_file`` (so a self-signed certificate shared by every node of a
cluster is trusted). Host names are always checked.
"""

from __future__ import annotations

import ssl

from chronomq.cluster.config.nodeconfig import ConfigError, NodeConfig


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The context a node serves HTTPS with; a file that cannot be used names its key."""
    for key, path in (("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "tls_cert_file", f"{cert_file} with {key_file} is not a usable certificate: {exc}"
        ) from None
    return ctx


def client_context(ca_file: str | None = None, also_trust: str | None = None) -> ssl.SSLContext:
    """A verifying client context: ``ca_file`` alone when given, else the system's store plus
    ``also_trust`` (a PEM file) when given."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file or None)
        if not ca_file and also_trust:
            ctx.load_verify_locations(cafile=also_trust)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "tls_ca_file", f"cannot load {ca_file or also_trust} as PEM certificates: {exc}"
        ) from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def peer_context(config: NodeConfig) -> ssl.SSLContext:
    """What a node trusts when it calls another node over HTTPS."""
    return client_context(config.tls_ca_file or None, config.tls_cert_file or None)
