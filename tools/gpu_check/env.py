"""What this machine offers: tools on PATH, the CUDA toolkit, a Python with torch, and the GPU.

Nothing here changes the machine. ``discover()`` returns one ``Environment`` that the stages
and the report read: absolute paths of the tools (None when absent), the Python chosen to run
the torch workloads (the first candidate that imports torch), and what nvidia-smi and
torch.cuda say about the GPU. A GPU counts as present when either of them sees one.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

#: tools without which nothing can be built
REQUIRED_TOOLS = ("meson", "ninja", "nvcc", "c++")

# Run by each candidate Python: one JSON line describing it (stdlib + optional torch/pybind11).
_PY_PROBE = r"""
import json, sys, sysconfig, os
d = {"executable": sys.executable, "version": sys.version.split()[0],
     "scripts_dir": sysconfig.get_path("scripts"), "has_python_h": os.path.exists(
         os.path.join(sysconfig.get_paths()["include"], "Python.h"))}
try:
    import pybind11
    d["pybind11"] = {"version": pybind11.__version__, "include": pybind11.get_include(),
                     "cmakedir": pybind11.get_cmake_dir()}
    pc = os.path.join(os.path.dirname(pybind11.__file__), "share", "pkgconfig")
    d["pybind11"]["pkgconfigdir"] = pc if os.path.exists(os.path.join(pc, "pybind11.pc")) else None
except Exception as e:
    d["pybind11"] = None
try:
    import mesonbuild.mesonmain  # noqa: F401
    d["meson_module"] = True
except Exception:
    d["meson_module"] = False
