"""What every benchmark here leaves behind: ``NAME.json`` (the command, the date, the settings, the summary) and ``NAME.png``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable


def write_report(out: str, name: str, argv: list[str] | None, settings: dict[str, Any], summary: dict, plot: Callable[[dict, str], None]) -> None:
    """Write ``out/NAME.json`` and, where matplotlib is installed, ``out/NAME.png`` (``plot(summary, path)``)."""
    result = {
        "command": f"python -m benchmarks.{name} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        **settings,
        "summary": summary,
    }
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    try:
        plot(summary, os.path.join(out, f"{name}.png"))
    except ImportError:
        pass
