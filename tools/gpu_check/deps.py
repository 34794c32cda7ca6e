"""Build dependencies a bare GPU host may lack: gathered here, unpacked there, checked with meson.

``prepare()`` runs on a Debian 12 development machine: ``apt-get download`` fetches the .deb
files of spdlog, fmt, nlohmann-json, doctest and pybind11 (and the two runtime libraries
spdlog needs) into ``.gpu-deps/debs/`` with a manifest (versions, sizes, sha256). That folder
travels with the working tree to the GPU host (which has no network and no apt).

On the host, ``provide()`` asks meson itself which of the five dependencies it finds (a probe
project in ``<prefix>/probe``). Only for those it does not find, it unpacks the matching
.debs into a private prefix (``dpkg-deb -x`` when present, else ``extract_deb()``: ar + tar in
Python), writes pkg-config files with absolute paths for them, and probes again with the
variables a build needs (PKG_CONFIG_PATH, CMAKE_PREFIX_PATH, CPATH, LIBRARY_PATH,
LD_LIBRARY_PATH). If spdlog's compiled library does not link on the host (another libc, or
not x86_64), spdlog and fmt are switched to their header-only form and probed once more.
pybind11 comes from the target Python's pip package when it has one (it matches that
interpreter), else from the .deb. When the host has no pkg-config, meson gets
``pkg_config.py`` through a native file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
from typing import Dict, List, Mapping, Optional, Sequence

#: every .deb --prepare fetches; all are small (about 1.3 MB together for Debian 12)
DEB_PACKAGES = ["libspdlog-dev", "libspdlog1.10", "libfmt-dev", "libfmt9", "nlohmann-json3-dev",
                "doctest-dev", "pybind11-dev"]
#: meson dependency name -> packages it needs
DEP_PACKAGES = {
    "spdlog": ["libspdlog-dev", "libspdlog1.10", "libfmt-dev", "libfmt9"],
    "fmt": ["libfmt-dev", "libfmt9"],
    "nlohmann_json": ["nlohmann-json3-dev"],
    "doctest": ["doctest-dev"],
    "pybind11": ["pybind11-dev"],
}
DEP_NAMES = ["spdlog", "fmt", "nlohmann_json", "doctest", "pybind11"]
#: dependencies of the fetched packages that are not fetched: the host has them, or the build does not need them
ASSUMED_ON_HOST = {"libc6", "libgcc-s1", "libstdc++6", "catch2", "python3-dev", "python3"}
MAX_BYTES = 60 * 1024 * 1024
MULTIARCH = "x86_64-linux-gnu"


# ---- .deb files -----------------------------------------------------------------------------

def ar_members(data: bytes) -> Dict[str, bytes]:
    """The members of a Unix ar archive (the container of a .deb), by name.

    @throws ValueError when `data` is not an ar archive or a header is damaged.
    """
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        hdr = data[pos:pos + 60]
        if hdr[58:60] != b"`\n":
            raise ValueError(f"damaged ar member header at byte {pos}")
        name = hdr[0:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(hdr[48:58].decode("ascii").strip())
        except ValueError:
            raise ValueError(f"damaged ar member size at byte {pos}") from None
        body = data[pos + 60:pos + 60 + size]
        if len(body) != size:
            raise ValueError(f"ar member '{name}' is truncated")
        out[name] = body
        pos += 60 + size + (size & 1)
    return out


def _open_data_tar(members: Mapping[str, bytes]) -> tarfile.TarFile:
    name = next((n for n in members if n.startswith("data.tar")), None)
    if name is None:
        raise ValueError(f"no data.tar.* member (members: {sorted(members)})")
    blob = members[name]
    if name.endswith(".zst"):
        zstd = shutil.which("zstd")
        if not zstd:
            raise ValueError("data.tar.zst needs the zstd tool, which is not installed")
        blob = subprocess.run([zstd, "-dc"], input=blob, stdout=subprocess.PIPE, check=True).stdout
        return tarfile.open(fileobj=io.BytesIO(blob), mode="r:")
    return tarfile.open(fileobj=io.BytesIO(blob), mode="r:*")   # gz, xz, bz2, or none


def _safe_rel(name: str) -> Optional[str]:
    """`name` as a relative path inside the destination, or None if it would leave it."""
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        return None
    return os.path.join(*parts)


def extract_deb_python(deb: str, dest: str) -> List[str]:
    """Unpack the files of `deb` under `dest` without dpkg (ar + tar, standard library only).

    Regular files, directories, symbolic links and hard links are created; absolute link
    targets are re-rooted under `dest`; entries that would leave `dest` and device files are
    skipped. @returns the relative paths of the files and links created.
    @throws ValueError when the file is not a readable .deb.
    """
    with open(deb, "rb") as f:
        members = ar_members(f.read())
    created: List[str] = []
    dest = os.path.abspath(dest)
    with _open_data_tar(members) as tar:
        for m in tar.getmembers():
            rel = _safe_rel(m.name)
            if rel is None:
                continue
            target = os.path.join(dest, rel)
            if m.isdir():
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.lexists(target):
                os.unlink(target)
            if m.isreg():
                src = tar.extractfile(m)
                with open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(target, (m.mode & 0o755) | stat.S_IRUSR | stat.S_IWUSR)
            elif m.issym():
                link = m.linkname
                if os.path.isabs(link):
                    link = os.path.join(dest, link.lstrip("/"))
                os.symlink(link, target)
            elif m.islnk():
                src_rel = _safe_rel(m.linkname)
                if src_rel is None or not os.path.exists(os.path.join(dest, src_rel)):
                    continue
                shutil.copy2(os.path.join(dest, src_rel), target)
            else:
                continue
            created.append(rel)
    return created


def extract_deb(deb: str, dest: str, use_dpkg: bool = True) -> str:
    """Unpack `deb` under `dest` with ``dpkg-deb -x`` when present (and `use_dpkg`), else in Python.

    @returns the method used ("dpkg-deb" or "python").
    @throws ValueError / subprocess.CalledProcessError when the package cannot be unpacked.
    """
    os.makedirs(dest, exist_ok=True)
    dpkg = shutil.which("dpkg-deb") if use_dpkg else None
    if dpkg:
        subprocess.run([dpkg, "-x", deb, dest], check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return "dpkg-deb"
    extract_deb_python(deb, dest)
    return "python"


def deb_control(deb: str) -> Dict[str, str]:
    """The fields of a .deb's control file (Package, Version, Depends, ...), read in Python."""
    with open(deb, "rb") as f:
        members = ar_members(f.read())
    name = next((n for n in members if n.startswith("control.tar")), None)
    if name is None:
        raise ValueError(f"{deb}: no control.tar.* member")
    if name.endswith(".zst"):
        return {}
    with tarfile.open(fileobj=io.BytesIO(members[name]), mode="r:*") as tar:
        m = next((m for m in tar.getmembers() if m.name.lstrip("./") == "control"), None)
        if m is None:
            raise ValueError(f"{deb}: control.tar has no control file")
        text = tar.extractfile(m).read().decode("utf-8", "replace")
    fields: Dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, val = line.partition(":")
            fields[key.strip()] = val.strip()
    return fields