try:
    import torch
    t = {"version": torch.__version__, "cuda": torch.version.cuda,
         "cuda_available": bool(torch.cuda.is_available())}
    if t["cuda_available"]:
        t["device_count"] = torch.cuda.device_count()
        p = torch.cuda.get_device_properties(0)
        t["name"] = p.name
        t["capability"] = "%d.%d" % (p.major, p.minor)
        t["memory_total_mib"] = int(p.total_memory // (1 << 20))
    d["torch"] = t
except Exception as e:
    d["torch"] = None
    d["torch_error"] = "%s: %s" % (type(e).__name__, e)
print("GPU_CHECK_PROBE " + json.dumps(d))
"""


@dataclass
class Environment:
    tools: Dict[str, Optional[str]] = field(default_factory=dict)
    python: Optional[str] = None
    python_info: Dict[str, object] = field(default_factory=dict)
    python_candidates: Dict[str, object] = field(default_factory=dict)
    nvcc_version: Optional[str] = None
    cuda_home: Optional[str] = None
    gpu: Dict[str, object] = field(default_factory=dict)
    path: str = ""
    meson_cmd: List[str] = field(default_factory=list)

    @property
    def missing_required(self) -> List[str]:
        return [t for t in REQUIRED_TOOLS if not self.tools.get(t)]

    @property
    def torch(self) -> Optional[Dict[str, object]]:
        t = self.python_info.get("torch")
        return t if isinstance(t, dict) else None

    def to_json(self) -> Dict[str, object]:
        return {"tools": self.tools, "missing_required": self.missing_required, "python": self.python,
                "python_info": self.python_info, "python_candidates": self.python_candidates,
                "nvcc_version": self.nvcc_version, "cuda_home": self.cuda_home}


def _run(cmd: List[str], timeout: float = 60.0, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          timeout=timeout, env=env, universal_newlines=True)


def cuda_home_candidates() -> List[str]:
    c = [os.environ.get(k) for k in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    c += ["/usr/local/cuda"] + sorted((os.path.join("/usr/local", d) for d in _listdir("/usr/local")
                                       if d.startswith("cuda-")), reverse=True)
    return [x for x in c if x and os.path.isdir(x)]


def _listdir(d: str) -> List[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def search_path(extra_dirs: List[str]) -> str:
    """PATH with the CUDA toolkit's bin (and `extra_dirs`) appended where they are missing."""
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for d in extra_dirs:
        if d and os.path.isdir(d) and d not in parts:
            parts.append(d)
    return os.pathsep.join(parts)


def probe_python(py: str, timeout: float = 120.0) -> Dict[str, object]:
    """Describe interpreter `py` (version, torch, pybind11, meson module); {'error': ...} on failure."""
    try:
        r = _run([py, "-c", _PY_PROBE], timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    for line in r.stdout.splitlines():
        if line.startswith("GPU_CHECK_PROBE "):
            return json.loads(line[len("GPU_CHECK_PROBE "):])
    return {"error": f"exit {r.returncode}: {r.stdout[-500:]}"}


def python_candidates() -> List[str]:
    """Interpreters worth probing for torch, most likely first: the active virtual environment,
    python3 and python on PATH, the usual system ones, this one, then virtual environments in
    the usual places (a GPU host may keep torch in one that is not activated)."""
    c = []
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        c.append(os.path.join(venv, "bin", "python"))
    c += [shutil.which("python3"), shutil.which("python"), "/usr/local/bin/python3", "/usr/bin/python3", sys.executable]
    home = os.path.expanduser("~")
    for pattern in (os.path.join(home, ".venv"), os.path.join(home, "venv*"), os.path.join(home, "*", ".venv"),
                    "/opt/*", "/opt/*/venv", "/venv", "/workspace/*", "/workspace/.venv", "/root/.venv"):
        for d in sorted(glob.glob(pattern)):
            c.append(os.path.join(d, "bin", "python"))
    return [x for x in c if x]


def choose_python(explicit: Optional[str]) -> Tuple[str, Dict[str, object], Dict[str, object]]:
    """The interpreter for the torch workloads and the Python module.

    With `explicit`, that one. Otherwise the first of python_candidates() that imports torch,
    else the first that runs at all.
    @returns (path, its probe, probes of every candidate tried).
    """
    if explicit:
        path = shutil.which(explicit) or explicit
        info = probe_python(path)
        return path, info, {path: info}
    seen, probes = set(), {}
    first_ok = None
    for c in python_candidates():
        if not os.path.exists(c):
            continue
        key = os.path.realpath(c)
        if key in seen:
            continue
        seen.add(key)
        info = probe_python(c)
        probes[c] = {k: info.get(k) for k in ("version", "torch", "torch_error", "error", "has_python_h")}
        if "error" in info:
            continue
        if first_ok is None:
            first_ok = (c, info)
        if info.get("torch"):
            return c, info, probes
    if first_ok:
        return first_ok[0], first_ok[1], probes
    return sys.executable, {"error": "no working python3 found"}, probes


def query_nvidia_smi(nvidia_smi: Optional[str]) -> Dict[str, object]:
    """GPUs as nvidia-smi lists them: {'gpus': [...]} or {'error': ...}."""
    if not nvidia_smi:
        return {"error": "nvidia-smi not found"}
    fields = ["name", "driver_version", "compute_cap", "memory.total"]
    for fl in (fields, fields[:2] + fields[3:]):   # old drivers lack compute_cap
        try:
            r = _run([nvidia_smi, "--query-gpu=" + ",".join(fl), "--format=csv,noheader,nounits"], timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"error": f"nvidia-smi: {exc}"}
        if r.returncode != 0:
            err = r.stdout.strip()[-300:]
            continue
        gpus = []
        for line in r.stdout.strip().splitlines():
            vals = [v.strip() for v in line.split(",")]
            if len(vals) != len(fl):
                continue
            g = dict(zip(fl, vals))
            gpus.append({"name": g.get("name"), "driver": g.get("driver_version"),
                         "compute_cap": g.get("compute_cap"),
                         "memory_total_mib": _int_or_none(g.get("memory.total"))})
        if gpus:
            return {"gpus": gpus}
        err = "nvidia-smi listed no GPU"
    return {"error": f"nvidia-smi failed: {err}"}


def _int_or_none(s: Optional[str]) -> Optional[int]:
    try:
        return int(float(s)) if s is not None else None
    except ValueError:
        return None


def sm_from_capability(cap: Optional[str]) -> Optional[str]:
    """'9.0' -> '90'; None for anything else."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", cap or "")
    return f"{m.group(1)}{m.group(2)}" if m else None


def describe_gpu(smi: Dict[str, object], torch_info: Optional[Dict[str, object]]) -> Dict[str, object]:
    """One GPU description from nvidia-smi (preferred) and torch.cuda; present=False with a note when neither sees one."""
    g: Dict[str, object] = {"present": False, "model": None, "driver": None, "compute_cap": None, "sm": None,
                            "memory_total_mib": None, "count": 0, "source": None}
    gpus = smi.get("gpus") if isinstance(smi, dict) else None
    if gpus:
        first = gpus[0]
        g.update(present=True, model=first["name"], driver=first["driver"], compute_cap=first["compute_cap"],
                 memory_total_mib=first["memory_total_mib"], count=len(gpus), source="nvidia-smi")
    if torch_info and torch_info.get("cuda_available"):
        if not g["present"]:
            g.update(present=True, model=torch_info.get("name"), count=torch_info.get("device_count"),
                     memory_total_mib=torch_info.get("memory_total_mib"), source="torch.cuda")
        if not g["compute_cap"]:
            g["compute_cap"] = torch_info.get("capability")
    g["sm"] = sm_from_capability(g["compute_cap"])
    if not g["present"]:
        why = [str(smi.get("error", "nvidia-smi saw no GPU"))]
        if torch_info is None:
            why.append("torch not importable")
        else:
            why.append(f"torch {torch_info.get('version')}: torch.cuda.is_available() is False")
        g["note"] = "; ".join(why)
    return g


def nvcc_release(nvcc: Optional[str]) -> Optional[str]:
    if not nvcc:
        return None
    try:
        r = _run([nvcc, "--version"], timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", r.stdout)
    return m.group(1) if m else None


def find_compute_sanitizer(path: str, cuda_home: Optional[str]) -> Optional[str]:
    p = shutil.which("compute-sanitizer", path=path)
    if p:
        return p
    if cuda_home:
        for c in (os.path.join(cuda_home, "bin", "compute-sanitizer"),
                  os.path.join(cuda_home, "compute-sanitizer", "compute-sanitizer")):
            if os.access(c, os.X_OK):
                return c
    return None


def discover(python: Optional[str] = None, probe_gpu: bool = True) -> Environment:
    """Find every tool and describe the GPU (`probe_gpu` False: assume none, a CPU smoke run).
    Takes a few seconds (imports torch once per candidate)."""
    env = Environment()
    homes = cuda_home_candidates()
    env.cuda_home = homes[0] if homes else None
    py, info, probes = choose_python(python)
    env.python, env.python_info, env.python_candidates = py, info, probes
    extra = [os.path.join(h, "bin") for h in homes[:1]]
    if isinstance(info.get("scripts_dir"), str):
        extra.append(info["scripts_dir"])   # pip's meson/ninja live beside the interpreter
    env.path = search_path(extra)
    which = lambda name: shutil.which(name, path=env.path)  # noqa: E731
    env.tools = {
        "meson": which("meson"), "ninja": which("ninja") or which("ninja-build"), "nvcc": which("nvcc"),
        "c++": which(os.environ.get("CXX", "c++")) or which("g++") or which("clang++"),
        "pkg-config": which("pkg-config") or which("pkgconf"), "cmake": which("cmake"),
        "nvidia-smi": which("nvidia-smi"), "dpkg-deb": which("dpkg-deb"),
        "compute-sanitizer": find_compute_sanitizer(env.path, env.cuda_home),
        "python": py if "error" not in info else None,
    }
    if env.tools["meson"]:
        env.meson_cmd = [env.tools["meson"]]
    elif info.get("meson_module"):      # pip's meson without its script on PATH
        env.meson_cmd = [py, "-m", "mesonbuild.mesonmain"]
        env.tools["meson"] = " ".join(env.meson_cmd)
    if env.tools["nvcc"] and not env.cuda_home:
        env.cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(env.tools["nvcc"])))
    env.nvcc_version = nvcc_release(env.tools["nvcc"])
    smi = query_nvidia_smi(env.tools["nvidia-smi"]) if probe_gpu else {"error": "not probed (CPU smoke run)"}
    env.gpu = describe_gpu(smi, env.torch)
    return env
