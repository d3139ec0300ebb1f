"""`diffgraph serve` with its engine in the server's own process (the layout before issue 28 point 2), for the
process hop's benchmark only: the same flags, the same app, the engine built by an in-process factory.

    python3 tools/bench_dp.py --label inproc --in-process --sat-rate 14 --duration 30
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from diffgraph.server.cli import add_serve_arguments, config_from_args, serve  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_serve_arguments(p)
    config = config_from_args(p.parse_args())
    if config.devices:
        p.error("the in-process layout has one engine: leave --devices out")
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def engine_factory():
        from diffgraph.engine.engine import Engine
        return Engine(**config.engine_kwargs())
    return serve(config, engine_factory)


if __name__ == "__main__":
    sys.exit(main())
