"""Error mapping from apiserver Status bodies to the kube error taxonomy."""

from __future__ import annotations

import json

import pytest

from computedomain.kube import errors
from computedomain.kube.errors import error_from_response, error_from_status


def _status(code: int, reason: str, message: str, **details: object) -> bytes:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason}
    body["message"] = message
    if details:
        body["details"] = details
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("code", "reason", "cls"),
    [
        (404, "NotFound", errors.NotFound),
        (409, "Conflict", errors.Conflict),
        (409, "AlreadyExists", errors.AlreadyExists),
        (410, "Expired", errors.Gone),
        (410, "Gone", errors.Gone),
        (422, "Invalid", errors.Invalid),
        (403, "Forbidden", errors.Forbidden),
        (401, "Unauthorized", errors.Permanent),
        (400, "BadRequest", errors.Permanent),
        (405, "MethodNotAllowed", errors.Permanent),
        (415, "UnsupportedMediaType", errors.Permanent),
        (429, "TooManyRequests", errors.TooManyRequests),
        (500, "InternalError", errors.Transient),
        (502, "", errors.Transient),
        (503, "ServiceUnavailable", errors.Transient),
        (504, "Timeout", errors.Transient),
        (501, "NotImplemented", errors.Permanent),
    ],
)
def test_status_code_maps_to_class(code: int, reason: str, cls: type[errors.KubeError]) -> None:
    err = error_from_response(code, _status(code, reason, "boom"))
    assert type(err) is cls
    assert err.status == code
    assert err.reason == reason
    assert str(err) == "boom"


def test_already_exists_is_a_conflict() -> None:
    err = error_from_response(409, _status(409, "AlreadyExists", 'pods "x" already exists', name="x", kind="pods"))
    assert isinstance(err, errors.Conflict)
    assert err.name == "x"
    assert err.kind == "pods"


def test_invalid_and_forbidden_are_permanent() -> None:
    assert isinstance(error_from_response(422, _status(422, "Invalid", "bad")), errors.Permanent)
    assert isinstance(error_from_response(403, _status(403, "Forbidden", "no")), errors.Permanent)


def test_invalid_carries_the_field_names_and_the_apiserver_message() -> None:
    message = (
        'ComputeDomain.resource.nvidia.com "cd" is invalid: spec.numNodes: Invalid value: -1: '
        "spec.numNodes in body should be greater than or equal to 0"
    )
    body = _status(
        422,
        "Invalid",
        message,
        name="cd",
        group="resource.nvidia.com",
        kind="ComputeDomain",
        causes=[
            {
                "reason": "FieldValueInvalid",
                "message": "Invalid value: -1: spec.numNodes in body should be greater than or equal to 0",
                "field": "spec.numNodes",
            }
        ],
    )
    err = error_from_response(422, body)
    assert isinstance(err, errors.Invalid)
    assert err.fields == ("spec.numNodes",)
    assert err.causes[0].reason == "FieldValueInvalid"
    assert "spec.numNodes" in str(err)
    assert err.kind == "ComputeDomain"


def test_retry_after_header_and_details() -> None:
    err = error_from_response(429, _status(429, "TooManyRequests", "slow down"), retry_after_header="30")
    assert isinstance(err, errors.TooManyRequests)
    assert err.retry_after == 30.0
    from_details = error_from_response(429, _status(429, "TooManyRequests", "x", retryAfterSeconds=2))
    assert from_details.retry_after == 2.0
    # A 503 with Retry-After (apiserver shutting down) stays Transient but keeps the hint.
    busy = error_from_response(503, b"", retry_after_header="1")
    assert isinstance(busy, errors.Transient)
    assert busy.retry_after == 1.0


@pytest.mark.parametrize("value", [None, "", "soon", "Wed, 21 Oct 2015 07:28:00 GMT"])
def test_unparseable_retry_after_is_none(value: str | None) -> None:
    assert errors.parse_retry_after(value) is None


