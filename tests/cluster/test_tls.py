"""TLS contexts: TLS 1.2 at least, host names checked, unusable files named by their key."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from chronomq.cluster.config.nodeconfig import ConfigError
from chronomq.cluster.node.tls import client_context, server_context
from chronomq.cluster.process.server import run
from tests.selfsigned import self_signed


def test_server_and_client_contexts_need_tls_1_2_and_check_host_names(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server = server_context(str(cert), str(key))
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    for client in (client_context(str(cert)), client_context(None, str(cert)), client_context()):
        assert client.minimum_version >= ssl.TLSVersion.TLSv1_2
        assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    # The node's own certificate is trusted on top of the system's store.
    assert len(client_context(None, str(cert)).get_ca_certs()) == 1 + len(
        client_context().get_ca_certs()
    )


def test_unusable_files_name_their_key(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with pytest.raises(ConfigError) as missing_key:
        server_context(str(cert), str(tmp_path / "absent.pem"))
    assert missing_key.value.key == "tls_key_file"
    with pytest.raises(ConfigError) as swapped:
        server_context(str(key), str(cert))
    assert swapped.value.key == "tls_cert_file"
    with pytest.raises(ConfigError) as bad_ca:
        client_context(str(key))
    assert bad_ca.value.key == "tls_ca_file"


def test_a_node_with_an_unreadable_key_does_not_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, _key = self_signed(tmp_path)
    overrides = {
        "data_dir": str(tmp_path / "data"),
        "tls_cert_file": str(cert),
        "tls_key_file": str(tmp_path / "absent.pem"),
    }
    assert run(None, overrides) == 2
    assert "tls_key_file" in capsys.readouterr().err
