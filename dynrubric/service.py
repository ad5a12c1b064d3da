"""What every HTTP service shares: /healthz, /readyz, /metrics, bearer-token checks, uvicorn run."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import SecretStr


def make_app(title: str, registry: CollectorRegistry, ready: Callable[[], bool] = lambda: True) -> FastAPI:
    """A FastAPI app with the standard probes and a Prometheus endpoint over `registry`."""
    app = FastAPI(title=title)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        ok = ready()
        return Response(
            content='{"ready": %s}' % ("true" if ok else "false"),
            status_code=200 if ok else 503,
            media_type="application/json",
        )

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def token_from_request(request: Request) -> str | None:
    """A bearer header, or a `token` query parameter (for clients that cannot send headers)."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.query_params.get("token")


def require_token(request: Request, expected: SecretStr | None) -> None:
    """401 unless the request carries the configured token; open when no token is configured."""
    if expected is None:
        return
    given = token_from_request(request)
    if given is None or not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token")


def serve(app: FastAPI, host: str, port: int) -> None:
    """Run until SIGTERM/SIGINT; uvicorn finishes in-flight requests before exiting."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
