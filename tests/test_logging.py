"""vgraph's default logging, as a Python API user meets it: fresh interpreters, real stderr."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vgraph import logging_setup


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VGRAPH_LOGGING")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=full_env)


LOG_BOTH = ("import logging, vgraph\n"
            "log = logging.getLogger('vgraph.engine')\n"
            "log.info('timeline-info'); log.warning('timeline-warning')\n")


def test_import_vgraph_shows_info_on_stderr_once():
    result = run_python(LOG_BOTH)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("timeline-info") == 1 and result.stderr.count("timeline-warning") == 1
    line = next(x for x in result.stderr.splitlines() if "timeline-info" in x)
    assert line.startswith("INFO ") and "[vgraph.engine]" in line
    assert result.stdout == ""


@pytest.mark.parametrize("level,shown,hidden", [("WARNING", ["timeline-warning"], ["timeline-info"]),
                                                ("error", [], ["timeline-info", "timeline-warning"]),
                                                ("DEBUG", ["timeline-info", "timeline-warning"], [])])
def test_level_from_the_environment(level, shown, hidden):
    result = run_python(LOG_BOTH, VGRAPH_LOGGING_LEVEL=level)
    assert result.returncode == 0, result.stderr
    assert all(result.stderr.count(s) == 1 for s in shown) and not any(h in result.stderr for h in hidden)


def test_an_application_that_configures_logging_gets_each_record_once():
    """Its handlers print vgraph's records (propagation); vgraph's own handler stays quiet."""
    code = ("import logging, vgraph\n"
            "logging.basicConfig(level=logging.INFO, format='APP %(name)s %(message)s')\n"
            "logging.getLogger('vgraph').info('timeline-info')\n"
            "logging.getLogger('other').info('app-info')\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["APP vgraph timeline-info", "APP other app-info"]


def test_the_root_logger_is_left_alone():
    code = ("import logging, vgraph\n"
            "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
            "assert logging.getLogger().level == logging.WARNING\n"
            "logging.getLogger('other').info('not shown')\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "not shown" not in result.stderr


def test_configure_logging_off_and_a_bad_level():
    off = run_python(LOG_BOTH, VGRAPH_CONFIGURE_LOGGING="0")
    assert "timeline-info" not in off.stderr and "timeline-warning" in off.stderr  # Python's last resort
    bad = run_python(LOG_BOTH, VGRAPH_LOGGING_LEVEL="LOUD")
    assert bad.returncode == 0, bad.stderr
    assert "VGRAPH_LOGGING_LEVEL='LOUD' is not a log level" in bad.stderr and "timeline-info" in bad.stderr


def test_env_level_parsing(monkeypatch):
    monkeypatch.delenv(logging_setup.LEVEL_ENV, raising=False)
    assert logging_setup.env_level() is None
    monkeypatch.setenv(logging_setup.LEVEL_ENV, " warning ")
    assert logging_setup.env_level() == "WARNING"
    monkeypatch.setenv(logging_setup.LEVEL_ENV, "verbose")
    with pytest.raises(ValueError, match="choose one of DEBUG, INFO, WARNING, ERROR"):
        logging_setup.env_level()
