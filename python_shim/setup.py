"""Build hook: ships the kvsparse cdylib and its header inside the package.

The library comes from $KVSPARSE_LIB (a prebuilt libkvsparse.so) or from
`cargo build --release --lib` in the repository that contains this directory.
The header is copied next to it because the binding parses it (single source
of truth for the ABI). The wheel is a platform wheel (`py3-none-<platform>`):
it carries a native library, loaded by cffi in ABI mode.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 has its own; before that it came with `wheel`
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LIBNAME = "libkvsparse.so"


def _locate_library() -> Path:
    env = os.environ.get("KVSPARSE_LIB")
    if env:
        lib = Path(env)
        if not lib.is_file():
            raise RuntimeError(f"KVSPARSE_LIB={env} is not a file")
        return lib
    if not (REPO / "Cargo.toml").is_file():
        raise RuntimeError(
            f"no Cargo.toml at {REPO}: build from the kvsparse repository or set KVSPARSE_LIB"
        )
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    subprocess.run(["cargo", "build", "--release", "--lib", "-p", "kvsparse"], cwd=REPO, check=True)
    return target / "release" / LIBNAME


class BuildWithCdylib(build_py):
    def run(self):
        dest = HERE / "kvsparse" / "lib"
        dest.mkdir(exist_ok=True)
        shutil.copy2(_locate_library(), dest / LIBNAME)
        header = Path(os.environ.get("KVSPARSE_HEADER", REPO / "include" / "kvsparse.h"))
        shutil.copy2(header, dest / "kvsparse.h")
        super().run()


class NativeLibDistribution(Distribution):
    """The package ships libkvsparse.so, built for this platform: a platform (not pure) distribution, so
    the wheel installs into platlib and gets a platform tag."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Tags the wheel `py3-none-<platform>` (e.g. linux_x86_64), not `py3-none-any` nor
    `cp3X-cp3X-<platform>`: cffi loads the library in ABI mode (dlopen, no compiled extension module), so
    any Python 3 and ABI will do; only the platform matters."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=NativeLibDistribution, cmdclass={"build_py": BuildWithCdylib, "bdist_wheel": PlatformWheel})
