"""The warm template (``runtime/template_server.py``, ``runtime/warm_template.py``): a trainer
forked from it runs the script as ``python SCRIPT ARGS`` would -- ``__main__``, its own argv,
environment and working directory, its output through the agent's pipe, its exit status and
its death by signal reported to the agent by the template (its parent) -- and nothing outlives
the template.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

from leto_lightning.runtime.procs_state import is_alive
from leto_lightning.runtime.template_server import imported_modules
from leto_lightning.runtime.warm_template import ForkedProcess, WarmTemplate
from leto_lightning.testing.crash import run_in_child

SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    import colorsys  # imported by the template before any trainer
    import numpy

    def main():
        import textwrap  # imported in a function body: the template imports it too
        print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                          "ppid": os.getppid(), "path0": sys.path[0], "preloaded": "colorsys" in sys.modules,
                          "numpy_draw": int(numpy.random.randint(1 << 30))}),
              flush=True)
        if sys.argv[1] == "sleep":
            time.sleep(60)
        if sys.argv[1] == "raise":
            raise RuntimeError("boom from the script")
        sys.exit(int(sys.argv[1]))

    if __name__ == "__main__":
        main()
''')


def _ready(template: WarmTemplate) -> None:
    deadline = time.monotonic() + 60
    while template.check() is None:
        assert time.monotonic() < deadline, "the template never reported"
        time.sleep(0.02)
    assert template.status is not None and template.status.ready, template.status


def _exercise(script: str, workdir: str) -> dict:
    os.chdir(workdir)
    template = WarmTemplate.start(sys.executable, script, dict(os.environ, RANK="template"))
    _ready(template)
    seen: dict = {"template_pid": template.popen.pid}
    for arg in ("3", "raise"):
        child = template.fork([script, arg], dict(os.environ, RANK="7"))
        assert isinstance(child, ForkedProcess)
        seen[arg] = {"code": child.wait(timeout=30), "lines": child.stdout.read().splitlines()}
    sleeper = template.fork([script, "sleep"], dict(os.environ, RANK="1"))
    assert sleeper is not None
    seen["sleeper_said"] = json.loads(sleeper.stdout.readline())
    os.kill(sleeper.pid, signal.SIGKILL)
    seen["killed"] = sleeper.wait(timeout=30)
    template.close()
    seen["template_code"] = template.popen.returncode
    return seen


def test_a_forked_trainer_runs_the_script_as_python_would(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    seen = run_in_child(lambda: _exercise(str(script), str(tmp_path)), timeout=120).value
    said = json.loads(seen["3"]["lines"][0])
    assert said["name"] == "__main__" and said["argv"] == [str(script), "3"] and said["rank"] == "7"
    assert said["cwd"] == str(tmp_path) and said["path0"] == str(tmp_path) and said["preloaded"]
    assert said["ppid"] == seen["template_pid"]  # the template's child: it reaps it and reports its exit
    assert seen["3"]["code"] == 3
    assert seen["raise"]["code"] == 1 and seen["raise"]["lines"][-1] == "RuntimeError: boom from the script"
    assert seen["sleeper_said"]["ppid"] == seen["template_pid"] and seen["killed"] == -signal.SIGKILL
    # NumPy's global generator is seeded per trainer, as in a fresh interpreter, not copied
    assert said["numpy_draw"] != seen["sleeper_said"]["numpy_draw"]
    assert seen["template_code"] == 0 and not is_alive(seen["template_pid"])


def test_the_template_imports_what_the_script_names_never_its_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os.path\nfrom json import dumps\nfrom . import sibling\n"
                      "def f():\n    import colorsys\nraise SystemExit('the script ran')\n")
    assert imported_modules(str(script)) == ["os.path", "json", "colorsys"]


def test_a_thread_started_at_import_makes_the_template_refuse_to_fork(tmp_path: Path) -> None:
    (tmp_path / "threaded_mod.py").write_text("import threading, time\n"
                                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    script = tmp_path / "train.py"
    script.write_text("import threaded_mod\n")

    def attempt() -> tuple[bool, str | None, object]:
        template = WarmTemplate.start(sys.executable, str(script), dict(os.environ))
        deadline = time.monotonic() + 60
        while template.check() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        status = template.status
        forked = template.fork([str(script)], dict(os.environ))
        template.close()
        return bool(status and status.ready), status.reason if status else None, forked

    ready, reason, forked = run_in_child(attempt, timeout=120).value
    assert not ready and "Python thread" in (reason or "") and forked is None
