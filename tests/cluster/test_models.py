"""Request models: what they refuse, the field a refusal names, and the schema they give."""

from __future__ import annotations

import orjson
import pytest

from chronomq.cluster.httpapi.openapi import ROUTES, spec
from chronomq.cluster.node import models
from chronomq.cluster.node.errors import ApiError


def refused(raw: object, model: type) -> ApiError:
    with pytest.raises(ApiError) as err:
        models.decode(orjson.dumps(raw), model)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"body": 1}]}, "messages[0].body"),
        ({"messages": [{"body": "x", "bodyx": 1}]}, "messages[0].bodyx"),
        ({"messages": [{"body": "x"}, {"body": "y", "queue": -1}]}, "messages[1].queue"),
        ({"messages": [{"body": "x", "delay_ms": 1.5}]}, "messages[0].delay_ms"),
        ({"messages": [{"body": "x", "delay_ms": True}]}, "messages[0].delay_ms"),
        ({"messages": [{"body": "x", "keys": ["a", 2]}]}, "messages[0].keys[1]"),
        ({"messages": [{"body": "x", "properties": {"a": 1}}]}, "messages[0].properties"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ([], "body"),
    ],
)
def test_a_produce_misfit_names_its_field(body: object, field: str) -> None:
    err = refused(body, models.ProduceRequest)
    assert (err.code, err.field) == ("invalid_input", field), err.message


def test_null_is_absent_where_declared_nullable_and_refused_where_not() -> None:
    raw = {"messages": [{"body": "x", "tags": None, "keys": None, "delay_ms": None}]}
    assert models.decode(orjson.dumps(raw), models.ProduceRequest).messages[0].tags is None
    assert refused({"paused": None}, models.ScheduleControls).field == "paused"
    assert refused({"mode": None}, models.ScheduleControls).field == "mode"
    assert refused({"stop_enqueue": None}, models.TimerSwitches).field == "stop_enqueue"


def test_bad_json_and_empty_bodies_keep_their_codes() -> None:
    with pytest.raises(ApiError) as err:
        models.decode(b"{", models.ProduceRequest)
    assert (err.value.code, err.value.field) == ("invalid_json", "body")
    with pytest.raises(ApiError) as err:
        models.decode(b"", models.ProduceRequest)
    assert (err.value.code, err.value.field) == ("invalid_input", "body")


def test_the_spec_takes_its_schemas_from_the_models() -> None:
    doc = spec()
    components = doc["components"]["schemas"]
    for (method, path), (_, request, response, _) in ROUTES.items():
        op = doc["paths"][path][method.lower()]
        for model, got in (
            (request, op.get("requestBody", {}).get("content", {}).get("application/json")),
            (response, op["responses"]["200"]["content"]["application/json"]),
        ):
            if isinstance(model, type):
                assert got["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
                assert model.__name__ in components
    node = components["NodeStatus"]["properties"]
    assert {"type": "null"} in node["last_election_ms"]["anyOf"]
    assert {"type": "null"} in components["MessageOut"]["properties"]["tags"]["anyOf"]
    assert components["ScheduleControls"]["properties"]["paused"] == {"type": "boolean"}


def test_the_spec_asks_for_a_token_only_when_the_node_has_one() -> None:
    doc = spec(auth_required=False)
    assert doc["security"] == []
    assert all(op["security"] == [] for item in doc["paths"].values() for op in item.values())


HAND_WRITTEN_REQUESTS = {
    # Still a JSON Schema next to hand-written checks; the schema-driven fuzz holds them to
    # each other until they move to models. Nothing may join this list.
    ("PATCH", "/v1/admin/config"),  # generated from the runtime keys of cluster.config.keys
    ("POST", "/v1/admin/node/removal"),  # a signed notice, checked byte for byte
}


def test_every_other_request_body_is_a_model() -> None:
    hand = {key for key, (_, request, _, _) in ROUTES.items() if isinstance(request, dict)}
    assert hand == HAND_WRITTEN_REQUESTS
