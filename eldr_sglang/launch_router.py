"""`python -m eldr_sglang.launch_router --pd-disaggregation --disagg-router eldr --prefill URL [PORT] --decode URL ...`"""

from __future__ import annotations

import asyncio
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from eldr_sglang.router.config import ConfigError, parse_config

    try:
        cfg = parse_config(argv)
    except ConfigError as exc:
        print(f"launch_router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import aiohttp  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        print(f"launch_router: error: {exc.name} is missing; pip install 'eldr-sglang[serve]'", file=sys.stderr)
        return 2
    from eldr_sglang.router.app import serve

    try:
        import uvloop  # optional: a faster event loop when installed

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as exc:  # port in use, bad centroid file, ...
        print(f"launch_router: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
