"""OpenAI-compatible HTTP server (``unmask serve``): completions, chat, SSE streaming in
``committed`` and ``canvas`` modes, continuous batching for AR, Prometheus metrics and a
playground page. Needs the ``serve`` extra (``pip install 'unmask[serve]'``): fastapi, uvicorn
and prometheus_client are imported only here, behind :func:`require`.
"""

from __future__ import annotations

import importlib.util

from unmask.errors import UnmaskError

NEEDS = ("fastapi", "uvicorn", "prometheus_client")


def require() -> None:
    """Raise UnmaskError naming the missing server packages, if any."""
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise UnmaskError(f"the server needs {', '.join(missing)}; install them with pip install 'unmask[serve]' "
                          "(in a clone: pip install -e '.[serve]')")


def create_app(bundle, **kwargs):
    """See :func:`unmask.serve.app.create_app`."""
    require()
    from unmask.serve.app import create_app as _create

    return _create(bundle, **kwargs)


__all__ = ["create_app", "require"]
