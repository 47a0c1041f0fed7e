"""The wheel of ./python_shim: a platform wheel (`py3-none-<platform>`: it ships libkvsparse.so, which cffi
loads in ABI mode, so any Python 3 will do but only this platform), holding the library and the header, and
built without setuptools' warning that 'kvsparse.lib' is absent from `packages`. Reuses the installed
package's library through KVSPARSE_LIB (no cargo build); runs without torch (`--noconftest`)."""
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from kvsparse import _ffi

SHIM = Path(__file__).resolve().parents[1]


def test_wheel_is_a_platform_wheel_with_the_library(tmp_path):
    env = dict(os.environ, KVSPARSE_LIB=str(_ffi.LIB_PATH))
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", str(SHIM), "-w", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    assert "absent from the `packages`" not in log, log[-4000:]
    (wheel,) = tmp_path.glob("*.whl")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.rsplit("-", 3)[1:] == ["py3", "none", f"{platform}.whl"], wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        tags = z.read(meta).decode()
    assert {"kvsparse/lib/libkvsparse.so", "kvsparse/lib/kvsparse.h", "kvsparse/_ffi.py"} <= names, sorted(names)
    assert "Root-Is-Purelib: false" in tags and f"Tag: py3-none-{platform}" in tags, tags
