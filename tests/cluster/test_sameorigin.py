"""The rules of :mod:`chronomq.cluster.httpapi.sameorigin`, header by header."""

from __future__ import annotations

import pytest

from chronomq.cluster.httpapi.sameorigin import body_type_error, cross_origin_reason


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_bodies_pass(content_type: str) -> None:
    assert body_type_error(content_type) is None


@pytest.mark.parametrize(
    ("content_type", "said"),
    [
        ("text/plain", "'text/plain'"),
        ("application/x-www-form-urlencoded", "urlencoded"),
        ("multipart/form-data; boundary=x", "multipart"),
        ("application/jsonx", "jsonx"),
        (None, "none was given"),
    ],
)
def test_other_bodies_answer_415_naming_the_type(content_type: str | None, said: str) -> None:
    error = body_type_error(content_type)
    assert error is not None and error.status == 415 and error.field == "Content-Type"
    assert said in error.message


@pytest.mark.parametrize(
    ("headers", "host"),
    [
        ({}, "127.0.0.1:8080"),
        ({"Sec-Fetch-Site": "same-origin"}, "127.0.0.1:8080"),
        ({"Sec-Fetch-Site": "none"}, "127.0.0.1:8080"),
        ({"Origin": "http://127.0.0.1:8080"}, "127.0.0.1:8080"),
        ({"Origin": "http://Broker.example"}, "broker.example"),
        ({"Origin": "https://broker.example"}, "broker.example:443"),
        ({"Origin": "https://broker.example"}, "broker.example"),  # TLS ended by a proxy
        ({"Origin": "http://[::1]:8080"}, "[::1]:8080"),
    ],
)
def test_the_same_origin_and_clients_without_the_headers_pass(
    headers: dict[str, str], host: str
) -> None:
    assert cross_origin_reason(headers, host) is None


@pytest.mark.parametrize(
    ("headers", "host"),
    [
        ({"Sec-Fetch-Site": "cross-site"}, "127.0.0.1:8080"),
        ({"Sec-Fetch-Site": "same-site"}, "127.0.0.1:8080"),
        ({"Origin": "null"}, "127.0.0.1:8080"),
        ({"Origin": "http://127.0.0.1:8081"}, "127.0.0.1:8080"),
        ({"Origin": "http://localhost:8080"}, "127.0.0.1:8080"),
        ({"Origin": "http://broker.example"}, "broker.example:8080"),
        ({"Origin": "https://broker.example"}, "broker.example:80"),
        ({"Origin": "http://[::1]:8081"}, "[::1]:8080"),
        ({"Origin": "file://"}, "127.0.0.1:8080"),
        ({"Origin": "http://127.0.0.1:8080", "Sec-Fetch-Site": "cross-site"}, "127.0.0.1:8080"),
    ],
)
def test_another_origin_is_named(headers: dict[str, str], host: str) -> None:
    assert cross_origin_reason(headers, host) is not None