def test_non_status_body_keeps_the_text() -> None:
    err = error_from_response(502, b"<html>bad gateway</html>")
    assert isinstance(err, errors.Transient)
    assert "bad gateway" in str(err)
    assert "502" in str(err)


def test_empty_body_has_a_message() -> None:
    err = error_from_response(404, b"")
    assert isinstance(err, errors.NotFound)
    assert "404" in str(err)


def test_watch_error_event_status_maps_to_gone() -> None:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": "too old resource version: 1 (2345)",
        "reason": "Expired",
        "code": 410,
    }
    err = error_from_status(status)
    assert isinstance(err, errors.Gone)
    assert "too old" in str(err)


@pytest.mark.parametrize(
    ("code", "permanent"),
    [(0, False), (400, True), (401, True), (403, True), (404, False), (405, True), (408, False), (409, False),
     (410, False), (415, True), (422, True), (429, False), (500, False), (501, True), (503, False), (504, False)],
)  # fmt: skip
def test_permanence_is_decided_by_the_status_code(code: int, permanent: bool) -> None:
    err = error_from_response(code, _status(code, "", "x")) if code else errors.Transient("no answer")
    assert err.permanent is permanent


def test_explain_names_permission_quota_and_field() -> None:
    forbidden = error_from_response(403, _status(403, "Forbidden", "nope")).for_request("watch", "nodes", None)
    assert "may not watch nodes (cluster scope)" in errors.explain(forbidden)
    assert "grant the verb watch on nodes" in errors.explain(forbidden)
    quota = error_from_response(
        403, _status(403, "Forbidden", "exceeded quota: q, requested: count/x=1, used: count/x=0, limited: count/x=0")
    ).for_request("create", "resourceclaimtemplates.resource.k8s.io", "team")
    assert "refused by a ResourceQuota" in errors.explain(quota)
    assert "raise the quota" in errors.explain(quota)
    invalid = error_from_response(422, _status(422, "Invalid", 'metadata.name: Invalid value: "A_b"'))
    invalid.for_request("create", "resourceclaimtemplates.resource.k8s.io", "team")
    assert errors.explain(invalid).endswith('rejected as invalid: metadata.name: Invalid value: "A_b"')


def test_the_first_request_context_wins() -> None:
    err = errors.NotFound("x").for_request("get", "pods", "a")
    err.for_request("list", "nodes", None)
    assert (err.verb, err.resource, err.namespace) == ("get", "pods", "a")


def test_a_status_with_fields_no_apiserver_sends_stays_in_the_taxonomy() -> None:
    """The apiserver types ``code`` and ``retryAfterSeconds`` as int32; a hostile server (or one in the middle)
    sent 400 digits or a string, and the caller got an ``OverflowError`` or a ``ValueError``, which ended the
    leader election that catches only ``KubeError``."""
    huge = int("9" * 400)
    err = error_from_response(500, _status(500, "InternalError", "x", retryAfterSeconds=huge))
    assert isinstance(err, errors.KubeError) and err.retry_after is None
    assert error_from_response(500, _status(500, "InternalError", "x", retryAfterSeconds="7")).retry_after is None
    teapot = error_from_status({"kind": "Status", "code": "teapot", "reason": "Expired"})
    assert isinstance(teapot, errors.KubeError)
    assert isinstance(error_from_status({"kind": "Status", "code": huge}), errors.KubeError)
    for causes in (5, True, 1.5, "abc", {"field": "x"}):
        assert error_from_status({"kind": "Status", "code": 409, "details": {"causes": causes}}).causes == ()
    # A hint is taken for at most MAX_RETRY_AFTER_S, and never an infinite one: either parked a reconcile.
    assert errors.parse_retry_after("inf") is None and errors.parse_retry_after("nan") is None
    assert errors.parse_retry_after("86400") == errors.MAX_RETRY_AFTER_S
    week = error_from_response(429, _status(429, "TooManyRequests", "x", retryAfterSeconds=2**31 - 1))
    assert week.retry_after == errors.MAX_RETRY_AFTER_S
