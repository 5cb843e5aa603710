"""``python -m mla_backend.sglang_plugin.launch_server <sglang.launch_server arguments>``.

Equivalent to ``python -m sglang.launch_server`` (default HTTP mode) for environments where this
package's ``sglang.srt.plugins`` entry point is not installed (e.g. a source checkout on
``PYTHONPATH``): it registers ``tilelang_mla`` before the command line is parsed and again in
every scheduler subprocess (SGLang spawns them, so a registration in this process alone would not
reach them). With the entry point installed, plain ``python -m sglang.launch_server`` or
``sglang serve`` already does all of this.
"""

from __future__ import annotations

import os
import sys


def run_scheduler_process(*args, **kwargs):
    """Scheduler subprocess target: register the backend, then run SGLang's scheduler."""
    from . import register

    register()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run_scheduler_process

    return sglang_run_scheduler_process(*args, **kwargs)


def main(argv=None) -> None:
    from sglang.srt.plugins import load_plugins

    from . import register

    load_plugins()  # other installed plugins, as sglang.launch_server does
    register()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(sys.argv[1:] if argv is None else list(argv))
    try:
        launch_server(server_args, run_scheduler_process_func=run_scheduler_process)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
