"""GET /dashboard (one self-contained HTML page: the vendored uPlot inlined) and GET /dashboard/data
(the JSON it polls); open without the API key, like /metrics: they show counts, never request text."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from ..dashboard_data import dashboard_data
from .deps import ServingDep

router = APIRouter()
STATIC = Path(__file__).resolve().parent.parent / "static"


@cache
def page() -> str:
    """The page with uPlot's script and style inlined, so that it loads in one request (and offline)."""
    vendor = STATIC / "vendor"
    html = (STATIC / "dashboard.html").read_text()
    return (html.replace("/*UPLOT_CSS*/", (vendor / "uPlot.min.css").read_text())
            .replace("/*UPLOT_JS*/", (vendor / "uPlot.iife.min.js").read_text()))


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page())


@router.get("/dashboard/data")
async def data(serving: ServingDep) -> dict[str, Any]:
    return dashboard_data(serving.llm, serving.metrics.latencies, serving.in_flight) | {
        "model": serving.model_name}
