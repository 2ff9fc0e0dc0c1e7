"""``serve --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials``:
CORS headers on a live server, as ``vllm serve``'s flags give them."""

from __future__ import annotations

import pytest

from tests.server.conftest import API_KEY, start_server, stop_server

httpx = pytest.importorskip("httpx")

GOOD, BAD = "https://app.example", "https://evil.example"


def _preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    return httpx.options(f"{url}/v1/chat/completions", headers=headers, timeout=10)


def test_only_the_allowed_origin_gets_cors_headers() -> None:
    server = start_server(
        "--allowed-origins", f'["{GOOD}"]',
        "--allowed-methods", '["GET", "POST"]',
        "--allowed-headers", '["Authorization", "Content-Type"]',
        "--allow-credentials",
        api_key=API_KEY,
    )  # fmt: skip
    try:
        pre = _preflight(server.url, GOOD)  # no API key: a browser sends none on a preflight
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == GOOD
        assert pre.headers["access-control-allow-credentials"] == "true"
        assert set(pre.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        allowed = pre.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "content-type" in allowed
        get = httpx.get(
            f"{server.url}/v1/models", headers={"Origin": GOOD, **server.headers}, timeout=10
        )
        assert get.status_code == 200
        assert get.headers["access-control-allow-origin"] == GOOD
        assert get.headers["access-control-allow-credentials"] == "true"
        # an error answer carries them too, so the page can read why
        denied = httpx.get(f"{server.url}/v1/models", headers={"Origin": GOOD}, timeout=10)
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == GOOD

        assert _preflight(server.url, GOOD, method="DELETE").status_code == 400
        bad_pre = _preflight(server.url, BAD)
        assert bad_pre.status_code == 400
        assert "access-control-allow-origin" not in bad_pre.headers
        bad_get = httpx.get(
            f"{server.url}/v1/models", headers={"Origin": BAD, **server.headers}, timeout=10
        )
        assert bad_get.status_code == 200  # the browser, not the server, withholds it
        # no Access-Control-Allow-Origin, so the browser hides the answer from the page
        # (Starlette, as vLLM, still sends its constant Allow-Credentials header)
        assert "access-control-allow-origin" not in bad_get.headers
        assert "access-control-allow-methods" not in bad_get.headers
    finally:
        stop_server(server)


def test_by_default_any_origin_without_credentials() -> None:
    server = start_server()
    try:
        pre = _preflight(server.url, BAD, method="PATCH")
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in pre.headers
        assert "PATCH" in pre.headers["access-control-allow-methods"]
        got = httpx.get(f"{server.url}/v1/models", headers={"Origin": BAD}, timeout=10)
        assert got.status_code == 200
        assert got.headers["access-control-allow-origin"] == "*"
        plain = httpx.get(f"{server.url}/v1/models", timeout=10)
        assert "access-control-allow-origin" not in plain.headers  # no Origin, no CORS
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--allowed-origins", "https://app.example"),  # not JSON
        ("--allowed-methods", '"GET"'),  # JSON, not a list
        ("--allowed-headers", "[1, 2]"),  # a list, not of strings
        ("--allowed-origins", '{"a": 1}'),
    ],
)
def test_a_bad_cors_list_is_refused_before_start(flag: str, value: str, capsys) -> None:
    from medha_runtime.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "tiny", "--port", "0", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"medha-runtime serve: error: argument {flag}:"), err
    assert f"expected a JSON list of strings, got {value!r}" in last
    assert "Traceback" not in err


def test_cors_config_validates() -> None:
    from medha_runtime.server.cors import CorsConfig

    with pytest.raises(ValueError, match="allowed_origins must be a tuple of strings"):
        CorsConfig(allowed_origins=["*"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allow_credentials must be a bool, got 'yes'"):
        CorsConfig(allow_credentials="yes")  # type: ignore[arg-type]
