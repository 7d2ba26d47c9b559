"""--api-key: Bearer auth on every /v1 route; /health and /metrics stay open."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEYS, assert_error, http


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEYS[0]}"}],
    ids=["missing", "wrong", "not-bearer"],
)
def test_v1_routes_need_a_key(keyed_url: str, headers: dict[str, str]):
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
    ]:
        reply = http(method, f"{keyed_url}{path}", json={}, headers=headers)
        assert_error(reply, 401, code="invalid_api_key")


def test_the_sdk_sees_401_then_succeeds_with_a_key(keyed_url: str, model_name: str):
    bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for key in API_KEYS:
        good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in good.models.list().data] == [model_name]
    out = good.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_health_and_metrics_stay_open(keyed_url: str):
    assert http("GET", f"{keyed_url}/health").status == 200
    assert http("GET", f"{keyed_url}/metrics").status == 200
