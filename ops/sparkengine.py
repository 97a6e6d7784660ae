"""Starting Spark for our jobs: local, standalone cluster or Spark Connect, kept quiet.

Spark's own log goes to stderr at WARN (or the level asked for) through a log4j2 configuration
written for the run, without the start-up banner and the warnings every run repeats. Spark and
Py4J exceptions are turned into a line or two for the operator: never only a JVM stack trace.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "2g"
EXIT_SPARK_FAILED, EXIT_BAD_INPUT = 1, 2

_LOG4J2 = """\
status = error
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = spark %p %c{{1}}: %m%n%ex{{6}}
# A PySpark driver counts as a shell: Spark resets the root level to the level of the logger
# below (WARN unless configured) and says so on stderr. Configured, it leaves ours alone.
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = {level}
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.utils.name = org.apache.spark.util.Utils
logger.utils.level = error
logger.plan.name = org.apache.spark.sql.catalyst.util.SparkStringUtils
logger.plan.level = error
logger.blockmanager.name = org.apache.spark.storage.BlockManager
logger.blockmanager.level = error
logger.cache.name = org.apache.spark.sql.execution.CacheManager
logger.cache.level = error
logger.jersey.name = org.glassfish.jersey
logger.jersey.level = off
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = error
"""


class EngineError(Exception):
    """Spark cannot be used as asked; ``exit_code`` 2 for a bad --master, 1 for the rest."""

    def __init__(self, message: str, exit_code: int = EXIT_SPARK_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _endpoints(master: str) -> tuple[str, list[tuple[str, int]]]:
    scheme, sep, rest = master.partition("://")
    if not sep or scheme not in ("spark", "sc"):
        raise EngineError(
            f"unsupported --master {master!r}: use local[N], spark://host:port or sc://host:port",
            EXIT_BAD_INPUT,
        )
    default_port = 7077 if scheme == "spark" else 15002
    endpoints = []
    # spark://h1:7077,h2:7077 names standby masters; sc://host:port/;param=value has options.
    for part in rest.split("/")[0].split(","):
        url = urlsplit(f"{scheme}://{part}")
        try:
            port = url.port or default_port
        except ValueError:
            raise EngineError(f"invalid port in --master {master!r}", EXIT_BAD_INPUT) from None
        endpoints.append((url.hostname or "localhost", port))
    return scheme, endpoints


def check_master(master: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with a plain message, when a cluster master cannot be reached at all."""
    if master.startswith("local"):
        return
    scheme, endpoints = _endpoints(master)
    errors = []
    for host, port in endpoints:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc}")
    kind = "Spark master" if scheme == "spark" else "Spark Connect server"
    raise EngineError(f"cannot reach the {kind} at " + "; ".join(errors), EXIT_SPARK_FAILED)


@contextlib.contextmanager
def spark_session(
    master: str = DEFAULT_MASTER,
    conf: Sequence[tuple[str, str]] = (),
    driver_memory: str = DEFAULT_DRIVER_MEMORY,
    log_level: str = "WARN",
    app_name: str = "chronomq",
) -> Iterator[SparkSession]:
    """A SparkSession for a job of ours, quiet unless something is wrong; stopped at the end.

    ``master`` is local[N], spark://host:port or sc://host:port. ``driver_memory`` and the
    log configuration apply when this call starts the driver JVM (not on Spark Connect).
    """
    check_master(master)
    if master.startswith("sc://"):
        try:
            from pyspark.sql.connect.session import SparkSession as ConnectSession  # noqa: F401
        except ImportError as exc:
            raise EngineError(
                f"Spark Connect needs extra packages ({exc.name} is missing): "
                "pip install 'pyspark[connect]'",
                EXIT_SPARK_FAILED,
            ) from None
    from pyspark.sql import SparkSession

    builder: Any = SparkSession.builder
    settings = dict(conf)
    log_dir = tempfile.mkdtemp(prefix="chronomq-report-")
    try:
        if master.startswith("sc://"):
            builder = builder.remote(master)
        else:
            log_file = Path(log_dir) / "log4j2.properties"
            log_file.write_text(_LOG4J2.format(level=log_level.lower()))
            options = settings.get("spark.driver.extraJavaOptions", "")
            settings["spark.driver.extraJavaOptions"] = (
                f"{options} -Dlog4j2.configurationFile=file:{log_file}".strip()
            )
            settings.setdefault("spark.driver.memory", driver_memory)
            settings.setdefault("spark.ui.showConsoleProgress", "false")
            if master.startswith("local"):
                # One machine: a few partitions per core, not Spark's 200. On a cluster, its
                # own spark-defaults.conf decides.
                settings.setdefault("spark.sql.shuffle.partitions", "16")
            builder = builder.master(master)
        settings.setdefault("spark.sql.session.timeZone", "UTC")
        builder = builder.appName(app_name)
        for key, value in settings.items():
            builder = builder.config(key, value)
        try:
            spark = builder.getOrCreate()
        except Exception as exc:
            if is_spark_error(exc):
                raise EngineError(
                    f"could not start Spark on {master}: {spark_error_summary(exc)}",
                    EXIT_SPARK_FAILED,
                ) from None
            raise
        try:
            yield spark
        finally:
            spark.stop()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def is_spark_error(exc: BaseException) -> bool:
    """An exception raised by PySpark or Py4J (as opposed to a bug of ours)."""
    module = type(exc).__module__ or ""
    return module.startswith(("pyspark", "py4j"))


def spark_error_summary(exc: BaseException, max_lines: int = 3) -> str:
    """A few readable lines for a Spark/Py4J exception, without the JVM stack trace."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            text = str(java.toString())
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("at ", "...", "JVM stacktrace"))
    ]
    return " / ".join(lines[:max_lines]) or type(exc).__name__
