"""The one archive of logs and results that goes into the report folder.

A GPU host hands back at most 8 files of the report folder, so the folder holds exactly
three: report.json, report.md and ``gpu-check-logs.tar.gz``, which packs the work folder's
``logs/*.log`` and ``results/*.json``. Each member keeps only its last ``max_member_bytes``
(a build log can be long; its end says what failed), with a first line saying how much was
dropped. The archive is written atomically and rewritten after every stage, so a run cut
from outside still leaves the logs up to its last stage.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from typing import Dict, List

from .report import atomic_file

ARCHIVE_NAME = "gpu-check-logs.tar.gz"
#: the files of the report folder, all of them (the host returns at most 8)
REPORT_FILES = ("report.json", "report.md", ARCHIVE_NAME)
MAX_MEMBER_BYTES = 256 * 1024


def _members(work_dir: str) -> List[str]:
    out = []
    for sub, suffix in (("logs", ".log"), ("results", ".json")):
        d = os.path.join(work_dir, sub)
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        out += [os.path.join(sub, n) for n in names if n.endswith(suffix) and os.path.isfile(os.path.join(d, n))]
    return out


def write_archive(work_dir: str, outdir: str, max_member_bytes: int = MAX_MEMBER_BYTES) -> Dict[str, object]:
    """Pack the work folder's logs and results into `outdir`/gpu-check-logs.tar.gz.

    @returns {"path", "members": [names], "bytes", "truncated": [names]}.
    """
    members = _members(work_dir)
    truncated: List[str] = []
    path = os.path.join(outdir, ARCHIVE_NAME)
    with atomic_file(path, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for rel in members:
            with open(os.path.join(work_dir, rel), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_member_bytes))
                data = f.read()
            if size > max_member_bytes:
                truncated.append(rel)
                data = f"[gpu-check: the first {size - len(data)} bytes of {size} were dropped]\n".encode() + data
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return {"path": path, "members": members, "bytes": os.path.getsize(path), "truncated": truncated}