def upstream_version(deb_version: str) -> str:
    """'1:1.10.0+ds-0.4' -> '1.10.0' (epoch, Debian revision and +suffix removed)."""
    v = deb_version.split(":", 1)[-1]
    v = v.rsplit("-", 1)[0] if "-" in v else v
    return re.split(r"[+~]", v, maxsplit=1)[0]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for fn in files:
            p = os.path.join(d, fn)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def prepare(deps_dir: str, packages: Sequence[str] = DEB_PACKAGES, log=print) -> Dict[str, object]:
    """Fetch the .debs with ``apt-get download`` into `deps_dir`/debs and write a manifest.

    @returns the manifest. @throws RuntimeError when apt-get fails, a package is missing
             after the download, or the folder exceeds MAX_BYTES.
    """
    apt = shutil.which("apt-get")
    if not apt:
        raise RuntimeError("--prepare needs apt-get (run it on a Debian or Ubuntu development machine)")
    debs = os.path.join(deps_dir, "debs")
    os.makedirs(debs, exist_ok=True)
    for fn in os.listdir(debs):
        if fn.endswith(".deb"):
            os.unlink(os.path.join(debs, fn))
    r = subprocess.run([apt, "download"] + list(packages), cwd=debs, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True)
    if r.returncode != 0:
        raise RuntimeError(f"apt-get download failed (exit {r.returncode}):\n{r.stdout[-2000:]}")
    entries, provided = [], set()
    for fn in sorted(os.listdir(debs)):
        if not fn.endswith(".deb"):
            continue
        p = os.path.join(debs, fn)
        ctl = deb_control(p)
        # apt names files <pkg>_<epoch%3a version>_<arch>.deb; keep names plain for every transport.
        safe = "{}_{}_{}.deb".format(ctl.get("Package"), re.sub(r"[^A-Za-z0-9.-]", "-", ctl.get("Version", "0")),
                                     ctl.get("Architecture", "all"))
        if safe != fn:
            os.replace(p, os.path.join(debs, safe))
            fn, p = safe, os.path.join(debs, safe)
        provided.add(ctl.get("Package", ""))
        entries.append({"package": ctl.get("Package"), "version": ctl.get("Version"),
                        "architecture": ctl.get("Architecture"), "depends": ctl.get("Depends", ""),
                        "file": fn, "bytes": os.path.getsize(p), "sha256": _sha256(p)})
    missing = [p for p in packages if p not in provided]
    if missing:
        raise RuntimeError(f"apt-get download did not deliver: {', '.join(missing)}")
    unbundled = set()
    for e in entries:
        for alt in re.split(r"\s*,\s*", e["depends"] or ""):
            name = alt.split("|")[0].split("(")[0].split(":")[0].strip()
            if name and name not in provided:
                unbundled.add(name)
    total = dir_bytes(deps_dir)
    manifest = {"created": _now(), "source": _os_release(), "packages": entries,
                "total_bytes": total, "not_bundled": sorted(unbundled),
                "not_bundled_reason": "present on any glibc host with a C++ compiler, or only "
                                      "needed by the packages' own tests"}
    with open(os.path.join(deps_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    total = dir_bytes(deps_dir)
    manifest["total_bytes"] = total
    if total > MAX_BYTES:
        raise RuntimeError(f"{deps_dir} holds {total} bytes, over the {MAX_BYTES} byte limit")
    for e in entries:
        log(f"  {e['package']:<20} {e['version']:<20} {e['bytes']:>9,} B  {e['file']}")
    log(f"  total {total:,} B ({total / 2**20:.2f} MiB, limit 60 MiB) in {deps_dir}")
    if unbundled:
        log(f"  not bundled (assumed on the host or not needed): {', '.join(sorted(unbundled))}")
    return manifest


def _now() -> str:
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def _os_release() -> str:
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "unknown"


# ---- private prefix and pkg-config files ----------------------------------------------------

def find_debs(deps_dir: str) -> Dict[str, str]:
    """Package name -> .deb path for the .debs in `deps_dir`/debs (named <package>_<version>_<arch>.deb)."""
    debs = os.path.join(deps_dir, "debs")
    out: Dict[str, str] = {}
    for fn in sorted(os.listdir(debs)) if os.path.isdir(debs) else []:
        if fn.endswith(".deb"):
            out[fn.split("_", 1)[0]] = os.path.join(debs, fn)
    return out


def write_pc(pcdir: str, name: str, version: str, cflags: str, libs: str = "", requires: str = "",
             description: str = "") -> str:
    """Write `pcdir`/`name`.pc with absolute paths; returns its path."""
    os.makedirs(pcdir, exist_ok=True)
    path = os.path.join(pcdir, name + ".pc")
    lines = [f"Name: {name}", f"Description: {description or name + ' (gact gpu-check private prefix)'}",
             f"Version: {version}", f"Cflags: {cflags}"]
    if libs:
        lines.append(f"Libs: {libs}")
    if requires:
        lines.append(f"Requires: {requires}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_prefix_pcs(root: str, pcdir: str, deps: Sequence[str], versions: Mapping[str, str],
                     header_only: bool) -> None:
    """pkg-config files for `deps` whose files were unpacked under `root` (= the fake '/').

    spdlog and fmt are described as compiled shared libraries, or with `header_only` as
    header-only libraries (no binary from the .deb is then used).
    """
    inc = os.path.join(root, "usr", "include")
    lib = os.path.join(root, "usr", "lib", MULTIARCH)
    for d in deps:
        v = versions.get(d, "0")
        if d == "fmt":
            if header_only:
                write_pc(pcdir, "fmt", v, f"-I{inc} -DFMT_HEADER_ONLY")
            else:
                write_pc(pcdir, "fmt", v, f"-I{inc}", f"-L{lib} -Wl,-rpath,{lib} -lfmt")
        elif d == "spdlog":
            if header_only:
                write_pc(pcdir, "spdlog", v, f"-I{inc} -DSPDLOG_FMT_EXTERNAL", "-pthread", requires="fmt")
            else:
                write_pc(pcdir, "spdlog", v, f"-I{inc} -DSPDLOG_SHARED_LIB -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL",
                         f"-L{lib} -Wl,-rpath,{lib} -lspdlog -pthread", requires="fmt")
        else:
            write_pc(pcdir, d, v, f"-I{inc}")


_PROBE_MESON = """project('gact-gpu-check-probe', 'cpp', default_options: ['cpp_std=c++20'])
cpp = meson.get_compiler('cpp')
foreach n : ['spdlog', 'fmt', 'nlohmann_json', 'doctest', 'pybind11']
  d = dependency(n, required: false)
  message('GPU_CHECK_DEP @0@ @1@ @2@ @3@'.format(n, d.found(), d.found() ? d.version() : '-',
          d.found() ? d.type_name() : '-'))
endforeach
s = dependency('spdlog', required: false)
if s.found()
  ok = cpp.links('''#include <spdlog/spdlog.h>
                    int main() { spdlog::logger l("p"); l.info("{}", 1); return 0; }''',
                 dependencies: [s, dependency('threads')], name: 'spdlog links')
  message('GPU_CHECK_LINK spdlog @0@'.format(ok))
endif
"""


def meson_probe(meson_cmd: Sequence[str], workdir: str, env: Mapping[str, str],
                native_file: Optional[str] = None, timeout: float = 120.0) -> Dict[str, object]:
    """Configure a throw-away meson project that asks for each dependency.

    @returns {'deps': {name: {'found', 'version', 'method'}}, 'spdlog_links': bool|None, 'log': tail}.
    """
    shutil.rmtree(workdir, ignore_errors=True)
    src = os.path.join(workdir, "src")
    os.makedirs(src)
    with open(os.path.join(src, "meson.build"), "w", encoding="utf-8") as f:
        f.write(_PROBE_MESON)
    cmd = list(meson_cmd) + ["setup", os.path.join(workdir, "build"), src]
    if native_file:
        cmd += ["--native-file", native_file]
    from .runner import run_command   # tracked, so a signal to gpu-check ends the probe too
    log = os.path.join(workdir, "probe.log")
    step = run_command("meson probe", cmd, timeout, log, env=env)
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            out = f.read()
    except OSError:
        out = ""
    if step.status != "pass":
        out += f"\n[gpu-check] meson probe {step.status} (exit {step.returncode}) {step.note}"
    deps: Dict[str, Dict[str, object]] = {}
    links = None
    for line in out.splitlines():
        m = re.search(r"GPU_CHECK_DEP (\S+) (true|false) (\S+) (\S+)", line)
        if m:
            deps[m.group(1)] = {"found": m.group(2) == "true", "version": m.group(3), "method": m.group(4)}
        m = re.search(r"GPU_CHECK_LINK spdlog (true|false)", line)
        if m:
            links = m.group(1) == "true"
    return {"deps": deps, "spdlog_links": links, "log": out[-3000:]}


def write_native_file(path: str, python: str, shim: str) -> str:
    """A meson native file that makes `shim` (run by `python`) the pkg-config binary."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("[binaries]\n")
        f.write(f"pkg-config = [{python!r}, {shim!r}]\n")
        f.write(f"pkgconfig = [{python!r}, {shim!r}]\n")
    return path


def _prepend(env: Dict[str, str], key: str, *vals: str) -> None:
    parts = [v for v in vals if v] + [p for p in env.get(key, "").split(os.pathsep) if p]
    seen, out = set(), []
    for p in parts:
        if p not in seen:
            seen.add(p)
            out.append(p)
    env[key] = os.pathsep.join(out)


def provide(meson_cmd: Sequence[str], prefix: str, deps_dir: str, base_env: Mapping[str, str],
            python_info: Mapping[str, object], pkg_config: Optional[str], log=print) -> Dict[str, object]:
    """Make meson find spdlog, fmt, nlohmann_json, doctest and pybind11; see the module doc.

    @returns {'ok': bool, 'env': the environment for the build, 'native_file': path or None,
              'deps': {name: {'source', 'version', 'method'}}, 'notes': [...], 'probe_log': tail,
              'not_found': [names meson still does not find] (absent when all are found)}.
    """
    env = dict(base_env)
    notes: List[str] = []
    os.makedirs(prefix, exist_ok=True)
    native = None
    if not pkg_config:
        shim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pkg_config.py")
        native = write_native_file(os.path.join(prefix, "native.ini"), sys.executable, shim)
        notes.append("no pkg-config on this host: meson uses tools/gpu_check/pkg_config.py")
    pcdir = os.path.join(prefix, "pkgconfig")
    shutil.rmtree(pcdir, ignore_errors=True)
    os.makedirs(pcdir)
    # pybind11 from the target interpreter's pip package, when it has one.
    pb = python_info.get("pybind11") if isinstance(python_info.get("pybind11"), dict) else None
    pip_pybind11 = False
    if pb and pb.get("include"):
        write_pc(pcdir, "pybind11", str(pb.get("version", "0")), f"-I{pb['include']}",
                 description="pybind11 from the target Python's pip package")
        _prepend(env, "CMAKE_PREFIX_PATH", str(pb.get("cmakedir") or ""))
        pip_pybind11 = True
    _prepend(env, "PKG_CONFIG_PATH", pcdir)
    probe_dir = os.path.join(prefix, "probe")
    first = meson_probe(meson_cmd, probe_dir, env, native)
    found = {n: d for n, d in first["deps"].items() if d.get("found")}
    if not first["deps"]:
        return {"ok": False, "env": env, "native_file": native, "deps": {}, "notes": notes + [
            "the meson probe project did not configure (see probe_log)"], "probe_log": first["log"]}
    spdlog_ok = first["spdlog_links"] is not False
    missing = [n for n in DEP_NAMES if n not in found]
    if "spdlog" in found and not spdlog_ok:
        notes.append("the host's spdlog is found but does not link; using the private copy")
        missing += [n for n in ("spdlog", "fmt") if n not in missing]
    if "spdlog" in missing and "fmt" not in missing:
        missing.append("fmt")      # spdlog 1.10 from the .deb is built against fmt 9: they travel together
    result_deps: Dict[str, Dict[str, object]] = {}
    for n, d in found.items():
        if n not in missing:
            src = "python package" if (n == "pybind11" and pip_pybind11) else "system"
            result_deps[n] = {"source": src, "version": d["version"], "method": d["method"]}
    if not missing:
        return {"ok": True, "env": env, "native_file": native, "deps": result_deps, "notes": notes,
                "probe_log": first["log"]}
    debs = find_debs(deps_dir)
    root = os.path.join(prefix, "root")
    shutil.rmtree(root, ignore_errors=True)
    need_pkgs = sorted({p for n in missing for p in DEP_PACKAGES[n]})
    absent = [p for p in need_pkgs if p not in debs]
    if absent:
        notes.append(f"missing {', '.join(missing)} and no .deb for {', '.join(absent)} in {deps_dir} "
                     "(run tools/gpu-check --prepare on a Debian 12 machine and carry .gpu-deps/)")
        return {"ok": False, "env": env, "native_file": native, "deps": result_deps, "notes": notes,
                "probe_log": first["log"], "missing": missing, "not_found": missing}
    versions: Dict[str, str] = {}
    methods = set()
    for p in need_pkgs:
        methods.add(extract_deb(debs[p], root))
        ver = upstream_version(deb_control(debs[p]).get("Version", "0"))
        for n, pk in DEP_PACKAGES.items():
            if pk[0] == p:
                versions[n] = ver
    notes.append(f"unpacked {', '.join(need_pkgs)} into {root} ({'/'.join(sorted(methods))})")
    lib = os.path.join(root, "usr", "lib", MULTIARCH)
    inc = os.path.join(root, "usr", "include")
    _prepend(env, "CMAKE_PREFIX_PATH", os.path.join(root, "usr"))
    _prepend(env, "CPATH", inc)
    _prepend(env, "LIBRARY_PATH", lib)
    _prepend(env, "LD_LIBRARY_PATH", lib)
    header_only = False
    write_prefix_pcs(root, pcdir, missing, versions, header_only)
    second = meson_probe(meson_cmd, probe_dir, env, native)
    if "spdlog" in missing and second["spdlog_links"] is False:
        notes.append("spdlog from the .deb does not link here: using spdlog and fmt header-only")
        header_only = True
        write_prefix_pcs(root, pcdir, [n for n in missing if n in ("spdlog", "fmt")], versions, header_only)
        second = meson_probe(meson_cmd, probe_dir, env, native)
    ok = True
    for n in DEP_NAMES:
        d = second["deps"].get(n, {})
        if n in missing:
            result_deps[n] = {"source": "private prefix" + (" (header-only)" if header_only and n in ("spdlog", "fmt") else ""),
                              "version": d.get("version"), "method": d.get("method")}
        if not d.get("found"):
            ok = False
            notes.append(f"meson still does not find {n}")
    if second["spdlog_links"] is False:
        ok = False
        notes.append("spdlog does not link even header-only")
    not_found = [n for n in DEP_NAMES if not second["deps"].get(n, {}).get("found")]
    return {"ok": ok, "env": env, "native_file": native, "deps": result_deps, "notes": notes,
            "probe_log": second["log"], "missing_on_host": missing, "not_found": not_found}
